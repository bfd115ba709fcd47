"""Guard rails on a batch plan: a plan that cannot mean what the user wants stops, a risky one warns.

A profiled micro batch times the configured accumulation can exceed the data set (a micro batch of
2850 x accumulation 8 for 3000 samples: one optimizer step per epoch at 27x the LR). That is refused
unless asked for; an LR scaled by more than ``MAX_QUIET_LR_FACTOR`` from scaling alone is logged.
"""

from __future__ import annotations

from collections.abc import Sequence

from adaptive_batching.batching.lr_scaling import lr_factor
from adaptive_batching.batching.shape import EpochBatch
from adaptive_batching.errors import ConfigError

MAX_QUIET_LR_FACTOR = 8.0
ALLOW_KEY = "adaptive_batching.allow_global_batch_above_data"


def _source(entry: EpochBatch, profiled: bool) -> str:
    """The config keys that made this epoch's batch what it is."""
    keys = ["use_maximum_batch_size=True" if profiled else "batch_size", "gradient_accumulation_steps"]
    if entry.epoch > 0 and entry.increment:
        keys.append("batch_increase_function")
    return ", ".join(keys)


def check_plan_against_data(
    plan: Sequence[EpochBatch],
    *,
    dataset_size: int,
    profiled: bool,
    allow_above_data: bool,
    reference_global_batch: int,
    rule: str,
) -> None:
    """Raise ConfigError when a micro batch exceeds a rank's samples, or a global batch the epoch's samples.

    The second is allowed with ``adaptive_batching.allow_global_batch_above_data: true``.
    """
    for entry in plan:
        shape = entry.shape
        per_rank = dataset_size // shape.ranks
        where = f"epoch {entry.epoch + 1}: {shape.describe()} (from {_source(entry, profiled)})"
        if shape.micro_batch > max(per_rank, 1):
            raise ConfigError(
                f"{where} has a micro batch larger than a rank's {per_rank} samples per epoch; "
                "lower the batch or use fewer ranks"
            )
        if shape.global_batch > dataset_size and not allow_above_data:
            factor = lr_factor(shape.global_batch, reference_global_batch, rule)
            raise ConfigError(
                f"{where} is larger than the epoch's {dataset_size} samples: one optimizer step per epoch, "
                f"LR x{factor:.1f} ({rule} scaling). Lower gradient_accumulation_steps or the micro batch "
                "(adaptive_batching.memory_budget, use_maximum_batch_size=False), or set "
                f"{ALLOW_KEY}=True if that is what you want"
            )


def lr_factor_warnings(plan: Sequence[EpochBatch], *, reference_global_batch: int, rule: str) -> list[str]:
    """One line per epoch whose LR is scaled by more than ``MAX_QUIET_LR_FACTOR`` from batch scaling alone."""
    lines = []
    for entry in plan:
        factor = lr_factor(entry.shape.global_batch, reference_global_batch, rule)
        if factor > MAX_QUIET_LR_FACTOR:
            lines.append(
                f"epoch {entry.epoch + 1}: the LR is scaled x{factor:.1f} by the '{rule}' rule (global batch "
                f"{entry.shape.global_batch} against the config's {reference_global_batch}); above "
                f"x{MAX_QUIET_LR_FACTOR:g}, check that the LR still suits (lr_scaling, optimizer.lr)"
            )
    return lines
