"""The peak-memory model: a line fitted above any plateau, and the largest batch under a budget."""

from __future__ import annotations

import math
import random

import pytest

from adaptive_batching.profiling.memory_fit import (
    LinearFit,
    MemoryPoint,
    fit_memory,
    max_micro_batch_under,
    needs_more_points,
)

GB = 1e9


def points(curve, batches) -> list[MemoryPoint]:
    return [MemoryPoint(b, curve(b)) for b in batches]


def plateau_curve(b: float) -> float:
    """The optimizer step sets a 10 GB peak until activations (2 GB + 1.5 GB/sample) pass it, after b=5."""
    return max(10 * GB, 2 * GB + 1.5 * GB * b)


@pytest.mark.parametrize("fixed, per_sample", [(2 * GB, 1.5 * GB), (60 * GB, 0.9 * GB), (123_456_789, 4_321_000)])
@pytest.mark.parametrize("batches", [(1, 2), (1, 2, 4), (1, 2, 4, 8, 16), (3, 5, 11)])
def test_linear_curves_are_recovered_exactly(fixed: float, per_sample: float, batches: tuple[int, ...]) -> None:
    fit = fit_memory(points(lambda b: fixed + per_sample * b, batches))
    assert fit.fixed_bytes == pytest.approx(fixed, rel=1e-9)
    assert fit.bytes_per_sample == pytest.approx(per_sample, rel=1e-9)
    assert fit.points_used == batches
    assert fit.predict(100) == pytest.approx(fixed + 100 * per_sample, rel=1e-9)


def test_point_order_does_not_matter_and_repeats_keep_the_highest_peak() -> None:
    fit = fit_memory([MemoryPoint(4, 8 * GB), MemoryPoint(1, 3.5 * GB), MemoryPoint(4, 7 * GB), MemoryPoint(2, 5 * GB)])
    assert fit.points_used == (1, 2, 4)
    assert (fit.fixed_bytes, fit.bytes_per_sample) == pytest.approx((2 * GB, 1.5 * GB))


@pytest.mark.parametrize(
    "batches, used", [((1, 2, 4, 8, 16), (8, 16)), ((1, 2, 4, 8, 16, 32), (8, 16, 32)), ((1, 2, 3, 4, 6, 7), (6, 7))]
)
def test_plateau_points_are_left_out(batches: tuple[int, ...], used: tuple[int, ...]) -> None:
    fit = fit_memory(points(plateau_curve, batches))
    assert fit.points_used == used
    assert (fit.fixed_bytes, fit.bytes_per_sample) == pytest.approx((2 * GB, 1.5 * GB), rel=1e-9)
    assert fit.plateau_bytes == 10 * GB
    assert max_micro_batch_under(fit, 80 * GB) == 52  # (80 - 2) / 1.5
    assert fit.predict(1) == 10 * GB


def test_a_budget_below_the_plateau_fits_nothing() -> None:
    fit = fit_memory(points(plateau_curve, (1, 2, 4, 8, 16)))
    assert max_micro_batch_under(fit, 9.9 * GB) == 0
    assert max_micro_batch_under(fit, 10 * GB) == 5


@pytest.mark.parametrize("seed", range(200))
def test_one_percent_noise_keeps_the_prediction_within_three_percent(seed: int) -> None:
    rng = random.Random(seed)
    noisy = points(lambda b: (2 * GB + 1.5 * GB * b) * (1 + rng.uniform(-0.01, 0.01)), (1, 2, 4, 8, 16))
    assert max_micro_batch_under(fit_memory(noisy), 80 * GB) == pytest.approx(52, rel=0.03)


@pytest.mark.parametrize("seed", range(50))
def test_noisy_plateau_with_a_matching_tolerance(seed: int) -> None:
    rng = random.Random(seed)
    noisy = points(lambda b: plateau_curve(b) * (1 + rng.uniform(-0.01, 0.01)), (1, 2, 4, 8, 16, 32))
    fit = fit_memory(noisy, tolerance=0.02)
    assert fit.points_used[0] == 8
    assert max_micro_batch_under(fit, 80 * GB) == pytest.approx(52, rel=0.03)


