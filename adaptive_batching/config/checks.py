"""The checks of the config's values, each a pure function that raises a one-line ConfigError naming the key.

The value checks of the knobs under ``adaptive_batching:`` (:data:`CHECKS`, one per settings field), the torchtune
keys the adaptive machinery relies on (:func:`check_recipe_keys`), and the checks across keys of the typed sections
(a token budget's keys, elastic and fixed global batches, growth inside an epoch, the LR scheduler).
:func:`~adaptive_batching.config.settings.validate_config` runs them and assembles the settings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.optim.lr_scheduler import LambdaLR
from torchtune import config

from adaptive_batching.batching.elastic import ElasticSpec
from adaptive_batching.batching.lr_scaling import LR_SCALING_RULES, default_rule
from adaptive_batching.batching.settings import BatchingSettings
from adaptive_batching.config.components import check_nodes
from adaptive_batching.config.keys import meant_key
from adaptive_batching.core.nodes import packed, plain
from adaptive_batching.errors import ConfigError
from adaptive_batching.faults import preemption
from adaptive_batching.growth.interval import KEY as GROWTH_KEY
from adaptive_batching.growth.interval import growth_interval_error
from adaptive_batching.growth.planning import GROW_PAST_MEMORY
from adaptive_batching.growth.settings import GrowthSettings
from adaptive_batching.profiling.budget import fraction_error
from adaptive_batching.profiling.search import round_to_error
from adaptive_batching.units import parse_bytes

# A check returns None when the value is fine, else a description of what is allowed.
Check = Callable[[Any], str | None]


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "true or false"


def _pos_int(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else "an integer >= 1"


def _non_neg_int(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else "an integer >= 0"


def _opt_pos_int(v: Any) -> str | None:
    return None if v is None else _pos_int(v) and "null or an integer >= 1"


def _choice(*allowed: str) -> Check:
    return lambda v: None if v in allowed else " | ".join(allowed)


def _margin(v: Any) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 0.5
    return None if ok else "a number in [0, 0.5)"


def _tolerance(v: Any) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 0.25
    return None if ok else "a number in [0, 0.25] (0.01: the search stops within 1% of the largest that fits)"


def _memory(v: Any) -> str | None:
    if v is None:
        return None
    try:
        parse_bytes(v)
    except ValueError:
        return "null or a memory size such as '12GiB', '500MB' or a number of bytes"
    return None


def _opt_str(v: Any) -> str | None:
    return None if v is None or isinstance(v, str) else "null or a path"


def _max_tokens(v: Any) -> str | None:
    if v is None or v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        return None
    return "null, 'auto' (the profiler sets it) or an integer >= 1 (padded tokens per micro batch)"


def _opt_mapping(v: Any) -> str | None:
    return None if v is None or isinstance(v, Mapping) else "null or a mapping"


# The knobs' checks, in the order the errors and docs/config-keys.md list them. The keys themselves, their
# sections and their defaults are the section dataclasses' fields (``config.settings.KNOBS``).
CHECKS: dict[str, Check] = {
    "memory_budget": _memory,
    "memory_fraction": fraction_error,
    "safety_margin": _margin,
    "round_to": round_to_error,
    "search_tolerance": _tolerance,
    "reprofile": _bool,
    "cache_dir": _opt_str,
    "grow_past_memory": _choice(*GROW_PAST_MEMORY),
    "growth_interval": growth_interval_error,
    "allow_global_batch_above_data": _bool,
    "keep_global_batch": _bool,
    "max_tokens": _max_tokens,
    "picking_order": _choice("dataloader", "seqlen", "random"),
    "min_batch_size": _opt_pos_int,
    "max_batch_size": _opt_pos_int,
    "elastic": _opt_mapping,
    "oom_recovery": _bool,
    "oom_grow_back_after": _opt_pos_int,
    "guard_steps": _non_neg_int,
    "stop_signals": preemption.check_signals,
}


@dataclass(frozen=True)
class Knob:
    """One key under ``adaptive_batching:``: its default as a config writes it (its section's field's default),
    its check and the section it belongs to."""

    default: Any
    check: Check
    section: str


def knob_values(cfg: DictConfig, knobs: Mapping[str, Knob]) -> dict[str, Any]:
    """Every knob's value: the ``adaptive_batching:`` section's, checked, or the knob's default. A misspelt knob is
    an error naming the known ones."""
    section = plain(cfg.get("adaptive_batching", None))
    section = {} if section is None else section
    if not isinstance(section, Mapping):
        raise invalid("adaptive_batching", section, f"a mapping with keys {', '.join(knobs)}")
    unknown = sorted(str(k) for k in section if k not in knobs)
    if unknown:
        meant = [f"'adaptive_batching.{m}'" for m in (meant_key(k, knobs) for k in unknown) if m is not None]
        raise ConfigError(
            f"unknown config key(s) {', '.join('adaptive_batching.' + k for k in unknown)}; "
            + (f"did you mean {', '.join(meant)}? " if meant else "")
            + f"known keys under 'adaptive_batching': {', '.join(knobs)}"
        )
    values = {name: knob.default for name, knob in knobs.items()}
    for name, value in section.items():
        allowed = knobs[name].check(value)
        if allowed:
            raise invalid(f"adaptive_batching.{name}", value, allowed)
        values[name] = value
    return values


def checked_lr_scaling(cfg: DictConfig) -> str:
    """The LR scaling rule: ``lr_scaling``, or the optimizer's default rule when it is null or absent."""
    lr_scaling = plain(cfg.get("lr_scaling", None))
    if lr_scaling is not None and lr_scaling not in LR_SCALING_RULES:
        raise invalid("lr_scaling", lr_scaling, " | ".join(LR_SCALING_RULES) + " (or null for the default)")
    return default_rule(str(cfg.optimizer.get("_component_", ""))) if lr_scaling is None else lr_scaling


