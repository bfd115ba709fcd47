"""Per-epoch batch growth: loading the increase function and planning every epoch's batch.

The increase function ``f(epoch, current_batch_size) -> int`` is called at the start of every
epoch after the first and returns by how much to grow the micro batch. The plan is computed
for all epochs before training starts, so a function that misbehaves fails before any step.

When growth would take the micro batch past the profiled memory cap, ``grow_past_memory``
decides: ``skip`` (the torchtune RFC rule) leaves the batch as it is, ``accumulate`` keeps the
requested size and realises it as the capped micro batch times more gradient accumulation.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from omegaconf import OmegaConf
from torchtune.config._utils import _get_component_from_path

from adaptive_batching.batching.shape import BatchShape, EpochBatch
from adaptive_batching.core.checks import check_int
from adaptive_batching.errors import ConfigError

IncreaseFunction = Callable[[int, int], int]

KEY = "batch_increase_function"
SKIP, ACCUMULATE = "skip", "accumulate"
GROW_PAST_MEMORY = (SKIP, ACCUMULATE)
REASONS = ("start", "function", "capped", "accumulated", "unchanged")
_EXAMPLE = "'adaptive_batching.growth.linear_ramp'"


def _keyword_names(signature: inspect.Signature) -> list[str]:
    """The parameters a config node can bind: all but the first two positional ones."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p.name for p in signature.parameters.values() if p.kind in kinds][:2]
    bindable = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in signature.parameters.values() if p.kind in bindable and p.name not in positional]


