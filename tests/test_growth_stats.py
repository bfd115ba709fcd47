"""Statistics-driven growth functions and calling increase functions with or without ``stats``."""

from __future__ import annotations

import functools
import math

import pytest

from adaptive_batching.batching.lr_scaling import lr_factor
from adaptive_batching.growth.functions import linear_ramp
from adaptive_batching.growth.planning import load_increase_function, plan_batches
from adaptive_batching.growth.statistics import (
    accepts_stats,
    call_increase,
    noise_scale,
    seesaw,
    seesaw_doublings,
    seesaw_lr_factor,
)


def stats_for(noise: float | None, micro: int = 8, accumulation: int = 4, ranks: int = 2) -> dict:
    return {
        "noise_scale": noise,
        "global_batch": micro * accumulation * ranks,
        "micro_batch": micro,
        "accumulation": accumulation,
        "ranks": ranks,
    }


# --------------------------------------------------------------------------- #
# noise_scale
# --------------------------------------------------------------------------- #


def test_noise_scale_grows_the_micro_batch_to_the_target_fraction() -> None:
    # global 64; target 0.5 x 160 = 80 = 1.25 x 64: micro 8 -> 10
    assert noise_scale(1, 8, stats=stats_for(160.0)) == 2
    # fraction 1: target 96 = 1.5 x 64: micro 8 -> 12
    assert noise_scale(1, 8, stats=stats_for(96.0), fraction=1.0) == 4


def test_noise_scale_grows_by_at_most_max_factor_per_call() -> None:
    assert noise_scale(1, 8, stats=stats_for(10_000.0)) == 8
    assert noise_scale(1, 8, stats=stats_for(10_000.0), max_factor=1.5) == 4


def test_noise_scale_keeps_a_batch_at_or_past_the_target() -> None:
    assert noise_scale(1, 8, stats=stats_for(128.0)) == 0  # target = current global
    assert noise_scale(1, 8, stats=stats_for(20.0)) == 0  # target below it: no shrinking by default


def test_noise_scale_shrinks_only_when_allowed_and_by_at_most_max_factor() -> None:
    assert noise_scale(1, 8, stats=stats_for(96.0), allow_shrink=True) == -2  # 48/64 x 8 = 6
    assert noise_scale(1, 8, stats=stats_for(8.0), allow_shrink=True) == -4  # bounded at 8 / 2
    assert noise_scale(1, 1, stats=stats_for(0.0, micro=1), allow_shrink=True) == 0  # never below 1


def test_noise_scale_scales_the_functions_own_size_by_the_global_ratio() -> None:
    # grow_past_memory=accumulate: the function sees 24 while 16 x 6 x 1 = 96 samples were trained
    stats = {"noise_scale": 288.0, "global_batch": 96, "micro_batch": 16, "accumulation": 6, "ranks": 1}
    assert noise_scale(3, 24, stats=stats) == 12  # 144 / 96 = 1.5 x 24 = 36


def test_noise_scale_waits_for_a_measurement() -> None:
    assert noise_scale(1, 8) == 0
    assert noise_scale(1, 8, stats=stats_for(None)) == 0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"fraction": 0}, "fraction"),
        ({"fraction": math.nan}, "fraction"),
        ({"max_factor": 0.5}, "max_factor"),
        ({"allow_shrink": "yes"}, "allow_shrink"),
        ({"stats": {"noise_scale": 10.0}}, "global_batch"),
        ({"stats": {"noise_scale": -1.0, "global_batch": 8}}, "noise_scale"),
        ({"stats": [1, 2]}, "mapping"),
    ],
)
def test_noise_scale_refuses_bad_settings_and_stats_by_name(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        noise_scale(1, 8, **kwargs)


def test_noise_scale_plans_no_growth_before_training() -> None:
    f = load_increase_function({"_component_": "adaptive_batching.growth.noise_scale", "fraction": 0.5})
    plan = plan_batches(epochs=4, start=8, accumulation=2, ranks=1, increase=f, memory_cap=None)
    assert [entry.reason for entry in plan] == ["start", "unchanged", "unchanged", "unchanged"]


# --------------------------------------------------------------------------- #
# seesaw
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "lr_decay, steps", [(1.3, 0), (1.0, 0), (0.51, 0), (0.5, 1), (0.3, 1), (0.25, 2), (0.2, 2), (0.1, 3)]
)
def test_seesaw_counts_the_halvings_since_the_last_doubling(lr_decay, steps) -> None:
    assert seesaw_doublings(lr_decay) == steps
    assert seesaw(2, 8, stats={"lr_decay": lr_decay}) == 8 * 2**steps - 8


def test_seesaw_counts_a_halving_reached_in_floating_point() -> None:
    assert seesaw_doublings(math.cos(math.pi / 3)) == 1  # 0.5000000000000001