def invalid(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config key '{key}' = {value!r} is invalid: expected {allowed}")


def check_recipe_keys(cfg: DictConfig) -> None:
    """The standard torchtune keys whose values the adaptive machinery relies on."""
    checks: dict[str, tuple[Check, bool]] = {
        "batch_size": (_pos_int, True),
        "gradient_accumulation_steps": (_pos_int, False),
        "epochs": (_pos_int, True),
        "max_steps_per_epoch": (_opt_pos_int, False),
        "save_every_n_steps": (_opt_pos_int, False),
        "log_every_n_steps": (_pos_int, False),
        "compile": (_bool, False),
        "enable_activation_checkpointing": (_bool, False),
        "resume_from_checkpoint": (_bool, False),
        "shuffle": (_bool, False),
        "log_peak_memory_stats": (_bool, False),
        "low_cpu_ram": (_bool, False),
        "dtype": (_choice("fp32", "bf16"), False),
    }
    for key, (check, required) in checks.items():
        if key not in cfg:
            if required:
                raise ConfigError(f"config key '{key}' is missing")
            continue
        value = plain(cfg[key])
        allowed = check(value)
        if allowed:
            raise invalid(key, value, allowed)
    seed = plain(cfg.get("seed", None))
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise invalid("seed", seed, "null or an integer >= 0")
    clip = plain(cfg.get("clip_grad_norm", None))
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0):
        raise invalid("clip_grad_norm", clip, "null or a number > 0")
    unsupported = {  # key: (values that mean "off", why)
        "tensor_parallel_dim": ((None, 1), "these recipes are data parallel (FSDP2) only"),
        "profiler.enabled": ((None, False), "the torch profiler is not wired into these recipes"),
    }
    for key, (off, why) in unsupported.items():
        value = plain(OmegaConf.select(cfg, key, default=None))
        if not any(value is v or (type(value) is type(v) and value == v) for v in off):
            raise ConfigError(f"config key '{key}' = {value!r} is not supported: {why}; remove it or set it to false")
    check_nodes(cfg)  # the nodes the recipes need: there, not null; a checkpointer's model type


