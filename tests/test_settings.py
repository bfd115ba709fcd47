"""Validation of the adaptive config keys and the recipe keys they rely on (pure, in-process)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from config_edits import CONFIGS, DELETE, modified, setting, typed
from omegaconf import DictConfig, OmegaConf

from adaptive_batching.batching.settings import BatchingSettings
from adaptive_batching.config.settings import KNOBS, validate_config
from adaptive_batching.errors import ConfigError
from adaptive_batching.faults.settings import FaultSettings
from adaptive_batching.growth.settings import GrowthSettings
from adaptive_batching.profiling.settings import ProfilerSettings
from adaptive_batching.units import parse_bytes


def config_error(cfg: DictConfig) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    return str(info.value)


# --------------------------------------------------------------------------- #
# Shipped configs
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", ["tiny_full", "tiny_lora"])
def test_shipped_tiny_configs_profile_then_grow(name: str) -> None:
    settings = validate_config(OmegaConf.load(CONFIGS / f"{name}.yaml"))
    assert settings.use_maximum_batch_size is True
    assert settings.batch_increase_function(1, 86) == 86  # geometric, factor 2
    assert settings.lr_scaling == "sqrt"  # AdamW's default
    assert settings.profiler.memory_budget == "512MiB"
    assert settings.growth.grow_past_memory == "accumulate"
    assert settings.profiler.cache_dir == f"/tmp/adaptive-batching/{name}/profile_cache"
    untouched = {k for k in KNOBS if k not in ("memory_budget", "cache_dir", "grow_past_memory")}
    assert {k: setting(settings, k) for k in untouched} == {k: typed(k, KNOBS[k].default) for k in untouched}


def test_knob_defaults_are_the_documented_ones() -> None:
    defaults = {name: knob.default for name, knob in KNOBS.items()}
    assert defaults["memory_budget"] is None
    assert defaults["memory_fraction"] == 0.9
    assert defaults["safety_margin"] == 0.05
    assert defaults["round_to"] == "none"
    assert defaults["search_tolerance"] == 0.01
    assert defaults["reprofile"] is False
    assert defaults["picking_order"] == "dataloader"
    assert defaults["oom_recovery"] is True
    assert defaults["oom_grow_back_after"] is None


def test_validation_does_not_modify_config(base_cfg: DictConfig) -> None:
    cfg = modified(base_cfg, {"adaptive_batching.memory_fraction": 0.9})
    before = OmegaConf.to_container(cfg, resolve=False)
    validate_config(cfg)
    assert OmegaConf.to_container(cfg, resolve=False) == before


def test_optional_recipe_keys_may_be_absent(base_cfg: DictConfig) -> None:
    cfg = modified(
        base_cfg,
        {
            k: DELETE
            for k in (
                "gradient_accumulation_steps",
                "max_steps_per_epoch",
                "seed",
                "clip_grad_norm",
                "dtype",
                "compile",
                "shuffle",
                "use_maximum_batch_size",
                "batch_increase_function",
                "lr_scaling",
                "adaptive_batching",
            )
        },
    )
    settings = validate_config(cfg)
    assert {name: setting(settings, name) for name in KNOBS} == {
        name: typed(name, k.default) for name, k in KNOBS.items()
    }


def test_each_sections_own_defaults_are_the_documented_ones(base_cfg: DictConfig) -> None:
    """A config without the section gets each section's own defaults, through their written form (KNOBS, the docs
    table's) and back."""
    settings = validate_config(modified(base_cfg, {"adaptive_batching": DELETE}))
    assert (settings.profiler, settings.batching, settings.faults, settings.elastic) == (
        ProfilerSettings(),
        BatchingSettings(),
        FaultSettings(),
        None,
    )
    assert dataclasses.replace(settings.growth, increase=None, lr_scaling="sqrt") == GrowthSettings()


