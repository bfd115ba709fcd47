"""Device memory statistics that are safe to call on any device.

torchtune's ``get_memory_stats`` raises on CPU and ``torch.cpu.empty_cache`` does not exist;
these helpers answer ``None`` or do nothing where the device keeps no statistics.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import torch

from adaptive_batching.core import logs
from adaptive_batching.runtime import nf4

GIB = 1024**3


def _accelerator(device: torch.device) -> ModuleType | None:
    """The torch module with memory statistics for ``device`` (cuda, xpu, ...), if any."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    return module if module is not None and hasattr(module, "max_memory_allocated") else None


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak bytes allocated by tensors since the last reset, or None where not tracked."""
    module = _accelerator(device)
    return None if module is None else int(module.max_memory_allocated(device))


def peak_memory_gb(device: torch.device) -> float | None:
    peak = peak_memory_bytes(device)
    return None if peak is None else peak / GIB


def reset_peak_memory(device: torch.device) -> None:
    module = _accelerator(device)
    if module is not None:
        module.reset_peak_memory_stats(device)


def freeze_long_lived_objects() -> None:
    """Collect once, then leave every object alive now out of later collections. Call it once the imports are
    done and before a run builds anything (the entry points do): :func:`release_memory` runs after every
    profiler trial step, and with torch and torchtune imported a full collection walks their objects for about
    half a second on a CPU; the run's own objects (a few thousand on the tiny model) stay collectable, so that
    at the end one cheap collection frees its process group (``distributed.release_destroyed_group``)."""
    gc.collect()
    gc.freeze()


def release_memory(device: torch.device) -> None:
    """Free cached blocks after a large step so the next one starts clean.

    On CPU that means glibc's ``malloc_trim``: after an allocation failed under an address-space
    limit, glibc grows its heap instead, and only a trim gives that space back.
    """
    gc.collect()
    module = _accelerator(device)
    if module is not None and hasattr(module, "empty_cache"):
        module.empty_cache()
    elif device.type == "cpu":
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


def live_tensor_bytes(*tracked: Any) -> int:
    """Bytes held by the parameters, buffers and gradients of modules and the state of optimizers."""
    seen: set[int] = set()  # storages' data pointers
    seen_nf4: set[int] = set()
    total = 0

    def add(tensor: Any) -> None:
        nonlocal total
        if not isinstance(tensor, torch.Tensor):
            return
        quantized = nf4.local_nf4(tensor)
        if quantized is not None:  # a tensor subclass without storage: its inner tensors' bytes
            if id(quantized) not in seen_nf4:
                seen_nf4.add(id(quantized))
                total += nf4.nf4_bytes(quantized)
            return
        if hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen and storage.device.type != "meta":
            seen.add(storage.data_ptr())
            total += storage.nbytes()

    for item in tracked:
        if isinstance(item, torch.nn.Module):
            for param in item.parameters():
                add(param)
                add(param.grad)
            for buffer in item.buffers():
                add(buffer)
        elif isinstance(item, torch.optim.Optimizer):
            for state in item.state.values():
                for value in state.values():
                    add(value)
    return total


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def _reset_resident_peak() -> bool:
    """Reset the kernel's peak resident-set counter (VmHWM) of this process; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