def check_token_budget(cfg: DictConfig, batching: BatchingSettings, use_max: bool) -> None:
    """The token-budget keys go together, on unpacked data; their bounds must not contradict."""
    budget = batching.max_tokens
    if budget is None:
        defaults = BatchingSettings()
        for name in ("picking_order", "min_batch_size", "max_batch_size"):
            if getattr(batching, name) != getattr(defaults, name):
                raise ConfigError(
                    f"config key 'adaptive_batching.{name}' = {getattr(batching, name)!r} only applies "
                    "to token-budget batching; set adaptive_batching.max_tokens too, or remove it"
                )
        return
    if packed(cfg.get("dataset", None)):
        raise ConfigError(
            f"config key 'adaptive_batching.max_tokens' = {budget!r} needs an unpacked dataset "
            "(a packed dataset's samples are already full packs of max_seq_len tokens); "
            "set dataset.packed=False or adaptive_batching.max_tokens=null"
        )
    if budget == "auto" and not use_max:
        raise ConfigError(
            "config key 'adaptive_batching.max_tokens' = 'auto' asks the profiler for the budget; "
            "set use_maximum_batch_size=True, or give a number of tokens"
        )
    low, high = batching.min_batch_size, batching.max_batch_size
    if low is not None and high is not None and low > high:
        raise ConfigError(
            f"config keys 'adaptive_batching.min_batch_size' = {low} and "
            f"'adaptive_batching.max_batch_size' = {high} contradict: expected min <= max"
        )


def check_elastic(elastic: ElasticSpec | None, growth: GrowthSettings, batching: BatchingSettings) -> None:
    if elastic is None:
        return
    if growth.increase is not None:
        raise ConfigError(
            "config key 'adaptive_batching.elastic' fixes one global batch for the whole run; "
            "it cannot be combined with batch_increase_function (set it to null)"
        )
    if batching.token_budget:
        raise ConfigError(
            "config key 'adaptive_batching.elastic' needs a fixed number of samples per step; "
            "it cannot be combined with adaptive_batching.max_tokens (set it to null)"
        )


def check_keep_global_batch(
    growth: GrowthSettings, use_max: bool, *, elastic: ElasticSpec | None, batching: BatchingSettings
) -> None:
    """The fixed-global-batch mode takes its micro batch from the profiler and fixes the global batch."""
    if not growth.keep_global_batch:
        return
    key = "config key 'adaptive_batching.keep_global_batch' = True"
    if not use_max:
        raise ConfigError(f"{key} takes the micro batch from the profiler; set use_maximum_batch_size=True")
    if growth.increase is not None:
        raise ConfigError(
            f"{key} keeps one global batch for the whole run; it cannot be combined with "
            "batch_increase_function (set it to null)"
        )
    for other, on in (("max_tokens", batching.token_budget), ("elastic", elastic is not None)):
        if on:
            raise ConfigError(f"{key} cannot be combined with adaptive_batching.{other} (set it to null)")


def check_growth_interval(growth: GrowthSettings, batching: BatchingSettings) -> None:
    """Growth inside an epoch needs a growth function and sample-count batching."""
    interval = growth.growth_interval
    if interval.per_epoch:
        return
    key = f"config key '{GROWTH_KEY}' = {interval.spelling!r}"
    if growth.increase is None:
        raise ConfigError(
            f"{key} says when the batch grows, but batch_increase_function is null: set one, or remove the key"
        )
    if batching.token_budget:
        raise ConfigError(
            f"{key} needs sample-count batching; token-budget batching "
            "(adaptive_batching.max_tokens) grows at epoch starts only: set growth_interval to 'epoch'"
        )


def check_lr_scheduler(cfg: DictConfig) -> None:
    """The scheduler must be a LambdaLR (all of torchtune's are): it is driven by consumed samples."""
    node = cfg.get("lr_scheduler", None)
    if node is None or node.get("_component_", None) is None:
        return
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        scheduler = config.instantiate(node, probe, num_training_steps=100)
    except Exception as error:  # noqa: BLE001 - any failure is the config's
        raise ConfigError(
            f"config key 'lr_scheduler' could not be built with (optimizer, num_training_steps=N): "
            f"{type(error).__name__}: {error}"
        ) from error
    if not isinstance(scheduler, LambdaLR):
        raise ConfigError(
            f"config key 'lr_scheduler._component_' = {node._component_!r} gives a {type(scheduler).__name__}; "
            f"expected a LambdaLR (every torchtune scheduler, e.g. "
            f"torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup), which the recipes drive by "
            f"consumed samples, or null"
        )