def _bare(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` without annotations, which read as quoted strings in messages."""
    empty = inspect.Parameter.empty
    params = [p.replace(annotation=empty) for p in signature.parameters.values()]
    return signature.replace(parameters=params, return_annotation=empty)


def load_increase_function(spec: Any) -> IncreaseFunction | None:
    """The increase function a ``batch_increase_function`` config value names, checked.

    ``spec`` is a dotted path (``"my_module.my_fn"``) or a mapping whose ``_component_`` is a
    dotted path and whose other keys are bound as keyword arguments. ``None``, ``"none"``,
    ``"null"`` and a mapping with ``_component_: null`` mean "off" and give None.
    The function must import, be callable and accept ``f(epoch, current_batch_size)`` once
    the keywords are bound; anything else raises ConfigError naming the key.
    """
    if OmegaConf.is_config(spec):
        spec = OmegaConf.to_container(spec, resolve=True)
    named = _named_function(spec)
    if named is None:
        return None
    path, kwargs, key = named
    obj = _imported(path, key)
    _check_callable_with(obj, path, kwargs)
    return functools.partial(obj, **kwargs) if kwargs else obj


def _named_function(spec: Any) -> tuple[str, dict[str, Any], str] | None:
    """The dotted path, the keyword arguments and the config key that named the path; None when off."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("none", "null")):
        return None
    if isinstance(spec, str) and spec.strip():
        path, kwargs, key = spec, {}, KEY
    elif isinstance(spec, Mapping):
        if "_component_" not in spec:
            raise ConfigError(
                f"config key '{KEY}' = {spec!r} is invalid: expected a node with '_component_' "
                f"(a dotted path like {_EXAMPLE}) and the function's keyword arguments"
            )
        path, key = spec["_component_"], f"{KEY}._component_"
        if path is None:
            return None
        kwargs = {str(k): v for k, v in spec.items() if k != "_component_"}
    else:
        raise ConfigError(
            f"config key '{KEY}' = {spec!r} is invalid: expected null, a dotted path to a "
            f"function like {_EXAMPLE}, or a node with '_component_'"
        )
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(
            f"config key '{key}' = {path!r} is invalid: expected a dotted path to a function like {_EXAMPLE}"
        )
    return path, kwargs, key


def _imported(path: str, key: str) -> Callable[..., Any]:
    """The callable at ``path``; a ConfigError naming ``key`` when it does not import or cannot be called."""
    try:
        obj = _get_component_from_path(path)
    except Exception as exc:
        raise ConfigError(
            f"config key '{key}' = {path!r} could not be imported ({' '.join(str(exc).split())}); "
            f"expected the dotted path of an importable function like {_EXAMPLE}"
        ) from exc
    if not callable(obj):
        raise ConfigError(
            f"config key '{key}' = {path!r} is invalid: it is a {type(obj).__name__}, not "
            f"callable; expected a function f(epoch, current_batch_size) -> int"
        )
    return obj


def _check_callable_with(obj: Callable[..., Any], path: str, kwargs: dict[str, Any]) -> None:
    """``obj`` takes ``kwargs`` and, with them bound, ``f(epoch, current_batch_size)``."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return  # some builtins have no signature: the plan's calls check them
    try:
        signature.bind_partial(**kwargs)
    except TypeError as exc:
        raise ConfigError(
            f"config key '{KEY}' binds {sorted(kwargs)} to {path!r}, which does not accept "
            f"them: {exc}; expected keyword arguments among {_keyword_names(signature)}"
        ) from exc
    try:
        signature.bind(0, 1, **kwargs)
    except TypeError as exc:
        bound = f" with keyword arguments {sorted(kwargs)}" if kwargs else ""
        raise ConfigError(
            f"config key '{KEY}': {path!r}{bound} cannot be called as "
            f"f(epoch, current_batch_size): {exc}; its signature is {_bare(signature)}, "
            f"expected f(epoch, current_batch_size, *, <keyword arguments>) -> int"
        ) from exc


def _realise(
    requested: int, accumulation: int, ranks: int, cap: int | None, mode: str
) -> tuple[BatchShape, str | None]:
    """The shape that serves ``requested`` samples per rank per step, and ``capped`` or
    ``accumulated`` when the cap changed it (None when it did not)."""
    if cap is None or requested <= cap:
        return BatchShape(requested, accumulation, ranks), None
    if mode == SKIP:
        return BatchShape(cap, accumulation, ranks), "capped"
    k = max(1, (2 * requested + cap) // (2 * cap))  # floor(requested / cap + 0.5), exact
    return BatchShape(cap, accumulation * k, ranks), "accumulated" if k > 1 else "capped"


def _call(increase: IncreaseFunction, epoch: int, current: int) -> int:
    """``increase(epoch, current)``, checked to be an int that keeps the batch >= 1."""
    where = f"config key '{KEY}' called at epoch {epoch} (0-based) with current batch size {current}"
    try:
        inc = increase(epoch, current)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{where} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(inc, int) or isinstance(inc, bool):
        raise ConfigError(f"{where} returned {inc!r} ({type(inc).__name__}): expected an integer increment")
    if current + inc < 1:
        raise ConfigError(
            f"{where} returned {inc!r}: the batch size would be {current + inc}, expected an "
            f"increment that keeps it >= 1"
        )
    return inc


def checked_increment(increase: IncreaseFunction, period: int, current: int) -> int:
    """``increase(period, current)`` at a growth boundary inside an epoch, checked as at an epoch start."""
    return _call(increase, period, current)


def plan_batches(
    *,
    epochs: int,
    start: int,
    accumulation: int,
    ranks: int,
    increase: IncreaseFunction | None,
    memory_cap: int | None,
    grow_past_memory: str = SKIP,
) -> list[EpochBatch]:
    """The batch of every epoch, calling ``increase(epoch, current)`` for each epoch >= 1.

    ``start`` is the micro batch at epoch 0, ``accumulation`` the configured gradient
    accumulation, ``memory_cap`` the profiled memory cap (None = no cap).

    ``grow_past_memory="skip"``: a growth that would take the micro batch past the cap is not
    applied (reason ``capped``) and the function sees the old size next time; shrinking always
    applies. A ``start`` above the cap runs at the cap, which the function then sees.

    ``grow_past_memory="accumulate"``: the function always sees the size it asked for. Up to
    the cap that size is the micro batch; above it the micro batch is the cap and the
    accumulation is ``accumulation * k`` with ``k = max(1, floor(requested / memory_cap
    + 0.5))``, the ratio rounded to the nearest integer, halves up (172/86 -> 2, 128/86 -> 1,
    129/86 -> 2). Reason ``accumulated`` when k > 1, ``capped`` when k = 1.

    A function returning 0 gives reason ``unchanged``. A function that raises, returns a
    non-int (bool included) or takes the batch below 1 raises ConfigError naming the epoch.
    """
    check_int("plan_batches", "epochs", epochs, 1)
    check_int("plan_batches", "start", start, 1)
    check_int("plan_batches", "accumulation", accumulation, 1)
    check_int("plan_batches", "ranks", ranks, 1)
    if memory_cap is not None:
        check_int("plan_batches", "memory_cap", memory_cap, 1)
    if grow_past_memory not in GROW_PAST_MEMORY:
        raise ConfigError(
            f"config key 'adaptive_batching.grow_past_memory' = {grow_past_memory!r} is invalid: "
            f"expected {' | '.join(GROW_PAST_MEMORY)}"
        )
    shape, capped = _realise(start, accumulation, ranks, memory_cap, grow_past_memory)
    plan = [EpochBatch(0, start, 0, shape, capped or "start", memory_cap)]
    for epoch in range(1, epochs):
        current = seen_size(plan[-1], grow_past_memory)
        inc = 0 if increase is None else _call(increase, epoch, current)
        plan.append(
            grow_entry(
                plan[-1],
                inc,
                epoch=epoch,
                accumulation=accumulation,
                ranks=ranks,
                memory_cap=memory_cap,
                grow_past_memory=grow_past_memory,
            )
        )
    return plan


def seen_size(entry: EpochBatch, grow_past_memory: str) -> int:
    """The ``current_batch_size`` a growth function sees after ``entry``: the micro batch that ran
    under ``skip``, the size it asked for under ``accumulate``."""
    return entry.shape.micro_batch if grow_past_memory == SKIP else entry.requested


def grow_entry(
    previous: EpochBatch,
    inc: int,
    *,
    epoch: int,
    accumulation: int,
    ranks: int,
    memory_cap: int | None,
    grow_past_memory: str,
) -> EpochBatch:
    """The batch after a growth function returned ``inc`` following ``previous`` (see :func:`plan_batches`)."""
    current = seen_size(previous, grow_past_memory)
    requested = current + inc
    if grow_past_memory == SKIP and inc > 0 and memory_cap is not None and requested > memory_cap:
        return EpochBatch(epoch, current, inc, previous.shape, "capped", memory_cap)
    shape, capped = _realise(requested, accumulation, ranks, memory_cap, grow_past_memory)
    return EpochBatch(epoch, requested, inc, shape, "unchanged" if inc == 0 else capped or "function", memory_cap)


def describe_plan(plan: list[EpochBatch]) -> list[str]:
    """A header and one aligned line per epoch, for logs and the CLI; epochs are 1-based."""
    header = (
        "epoch (1-based)",
        "requested",
        "increment",
        "micro batch",
        "accumulation",
        "ranks",
        "global batch",
        "reason",
    )
    rows = [
        (
            str(b.epoch + 1),
            str(b.requested),
            f"{b.increment:+d}",
            str(b.shape.micro_batch),
            str(b.shape.accumulation),
            str(b.shape.ranks),
            str(b.shape.global_batch),
            b.reason,
        )
        for b in plan
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        cells = [c.rjust(w) for c, w in zip(row[:-1], widths)]
        return "  ".join([*cells, row[-1]])

    return [line(header), *(line(r) for r in rows)]


def epoch_switch_reason(previous: EpochBatch, new: EpochBatch) -> str:
    """A short phrase saying why ``new`` has the batch it has, for the epoch-switch log line."""
    said = f"function returned {new.increment:+d}"
    if new.reason == "start":
        return "start"
    if new.reason == "unchanged":
        return "function returned 0: unchanged"
    if new.reason == "function":
        return said
    cap = new.memory_cap if new.memory_cap is not None else new.shape.micro_batch
    if new.reason == "capped" and new.requested <= new.shape.micro_batch:
        asked = new.requested + new.increment
        return (
            f"{said} ({new.requested} -> {asked}), capped at micro batch {cap} (memory): "
            f"not applied, micro batch stays {previous.shape.micro_batch}"
        )
    return (
        f"{said}; realised as micro batch {new.shape.micro_batch} x {new.shape.accumulation} "
        f"accumulation (requested {new.requested} is above the memory cap {cap})"
    )
