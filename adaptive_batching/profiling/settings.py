"""The profiler's settings: its section of ``adaptive_batching:`` (see docs/config-keys.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProfilerSettings:
    """How the start-up profiler measures and what it keeps."""

    memory_budget: str | int | None = None
    """Memory the profile may fill per rank (``'12GiB'``, ``'500MB'`` or bytes); None: ``memory_fraction`` of the
    device's memory (of the process's address-space limit or the machine's memory on a CPU)."""
    memory_fraction: float = 0.9
    """The share of the device's memory the budget is, when ``memory_budget`` is None."""
    safety_margin: float = 0.05
    """The share taken off the largest micro batch that fits before training with it."""
    round_to: str = "none"
    """``power_of_two``, ``multiple_of_N`` or ``none``: how the micro batch is rounded down after the margin."""
    search_tolerance: float = 0.01
    """The verification search stops within this share of the largest micro batch that fits."""
    reprofile: bool = False
    """Profile again even when the cache holds a profile of this set-up."""
    cache_dir: str | None = None
    """The folder of the profile cache (and the sample-length cache); None: ``core.paths.default_cache_dir()``."""
