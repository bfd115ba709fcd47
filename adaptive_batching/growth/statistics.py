"""Batch increase functions driven by training statistics, and calling any increase function.

These follow the contract of :mod:`adaptive_batching.growth.functions` (``f(epoch, current_batch_size) ->
int``, the increment to the micro batch as the function sees it) and take what they measure through
an optional keyword argument ``stats``, a mapping the trainer fills at each epoch start:

* ``noise_scale``: the measured simple noise scale ``B_simple`` in samples of the *global* batch
  (:class:`adaptive_batching.growth.gradient_noise.NoiseScaleEstimator`), None until measured.
* ``global_batch``: samples per optimizer step over all ranks, as trained in the previous epoch.
* ``micro_batch``: samples per rank per forward/backward, as trained in the previous epoch.
* ``accumulation``: micro batches per optimizer step, as trained in the previous epoch.
* ``ranks``: data-parallel ranks.
* ``lr_decay`` (Seesaw): the LR schedule's shape now over its value at the last Seesaw step that
  grew the batch (at first: its peak so far), without the batch-size factor; see :func:`seesaw`.

A function reads only the keys it needs. Without ``stats`` (``stats=None``: the plan made before
training, which has no measurement yet) both functions here return 0: what grows the batch is
the trainer's call at each epoch start with the statistics. A user's two-argument function keeps working:
:func:`call_increase` passes ``stats`` only to a function that has a parameter named ``stats``.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from adaptive_batching.growth.functions import check_call


@dataclass(frozen=True)
class TrainingStatistics(Mapping):
    """What a statistics-reading growth function is given as ``stats`` (the keys of the module docstring). It is
    a mapping too, so a user's function may read ``stats["noise_scale"]`` or ``stats.get(...)``."""

    noise_scale: float | None
    global_batch: int
    micro_batch: int
    accumulation: int
    ranks: int
    epoch: int
    lr_decay: float | None

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    @classmethod
    def _keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def unwrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function under any ``functools.partial`` layers (a YAML node's arguments are bound that way)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def accepts_stats(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` can be called with a keyword argument ``stats``.

    True when its signature has a parameter named ``stats`` that is keyword-passable; a bare
    ``**kwargs`` does not count (a user's function that forwards its keywords did not ask for
    statistics). ``functools.partial`` objects, nested or not, and the partials that
    :func:`adaptive_batching.growth.planning.load_increase_function` builds from a YAML node are seen
    through by :func:`inspect.signature`, as are callable objects. A callable without a readable
    signature (some builtins) gives False.
    """
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = parameters.get("stats")
    return p is not None and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def call_increase(fn: Callable[..., Any], epoch: int, current: int, stats: Mapping[str, Any] | None) -> Any:
    """``fn(epoch, current, stats=stats)`` if ``fn`` accepts ``stats``, else ``fn(epoch, current)``.

    The result is returned unchecked; :mod:`adaptive_batching.growth.planning` checks increments.
    """
    if accepts_stats(fn):
        return fn(epoch, current, stats=stats)
    return fn(epoch, current)


def _number(where: str, name: str, value: Any, *, minimum: float, inclusive: bool = True) -> float:
    """``value`` as a finite float (bool excluded) at or above ``minimum``; else ValueError naming it."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (not inclusive and value == minimum):
        bound = ">=" if inclusive else ">"
        raise ValueError(f"{where}: {name} must be a finite number {bound} {minimum}, got {value!r}")
    return float(value)


def _stat(where: str, stats: Mapping[str, Any], key: str) -> Any:
    """``stats[key]``; ValueError naming the key and the keys present when it is missing."""
    if not isinstance(stats, Mapping):
        raise ValueError(f"{where}: stats must be a mapping, got {type(stats).__name__}")
    if key not in stats:
        raise ValueError(f"{where}: stats has no {key!r} (keys: {sorted(stats)})")
    return stats[key]


def _scaled(current: int, ratio: float) -> int:
    """``current * ratio`` rounded to the nearest integer (halves up), at least 1."""
    return max(1, math.floor(current * ratio + 0.5))


def noise_scale(
    epoch: int,
    current_batch_size: int,
    *,
    stats: Mapping[str, Any] | None = None,
    fraction: float = 0.5,
    max_factor: float = 2.0,
    allow_shrink: bool = False,
) -> int:
    """Grow the batch toward ``fraction`` x the measured gradient noise scale (McCandlish et al. 2018).

    The simple noise scale ``B_simple`` is about the critical batch: below it a larger batch trains
    almost as well per sample and in fewer steps, above it extra samples are mostly wasted. The
    target global batch is ``fraction * stats["noise_scale"]``; the micro batch is multiplied by
    ``target / stats["global_batch"]``, at most ``max_factor`` per call (the estimate lags the run
    and is noisy), and rounded to the nearest integer. Scaling the function's own
    ``current_batch_size`` by the global ratio keeps ranks and accumulation (even the accumulation
    that ``grow_past_memory: accumulate`` adds) out of the arithmetic.

    Args:
        epoch: 0-based index of the epoch about to start.
        current_batch_size: micro batch in force during the previous epoch as the function sees it.
        stats: the trainer's statistics (module docstring); uses ``noise_scale`` and
            ``global_batch``. None, or a ``noise_scale`` of None (not measured yet), gives 0.
        fraction: default 0.5; the target as a fraction of the noise scale, > 0. McCandlish et al.
            find the step/sample trade-off balanced at about the noise scale; 0.5 stays on the
            sample-efficient side while the estimate is uncertain.
        max_factor: default 2.0; the largest multiplication per call, >= 1.
        allow_shrink: default False; when True a target below the current batch shrinks it, by at
            most ``1 / max_factor`` per call.

    Returns:
        The increment ``new - current_batch_size``; 0 when the batch is at or past the target.

    Example::

        _component_: adaptive_batching.growth.noise_scale
        fraction: 0.5
        max_factor: 2
    """
    where = "noise_scale"
    check_call(where, epoch, current_batch_size)
    fraction = _number(where, "fraction", fraction, minimum=0.0, inclusive=False)
    max_factor = _number(where, "max_factor", max_factor, minimum=1.0)
    if not isinstance(allow_shrink, bool):
        raise ValueError(f"{where}: allow_shrink must be true or false, got {allow_shrink!r}")
    if stats is None:
        return 0
    measured = _stat(where, stats, "noise_scale")
    if measured is None:
        return 0
    measured = _number(where, "stats['noise_scale']", measured, minimum=0.0)
    global_batch = _number(where, "stats['global_batch']", _stat(where, stats, "global_batch"), minimum=1.0)
    ratio = fraction * measured / global_batch
    if ratio > 1.0:
        return _scaled(current_batch_size, min(ratio, max_factor)) - current_batch_size
    if allow_shrink and ratio < 1.0:
        return _scaled(current_batch_size, max(ratio, 1.0 / max_factor)) - current_batch_size
    return 0


def seesaw_doublings(lr_decay: float, factor: float = 2.0) -> int:
    """How many Seesaw steps the schedule owes: the largest ``n`` with ``lr_decay <= factor ** -n``.

    ``lr_decay`` is the schedule's LR now over its LR at the last Seesaw step, a finite number > 0
    (above 1 while a warm-up still raises it: 0 steps). A relative tolerance of 1e-9 counts a
    schedule that reached exactly ``1/factor`` in floating point.
    """
    where = "seesaw"
    lr_decay = _number(where, "stats['lr_decay']", lr_decay, minimum=0.0, inclusive=False)
    factor = _number(where, "factor", factor, minimum=1.0, inclusive=False)
    if lr_decay >= 1.0:
        return 0
    return int(math.floor(math.log(1.0 / lr_decay) / math.log(factor) + 1e-9))


def seesaw_lr_factor(doublings: int, factor: float = 2.0) -> float:
    """The LR multiplier on top of the schedule's after ``doublings`` Seesaw steps: ``factor ** (n / 2)``.

    Where the schedule divides the LR by ``factor``, Seesaw divides it by ``sqrt(factor)`` and
    multiplies the batch by ``factor``, so relative to the schedule the LR is ``sqrt(factor)``
    higher per step taken. With a global batch grown by ``factor ** n`` this is exactly the
    trainer's ``lr_scaling: sqrt`` factor, which therefore needs nothing more.
    """
    if not isinstance(doublings, int) or isinstance(doublings, bool) or doublings < 0:
        raise ValueError(f"seesaw: doublings must be an integer >= 0, got {doublings!r}")
    factor = _number("seesaw", "factor", factor, minimum=1.0, inclusive=False)
    return factor ** (doublings / 2)


def seesaw(
    epoch: int,
    current_batch_size: int,
    *,
    stats: Mapping[str, Any] | None = None,
    factor: float = 2.0,
    max_steps: int | None = None,
) -> int:
    """Seesaw (Meterez et al. 2025, arXiv 2510.14717): trade the LR schedule's decay for batch growth.

    Wherever the LR schedule would divide the LR by ``factor`` (2: halve it), Seesaw instead
    multiplies the batch by ``factor`` and divides the LR by only ``sqrt(factor)``; for SGD on
    noisy linear regression, and for Adam in the variance-dominated regime, the loss follows the
    same curve per sample in fewer steps. This function decides the batch side at each epoch start
    from ``stats["lr_decay"]``: for every power of ``1/factor`` the schedule has fallen since the
    last Seesaw step it multiplies the micro batch by ``factor`` (:func:`seesaw_doublings`; several
    at once when one epoch covers several, at most ``max_steps`` per call).

    The trainer's side: with ``lr_scaling: sqrt`` the LR is the schedule's times ``sqrt(global / reference)``,
    exactly Seesaw's ``sqrt(factor) ** n`` (:func:`seesaw_lr_factor`; ``linear`` or ``none`` would be wrong).
    ``lr_decay`` is the schedule's shape now over its value at the last Seesaw step that really grew the batch
    (a growth refused by ``grow_past_memory: skip`` is asked for again), computed as ``shape(now) / peak_shape
    x global_batch / start_global_batch``, which keeps the steps on the grid LR = peak / factor**k.

    Args:
        epoch: 0-based index of the epoch about to start.
        current_batch_size: micro batch in force during the previous epoch as the function sees it.
        stats: uses ``lr_decay``; None (the plan before training) gives 0.
        factor: default 2.0; the batch multiplier per Seesaw step, > 1 (the LR cut it replaces).
        max_steps: default None (no limit); the most Seesaw steps per call, >= 1. A schedule that
            ends at 0 owes unboundedly many steps near its end; the memory cap or this bounds them.

    Returns:
        ``current_batch_size * factor**n`` rounded to the nearest integer, minus ``current_batch_size``.

    Example::

        _component_: adaptive_batching.growth.seesaw
        factor: 2
        max_steps: 1
    """
    where = "seesaw"
    check_call(where, epoch, current_batch_size)
    factor = _number(where, "factor", factor, minimum=1.0, inclusive=False)
    if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1):
        raise ValueError(f"{where}: max_steps must be null or an integer >= 1, got {max_steps!r}")
    if stats is None:
        return 0
    steps = seesaw_doublings(_stat(where, stats, "lr_decay"), factor)
    if max_steps is not None:
        steps = min(steps, max_steps)
    if steps == 0:
        return 0
    return _scaled(current_batch_size, factor**steps) - current_batch_size
