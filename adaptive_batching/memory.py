"""Device memory statistics that are safe to call on any device.

torchtune's ``get_memory_stats`` raises on CPU and ``torch.cpu.empty_cache`` does not exist;
these helpers answer ``None`` or do nothing where the device keeps no statistics.
"""

from __future__ import annotations

import gc
from typing import Optional

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
