"""Device memory statistics that are safe to call on any device.

torchtune's ``get_memory_stats`` raises on CPU and ``torch.cpu.empty_cache`` does not exist;
these helpers answer ``None`` or do nothing where the device keeps no statistics.
"""

from __future__ import annotations

import gc
from typing import Any, Optional

import torch

GIB = 1024**3


def _accelerator(device: torch.device) -> Optional[object]:
    """The torch module with memory statistics for ``device`` (cuda, xpu, ...), if any."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    return module if module is not None and hasattr(module, "max_memory_allocated") else None


def peak_memory_bytes(device: torch.device) -> Optional[int]:
    """Peak bytes allocated by tensors since the last reset, or None where not tracked."""
    module = _accelerator(device)
    return None if module is None else int(module.max_memory_allocated(device))


def peak_memory_gb(device: torch.device) -> Optional[float]:
    peak = peak_memory_bytes(device)
    return None if peak is None else peak / GIB


def reset_peak_memory(device: torch.device) -> None:
    module = _accelerator(device)
    if module is not None:
        module.reset_peak_memory_stats(device)


def release_memory(device: torch.device) -> None:
    """Free cached blocks after a large step so the next one starts clean."""
    gc.collect()
    module = _accelerator(device)
    if module is not None and hasattr(module, "empty_cache"):
        module.empty_cache()


class PeakMeter:
    """Tensor memory at the start of a phase and its peak during it, on any device.

    Accelerators use the allocator's own statistics; on CPU, where torch keeps none, torch's
    ``MemTracker`` counts the tensors of the tracked modules and optimizers and all new ones.
    """

    def __init__(self, device: torch.device, *tracked: Any) -> None:
        self.device = device
        self.tracked = tracked
        self.start_bytes = 0
        self.peak_bytes = 0
        self._tracker: Any = None

    def __enter__(self) -> "PeakMeter":
        module = _accelerator(self.device)
        if module is not None:
            module.reset_peak_memory_stats(self.device)
            self.start_bytes = int(module.memory_allocated(self.device))
        else:
            from torch.distributed._tools.mem_tracker import MemTracker

            self._tracker = MemTracker()
            self._tracker.track_external(*self.tracked)
            self._tracker.__enter__()
            self.start_bytes = self._cpu_total("current")
        return self

    def __exit__(self, *exc: Any) -> None:
        module = _accelerator(self.device)
        if module is not None:
            self.peak_bytes = int(module.max_memory_allocated(self.device))
            return
        self._tracker.__exit__(*exc)
        self.peak_bytes = self._cpu_total("peak")

    def _cpu_total(self, kind: str) -> int:
        snapshot = self._tracker.get_tracker_snapshot(kind)
        return int(sum(per_device.get("Total", 0) for per_device in snapshot.values()))


def current_bytes(device: torch.device, *tracked: Any) -> int:
    """Tensor memory alive now (on CPU: the tensors of ``tracked`` modules and optimizers)."""
    with PeakMeter(device, *tracked) as meter:
        pass
    return meter.start_bytes
