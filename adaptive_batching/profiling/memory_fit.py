"""A linear model of peak memory against the micro batch, fitted from a few probe steps.

A training step's peak is ``fixed + bytes_per_sample x micro_batch`` once activations dominate.
At small micro batches a batch-independent peak (e.g. the optimizer step) can hide that line,
so the measured curve is ``max(plateau, fixed + slope x b)``: flat first, then linear. The fit
finds where the flat part ends and uses only the points after it, because a slope taken across
the plateau underestimates the bytes per sample and overestimates the largest batch that fits.

Measurements that differ by less than ``tolerance`` (relative) count as equal: a line is only
trusted when its points rise by more than that, otherwise the caller should probe larger batches.
Pure Python on purpose, so it is testable without a model or a device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Relative difference below which two peak measurements count as equal. Device allocators report
# peaks almost exactly, so this only absorbs rounding, not a real (if small) slope.
DEFAULT_TOLERANCE = 0.005


@dataclass(frozen=True)
class MemoryPoint:
    """The peak memory measured by one probe step at ``micro_batch`` samples."""

    micro_batch: int
    peak_bytes: float

    def __post_init__(self) -> None:
        if isinstance(self.micro_batch, bool) or not isinstance(self.micro_batch, int) or self.micro_batch < 1:
            raise ValueError(f"micro_batch must be an integer >= 1, got {self.micro_batch!r}")
        if not math.isfinite(self.peak_bytes) or self.peak_bytes < 0:
            raise ValueError(f"peak_bytes must be a finite number >= 0, got {self.peak_bytes!r}")


@dataclass(frozen=True)
class LinearFit:
    """Predicted peak memory: ``fixed_bytes + bytes_per_sample x micro_batch``, never below the plateau.

    ``plateau_bytes`` is the batch-independent peak seen at the smallest batches (0 when there
    was none); it matters when the budget is below it, as then not even one sample fits.
    """

    fixed_bytes: float
    bytes_per_sample: float
    points_used: tuple[int, ...]
    plateau_bytes: float = 0.0

    def predict(self, micro_batch: float) -> float:
        """The peak memory expected at ``micro_batch`` samples."""
        return max(self.plateau_bytes, self.fixed_bytes + self.bytes_per_sample * micro_batch)


def fit_memory(points: Sequence[MemoryPoint], *, tolerance: float = DEFAULT_TOLERANCE) -> LinearFit:
    """Fit the linear part of the peak-memory curve, leaving out a leading plateau.

    Raises ``ValueError`` when no slope can be measured (fewer than two points above the flat
    part, or no growth beyond ``tolerance``); probing larger micro batches is the remedy.
    """
    merged = _merge(points)
    fit = _best_fit(merged, tolerance)
    if fit is None:
        batches = [p.micro_batch for p in merged]
        raise ValueError(
            f"peak memory did not grow with the micro batch over batches {batches} (at least two points "
            f"above any flat part must differ by more than {tolerance:.1%}): probe larger batches"
        )
    return fit


def needs_more_points(points: Sequence[MemoryPoint], *, tolerance: float = DEFAULT_TOLERANCE) -> bool:
    """Whether a larger batch must be probed before ``fit_memory`` can measure a slope."""
    return _best_fit(_merge(points), tolerance) is None


def max_micro_batch_under(fit: LinearFit, budget_bytes: float) -> int:
    """The largest micro batch whose predicted peak is within ``budget_bytes`` (0 if none)."""
    if not math.isfinite(budget_bytes):
        raise ValueError(f"budget_bytes must be finite, got {budget_bytes!r}")
    if not fit.bytes_per_sample > 0:
        raise ValueError(f"the fit has no positive slope ({fit.bytes_per_sample!r} bytes per sample)")
    if fit.predict(1) > budget_bytes:
        return 0
    guess = (budget_bytes - fit.fixed_bytes) / fit.bytes_per_sample
    if not math.isfinite(guess):
        raise ValueError(f"a budget of {budget_bytes!r} bytes allows an unbounded micro batch under {fit!r}")
    b = max(1, math.floor(guess))
    # The division may round either way; settle on the exact boundary of predict() itself.
    while fit.predict(b + 1) <= budget_bytes:
        b += 1
    while b > 0 and fit.predict(b) > budget_bytes:
        b -= 1
    return b


def _merge(points: Sequence[MemoryPoint]) -> list[MemoryPoint]:
    """One point per micro batch, in increasing order; repeats keep the highest (safest) peak."""
    highest: dict[int, float] = {}
    for p in points:
        highest[p.micro_batch] = max(p.peak_bytes, highest.get(p.micro_batch, p.peak_bytes))
    return [MemoryPoint(b, highest[b]) for b in sorted(highest)]


def _least_squares(points: Sequence[MemoryPoint]) -> tuple[float, float]:
    """Intercept and slope of the ordinary least-squares line through ``points`` (two or more)."""
    n = len(points)
    mean_b = sum(p.micro_batch for p in points) / n
    mean_peak = sum(p.peak_bytes for p in points) / n
    spread = sum((p.micro_batch - mean_b) ** 2 for p in points)
    slope = sum((p.micro_batch - mean_b) * (p.peak_bytes - mean_peak) for p in points) / spread
    return mean_peak - slope * mean_b, slope


def _relative_error(measured: float, predicted: float) -> float:
    if measured == predicted:
        return 0.0
    return abs(measured - predicted) / max(abs(measured), abs(predicted))


def _best_fit(points: list[MemoryPoint], tolerance: float) -> LinearFit | None:
    """The plateau/line split that explains the points, or None when no slope is measurable.

    Each split ``k`` treats the first ``k`` points as the plateau and fits a line to the rest.
    A split is admissible when the line rises by more than ``tolerance`` and has a positive
    slope, no plateau point lies clearly below the line (one on it is the corner where the two
    meet), and the first line point lies clearly above the plateau (else it may still be on it).
    The fewest plateau points whose model fits every point within ``tolerance`` wins; if none
    does (noisier data than assumed), the admissible split with the smallest worst error that
    keeps a leading run of equal peaks on the plateau, as a line that fits poorly cannot start flat.
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    flat = 1
    while flat < len(points) and points[flat].peak_bytes <= points[0].peak_bytes * (1 + tolerance):
        flat += 1
    best: tuple[float, LinearFit] | None = None
    for k in range(len(points) - 1):
        plateau, line = points[:k], points[k:]
        if line[-1].peak_bytes <= line[0].peak_bytes * (1 + tolerance):
            continue
        fixed, slope = _least_squares(line)
        if slope <= 0:
            continue
        level = max((p.peak_bytes for p in plateau), default=0.0)
        if plateau and line[0].peak_bytes <= level * (1 + tolerance):
            continue
        # A plateau point may sit on the line (where the rising part meets the flat one), never below it.
        if any(p.peak_bytes < (fixed + slope * p.micro_batch) * (1 - tolerance) for p in plateau):
            continue
        fit = LinearFit(fixed, slope, tuple(p.micro_batch for p in line), level)
        mean_level = sum(p.peak_bytes for p in plateau) / k if plateau else 0.0
        error = max(
            [_relative_error(p.peak_bytes, max(mean_level, fixed + slope * p.micro_batch)) for p in plateau]
            + [_relative_error(p.peak_bytes, fixed + slope * p.micro_batch) for p in line]
        )
        if error <= tolerance:
            return fit
        if (best is None or error < best[0]) and (flat < 2 or k >= flat):
            best = (error, fit)
    return None if best is None else best[1]