class PeakMeter:
    """Tensor memory at the start of a phase and its peak during it, on any device.

    Accelerators use the allocator's own statistics. On CPU, where torch keeps none, the peak is
    the live tensors at the start plus the growth of the process's resident memory during the
    phase (the kernel's high-water mark, reset for the phase): it counts every allocation the
    step makes, as a real memory limit does, and holds no reference to any tensor. Where that
    counter cannot be reset, and for fake tensors, torch's ``MemTracker`` counts tensors instead
    (:class:`~adaptive_batching.runtime.mem_tracker.FrozenAwareMemTracker`, which also takes LoRA models).
    """

    def __init__(self, device: torch.device, *tracked: Any) -> None:
        self.device = device
        self.tracked = tracked
        self.start_bytes = 0
        self.peak_bytes = 0
        # Accelerators only: the caching allocator's peak reservation, and how often it had to free
        # its cache and retry an allocation during the phase (a sign of thrashing near the limit).
        self.reserved_peak_bytes: int | None = None
        self.alloc_retries = 0
        self._retries_start = 0
        self._tracker: Any = None
        self._resident_start: int | None = None

    def __enter__(self) -> PeakMeter:
        module = _accelerator(self.device)
        if module is not None:
            module.reset_peak_memory_stats(self.device)
            self.start_bytes = int(module.memory_allocated(self.device))
            self._retries_start = _alloc_retries(module, self.device)
        elif not _fake_mode_active() and _reset_resident_peak():
            self.start_bytes = live_tensor_bytes(*self.tracked)
            self._resident_start = _proc_status_bytes("VmRSS")
        else:
            from adaptive_batching.runtime.mem_tracker import FrozenAwareMemTracker

            self._tracker = FrozenAwareMemTracker()
            self._tracker.track_external(*self.tracked)
            self._tracker.__enter__()
            self.start_bytes = self._tracked_total("current")
        return self

    def __exit__(self, *exc: Any) -> None:
        module = _accelerator(self.device)
        if module is not None:
            self.peak_bytes = int(module.max_memory_allocated(self.device))
            if hasattr(module, "max_memory_reserved"):
                self.reserved_peak_bytes = int(module.max_memory_reserved(self.device))
            self.alloc_retries = _alloc_retries(module, self.device) - self._retries_start
        elif self._resident_start is not None:
            growth = _proc_status_bytes("VmHWM") - self._resident_start
            self.peak_bytes = self.start_bytes + max(0, growth)
        else:
            self._tracker.__exit__(*exc)
            self.peak_bytes = self._tracked_total("peak")

    def _tracked_total(self, kind: str) -> int:
        snapshot = self._tracker.get_tracker_snapshot(kind)
        return int(sum(per_device.get("Total", 0) for per_device in snapshot.values()))


def _alloc_retries(module: Any, device: torch.device) -> int:
    """The caching allocator's count of allocations that failed, emptied its cache and retried."""
    stats = module.memory_stats(device) if hasattr(module, "memory_stats") else {}
    return int(stats.get("num_alloc_retries", 0))


def _fake_mode_active() -> bool:
    from torch._guards import active_fake_mode

    return active_fake_mode() is not None


def current_bytes(device: torch.device, *tracked: Any) -> int:
    """Tensor memory alive now (on CPU: the tensors of ``tracked`` modules and optimizers)."""
    with PeakMeter(device, *tracked) as meter:
        pass
    return meter.start_bytes


M_TRIM_THRESHOLD = -1  # glibc mallopt parameters
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 128 * 1024
REUSE_MMAP_THRESHOLD_BYTES = 32 * 2**20  # the ceiling of glibc's own moving threshold on 64-bit
REUSE_TRIM_THRESHOLD_BYTES = 2**30
_pinned = False
# The same two settings as glibc's environment tunables, read once when a process starts.
PINNED_TUNABLES = {"glibc.malloc.mmap_threshold": str(MMAP_THRESHOLD_BYTES), "glibc.malloc.arena_max": "1"}
RESTARTED_ENV = "ADAPTIVE_BATCHING_RESTARTED_FOR_GLIBC"