def test_the_known_keys_and_their_defaults_are_the_sections_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """KNOBS follows the dataclasses: a changed default, a new field or a field without a check shows there."""
    from adaptive_batching.config import checks
    from adaptive_batching.config import settings as module

    @dataclasses.dataclass(frozen=True)
    class Faults(FaultSettings):
        guard_steps: int = 7
        extra_knob: bool = True

    monkeypatch.setitem(module.SECTIONS, module.FAULTS, Faults)
    with pytest.raises(TypeError, match=r"\['extra_knob'\]"):
        module._knobs()
    monkeypatch.setitem(checks.CHECKS, "extra_knob", checks._bool)
    knobs = module._knobs()
    assert (knobs["guard_steps"].default, knobs["extra_knob"].default) == (7, True)
    assert knobs["extra_knob"].section == module.FAULTS
    assert "batch_increase_function" not in knobs and "increase" not in knobs and "lr_scaling" not in knobs


@pytest.mark.parametrize("rule", ["linear", "sqrt", "none"])
def test_lr_scaling_rules_accepted(base_cfg: DictConfig, rule: str) -> None:
    assert validate_config(modified(base_cfg, {"lr_scaling": rule})).lr_scaling == rule


@pytest.mark.parametrize("value", ["power_of_two", "none", "multiple_of_8", "multiple_of_1"])
def test_round_to_valid_values_pass_the_type_check(base_cfg: DictConfig, value: str) -> None:
    cfg = modified(base_cfg, {"adaptive_batching.round_to": value})
    assert validate_config(cfg).profiler.round_to == value


# --------------------------------------------------------------------------- #
# Bad inputs: the message names the key, the value and what is allowed
# --------------------------------------------------------------------------- #

ALL_KNOBS = tuple(KNOBS)

