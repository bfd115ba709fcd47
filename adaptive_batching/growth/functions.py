"""Shipped batch increase functions, for ``batch_increase_function`` in a recipe config.

A batch increase function is ``f(epoch, current_batch_size) -> int``: called at the start of
every epoch after the first, with ``epoch`` the 0-based index of the epoch about to start and
``current_batch_size`` the micro batch in force during the previous epoch as the function sees
it, it returns by how much to grow the micro batch (0 to keep it, negative to shrink it).

Each function here takes its settings as keyword-only arguments, so a YAML node binds them::

    batch_increase_function:
      _component_: adaptive_batching.growth.linear_ramp
      increment: 8
      every: 2

Bad settings raise ValueError naming the argument; as the function is only called per epoch,
``adaptive_batching.growth.planning.plan_batches`` calls it for every epoch before training starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from adaptive_batching.core.checks import check_int


def check_call(where: str, epoch: Any, current_batch_size: Any) -> None:
    """The two positional arguments every increase function receives."""
    check_int(where, "epoch", epoch, 0)
    check_int(where, "current_batch_size", current_batch_size, 1)


def _int_list(where: str, name: str, value: Any) -> list[int]:
    """A list of ints from a sequence (not a string); else ValueError naming it."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{where}: {name} must be a list of integers, got {value!r}")
    return [check_int(where, f"{name}[{i}]", v) for i, v in enumerate(value)]


def _on_period(where: str, epoch: int, every: Any, start_epoch: Any, stop_epoch: Any) -> bool:
    """Whether ``epoch`` is ``start_epoch + n * every`` (n >= 0) and below ``stop_epoch``."""
    check_int(where, "every", every, 1)
    check_int(where, "start_epoch", start_epoch, 0)
    if stop_epoch is not None:
        check_int(where, "stop_epoch", stop_epoch)
        if stop_epoch <= start_epoch:
            raise ValueError(
                f"{where}: stop_epoch must be null or greater than start_epoch ({start_epoch}), got {stop_epoch!r}"
            )
    if epoch < start_epoch or (stop_epoch is not None and epoch >= stop_epoch):
        return False
    return (epoch - start_epoch) % every == 0


def step_increase(
    epoch: int,
    current_batch_size: int,
    *,
    at_epochs: Sequence[int],
    increment: int | Sequence[int],
) -> int:
    """Grow the micro batch by a fixed amount at chosen epochs, and leave it alone otherwise.

    Args:
        epoch: 0-based index of the epoch about to start (1 for the second epoch).
        current_batch_size: micro batch in force during the previous epoch (unused; it is
            part of the contract of every increase function).
        at_epochs: required; the 0-based epochs at whose start to grow, each >= 1 (epoch 0
            is the start and never calls the function), no repeats.
        increment: required; the growth at every listed epoch, or a list pairing one
            growth with each entry of ``at_epochs`` (same length). Negative values shrink.

    Returns:
        The matching increment at a listed epoch, else 0.

    Example::

        _component_: adaptive_batching.growth.step_increase
        at_epochs: [2, 4]
        increment: [8, 16]    # +8 at the start of the third epoch, +16 at the fifth
    """
    where = "step_increase"
    check_call(where, epoch, current_batch_size)
    epochs = _int_list(where, "at_epochs", at_epochs)
    for i, e in enumerate(epochs):
        check_int(where, f"at_epochs[{i}]", e, 1)
    if len(set(epochs)) != len(epochs):
        raise ValueError(f"{where}: at_epochs must not repeat an epoch, got {list(at_epochs)!r}")
    if isinstance(increment, int) and not isinstance(increment, bool):
        increments = [increment] * len(epochs)
    elif isinstance(increment, (str, bytes)) or not isinstance(increment, Sequence):
        raise ValueError(f"{where}: increment must be an integer or a list of integers, got {increment!r}")
    else:
        increments = _int_list(where, "increment", increment)
        if len(increments) != len(epochs):
            raise ValueError(
                f"{where}: increment must be an integer or a list as long as at_epochs "
                f"({len(epochs)}), got {len(increments)} value(s): {list(increment)!r}"
            )
    return dict(zip(epochs, increments)).get(epoch, 0)


def linear_ramp(
    epoch: int,
    current_batch_size: int,
    *,
    increment: int,
    every: int = 1,
    start_epoch: int = 1,
    stop_epoch: int | None = None,
) -> int:
    """Grow the micro batch by the same amount every few epochs: an arithmetic ramp.

    Args:
        epoch: 0-based index of the epoch about to start (1 for the second epoch).
        current_batch_size: micro batch in force during the previous epoch (unused; it is
            part of the contract of every increase function).
        increment: required; the growth at each ramp epoch (negative shrinks).
        every: default 1; grow every ``every`` epochs, counted from ``start_epoch``; >= 1.
        start_epoch: default 1; the first 0-based epoch that grows (inclusive), >= 0.
        stop_epoch: default None (no end); the first 0-based epoch that no longer grows
            (exclusive); when set, greater than ``start_epoch``.

    Returns:
        ``increment`` at epochs ``start_epoch, start_epoch + every, ...`` below
        ``stop_epoch``, else 0.

    Example::

        _component_: adaptive_batching.growth.linear_ramp
        increment: 4
        every: 2
        start_epoch: 2
        stop_epoch: 7         # +4 at epochs 2, 4 and 6 (0-based)
    """
    where = "linear_ramp"
    check_call(where, epoch, current_batch_size)
    check_int(where, "increment", increment)
    return increment if _on_period(where, epoch, every, start_epoch, stop_epoch) else 0


def geometric(
    epoch: int,
    current_batch_size: int,
    *,
    factor: float = 2.0,
    every: int = 1,
    start_epoch: int = 1,
    stop_epoch: int | None = None,
) -> int:
    """Multiply the micro batch by a constant factor every few epochs: a geometric ramp.

    The new size is ``current_batch_size * factor`` rounded to the nearest integer with halves
    rounded up (``floor(x + 0.5)``: 3 x 1.5 = 4.5 gives 5), and never below 1.

    Args:
        epoch: 0-based index of the epoch about to start (1 for the second epoch).
        current_batch_size: micro batch in force during the previous epoch; the base of the
            multiplication.
        factor: default 2.0; the multiplier, a finite number > 0 (below 1 shrinks).
        every: default 1; multiply every ``every`` epochs, counted from ``start_epoch``; >= 1.
        start_epoch: default 1; the first 0-based epoch that grows (inclusive), >= 0.
        stop_epoch: default None (no end); the first 0-based epoch that no longer grows
            (exclusive); when set, greater than ``start_epoch``.

    Returns:
        The increment ``new size - current_batch_size`` at epochs ``start_epoch,
        start_epoch + every, ...`` below ``stop_epoch``, else 0.

    Example::

        _component_: adaptive_batching.growth.geometric
        factor: 1.5
        every: 2              # 16 -> 24 at epoch 1, 24 -> 36 at epoch 3, ...
    """
    where = "geometric"
    check_call(where, epoch, current_batch_size)
    valid = isinstance(factor, (int, float)) and not isinstance(factor, bool)
    if not valid or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"{where}: factor must be a finite number > 0, got {factor!r}")
    if not _on_period(where, epoch, every, start_epoch, stop_epoch):
        return 0
    new_size = max(1, math.floor(current_batch_size * factor + 0.5))
    return new_size - current_batch_size
