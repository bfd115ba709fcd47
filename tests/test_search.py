"""The verification search on simulated out-of-memory oracles, and the final choice of micro batch."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from fractions import Fraction

import pytest

from adaptive_batching.profiling.search import SearchResult, Trial, choose_micro_batch, search_max_micro_batch


def oracle(fits: Callable[[int], bool]) -> Callable[[int], Trial]:
    def run(b: int) -> Trial:
        ok = fits(b)
        return Trial(b, ok, 1e9 * b if ok else None, 0.01, "verify")

    return run


def up_to(true_max: int) -> Callable[[int], Trial]:
    return oracle(lambda b: b <= true_max)


def sizes(result: SearchResult) -> list[int]:
    return [t.micro_batch for t in result.trials]


def check(result: SearchResult, true_max: int, max_steps: int) -> None:
    assert result.max_ok <= true_max
    assert result.max_ok >= 0.97 * true_max
    assert len(sizes(result)) == len(set(sizes(result))), f"a size was tried twice: {sizes(result)}"
    assert len(result.trials) <= max_steps


TRUE_MAXIMA = [1, 2, 3, 7, 10, 33, 50, 100, 371, 1000, 4099]
NEAR = {
    "exact": lambda t: t,
    "5% low": lambda t: math.floor(t * 0.95),
    "20% low": lambda t: math.floor(t * 0.8),
    "30% high": lambda t: math.ceil(t * 1.3),
}
FAR = {"2x high": lambda t: 2 * t, "from 1": lambda t: 1}


@pytest.mark.parametrize("true_max", TRUE_MAXIMA)
@pytest.mark.parametrize("name", NEAR)
def test_estimates_off_by_up_to_30_percent_land_within_3_percent_in_8_steps(true_max: int, name: str) -> None:
    start = max(1, NEAR[name](true_max))
    check(search_max_micro_batch(up_to(true_max), start), true_max, 8)


@pytest.mark.parametrize("true_max", TRUE_MAXIMA)
@pytest.mark.parametrize("name", FAR)
def test_far_estimates_need_more_steps_but_still_land_within_3_percent(true_max: int, name: str) -> None:
    """Each doubling of the estimate's error costs about two more steps (gallop, then bisect)."""
    check(search_max_micro_batch(up_to(true_max), FAR[name](true_max), max_steps=16), true_max, 16)


@pytest.mark.parametrize("true_max", TRUE_MAXIMA)
@pytest.mark.parametrize("name", FAR)
def test_far_estimates_within_the_default_steps_are_safe(true_max: int, name: str) -> None:
    result = search_max_micro_batch(up_to(true_max), FAR[name](true_max))
    assert 1 <= result.max_ok <= true_max
    assert len(result.trials) <= 8


def test_an_estimate_within_tolerance_below_the_maximum_takes_two_steps() -> None:
    for true_max in range(1, 600):
        for start in range(max(1, math.floor(true_max / 1.04)), true_max + 1):
            if math.ceil(start * (1 + Fraction(3, 100))) <= true_max:
                continue  # more than 3% below: one step up would still fit
            result = search_max_micro_batch(up_to(true_max), start)
            assert result.max_ok == start and len(result.trials) == 2, (true_max, start, sizes(result))


@pytest.mark.parametrize("start", [1, 2, 5, 40, 1000])
def test_nothing_fits(start: int) -> None:
    result = search_max_micro_batch(up_to(0), start, max_steps=12)
    assert result.max_ok == 0
    assert sizes(result)[-1] == 1 and len(set(sizes(result))) == len(result.trials)
    assert len(result.trials) <= 12


def test_nothing_fits_within_the_step_limit() -> None:
    result = search_max_micro_batch(up_to(0), 100_000, max_steps=4)
    assert result.max_ok == 0 and len(result.trials) == 4


@pytest.mark.parametrize("start", [1, 2, 3, 50])
def test_only_one_fits(start: int) -> None:
    result = search_max_micro_batch(up_to(1), start)
    assert result.max_ok == 1


@pytest.mark.parametrize("seed", range(300))
def test_a_flaky_oracle_never_yields_a_size_above_a_failure_or_the_truth(seed: int) -> None:
    rng = random.Random(seed)
    true_max = rng.randint(5, 2000)
    flaky = oracle(lambda b: b <= true_max and not (b >= 0.9 * true_max and rng.random() < 0.2))
    start = max(1, round(true_max * rng.uniform(0.7, 1.4)))
    result = search_max_micro_batch(flaky, start)
    failures = [t.micro_batch for t in result.trials if not t.ok]
    assert result.max_ok <= true_max
    assert all(result.max_ok < f for f in failures)
    assert result.max_ok == 0 or any(t.ok and t.micro_batch == result.max_ok for t in result.trials)
    assert len(sizes(result)) == len(set(sizes(result))) and len(result.trials) <= 8