BAD_INPUTS = [
    # (id, updates, key named in the message, the value's repr or None, fragments of what is allowed)
    ("unknown_knob", {"adaptive_batching.bogus": 1}, "adaptive_batching.bogus", None, ALL_KNOBS),
    (
        "misspelt_knob",
        {"adaptive_batching.memory_budgett": "12GiB"},
        "adaptive_batching.memory_budgett",
        None,
        ALL_KNOBS,
    ),
    ("use_max_string", {"use_maximum_batch_size": "yes"}, "'use_maximum_batch_size'", "'yes'", ("true or false",)),
    ("batch_size_zero", {"batch_size": 0}, "'batch_size'", "0", ("an integer >= 1",)),
    ("batch_size_float", {"batch_size": 2.5}, "'batch_size'", "2.5", ("an integer >= 1",)),
    (
        "grad_accum_negative",
        {"gradient_accumulation_steps": -1},
        "'gradient_accumulation_steps'",
        "-1",
        ("an integer >= 1",),
    ),
    ("epochs_bool", {"epochs": True}, "'epochs'", "True", ("an integer >= 1",)),
    ("seed_negative", {"seed": -3}, "'seed'", "-3", ("null or an integer >= 0",)),
    ("clip_zero", {"clip_grad_norm": 0}, "'clip_grad_norm'", "0", ("null or a number > 0",)),
    ("dtype", {"dtype": "fp16x"}, "'dtype'", "'fp16x'", ("fp32 | bf16",)),
    ("lr_scaling", {"lr_scaling": "cubic"}, "'lr_scaling'", "'cubic'", ("linear | sqrt | none",)),
    (
        "round_to_zero",
        {"adaptive_batching.round_to": "multiple_of_0"},
        "'adaptive_batching.round_to'",
        "'multiple_of_0'",
        ("power_of_two", "multiple_of_N", "none"),
    ),
    (
        "round_to_nearest",
        {"adaptive_batching.round_to": "nearest"},
        "'adaptive_batching.round_to'",
        "'nearest'",
        ("power_of_two", "multiple_of_N", "none"),
    ),
    (
        "memory_budget",
        {"adaptive_batching.memory_budget": "12 gigs"},
        "'adaptive_batching.memory_budget'",
        "'12 gigs'",
        ("'12GiB'", "'500MB'"),
    ),
    (
        "memory_fraction_big",
        {"adaptive_batching.memory_fraction": 1.5},
        "'adaptive_batching.memory_fraction'",
        "1.5",
        ("(0, 1]",),
    ),
    (
        "memory_fraction_zero",
        {"adaptive_batching.memory_fraction": 0},
        "'adaptive_batching.memory_fraction'",
        "0",
        ("(0, 1]",),
    ),
    (
        "search_tolerance_negative",
        {"adaptive_batching.search_tolerance": -0.01},
        "'adaptive_batching.search_tolerance'",
        "-0.01",
        ("[0, 0.25]",),
    ),
    (
        "search_tolerance_string",
        {"adaptive_batching.search_tolerance": "2%"},
        "'adaptive_batching.search_tolerance'",
        "'2%'",
        ("[0, 0.25]",),
    ),
    (
        "oom_recovery_string",
        {"adaptive_batching.oom_recovery": "on"},
        "'adaptive_batching.oom_recovery'",
        "'on'",
        ("true or false",),
    ),
    (
        "stop_signals_sigint",
        {"adaptive_batching.stop_signals": ["SIGINT"]},
        "'adaptive_batching.stop_signals'",
        "['SIGINT']",
        ("SIGTERM, SIGUSR1, SIGUSR2, SIGHUP, SIGQUIT", "[] turns it off"),
    ),
    (
        "stop_signals_string",
        {"adaptive_batching.stop_signals": "SIGTERM"},
        "'adaptive_batching.stop_signals'",
        "'SIGTERM'",
        ("a list of distinct signal names",),
    ),
    (
        "oom_grow_back_zero",
        {"adaptive_batching.oom_grow_back_after": 0},
        "'adaptive_batching.oom_grow_back_after'",
        "0",
        ("null or an integer >= 1",),
    ),
    (
        "max_tokens_bad",
        {"adaptive_batching.max_tokens": "lots"},
        "'adaptive_batching.max_tokens'",
        "'lots'",
        ("'auto'", "an integer >= 1"),
    ),
    (
        "max_tokens_auto_without_profiler",
        {"adaptive_batching.max_tokens": "auto", "use_maximum_batch_size": False},
        "'adaptive_batching.max_tokens'",
        "'auto'",
        ("use_maximum_batch_size=True",),
    ),
    (
        "max_tokens_packed",
        {"adaptive_batching.max_tokens": 4096, "dataset.packed": True},
        "'adaptive_batching.max_tokens'",
        "4096",
        ("unpacked dataset",),
    ),
    (
        "picking_order_alone",
        {"adaptive_batching.picking_order": "seqlen"},
        "'adaptive_batching.picking_order'",
        "'seqlen'",
        ("adaptive_batching.max_tokens",),
    ),
    (
        "min_over_max",
        {
            "adaptive_batching.max_tokens": 4096,
            "adaptive_batching.min_batch_size": 8,
            "adaptive_batching.max_batch_size": 4,
        },
        "'adaptive_batching.min_batch_size'",
        "8",
        ("min <= max",),
    ),
    (
        "elastic_missing",
        {"adaptive_batching.elastic": {"max_global_batch": 64}},
        "'adaptive_batching.elastic.micro_batches'",
        None,
        ("missing",),
    ),
    (
        "elastic_with_growth",
        {"adaptive_batching.elastic": {"max_global_batch": 64, "micro_batches": [2], "max_ranks": 4}},
        "'adaptive_batching.elastic'",
        None,
        ("batch_increase_function",),
    ),
    ("section_not_mapping", {"adaptive_batching": [1, 2]}, "'adaptive_batching'", "[1, 2]", ("a mapping",) + ALL_KNOBS),
    ("missing_model", {"model": DELETE}, "'model'", None, ("missing",)),
    ("missing_batch_size", {"batch_size": DELETE}, "'batch_size'", None, ("missing",)),
    (
        "increase_fn_empty",
        {"batch_increase_function": ""},
        "'batch_increase_function'",
        "''",
        ("dotted path", "_component_"),
    ),
    (
        "increase_fn_int",
        {"batch_increase_function": 5},
        "'batch_increase_function'",
        "5",
        ("dotted path", "_component_"),
    ),
    (
        "increase_fn_bad_component",
        {"batch_increase_function": {"_component_": 5}},
        "'batch_increase_function._component_'",
        "5",
        ("dotted path",),
    ),
    (
        "increase_fn_no_component",
        {"batch_increase_function": {"factor": 2}},
        "'batch_increase_function'",
        "{'factor': 2}",
        ("_component_",),
    ),
    (
        "memory_budget_inf",
        {"adaptive_batching.memory_budget": float("inf")},
        "'adaptive_batching.memory_budget'",
        "inf",
        ("'12GiB'",),
    ),
    (
        "memory_budget_huge",
        {"adaptive_batching.memory_budget": "9" * 400 + "GiB"},
        "'adaptive_batching.memory_budget'",
        None,
        ("'12GiB'",),
    ),
    ("section_false", {"adaptive_batching": False}, "'adaptive_batching'", "False", ("a mapping",)),
    ("section_empty_list", {"adaptive_batching": []}, "'adaptive_batching'", "[]", ("a mapping",)),
]