def pin_cpu_allocator(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Make a CPU process's address space follow its tensors; True if it could (Linux glibc).

    By default glibc raises its mmap threshold as blocks are freed, so later tensors come from
    heaps that never shrink, and each new thread (a progress bar's monitor, say) reserves a
    64 MiB arena: the address space only ratchets up, and a micro batch that fitted once no longer
    fits later. A fixed threshold returns freed blocks at once and one arena serves all threads,
    so the profiler's answer holds for the rest of the run.
    """
    pinned = _mallopt((M_MMAP_THRESHOLD, threshold_bytes), (M_ARENA_MAX, 1))
    global _pinned
    _pinned = _pinned or pinned
    return pinned


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's ``mallopt`` for each (parameter, value) in order; True if every one was taken (Linux glibc)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return all(bool(libc.mallopt(parameter, value)) for parameter, value in settings)
    except (OSError, AttributeError):
        return False


def reuses_freed_memory(env: Mapping[str, str]) -> bool:
    """Whether a CPU run that does not profile should keep freed memory for its next step (see
    :func:`reuse_freed_memory`): not when glibc was pinned, nor when the user tuned glibc's malloc, nor under an
    address-space limit, where memory kept could count against the micro batch that fits."""
    tuned = any(key.startswith("glibc.malloc.") for key in _tunables(env.get("GLIBC_TUNABLES", "")))
    return not (_pinned or tuned or address_space_limit() is not None)


def reuse_freed_memory() -> bool:
    """Keep freed memory in the heap for the next step instead of giving it back to the system; True if set.

    With glibc's defaults a training step's large tensors are mapped and unmapped, and the heap's top is trimmed
    after the step, so the next step faults the same pages in again (thousands of page faults a step on the tiny
    model). Fixing the mmap threshold at glibc's own ceiling and trimming only past 1 GiB of free heap keeps
    them. Stock DPO gets the same by accident: its last reference logits stay alive and hold the heap's top.
    """
    return _mallopt((M_MMAP_THRESHOLD, REUSE_MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, REUSE_TRIM_THRESHOLD_BYTES))


def _tunables(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(":") if "=" in item)


def pinned_from_start(env: Mapping[str, str]) -> bool:
    """Whether this process started with both allocator settings in ``GLIBC_TUNABLES`` (any values:
    a user's own choice is kept)."""
    return PINNED_TUNABLES.keys() <= _tunables(env.get("GLIBC_TUNABLES", "")).keys()


def restart_for_glibc(
    env: Mapping[str, str], argv: Sequence[str], orig_argv: Sequence[str], address_space_limited: bool
) -> tuple[list[str], dict[str, str]] | None:
    """The arguments and environment that run this command again with glibc pinned from its start,
    or None when that is not needed or not safe.

    Needed only under an address-space limit (``ulimit -v``): every thread that calls malloc before
    the recipe can pin glibc (pyarrow's jemalloc thread starts when torchtune is imported) reserves
    a 64 MiB arena that the limit counts for the rest of the run. Safe only when the original
    command line ends with this program's arguments (``tune run``, ``torchrun``, ``python -m``), so
    running it again runs this recipe again, and only once (``RESTARTED_ENV``).
    """
    args = list(argv[1:])
    if not address_space_limited or env.get(RESTARTED_ENV) or pinned_from_start(env):
        return None
    if not args or len(orig_argv) <= len(args) or list(orig_argv[-len(args) :]) != args:
        return None
    tunables = {**PINNED_TUNABLES, **_tunables(env.get("GLIBC_TUNABLES", ""))}
    merged = ":".join(f"{key}={value}" for key, value in tunables.items())
    return list(orig_argv[1:]), {**env, "GLIBC_TUNABLES": merged, RESTARTED_ENV: "1"}


def address_space_limit() -> int | None:
    """This process's soft RLIMIT_AS in bytes, or None when it is unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


def restart_with_glibc_pinned(argv: Sequence[str]) -> None:
    """Run this command again, in this process, with glibc pinned from its start (see
    :func:`restart_for_glibc`; ``argv`` as the command line gave it); returns only when no restart
    is needed or it failed."""
    restart = restart_for_glibc(os.environ, argv, sys.orig_argv, address_space_limit() is not None)
    if restart is None:
        return
    args, env = restart
    logs.info(
        f"Profiler: an address-space limit is set, so this process starts again with "
        f"GLIBC_TUNABLES={env['GLIBC_TUNABLES']}: glibc then pins its allocator from the first import, and "
        f"no thread reserves a 64 MiB arena before the recipe could (start it so to skip this restart)"
    )
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # log handlers flush every record; buffered prints would be lost
    try:
        os.execve(sys.executable, [sys.executable, *args], env)
    except OSError as error:
        logs.info(f"Profiler: could not start again ({error}); pinning glibc at set-up instead")


def set_cpu_allocator(profiles: bool) -> None:
    """Before a CPU run's set-up: glibc pinned for a run that profiles (:func:`pin_glibc_for_profile`), else freed
    memory kept for the next step where nothing else decides (:func:`reuses_freed_memory`)."""
    if profiles:
        pin_glibc_for_profile()
    elif reuses_freed_memory(os.environ):
        reuse_freed_memory()


def pin_glibc_for_profile() -> None:
    """Pin glibc (see :func:`pin_cpu_allocator`) before a CPU run's set-up, so the heap set-up leaves behind
    is already under the rule the profile runs by; say whether it was pinned from the process start."""
    if pinned_from_start(os.environ):
        logs.info(
            "Profiler: glibc pinned from process start by GLIBC_TUNABLES "
            f"({os.environ['GLIBC_TUNABLES']}), so the address space follows the tensors"
        )
    elif pin_cpu_allocator():
        logs.info(
            "Profiler: glibc set to return freed tensors' memory at once and to use one arena, "
            "so the address space follows the tensors and the chosen micro batch keeps fitting"
        )
