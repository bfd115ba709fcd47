"""The shipped batch increase functions, called directly and bound from YAML-style nodes."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from adaptive_batching.growth.functions import geometric, linear_ramp, step_increase
from adaptive_batching.growth.planning import load_increase_function


def increments(f, epochs: range, current: int = 16) -> list[int]:
    """What ``f`` returns at each epoch, always seeing ``current``."""
    return [f(e, current) for e in epochs]


# --------------------------------------------------------------------------- #
# step_increase
# --------------------------------------------------------------------------- #


def test_step_increase_with_one_increment_grows_only_at_listed_epochs() -> None:
    got = [step_increase(e, 16, at_epochs=[2, 4], increment=8) for e in range(1, 7)]
    assert got == [0, 8, 0, 8, 0, 0]


def test_step_increase_pairs_a_list_of_increments_with_the_epochs() -> None:
    got = [step_increase(e, 16, at_epochs=(3, 1), increment=[-4, 10]) for e in range(1, 5)]
    assert got == [10, 0, -4, 0]


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"at_epochs": [2, 4], "increment": [8]}, "increment"),
        ({"at_epochs": [2, 4], "increment": 8.0}, "increment"),
        ({"at_epochs": 2, "increment": 8}, "at_epochs"),
        ({"at_epochs": [2.0], "increment": 8}, "at_epochs[0]"),
        ({"at_epochs": [0, 2], "increment": 8}, "at_epochs[0]"),
        ({"at_epochs": [2, 2], "increment": 8}, "at_epochs"),
    ],
)
def test_step_increase_rejects_bad_arguments_by_name(kwargs: dict, names: str) -> None:
    with pytest.raises(ValueError, match=r"step_increase: " + names.replace("[", r"\[")):
        step_increase(2, 16, **kwargs)


# --------------------------------------------------------------------------- #
# linear_ramp
# --------------------------------------------------------------------------- #


def test_linear_ramp_defaults_grow_every_epoch_from_the_second() -> None:
    assert increments(lambda e, c: linear_ramp(e, c, increment=4), range(1, 5)) == [4, 4, 4, 4]


def test_linear_ramp_every_start_and_exclusive_stop() -> None:
    def f(e, c):
        return linear_ramp(e, c, increment=4, every=2, start_epoch=2, stop_epoch=7)

    assert increments(f, range(1, 10)) == [0, 4, 0, 4, 0, 4, 0, 0, 0]


def test_linear_ramp_start_epoch_zero_counts_periods_from_the_first_epoch() -> None:
    def f(e, c):
        return linear_ramp(e, c, increment=-2, every=3, start_epoch=0)

    assert increments(f, range(1, 8)) == [0, 0, -2, 0, 0, -2, 0]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"increment": 4, "every": 0}, "every"),
        ({"increment": 4, "every": 1.5}, "every"),
        ({"increment": 4.0}, "increment"),
        ({"increment": 4, "start_epoch": -1}, "start_epoch"),
        ({"increment": 4, "start_epoch": 3, "stop_epoch": 3}, "stop_epoch"),
    ],
)
def test_linear_ramp_rejects_bad_arguments_by_name(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"linear_ramp: {name}"):
        linear_ramp(4, 16, **kwargs)


@pytest.mark.parametrize(
    "epoch, current, name", [(1.0, 16, "epoch"), (True, 16, "epoch"), (-1, 16, "epoch"), (1, 0, "current_batch_size")]
)
def test_shipped_functions_reject_a_bad_call(epoch, current, name: str) -> None:
    for f in (
        lambda: linear_ramp(epoch, current, increment=1),
        lambda: geometric(epoch, current),
        lambda: step_increase(epoch, current, at_epochs=[1], increment=1),
    ):
        with pytest.raises(ValueError, match=f": {name} must be an integer"):
            f()


# --------------------------------------------------------------------------- #
# geometric
# --------------------------------------------------------------------------- #


def test_geometric_doubles_by_default() -> None:
    assert [geometric(e, c) for e, c in [(1, 16), (2, 32), (3, 1)]] == [16, 32, 1]


def test_geometric_rounds_halves_up_and_never_below_one() -> None:
    assert geometric(1, 3, factor=1.5) == 2  # 4.5 -> 5
    assert geometric(1, 5, factor=1.5) == 3  # 7.5 -> 8
    assert geometric(1, 7, factor=1.3) == 2  # 9.1 -> 9
    assert geometric(1, 10, factor=0.5) == -5
    assert geometric(1, 1, factor=0.4) == 0  # 0.4 would be 0: stays 1
    assert geometric(1, 3, factor=1.1) == 0  # 3.3 -> 3


def test_geometric_every_start_and_stop() -> None:
    def f(e, c):
        return geometric(e, c, factor=1.5, every=2, start_epoch=1, stop_epoch=5)

    assert increments(f, range(1, 7), current=16) == [8, 0, 8, 0, 0, 0]


@pytest.mark.parametrize("factor", [0, -2.0, float("inf"), float("nan"), "2", True])
def test_geometric_rejects_a_bad_factor(factor) -> None:
    with pytest.raises(ValueError, match="geometric: factor must be a finite number > 0"):
        geometric(1, 16, factor=factor)


def test_geometric_rejects_a_bad_every() -> None:
    with pytest.raises(ValueError, match="geometric: every must be an integer >= 1"):
        geometric(1, 16, every=0)


# --------------------------------------------------------------------------- #
# Bound from a config node
# --------------------------------------------------------------------------- #


def test_step_increase_binds_from_a_plain_dict() -> None:
    f = load_increase_function(
        {"_component_": "adaptive_batching.growth.step_increase", "at_epochs": [2, 4], "increment": [8, 16]}
    )
    assert [f(e, 16) for e in range(1, 6)] == [0, 8, 0, 16, 0]


def test_linear_ramp_binds_from_a_plain_dict() -> None:
    f = load_increase_function({"_component_": "adaptive_batching.growth.linear_ramp", "increment": 4, "every": 2})
    assert [f(e, 16) for e in range(1, 6)] == [4, 0, 4, 0, 4]


def test_geometric_binds_from_a_plain_dict() -> None:
    f = load_increase_function({"_component_": "adaptive_batching.growth.geometric", "factor": 1.5, "start_epoch": 2})
    assert [f(1, 16), f(2, 16), f(3, 24)] == [0, 8, 12]


def test_geometric_by_dotted_path_uses_its_defaults() -> None:
    f = load_increase_function("adaptive_batching.growth.geometric")
    assert [f(1, 16), f(2, 32)] == [16, 32]


def test_a_yaml_node_binds_its_lists() -> None:
    cfg = OmegaConf.create("""
batch_increase_function:
  _component_: adaptive_batching.growth.step_increase
  at_epochs: [2, 4]
  increment: [8, 16]
""")
    f = load_increase_function(cfg.batch_increase_function)
    assert [f(e, 16) for e in range(1, 6)] == [0, 8, 0, 16, 0]