@pytest.mark.parametrize(
    "updates, key, value_repr, allowed", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS]
)
def test_bad_input_names_key_and_allowed_values(
    base_cfg: DictConfig, updates: dict[str, Any], key: str, value_repr: str | None, allowed: tuple[str, ...]
) -> None:
    message = config_error(modified(base_cfg, updates))
    assert key in message
    if value_repr is not None:
        assert f"= {value_repr} " in message
    for fragment in allowed:
        assert fragment in message, (fragment, message)


def test_a_misspelt_knob_gets_the_knob_meant_by_the_rule_of_the_top_level_keys(base_cfg: DictConfig) -> None:
    message = config_error(modified(base_cfg, {"adaptive_batching.memory_budgett": "12GiB"}))
    assert message.startswith(
        "unknown config key(s) adaptive_batching.memory_budgett; did you mean "
        "'adaptive_batching.memory_budget'? known keys under 'adaptive_batching': "
    )
    assert "did you mean" not in config_error(modified(base_cfg, {"adaptive_batching.bogus": 1}))


def test_unknown_knobs_are_all_named(base_cfg: DictConfig) -> None:
    message = config_error(modified(base_cfg, {"adaptive_batching.zzz": 1, "adaptive_batching.aaa": 2}))
    assert "adaptive_batching.aaa" in message and "adaptive_batching.zzz" in message
    assert "known keys under 'adaptive_batching'" in message


def test_bad_knob_type_names_the_key_and_the_allowed_values(base_cfg: DictConfig) -> None:
    message = config_error(modified(base_cfg, {"adaptive_batching.max_batch_size": 0}))
    assert "'adaptive_batching.max_batch_size' = 0 is invalid" in message
    assert "null or an integer >= 1" in message


NON_DEFAULT_VALID = {
    "memory_budget": "12GiB",
    "memory_fraction": 0.5,
    "safety_margin": 0.1,
    "round_to": "power_of_two",
    "search_tolerance": 0.0,
    "reprofile": True,
    "cache_dir": "/tmp/profile-cache",
    "grow_past_memory": "accumulate",
    "growth_interval": "50 steps",
    "allow_global_batch_above_data": True,
    "keep_global_batch": True,
    "max_tokens": 4096,
    "picking_order": "seqlen",
    "min_batch_size": 1,
    "max_batch_size": 64,
    "elastic": {"max_global_batch": 64, "micro_batches": [2, 4], "max_ranks": 4},
    "oom_recovery": False,
    "oom_grow_back_after": 50,
    "guard_steps": 0,
    "stop_signals": ["SIGUSR2"],
}


TOKEN_BUDGET_COMPANIONS = ("picking_order", "min_batch_size", "max_batch_size")


def test_non_default_samples_cover_every_knob() -> None:
    assert set(NON_DEFAULT_VALID) == set(KNOBS)


