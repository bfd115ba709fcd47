"""The typed settings of a run, assembled from a config validated before any model loads.

Top-level keys: ``use_maximum_batch_size``, ``batch_increase_function``, ``lr_scaling``. Knobs live under
``adaptive_batching:``, one typed section per part (:data:`SECTIONS`); the known knobs and their defaults are the
sections' fields (:data:`KNOBS`). :func:`validate_config` runs the checks of ``config/checks.py`` (each value, the
torchtune keys the adaptive machinery relies on, the keys that go together) and builds :class:`AdaptiveSettings`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from omegaconf import DictConfig
from torchtune import utils

from adaptive_batching.batching.elastic import ElasticSpec
from adaptive_batching.batching.settings import BatchingSettings
from adaptive_batching.config.checks import (
    CHECKS,
    Knob,
    check_elastic,
    check_growth_interval,
    check_keep_global_batch,
    check_lr_scheduler,
    check_recipe_keys,
    check_token_budget,
    checked_lr_scaling,
    invalid,
    knob_values,
)
from adaptive_batching.config.components import check_components
from adaptive_batching.config.keys import check_top_level_keys
from adaptive_batching.config.memory_savers import check_activation_offloading, check_optimizer_in_bwd
from adaptive_batching.config.training_kinds import check_training_kind, recipe_for_model
from adaptive_batching.config.vision import check_vision
from adaptive_batching.core.nodes import plain
from adaptive_batching.faults.settings import FaultSettings
from adaptive_batching.growth.interval import GrowthInterval, parse_growth_interval
from adaptive_batching.growth.planning import load_increase_function, plan_batches
from adaptive_batching.growth.settings import GrowthSettings
from adaptive_batching.profiling.settings import ProfilerSettings


@dataclass(frozen=True)
class AdaptiveSettings:
    """The validated adaptive configuration of one run: a few run-wide switches and one typed section per part,
    each part given only its own."""

    use_maximum_batch_size: bool = False
    optimizer_in_bwd: bool = False  # one micro batch per optimizer step: no accumulation anywhere
    profiler: ProfilerSettings = ProfilerSettings()
    batching: BatchingSettings = BatchingSettings()
    growth: GrowthSettings = GrowthSettings()
    elastic: ElasticSpec | None = None
    faults: FaultSettings = FaultSettings()

    @property
    def batch_increase_function(self) -> Callable[[int, int], int] | None:
        return self.growth.increase

    @property
    def lr_scaling(self) -> str:
        return self.growth.lr_scaling

    @property
    def needs_profile(self) -> bool:
        """The profile gives the starting micro batch (``use_maximum_batch_size``) and the cap on growth."""
        return self.use_maximum_batch_size or self.growth.increase is not None


PROFILER, BATCHING, GROWTH, ELASTIC, FAULTS = "profiler", "batching", "growth", "elastic", "faults"
# The sections of ``adaptive_batching:``: each field of theirs is a knob, except those a top-level key sets
# (their field's metadata names the key, e.g. growth's ``increase``: ``batch_increase_function``).
SECTIONS: dict[str, type] = {
    PROFILER: ProfilerSettings,
    BATCHING: BatchingSettings,
    GROWTH: GrowthSettings,
    FAULTS: FaultSettings,
}


def _written(value: Any) -> Any:
    """A typed default as a config writes it."""
    if isinstance(value, GrowthInterval):
        return value.spelling
    return list(value) if isinstance(value, tuple) else value


def _typed(name: str, value: Any) -> Any:
    """A checked config value as its section holds it."""
    if name == "growth_interval":
        return parse_growth_interval(value)
    if name == "elastic":
        return None if value is None else ElasticSpec.from_config(value)
    return tuple(value) if name == "stop_signals" else value


def _knobs() -> dict[str, Knob]:
    """Every knob, from the sections' fields (and ``AdaptiveSettings.elastic``, a section of its own)."""
    found = {
        f.name: (part, f.default) for part, cls in SECTIONS.items() for f in fields(cls) if "key" not in f.metadata
    }
    found[ELASTIC] = (ELASTIC, next(f.default for f in fields(AdaptiveSettings) if f.name == ELASTIC))
    if set(found) != set(CHECKS):
        raise TypeError(
            f"every settings field needs a check in CHECKS and every check a field: {sorted(set(found) ^ set(CHECKS))}"
        )
    return {name: Knob(_written(found[name][1]), check, found[name][0]) for name, check in CHECKS.items()}


KNOBS: dict[str, Knob] = _knobs()


def sections(
    values: Mapping[str, Any],
    increase: Callable[[int, int], int] | None = None,
    lr_scaling: str = GrowthSettings.lr_scaling,
) -> dict[str, Any]:
    """The typed sections of ``adaptive_batching:`` values already checked (every knob present)."""
    of = {
        part: {name: _typed(name, values[name]) for name, knob in KNOBS.items() if knob.section == part}
        for part in SECTIONS
    }
    return dict(
        profiler=ProfilerSettings(**of[PROFILER]),
        batching=BatchingSettings(**of[BATCHING]),
        growth=GrowthSettings(increase=increase, lr_scaling=lr_scaling, **of[GROWTH]),
        elastic=_typed(ELASTIC, values[ELASTIC]),
        faults=FaultSettings(**of[FAULTS]),
    )


def validate_config(cfg: DictConfig, recipe: str | None = None) -> AdaptiveSettings:
    """Check every adaptive key and the recipe keys it relies on; raise ConfigError naming the key. ``recipe``:
    the recipe of ours that runs (default: the one for the config's model), named when it refuses a key that asks
    for training it does not do."""
    check_training_kind(cfg, recipe)
    unread = check_top_level_keys(cfg)
    if unread and os.environ.get("RANK", "0") == "0":
        utils.get_logger("INFO").warning(f"config keys not read by the recipes (ignored): {', '.join(unread)}")
    check_recipe_keys(cfg)
    check_components(cfg)

    use_max = plain(cfg.get("use_maximum_batch_size", False))
    if not isinstance(use_max, bool):
        raise invalid("use_maximum_batch_size", use_max, "true or false")

    increase = load_increase_function(plain(cfg.get("batch_increase_function", None)))

    lr_scaling = checked_lr_scaling(cfg)
    check_lr_scheduler(cfg)

    parts = sections(knob_values(cfg, KNOBS), increase, lr_scaling)
    growth, batching = parts["growth"], parts["batching"]
    check_token_budget(cfg, batching, use_max)
    check_vision(cfg, recipe or recipe_for_model(cfg), token_budget=batching.max_tokens is not None)
    check_elastic(parts["elastic"], growth, batching)
    check_keep_global_batch(growth, use_max, elastic=parts["elastic"], batching=batching)
    check_growth_interval(growth, batching)
    in_bwd = check_optimizer_in_bwd(
        cfg,
        grow_past_memory=growth.grow_past_memory,
        elastic=parts["elastic"] is not None,
        max_tokens=batching.token_budget,
    )
    check_activation_offloading(cfg)
    if increase is not None:
        # Every epoch's call, made now: a bad return value stops the run before any model loads.
        plan_batches(
            epochs=cfg.epochs,
            start=cfg.batch_size,
            accumulation=cfg.get("gradient_accumulation_steps", 1),
            ranks=1,
            increase=increase,
            memory_cap=None,
        )
    return AdaptiveSettings(use_max, in_bwd, **parts)
