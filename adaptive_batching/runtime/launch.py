"""A training process's start: the allocator it runs under, its device and its place among the ranks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adaptive_batching.runtime import memory
from adaptive_batching.runtime.distributed import ParallelInfo, init_parallel


def start_process(device_type: str, *, profiles: bool, argv: Sequence[str]) -> tuple[torch.device, ParallelInfo]:
    """Start a run's process: on a CPU run that profiles, first start this command (``argv``) again with glibc pinned
    where an address-space limit asks for it (it must happen before any rank joins the process group: the restart
    replaces this process); then pick the device, join the process group under torchrun, and set the CPU allocator
    for the run (see :func:`~adaptive_batching.runtime.memory.set_cpu_allocator`)."""
    if device_type == "cpu" and profiles:
        memory.restart_with_glibc_pinned(argv)
    device, parallel = init_parallel(device_type)
    if device.type == "cpu":
        memory.set_cpu_allocator(profiles=profiles)
    return device, parallel