@pytest.mark.parametrize("name", sorted(NON_DEFAULT_VALID))
def test_each_knob_non_default(base_cfg: DictConfig, name: str) -> None:
    value = NON_DEFAULT_VALID[name]
    assert value != KNOBS[name].default
    companions = (
        {"adaptive_batching.max_tokens": 4096}
        if name in TOKEN_BUDGET_COMPANIONS
        else {"batch_increase_function": None}
        if name in ("elastic", "keep_global_batch")
        else {}
    )
    cfg = modified(base_cfg, {f"adaptive_batching.{name}": value, **companions})
    assert setting(validate_config(cfg), name) == typed(name, value)


@pytest.mark.parametrize("name", sorted(KNOBS))
def test_each_knob_at_its_default_passes(base_cfg: DictConfig, name: str) -> None:
    default = KNOBS[name].default
    settings = validate_config(modified(base_cfg, {f"adaptive_batching.{name}": default}))
    assert setting(settings, name) == typed(name, default)


def test_all_knobs_explicitly_at_default_pass(base_cfg: DictConfig) -> None:
    updates = {f"adaptive_batching.{name}": knob.default for name, knob in KNOBS.items()}
    updates.update({"use_maximum_batch_size": False, "batch_increase_function": None, "lr_scaling": None})
    settings = validate_config(modified(base_cfg, updates))
    assert settings.use_maximum_batch_size is False
    assert settings.batch_increase_function is None


@pytest.mark.parametrize(
    "value",
    [None, {"_component_": None}, {"_component_": None, "factor": 2}, "None", "null"],
    ids=["null", "component_null", "component_null_with_args", "str_None", "str_null"],
)
def test_batch_increase_function_off_forms(base_cfg: DictConfig, value: Any) -> None:
    assert validate_config(modified(base_cfg, {"batch_increase_function": value})).batch_increase_function is None


def test_interpolated_values_are_resolved(base_cfg: DictConfig) -> None:
    """Values given by interpolation are validated after resolution."""
    good = modified(base_cfg, {"micro": 4, "batch_size": "${micro}"})
    validate_config(good)
    bad = modified(base_cfg, {"micro": 0, "batch_size": "${micro}"})
    assert "'batch_size' = 0 is invalid" in config_error(bad)


# --------------------------------------------------------------------------- #
# parse_bytes
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "text, expected",
    [
        ("12GiB", 12 * 2**30),
        ("500MB", 500 * 10**6),
        ("1.5GiB", 3 * 2**29),
        ("12gib", 12 * 2**30),
        (" 64 KiB ", 64 * 2**10),
        ("2TB", 2 * 10**12),
        ("100B", 100),
        ("4096", 4096),
        (1073741824, 2**30),
        (1, 1),
    ],
)
def test_parse_bytes(text: Any, expected: int) -> None:
    result = parse_bytes(text)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    "value", ["abc", "-1GB", 0, -5, True, False, "", "12 gigs", "12G", "0GiB", 0.5, "0.5B", float("inf"), float("nan")]
)
def test_parse_bytes_rejects(value: Any) -> None:
    with pytest.raises(ValueError):
        parse_bytes(value)


def test_non_string_knob_key_is_an_unknown_key(base_cfg: DictConfig) -> None:
    cfg = modified(base_cfg, {})
    cfg.adaptive_batching = OmegaConf.create({1: 2, "bogus": 3})
    message = config_error(cfg)
    assert "adaptive_batching.1" in message and "adaptive_batching.bogus" in message
    assert all(knob in message for knob in KNOBS)


@pytest.mark.parametrize("key, value", [("tensor_parallel_dim", 2), ("profiler.enabled", True)])
def test_unsupported_torchtune_keys_fail_clearly(base_cfg: DictConfig, key: str, value: Any) -> None:
    message = config_error(modified(base_cfg, {key: value}))
    assert f"'{key}'" in message and "not supported" in message
    validate_config(modified(base_cfg, {key: False if isinstance(value, bool) else 1}))