def test_seesaw_with_another_factor_and_a_cap_per_call() -> None:
    assert seesaw(1, 10, stats={"lr_decay": 0.6}, factor=1.5) == 5  # 1/1.5 = 0.667 crossed
    assert seesaw(1, 8, stats={"lr_decay": 0.1}, max_steps=1) == 8
    assert seesaw(1, 8) == 0  # no stats: the plan


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"stats": {"lr_decay": 0.0}}, "lr_decay"),
        ({"stats": {}}, "lr_decay"),
        ({"factor": 1.0}, "factor"),
        ({"max_steps": 0}, "max_steps"),
    ],
)
def test_seesaw_refuses_bad_settings_and_stats_by_name(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        seesaw(1, 8, **kwargs)


def test_seesaw_lr_factor_is_what_the_sqrt_rule_gives_the_grown_batch() -> None:
    for n in range(5):
        assert seesaw_lr_factor(n) == pytest.approx(lr_factor(64 * 2**n, 64, "sqrt"))
    assert seesaw_lr_factor(2, factor=4.0) == pytest.approx(4.0)


def test_seesaw_replaces_each_halving_by_a_doubling_and_sqrt2_on_the_lr() -> None:
    """A trainer-like loop: cosine schedule over samples, ``lr_decay`` from the stateless formula
    of :func:`seesaw`'s docstring, the LR from the trainer's ``lr_scaling: sqrt`` factor."""
    total, micro, accumulation, epoch_samples = 4096.0, 4, 4, 256  # one rank, 16 epochs
    reference = micro * accumulation

    def shape(samples: float) -> float:
        return 0.5 * (1 + math.cos(math.pi * samples / total))

    def halvings(samples: float) -> int:  # how many times the schedule has halved from its peak
        return sum(1 for k in range(1, 40) if shape(samples) <= 0.5**k)

    global_batch, growth = reference, {}
    for epoch in range(1, 16):
        consumed = epoch * epoch_samples
        lr_decay = shape(consumed) / shape(0) * global_batch / reference
        inc = seesaw(epoch, micro, stats={"lr_decay": lr_decay})
        if inc:
            growth[epoch] = (micro + inc) / micro
            micro += inc
            global_batch = micro * accumulation
        lr = shape(consumed) * lr_factor(global_batch, reference, "sqrt")
        # Seesaw: where the schedule alone would have halved n times, the LR is sqrt(2)**n higher
        assert lr / shape(consumed) == pytest.approx(math.sqrt(2) ** halvings(consumed))
    expected = {
        e: 2.0 ** (halvings(e * epoch_samples) - halvings((e - 1) * epoch_samples))
        for e in range(1, 16)
        if halvings(e * epoch_samples) > halvings((e - 1) * epoch_samples)
    }
    assert growth == expected
    assert 4.0 in growth.values()  # the cosine's tail halves twice within one epoch
    assert micro == 4 * 2 ** halvings(15 * epoch_samples)


# --------------------------------------------------------------------------- #
# accepts_stats / call_increase
# --------------------------------------------------------------------------- #


def two_args(epoch: int, current: int) -> int:
    return epoch + current


def wants_stats(epoch: int, current: int, *, stats=None) -> int:
    return -1 if stats is None else stats["grow"]


def kwargs_only(epoch: int, current: int, **kwargs) -> int:
    assert not kwargs
    return 1


class Callable_:
    def __call__(self, epoch: int, current: int, stats=None) -> int:
        return 0 if stats is None else 5


@pytest.mark.parametrize(
    "fn, expected",
    [
        (two_args, False),
        (lambda e, c: 0, False),
        (kwargs_only, False),
        (max, False),
        (wants_stats, True),
        (noise_scale, True),
        (seesaw, True),
        (Callable_(), True),
        (functools.partial(noise_scale, fraction=0.25), True),
        (functools.partial(functools.partial(seesaw, factor=4.0), max_steps=2), True),
        (functools.partial(linear_ramp, increment=4), False),
    ],
)
def test_accepts_stats_reads_the_signature(fn, expected) -> None:
    assert accepts_stats(fn) is expected


def test_accepts_stats_sees_through_config_partials() -> None:
    assert accepts_stats(
        load_increase_function({"_component_": "adaptive_batching.growth.noise_scale", "fraction": 0.25})
    )
    assert accepts_stats(load_increase_function("adaptive_batching.growth.seesaw"))
    assert not accepts_stats(
        load_increase_function({"_component_": "adaptive_batching.growth.linear_ramp", "increment": 4})
    )


def test_call_increase_passes_stats_only_where_accepted() -> None:
    stats = {"grow": 7, **stats_for(10_000.0)}
    assert call_increase(two_args, 2, 8, stats) == 10
    assert call_increase(kwargs_only, 2, 8, stats) == 1
    assert call_increase(wants_stats, 2, 8, stats) == 7
    assert call_increase(wants_stats, 2, 8, None) == -1
    assert call_increase(Callable_(), 2, 8, stats) == 5
    f = load_increase_function({"_component_": "adaptive_batching.growth.noise_scale", "max_factor": 1.5})
    assert call_increase(f, 2, 8, stats) == 4
    assert call_increase(functools.partial(linear_ramp, increment=4), 1, 8, stats) == 4