def test_a_failure_below_the_true_maximum_caps_the_answer() -> None:
    """A size that fails though a larger one would run (fragmentation) is still an upper bound."""
    result = search_max_micro_batch(oracle(lambda b: b <= 100 and b != 90), 90)
    assert sizes(result)[0] == 90 and 0 < result.max_ok < 90

    clean = sizes(search_max_micro_batch(up_to(100), 80))
    broken = clean[2]  # fails in the gallop, although every size up to 100 fits
    result = search_max_micro_batch(oracle(lambda b: b <= 100 and b != broken), 80)
    assert broken in sizes(result) and result.max_ok < broken


@pytest.mark.parametrize("start", [1, 10, 64, 500])
def test_the_upper_limit_is_never_passed_and_returned_when_it_fits(start: int) -> None:
    tried: list[int] = []

    def run(b: int) -> Trial:
        tried.append(b)
        return up_to(1000)(b)

    result = search_max_micro_batch(run, start, upper_limit=64)
    assert max(tried) <= 64
    assert result.max_ok == 64 and tried[-1] == 64


def test_the_upper_limit_above_the_maximum_changes_nothing() -> None:
    assert search_max_micro_batch(up_to(100), 100, upper_limit=10_000).max_ok == 100


def test_trials_are_returned_in_order_with_their_details() -> None:
    result = search_max_micro_batch(up_to(100), 100)
    assert result.trials == (Trial(100, True, 1e11, 0.01, "verify"), Trial(103, False, None, 0.01, "verify"))


def test_zero_tolerance_finds_the_exact_maximum() -> None:
    for true_max, start in [(1, 1), (57, 50), (57, 64), (300, 290)]:
        result = search_max_micro_batch(up_to(true_max), start, tolerance=0.0, max_steps=20)
        assert result.max_ok == true_max and true_max + 1 in sizes(result)


def test_a_trial_for_another_size_is_refused() -> None:
    with pytest.raises(ValueError, match="returned a trial for micro batch 8"):
        search_max_micro_batch(lambda b: Trial(8, True, None, 0.0, "verify"), 7)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"start": 0},
        {"start": 3, "max_steps": 0},
        {"start": 3, "tolerance": -0.1},
        {"start": 3, "upper_limit": 0},
        {"start": 2.5},
    ],
)
def test_bad_arguments_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        search_max_micro_batch(up_to(10), **kwargs)


@pytest.mark.parametrize(
    "max_ok, margin, round_to, expected",
    [
        (100, 0.05, "none", 95),
        (100, 0.05, "power_of_two", 64),
        (100, 0.05, "multiple_of_8", 88),
        (100, 0.0, "power_of_two", 64),
        (128, 0.0, "power_of_two", 128),
        (5, 0.05, "multiple_of_8", 4),
        (5, 0.05, "power_of_two", 4),
        (1, 0.05, "none", 1),
        (1, 0.05, "power_of_two", 1),
        (1, 0.05, "multiple_of_8", 1),
        (0, 0.05, "none", 0),
        (0, 0.05, "power_of_two", 0),
        (0, 0.05, "multiple_of_8", 0),
        (20, 0.05, "multiple_of_1", 19),
        (100, 0.07, "none", 93),
    ],
)
def test_choose_micro_batch(max_ok: int, margin: float, round_to: str, expected: int) -> None:
    assert choose_micro_batch(max_ok, margin, round_to) == expected


@pytest.mark.parametrize("round_to", ["nearest", "power_of_2", "multiple_of_0", "multiple_of_", "", None])
def test_an_unknown_rounding_names_the_key_and_the_choices(round_to) -> None:
    with pytest.raises(ValueError, match=r"adaptive_batching\.round_to.*power_of_two \| multiple_of_N.*\| none"):
        choose_micro_batch(100, 0.05, round_to)


@pytest.mark.parametrize("max_ok, margin", [(-1, 0.05), (10, 1.0), (10, -0.1)])
def test_bad_choices_are_refused(max_ok: int, margin: float) -> None:
    with pytest.raises(ValueError):
        choose_micro_batch(max_ok, margin, "none")