@pytest.mark.parametrize(
    "batches, more", [((1,), True), ((1, 2), True), ((1, 2, 4), True), ((1, 2, 4, 8), True), ((1, 2, 4, 8, 16), False)]
)
def test_needs_more_points_until_two_lie_above_the_plateau(batches: tuple[int, ...], more: bool) -> None:
    assert needs_more_points(points(plateau_curve, batches)) is more


def test_two_rising_points_are_enough_without_a_plateau() -> None:
    assert needs_more_points(points(lambda b: 2 * GB + 1.5 * GB * b, (1, 2))) is False
    assert needs_more_points([]) is True


def test_a_rise_within_the_tolerance_is_not_a_slope() -> None:
    nearly_flat = points(lambda b: 60 * GB + 0.1 * GB * b, (1, 2))  # +0.17%
    assert needs_more_points(nearly_flat)
    assert not needs_more_points(points(lambda b: 60 * GB + 0.1 * GB * b, (1, 2, 4, 8)))


@pytest.mark.parametrize("peaks", [(5 * GB, 5 * GB), (5 * GB, 5 * GB, 5 * GB, 5 * GB), (5 * GB, 4 * GB, 3 * GB)])
def test_no_slope_is_a_clear_error(peaks: tuple[float, ...]) -> None:
    flat = [MemoryPoint(2**i, peak) for i, peak in enumerate(peaks)]
    with pytest.raises(ValueError, match="did not grow with the micro batch over batches") as caught:
        fit_memory(flat)
    assert str([p.micro_batch for p in flat]) in str(caught.value)
    assert "probe larger batches" in str(caught.value)


def test_a_single_point_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="probe larger batches"):
        fit_memory([MemoryPoint(1, GB)])


@pytest.mark.parametrize("fixed, per_sample", [(0.1, 0.2), (2 * GB, 1.5 * GB), (7_654_321.5, 333_333.3)])
def test_the_budget_boundary_is_exact(fixed: float, per_sample: float) -> None:
    fit = LinearFit(fixed, per_sample, (1, 2))
    for b in (1, 2, 3, 7, 10, 99, 1000, 12345):
        assert max_micro_batch_under(fit, fit.predict(b)) == b
        assert max_micro_batch_under(fit, math.nextafter(fit.predict(b), -math.inf)) == b - 1


def test_a_budget_below_one_sample_gives_zero() -> None:
    fit = LinearFit(2 * GB, 1.5 * GB, (1, 2))
    assert max_micro_batch_under(fit, 3.4 * GB) == 0
    assert max_micro_batch_under(fit, 0) == 0
    assert max_micro_batch_under(fit, 3.5 * GB) == 1


def test_a_fit_without_a_slope_or_a_finite_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="slope"):
        max_micro_batch_under(LinearFit(GB, 0.0, (1, 2)), 10 * GB)
    with pytest.raises(ValueError, match="finite"):
        max_micro_batch_under(LinearFit(GB, GB, (1, 2)), math.inf)


@pytest.mark.parametrize("batch, peak", [(0, GB), (1.5, GB), (True, GB), (1, -1.0), (1, math.nan)])
def test_memory_points_are_validated(batch, peak) -> None:
    with pytest.raises(ValueError):
        MemoryPoint(batch, peak)


def test_a_plateau_point_on_the_line_is_the_corner_where_they_meet() -> None:
    """Gemma 2B at 2048 tokens (fake steps): the gradients set the peak at 1 and 2 samples, the logits from 2
    on, and the point at 2 lies on the line as well as on the plateau. More probes cannot change that."""
    gib = 2**30
    points = [
        MemoryPoint(1, 20.64 * gib),
        MemoryPoint(2, 20.72 * gib),
        MemoryPoint(4, 27.43 * gib),
        MemoryPoint(8, 40.84 * gib),
        MemoryPoint(16, 67.66 * gib),
    ]
    fit = fit_memory(points)
    assert fit.bytes_per_sample == pytest.approx(3.3525 * gib, rel=0.01)
    assert fit.predict(1) == pytest.approx(20.64 * gib, rel=0.01)  # the plateau
    assert not needs_more_points(points[:4])
