"""Growth's settings: the growth function, when it is called, and how the batch may grow."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from adaptive_batching.growth.interval import GrowthInterval


@dataclass(frozen=True)
class GrowthSettings:
    """``batch_increase_function``, ``lr_scaling`` and the keys of ``adaptive_batching:`` that shape the plan (a
    field whose metadata names a ``key`` is that top-level key; every other field is a key under
    ``adaptive_batching:``)."""

    increase: Callable[[int, int], int] | None = field(default=None, metadata={"key": "batch_increase_function"})
    """``batch_increase_function``, loaded and checked; None: the batch does not grow."""
    lr_scaling: str = field(default="sqrt", metadata={"key": "lr_scaling"})
    """``linear``, ``sqrt`` or ``none``: the LR factor of a global batch against the config's."""
    grow_past_memory: str = "skip"
    """``skip`` or ``accumulate``: what growth past the profiled memory cap does."""
    growth_interval: GrowthInterval = GrowthInterval()
    """When the growth function is called: at each epoch start, or every N steps or samples."""
    keep_global_batch: bool = False
    """Keep the config's global batch, the micro batch the profiler's and the accumulation what is left."""
