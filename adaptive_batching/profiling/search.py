"""Verifying the largest micro batch that fits with real training steps, and the size to train with.

The search starts from an estimate and spends as few real steps as it can: when the estimate
is right (at most ``tolerance`` below the true maximum) it needs two, the estimate and one step
above it that fails. Otherwise it gallops away from the estimate with doubling steps, then
bisects the bracket until the smallest failure is within ``tolerance`` of the largest success.

Steps are measured in "tolerance units": one sample at small sizes, a factor of ``1 + tolerance``
at large ones (the resolution the stopping rule asks for), so the same schedule suits micro
batch 3 and micro batch 3000.

Out-of-memory outcomes can be noisy (fragmentation, other processes). A failure is always an
upper bound: the answer stays below the smallest size that failed, even if a larger one ran.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from adaptive_batching.core.checks import check_int

_MULTIPLE_OF = re.compile(r"^multiple_of_([1-9][0-9]*)$")
ROUND_TO_ALLOWED = "power_of_two | multiple_of_N (N >= 1, e.g. multiple_of_8) | none"


def round_to_error(round_to: object) -> str | None:
    """None when ``round_to`` is a rounding :func:`choose_micro_batch` knows, else the allowed values."""
    ok = round_to in ("power_of_two", "none") or (isinstance(round_to, str) and _MULTIPLE_OF.match(round_to))
    return None if ok else ROUND_TO_ALLOWED


# Gallop positions beyond this are meaningless for a micro batch; it keeps the arithmetic finite.
_LARGEST = 2.0**62


@dataclass(frozen=True)
class Trial:
    """One real training step at ``micro_batch`` samples and whether it fit."""

    micro_batch: int
    ok: bool
    peak_bytes: float | None  # None when it ran out of memory or the device keeps no statistics
    seconds: float
    phase: str  # "probe" or "verify"
    reserved_bytes: float | None = None  # the caching allocator's peak reservation (accelerators)
    alloc_retries: int = 0  # allocations the caching allocator retried after freeing its cache


@dataclass(frozen=True)
class SearchResult:
    """The largest micro batch that ran below every failure, and every trial in the order run."""

    max_ok: int
    trials: tuple[Trial, ...]


def search_max_micro_batch(
    run: Callable[[int], Trial],
    start: int,
    *,
    tolerance: float = 0.03,
    upper_limit: int | None = None,
    max_steps: int = 8,
) -> SearchResult:
    """Find the largest micro batch that runs, starting from the estimate ``start``.

    Stops when the smallest failure is at most ``max(max_ok + 1, ceil(max_ok x (1 + tolerance)))``,
    when ``upper_limit`` (never exceeded) runs, when size 1 fails, or after ``max_steps`` trials.
    No size is tried twice.
    """
    check_int("search_max_micro_batch", "start", start, 1)
    check_int("search_max_micro_batch", "max_steps", max_steps, 1)
    if upper_limit is not None:
        check_int("search_max_micro_batch", "upper_limit", upper_limit, 1)
        start = min(start, upper_limit)
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")

    trials: list[Trial] = []
    tried: set[int] = set()

    def attempt(micro_batch: int) -> bool:
        assert micro_batch not in tried, f"micro batch {micro_batch} was already tried"
        trial = run(micro_batch)
        if trial.micro_batch != micro_batch:
            raise ValueError(f"run({micro_batch}) returned a trial for micro batch {trial.micro_batch}")
        trials.append(trial)
        tried.add(micro_batch)
        return trial.ok

    started_ok = attempt(start)
    lo = start if started_ok else 0  # largest success
    hi: int | None = None if started_ok else start  # smallest failure
    gallop = 1
    while len(trials) < max_steps:
        size = _next_size(start, lo, hi, gallop, tolerance, upper_limit)
        if size is None:
            break
        if hi is None or lo == 0:
            gallop += 1
        if attempt(size):
            lo = size
        else:
            hi = size
    return SearchResult(_largest_below_failures(trials), tuple(trials))


def _next_size(
    start: int, lo: int, hi: int | None, gallop: int, tolerance: float, upper_limit: int | None
) -> int | None:
    """The next micro batch to try, or None when the search is done.

    ``lo`` is the largest success (0: none yet), ``hi`` the smallest failure (None: none yet). While nothing has
    failed it gallops up from ``start``, while nothing has run it gallops down, then it bisects between the two.
    """
    if hi is not None and hi <= _enough(lo, tolerance):
        return None
    if hi is None:
        if upper_limit is not None and lo >= upper_limit:
            return None
        if gallop == 1:
            size = _enough(start, tolerance)
        else:
            size = max(lo + 1, math.ceil(_shift(start, _doubled(gallop), tolerance)))
        return min(size, upper_limit) if upper_limit is not None else size
    if lo == 0:
        if gallop == 1:
            return _first_below(start, tolerance)
        return max(1, min(hi - 1, math.floor(_shift(start, -_doubled(gallop), tolerance))))
    return _between(lo, hi, tolerance)


def choose_micro_batch(max_ok: int, safety_margin: float, round_to: str) -> int:
    """The micro batch to train with: ``max_ok`` less the safety margin, rounded down per ``round_to``.

    Never 0 when ``max_ok >= 1``: a rounding that would reach 0 keeps the unrounded value.
    """
    check_int("choose_micro_batch", "max_ok", max_ok, 0)
    if not (isinstance(safety_margin, (int, float)) and 0 <= safety_margin < 1):
        raise ValueError(f"safety_margin must be a number in [0, 1), got {safety_margin!r}")
    if round_to_error(round_to):
        raise ValueError(f"adaptive_batching.round_to must be one of {ROUND_TO_ALLOWED}, got {round_to!r}")
    multiple = _MULTIPLE_OF.match(str(round_to))
    if max_ok == 0:
        return 0
    value = max(1, math.floor(max_ok * (1 - _exact(safety_margin))))
    if round_to == "power_of_two":
        return 1 << (value.bit_length() - 1)
    if multiple is not None:
        n = int(multiple.group(1))
        return value // n * n or value
    return value


def _exact(number: float) -> Fraction:
    """The decimal the user wrote (0.03, not the binary float just above or below it)."""
    return Fraction(str(number))


def _enough(largest_ok: int, tolerance: float) -> int:
    """The smallest failure that pins the maximum within ``tolerance`` of ``largest_ok``."""
    return max(largest_ok + 1, math.ceil(largest_ok * (1 + _exact(tolerance))))


def _first_below(failed: int, tolerance: float) -> int:
    """The smallest size whose success would end the search under a failure at ``failed``."""
    return min(failed - 1, math.floor((failed - 1) / (1 + _exact(tolerance))) + 1)


def _doubled(gallop: int) -> float:
    """How far the ``gallop``-th galloping step lands from the start: 1, 3, 7, 15, ... units."""
    return float(2 ** min(gallop, 60) - 1)


def _units(size: float, tolerance: float) -> float:
    """Where ``size`` lies on a scale of one sample per unit up to ``1 / tolerance``, then one
    factor of ``1 + tolerance`` per unit: the resolution the stopping rule asks for at each size."""
    knee = 1 / tolerance
    if size <= knee:
        return size
    return knee + math.log(size / knee) / math.log1p(tolerance)


def _size(units: float, tolerance: float) -> float:
    """The inverse of ``_units``, capped where sizes stop meaning anything."""
    knee = 1 / tolerance
    if units <= knee:
        return units
    return knee * math.exp(min((units - knee) * math.log1p(tolerance), math.log(_LARGEST / knee)))


def _shift(size: int, units: float, tolerance: float) -> float:
    """The size ``units`` tolerance units above (or, if negative, below) ``size``."""
    if tolerance == 0:
        return min(size + units, _LARGEST)
    return _size(_units(size, tolerance) + units, tolerance)


def _between(lo: int, hi: int, tolerance: float) -> int:
    """The size halfway between ``lo`` and ``hi`` in tolerance units, strictly inside them."""
    if tolerance == 0:
        middle = (lo + hi) / 2
    else:
        middle = _size((_units(lo, tolerance) + _units(hi, tolerance)) / 2, tolerance)
    return min(hi - 1, max(lo + 1, round(middle)))


def _largest_below_failures(trials: list[Trial]) -> int:
    smallest_failure = min((t.micro_batch for t in trials if not t.ok), default=None)
    return max(
        (t.micro_batch for t in trials if t.ok and (smallest_failure is None or t.micro_batch < smallest_failure)),
        default=0,
    )
