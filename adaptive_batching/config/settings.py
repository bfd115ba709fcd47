"""The adaptive config keys and the recipe keys they depend on, validated before any model loads.

Top-level keys: ``use_maximum_batch_size``, ``batch_increase_function``, ``lr_scaling``.
Knobs live under ``adaptive_batching:``; a misspelt knob is an error naming the known ones.
A knob whose feature is not available in this version fails when set to a non-default value,
so a config never silently asks for something that does not happen.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.optim.lr_scheduler import LambdaLR
from torchtune import config, utils

from adaptive_batching.batching.elastic import ElasticSpec
from adaptive_batching.batching.lr_scaling import LR_SCALING_RULES, default_rule
from adaptive_batching.batching.settings import BatchingSettings
from adaptive_batching.config.components import check_components, check_nodes
from adaptive_batching.config.keys import check_top_level_keys, meant_key
from adaptive_batching.config.training_kinds import check_training_kind
from adaptive_batching.core.memory_savers import check_activation_offloading, check_optimizer_in_bwd
from adaptive_batching.core.nodes import packed, plain
from adaptive_batching.errors import ConfigError
from adaptive_batching.faults import preemption
from adaptive_batching.faults.settings import FaultSettings
from adaptive_batching.growth.interval import KEY as GROWTH_KEY
from adaptive_batching.growth.interval import GrowthInterval, growth_interval_error, parse_growth_interval
from adaptive_batching.growth.planning import GROW_PAST_MEMORY, load_increase_function, plan_batches
from adaptive_batching.growth.settings import GrowthSettings
from adaptive_batching.profiling.budget import fraction_error
from adaptive_batching.profiling.search import round_to_error
from adaptive_batching.profiling.settings import ProfilerSettings
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
# sections and their defaults are the section dataclasses' fields (see :data:`KNOBS`).
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


@dataclass(frozen=True)
class Knob:
    """One key under ``adaptive_batching:``: its default as a config writes it (its section's field's default),
    its check and the section it belongs to."""

    default: Any
    check: Check
    section: str


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
    values: Mapping[str, Any], increase: Callable[[int, int], int] | None = None, lr_scaling: str = "sqrt"
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


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config key '{key}' = {value!r} is invalid: expected {allowed}")


def _check_recipe_keys(cfg: DictConfig) -> None:
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
            raise _fail(key, value, allowed)
    seed = plain(cfg.get("seed", None))
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise _fail("seed", seed, "null or an integer >= 0")
    clip = plain(cfg.get("clip_grad_norm", None))
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0):
        raise _fail("clip_grad_norm", clip, "null or a number > 0")
    unsupported = {  # key: (values that mean "off", why)
        "tensor_parallel_dim": ((None, 1), "these recipes are data parallel (FSDP2) only"),
        "profiler.enabled": ((None, False), "the torch profiler is not wired into these recipes"),
    }
    for key, (off, why) in unsupported.items():
        value = plain(OmegaConf.select(cfg, key, default=None))
        if not any(value is v or (type(value) is type(v) and value == v) for v in off):
            raise ConfigError(f"config key '{key}' = {value!r} is not supported: {why}; remove it or set it to false")
    check_nodes(cfg)  # the nodes the recipes need: there, not null; a checkpointer's model type


def validate_config(cfg: DictConfig, recipe: str | None = None) -> AdaptiveSettings:
    """Check every adaptive key and the recipe keys it relies on; raise ConfigError naming the key. ``recipe``:
    the recipe of ours that runs (default: the one for the config's model), named when it refuses a key that asks
    for training it does not do."""
    check_training_kind(cfg, recipe)
    unread = check_top_level_keys(cfg)
    if unread and os.environ.get("RANK", "0") == "0":
        utils.get_logger("INFO").warning(f"config keys not read by the recipes (ignored): {', '.join(unread)}")
    _check_recipe_keys(cfg)
    check_components(cfg)

    use_max = plain(cfg.get("use_maximum_batch_size", False))
    if not isinstance(use_max, bool):
        raise _fail("use_maximum_batch_size", use_max, "true or false")

    increase = load_increase_function(plain(cfg.get("batch_increase_function", None)))

    lr_scaling = plain(cfg.get("lr_scaling", None))
    if lr_scaling is not None and lr_scaling not in LR_SCALING_RULES:
        raise _fail("lr_scaling", lr_scaling, " | ".join(LR_SCALING_RULES) + " (or null for the default)")
    if lr_scaling is None:
        lr_scaling = default_rule(str(cfg.optimizer.get("_component_", "")))
    _check_lr_scheduler(cfg)

    section = plain(cfg.get("adaptive_batching", None))
    section = {} if section is None else section
    if not isinstance(section, Mapping):
        raise _fail("adaptive_batching", section, f"a mapping with keys {', '.join(KNOBS)}")
    unknown = sorted(str(k) for k in section if k not in KNOBS)
    if unknown:
        meant = [f"'adaptive_batching.{m}'" for m in (meant_key(k, KNOBS) for k in unknown) if m is not None]
        raise ConfigError(
            f"unknown config key(s) {', '.join('adaptive_batching.' + k for k in unknown)}; "
            + (f"did you mean {', '.join(meant)}? " if meant else "")
            + f"known keys under 'adaptive_batching': {', '.join(KNOBS)}"
        )
    values = {name: knob.default for name, knob in KNOBS.items()}
    for name, value in section.items():
        allowed = KNOBS[name].check(value)
        if allowed:
            raise _fail(f"adaptive_batching.{name}", value, allowed)
        values[name] = value
    parts = sections(values, increase, lr_scaling)
    growth, batching = parts["growth"], parts["batching"]
    _check_token_budget(cfg, batching, use_max)
    _check_elastic(parts["elastic"], growth, batching)
    _check_keep_global_batch(growth, use_max, elastic=parts["elastic"], batching=batching)
    _check_growth_interval(growth, batching)
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


def _check_token_budget(cfg: DictConfig, batching: BatchingSettings, use_max: bool) -> None:
    """The token-budget keys go together, on unpacked data; their bounds must not contradict."""
    budget = batching.max_tokens
    if budget is None:
        for name, default in (("picking_order", "dataloader"), ("min_batch_size", None), ("max_batch_size", None)):
            if getattr(batching, name) != default:
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


def _check_elastic(elastic: ElasticSpec | None, growth: GrowthSettings, batching: BatchingSettings) -> None:
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


def _check_keep_global_batch(
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


def _check_growth_interval(growth: GrowthSettings, batching: BatchingSettings) -> None:
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


def _check_lr_scheduler(cfg: DictConfig) -> None:
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
