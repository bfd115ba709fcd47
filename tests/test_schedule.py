"""Loading the batch increase function and planning every epoch's batch (pure, in-process)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from adaptive_batching.batching.shape import BatchShape, EpochBatch
from adaptive_batching.errors import ConfigError
from adaptive_batching.growth.functions import geometric, linear_ramp
from adaptive_batching.growth.planning import describe_plan, epoch_switch_reason, load_increase_function, plan_batches

USER_MODULE = "ab_schedule_user_fns"


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable module of user-written increase functions (and things that are not)."""
    (tmp_path / f"{USER_MODULE}.py").write_text(
        textwrap.dedent("""
        def plus_four(epoch, current_batch_size):
            return 4

        def scaled(epoch, current_batch_size, *, scale=1):
            return scale * epoch

        def one_arg(epoch):
            return 1

        NOT_A_FUNCTION = 42
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return USER_MODULE


class Recorder:
    """An increase function returning ``increments[epoch]`` (0 if absent) that records its calls."""

    def __init__(self, increments: dict[int, Any]) -> None:
        self.increments = increments
        self.calls: list[tuple[int, int]] = []

    def __call__(self, epoch: int, current_batch_size: int) -> Any:
        self.calls.append((epoch, current_batch_size))
        return self.increments.get(epoch, 0)


def plan(
    increase: Callable | None,
    *,
    epochs: int,
    start: int,
    accumulation: int = 1,
    ranks: int = 1,
    cap: int | None = None,
    mode: str = "skip",
) -> list[EpochBatch]:
    return plan_batches(
        epochs=epochs,
        start=start,
        accumulation=accumulation,
        ranks=ranks,
        increase=increase,
        memory_cap=cap,
        grow_past_memory=mode,
    )


def micro(p: list[EpochBatch]) -> list[int]:
    return [b.shape.micro_batch for b in p]


def reasons(p: list[EpochBatch]) -> list[str]:
    return [b.reason for b in p]


def config_error(spec: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_increase_function(spec)
    return str(info.value)


# --------------------------------------------------------------------------- #
# load_increase_function
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("spec", [None, {"_component_": None}, "none", "null"])
def test_off_specs_load_as_none(spec: Any) -> None:
    assert load_increase_function(spec) is None


def test_a_dotted_path_loads_the_function_itself(user_module: str) -> None:
    f = load_increase_function(f"{user_module}.plus_four")
    assert f.__name__ == "plus_four" and f(3, 10) == 4


def test_a_mapping_binds_its_other_keys_as_keywords(user_module: str) -> None:
    f = load_increase_function({"_component_": f"{user_module}.scaled", "scale": 3})
    assert f(2, 10) == 6


def test_an_unimportable_module_is_named() -> None:
    msg = config_error("no_such_module_ab_xyz.grow")
    assert msg.startswith("config key 'batch_increase_function' = 'no_such_module_ab_xyz.grow'")
    assert "could not be imported" in msg and "No module named 'no_such_module_ab_xyz'" in msg


def test_a_missing_attribute_is_named_under_component() -> None:
    msg = config_error({"_component_": "adaptive_batching.growth.no_such_fn"})
    assert msg.startswith("config key 'batch_increase_function._component_'")
    assert "could not be imported" in msg and "no_such_fn" in msg


def test_a_value_that_is_not_callable_is_refused(user_module: str) -> None:
    msg = config_error(f"{user_module}.NOT_A_FUNCTION")
    assert msg.startswith("config key 'batch_increase_function'")
    assert "it is a int, not callable" in msg


@pytest.mark.parametrize("path", [f"{USER_MODULE}.one_arg", "math.sqrt"])
def test_a_function_taking_one_argument_is_refused(user_module: str, path: str) -> None:
    msg = config_error(path)
    assert msg.startswith("config key 'batch_increase_function'")
    assert "cannot be called as f(epoch, current_batch_size)" in msg


def test_an_unknown_keyword_is_refused_with_the_known_ones() -> None:
    msg = config_error({"_component_": "adaptive_batching.growth.linear_ramp", "increment": 4, "evrey": 2})
    assert msg.startswith("config key 'batch_increase_function'")
    assert "'evrey'" in msg
    assert "['increment', 'every', 'start_epoch', 'stop_epoch']" in msg


def test_a_missing_required_keyword_is_refused() -> None:
    msg = config_error({"_component_": "adaptive_batching.growth.step_increase", "increment": 8})
    assert msg.startswith("config key 'batch_increase_function'") and "'at_epochs'" in msg


def test_binding_a_positional_argument_by_keyword_is_refused(user_module: str) -> None:
    msg = config_error({"_component_": f"{user_module}.plus_four", "epoch": 3})
    assert msg.startswith("config key 'batch_increase_function'") and "'epoch'" in msg


@pytest.mark.parametrize(
    "spec, key",
    [
        ({"at_epochs": [2]}, "'batch_increase_function' = "),
        ({"_component_": 5}, "'batch_increase_function._component_' = 5"),
        ({"_component_": ""}, "'batch_increase_function._component_' = ''"),
        (7, "'batch_increase_function' = 7"),
    ],
)
def test_malformed_specs_are_refused(spec: Any, key: str) -> None:
    msg = config_error(spec)
    assert msg.startswith(f"config key {key}") and "expected" in msg


# --------------------------------------------------------------------------- #
# plan_batches without a cap
# --------------------------------------------------------------------------- #


def test_no_function_keeps_the_start_every_epoch() -> None:
    p = plan(None, epochs=3, start=8, accumulation=2, ranks=4)
    assert [b.shape for b in p] == [BatchShape(8, 2, 4)] * 3
    assert [b.epoch for b in p] == [0, 1, 2]
    assert [b.requested for b in p] == [8, 8, 8]
    assert [b.increment for b in p] == [0, 0, 0]
    assert reasons(p) == ["start", "unchanged", "unchanged"]
    assert p[0].shape.global_batch == 64


def test_step_growth_applies_and_the_function_sees_each_new_size() -> None:
    f = Recorder({2: 8, 4: -4})
    p = plan(f, epochs=6, start=16, accumulation=2)
    assert f.calls == [(1, 16), (2, 16), (3, 24), (4, 24), (5, 20)]
    assert micro(p) == [16, 16, 24, 24, 20, 20]
    assert [b.increment for b in p] == [0, 0, 8, 0, -4, 0]
    assert reasons(p) == ["start", "unchanged", "function", "unchanged", "function", "unchanged"]
    assert {b.shape.accumulation for b in p} == {2}


def test_linear_ramp_growth() -> None:
    def f(e, c):
        return linear_ramp(e, c, increment=4, every=2)

    assert micro(plan(f, epochs=6, start=8)) == [8, 12, 12, 16, 16, 20]


def test_geometric_growth() -> None:
    def f(e, c):
        return geometric(e, c, factor=1.5)

    assert micro(plan(f, epochs=5, start=3)) == [3, 5, 8, 12, 18]


# --------------------------------------------------------------------------- #
# plan_batches with a cap
# --------------------------------------------------------------------------- #


def test_skip_leaves_growth_past_the_cap_unapplied_and_applies_shrinking() -> None:
    f = Recorder({1: 4, 2: 8, 3: 2, 4: -20, 5: 8})
    p = plan(f, epochs=6, start=80, cap=86)
    assert f.calls == [(1, 80), (2, 84), (3, 84), (4, 86), (5, 66)]
    assert micro(p) == [80, 84, 84, 86, 66, 74]
    assert [b.requested for b in p] == [80, 84, 84, 86, 66, 74]
    assert [b.increment for b in p] == [0, 4, 8, 2, -20, 8]
    assert reasons(p) == ["start", "function", "capped", "function", "function", "function"]
    assert all(b.memory_cap == 86 for b in p)


def test_accumulate_realises_sizes_past_the_cap_with_rounded_accumulation() -> None:
    f = Recorder({1: 86, 2: -44, 3: 1, 5: -89})
    p = plan(f, epochs=6, start=86, accumulation=3, ranks=2, cap=86, mode="accumulate")
    assert f.calls == [(1, 86), (2, 172), (3, 128), (4, 129), (5, 129)]
    assert [b.requested for b in p] == [86, 172, 128, 129, 129, 40]
    assert [b.shape for b in p] == [
        BatchShape(86, 3, 2),
        BatchShape(86, 6, 2),  # 172 / 86 = 2
        BatchShape(86, 3, 2),  # 128 / 86 = 1.49 -> 1
        BatchShape(86, 6, 2),  # 129 / 86 = 1.5 -> 2, halves up
        BatchShape(86, 6, 2),
        BatchShape(40, 3, 2),  # back under the cap: the configured accumulation
    ]
    assert [b.shape.global_batch for b in p] == [516, 1032, 516, 1032, 1032, 240]
    assert reasons(p) == ["start", "accumulated", "capped", "accumulated", "unchanged", "function"]


@pytest.mark.parametrize("start, k", [(87, 1), (128, 1), (129, 2), (172, 2), (214, 2), (215, 3), (300, 3), (301, 4)])
def test_accumulate_rounds_requested_over_cap_to_the_nearest_integer(start: int, k: int) -> None:
    b = plan(None, epochs=1, start=start, accumulation=2, cap=86, mode="accumulate")[0]
    assert b.shape == BatchShape(86, 2 * k, 1)
    assert b.requested == start
    assert b.reason == ("accumulated" if k > 1 else "capped")


def test_a_start_above_the_cap_with_skip_runs_at_the_cap_and_the_function_sees_it() -> None:
    f = Recorder({1: 8, 2: -6})
    p = plan(f, epochs=3, start=100, cap=86)
    assert f.calls == [(1, 86), (2, 86)]
    assert [b.requested for b in p] == [100, 86, 80]
    assert micro(p) == [86, 86, 80]
    assert reasons(p) == ["capped", "capped", "function"]


def test_no_function_with_a_start_above_the_cap() -> None:
    skip = plan(None, epochs=2, start=100, accumulation=2, cap=50)
    assert [b.shape for b in skip] == [BatchShape(50, 2, 1)] * 2
    assert reasons(skip) == ["capped", "unchanged"]
    acc = plan(None, epochs=2, start=100, accumulation=2, cap=50, mode="accumulate")
    assert [b.shape for b in acc] == [BatchShape(50, 4, 1)] * 2
    assert reasons(acc) == ["accumulated", "unchanged"]


def test_a_shipped_function_loaded_from_a_dict_plans_with_a_cap() -> None:
    f = load_increase_function({"_component_": "adaptive_batching.growth.geometric"})
    p = plan(f, epochs=4, start=16, cap=50)
    assert micro(p) == [16, 32, 32, 32]
    assert reasons(p) == ["start", "function", "capped", "capped"]


# --------------------------------------------------------------------------- #
# plan_batches: a misbehaving function
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "value, shown", [(8.0, "8.0 (float)"), (True, "True (bool)"), (None, "None (NoneType)"), ("8", "'8' (str)")]
)
def test_a_non_integer_increment_is_refused_naming_the_epoch(value: Any, shown: str) -> None:
    with pytest.raises(ConfigError) as info:
        plan(Recorder({2: value}), epochs=4, start=16)
    msg = str(info.value)
    assert msg.startswith("config key 'batch_increase_function' called at epoch 2 (0-based) with current batch size 16")
    assert f"returned {shown}" in msg


def test_an_increment_taking_the_batch_below_one_is_refused() -> None:
    with pytest.raises(
        ConfigError,
        match=r"at epoch 1 \(0-based\) with current batch size 16 "
        r"returned -16: the batch size would be 0",
    ):
        plan(Recorder({1: -16}), epochs=2, start=16)


def test_a_function_that_raises_is_reported_with_the_epoch() -> None:
    f = load_increase_function({"_component_": "adaptive_batching.growth.linear_ramp", "increment": 4, "every": 0})
    with pytest.raises(ConfigError, match=r"at epoch 1 .* raised ValueError: linear_ramp: every"):
        plan(f, epochs=3, start=16)


def test_an_unknown_grow_past_memory_is_refused() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^config key 'adaptive_batching.grow_past_memory' = "
        r"'grow' is invalid: expected skip \| accumulate",
    ):
        plan(None, epochs=2, start=8, cap=4, mode="grow")


def test_bad_plan_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="epochs must be an integer >= 1"):
        plan(None, epochs=0, start=8)
    with pytest.raises(ValueError, match="memory_cap must be an integer >= 1"):
        plan(None, epochs=1, start=8, cap=0)


# --------------------------------------------------------------------------- #
# describe_plan and epoch_switch_reason
# --------------------------------------------------------------------------- #


def test_describe_plan_has_a_header_and_the_numbers_of_each_epoch() -> None:
    p = plan(Recorder({1: 86, 2: -100}), epochs=3, start=86, accumulation=3, ranks=2, cap=86, mode="accumulate")
    lines = describe_plan(p)
    assert len(lines) == 4
    for column in ("epoch (1-based)", "requested", "micro batch", "accumulation", "ranks", "global batch", "reason"):
        assert column in lines[0]
    rows = [line.split() for line in lines[1:]]
    assert rows == [
        ["1", "86", "+0", "86", "3", "2", "516", "start"],
        ["2", "172", "+86", "86", "6", "2", "1032", "accumulated"],
        ["3", "72", "-100", "72", "3", "2", "432", "function"],
    ]
    assert lines[1].index("516") == lines[2].index("1032") + 1  # right-aligned columns


def test_epoch_switch_reason_for_each_kind_of_switch() -> None:
    skip = plan(Recorder({1: 8, 2: 2, 3: 0}), epochs=4, start=80, cap=86)
    assert epoch_switch_reason(skip[0], skip[1]) == (
        "function returned +8 (80 -> 88), capped at micro batch 86 (memory): not applied, micro batch stays 80"
    )
    assert epoch_switch_reason(skip[1], skip[2]) == "function returned +2"
    assert epoch_switch_reason(skip[2], skip[3]) == "function returned 0: unchanged"
    acc = plan(Recorder({1: 8, 2: 90}), epochs=3, start=80, accumulation=1, cap=86, mode="accumulate")
    assert epoch_switch_reason(acc[0], acc[1]) == (
        "function returned +8; realised as micro batch 86 x 1 accumulation (requested 88 is above the memory cap 86)"
    )
    assert epoch_switch_reason(acc[1], acc[2]) == (
        "function returned +90; realised as micro batch 86 x 2 accumulation (requested 178 is above the memory cap 86)"
    )