@pytest.mark.parametrize("name", ["llama3_8b", "llama3_8b_lora", "llama3_2_1b", "llama3_2_1b_lora"])
def test_real_model_configs_validate_and_build_on_meta(name: str) -> None:
    """The shipped GPU configs name real torchtune components (built on the meta device: no memory)."""
    import torch
    from torchtune import config as tune_config

    cfg = OmegaConf.load(CONFIGS / f"{name}.yaml")
    validate_config(cfg)
    with torch.device("meta"):
        model = tune_config.instantiate(cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params > (7e9 if "8b" in name else 1e9)
    assert ("lora" in name) == any("lora_a" in n for n, _ in model.named_parameters())


# --------------------------------------------------------------------------- #
# Batch growth, LR scaling and the LR scheduler
# --------------------------------------------------------------------------- #


def shrink_to_zero(epoch: int, current_batch_size: int) -> int:
    return -current_batch_size


def test_growth_function_from_a_component_node(base_cfg: DictConfig) -> None:
    node = {"_component_": "adaptive_batching.growth.step_increase", "at_epochs": [1], "increment": 4}
    settings = validate_config(modified(base_cfg, {"batch_increase_function": node, "epochs": 2}))
    assert [settings.batch_increase_function(e, 8) for e in (1, 2)] == [4, 0]


@pytest.mark.parametrize(
    "value, expected",
    [
        ("no_such_module.grow", "could not be imported"),
        ({"_component_": "adaptive_batching.growth.linear_ramp", "increment": 2, "speed": 3}, "speed"),
        ("adaptive_batching.growth", "callable"),
        ("math.sqrt", "batch_increase_function"),
        ("test_settings.shrink_to_zero", "epoch 1"),  # returns a batch of 0 at the second epoch
    ],
)
def test_growth_function_errors_name_the_key(base_cfg: DictConfig, value: Any, expected: str) -> None:
    message = config_error(modified(base_cfg, {"batch_increase_function": value, "epochs": 2}))
    assert "'batch_increase_function" in message and expected in message, message


@pytest.mark.parametrize("component, rule", [("torch.optim.AdamW", "sqrt"), ("torch.optim.SGD", "linear")])
def test_lr_scaling_default_follows_the_optimizer(base_cfg: DictConfig, component: str, rule: str) -> None:
    cfg = modified(base_cfg, {"optimizer": {"_component_": component, "lr": 0.1}, "lr_scaling": None})
    assert validate_config(cfg).lr_scaling == rule


def test_lr_scheduler_must_be_lambda_based(base_cfg: DictConfig) -> None:
    cfg = modified(base_cfg, {"lr_scheduler": {"_component_": "torch.optim.lr_scheduler.StepLR", "step_size": 2}})
    message = config_error(cfg)
    assert "'lr_scheduler" in message
    step = modified(base_cfg, {"lr_scheduler": {"_component_": "torch.optim.lr_scheduler.LambdaLR", "lr_lambda": 3}})
    assert "'lr_scheduler'" in config_error(step)
    off = modified(base_cfg, {"lr_scheduler": {"_component_": None}})
    validate_config(off)


@pytest.mark.parametrize("value", [0, -1, "often", 2.5])
def test_save_every_n_steps_is_checked(base_cfg: DictConfig, value: Any) -> None:
    assert "'save_every_n_steps'" in config_error(modified(base_cfg, {"save_every_n_steps": value}))


@pytest.mark.parametrize(
    "updates, message",
    [
        ({"use_maximum_batch_size": False, "batch_increase_function": None}, "set use_maximum_batch_size=True"),
        ({}, "cannot be combined with batch_increase_function"),
        (
            {"batch_increase_function": None, "adaptive_batching.max_tokens": 4096},
            "cannot be combined with adaptive_batching.max_tokens",
        ),
    ],
)
def test_keep_global_batch_refuses_what_it_cannot_honour(base_cfg: DictConfig, updates: dict, message: str) -> None:
    error = config_error(modified(base_cfg, {"adaptive_batching.keep_global_batch": True, **updates}))
    assert "adaptive_batching.keep_global_batch" in error and message in error
