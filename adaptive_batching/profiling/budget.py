"""The memory budget: how many bytes one training step's peak tensor memory may reach.

The start-up profiler grows the micro batch until a step's peak tensor memory (including the
tensors already alive: parameters, gradients, optimizer state) would pass this budget.
It comes from the user (``adaptive_batching.memory_budget``), from the accelerator's memory,
or on CPU from the tightest of the host limits this process runs under, the host's shared by its ranks.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adaptive_batching.errors import ConfigError
from adaptive_batching.runtime.distributed import local_world_size
from adaptive_batching.runtime.memory import address_space_limit
from adaptive_batching.units import parse_bytes

GIB = 1024**3
# cgroup v1 writes "no limit" as the largest page-aligned 63-bit number; anything this big is no limit.
_UNLIMITED = 2**60
_CGROUP_MOUNT = Path("sys/fs/cgroup")


@dataclass(frozen=True)
class Budget:
    """Bytes allowed for one step's peak tensor memory, and how they were derived (for the log)."""

    bytes: int
    source: str


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def fraction_error(fraction: Any) -> str | None:
    """None when ``fraction`` is a share of memory, else what is allowed."""
    ok = (
        isinstance(fraction, (int, float))
        and not isinstance(fraction, bool)
        and math.isfinite(fraction)
        and 0 < fraction <= 1
    )
    return None if ok else "a number in (0, 1]"


def _check_fraction(fraction: Any) -> float:
    allowed = fraction_error(fraction)
    if allowed:
        raise ConfigError(
            f"config key 'adaptive_batching.memory_fraction' = {fraction!r} is invalid: expected {allowed}"
        )
    return float(fraction)


def _explicit_budget(explicit: str | int) -> Budget:
    try:
        size = parse_bytes(explicit)
    except ValueError:
        raise ConfigError(
            f"config key 'adaptive_batching.memory_budget' = {explicit!r} is invalid: expected null "
            f"or a memory size such as '12GiB', '500MB', '1.5GiB' or a number of bytes (e.g. 1073741824)"
        ) from None
    return Budget(size, f"explicit adaptive_batching.memory_budget={explicit}")


def memory_budget(
    device: torch.device,
    *,
    explicit: str | int | None,
    fraction: float,
    live_tensor_bytes: int = 0,
    ranks_on_host: int | None = None,
    root: Path = Path("/"),
) -> Budget:
    """The budget for ``device``: the explicit size if given, else a ``fraction`` of what the device allows.

    On an accelerator the peak counts every tensor of the process, so ``live_tensor_bytes`` is
    already inside the device total; on CPU the room is measured after those tensors exist, so
    they are added back. On CPU the ranks on one host share its memory: each gets its share of the host's room
    (``ranks_on_host``, torchrun's local world size when None; see :func:`cpu_room_bytes`). ``root`` relocates
    ``/proc`` and ``/sys`` (for tests).
    """
    fraction = _check_fraction(fraction)
    if live_tensor_bytes < 0:
        raise ValueError(f"live_tensor_bytes must be >= 0, got {live_tensor_bytes}")
    if explicit is not None:
        return _explicit_budget(explicit)
    device = torch.device(device)
    if device.type == "cpu":
        ranks = local_world_size() if ranks_on_host is None else ranks_on_host
        room, limit = cpu_room_bytes(root=root, ranks_on_host=ranks)
        size = live_tensor_bytes + int(room * fraction)
        return Budget(
            size,
            f"CPU: {limit} leaves {_gib(room)}, x memory_fraction {fraction:.2f}, "
            f"+ {_gib(live_tensor_bytes)} live tensors",
        )
    return _accelerator_budget(device, fraction)


def _per_process_fraction(module: Any, index: int) -> float:
    """The cap set by ``set_per_process_memory_fraction`` (1.0 where the API does not exist)."""
    getter: Callable[[int], float] | None = getattr(module, "get_per_process_memory_fraction", None)
    if getter is None:
        getter = getattr(getattr(module, "memory", None), "get_per_process_memory_fraction", None)
    return 1.0 if getter is None else float(getter(index))


def _accelerator_budget(device: torch.device, fraction: float) -> Budget:
    """``fraction`` of what this process can hold on the device: the smaller of its per-process cap and
    the memory free now plus what its own caching allocator already reserves (``mem_get_info`` sees
    memory other processes hold, such as a second job or a monitoring agent, where the device's total
    does not)."""
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "get_device_properties"):
        raise ConfigError(
            f"cannot read the memory of device {device}; set adaptive_batching.memory_budget (e.g. '12GiB')"
        )
    index = device.index if device.index is not None else int(module.current_device())
    props = module.get_device_properties(index)
    total = int(props.total_memory)
    per_process = _per_process_fraction(module, index)
    name = getattr(props, "name", "unknown device")
    allowed = int(total * per_process)
    source = f"{device.type}:{index} ({name}) {_gib(total)} x per-process fraction {per_process:.2f}"
    if hasattr(module, "mem_get_info"):
        free, _ = module.mem_get_info(index)
        ours = int(module.memory_reserved(index)) if hasattr(module, "memory_reserved") else 0
        available = int(free) + ours
        if available < allowed:
            allowed = available
            source = (
                f"{device.type}:{index} ({name}) {_gib(int(free))} free + {_gib(ours)} this process "
                f"reserves, of {_gib(total)} (others hold {_gib(max(total - available, 0))})"
            )
    return Budget(int(allowed * fraction), f"{source} x memory_fraction {fraction:.2f}")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def proc_field_bytes(text: str, field: str) -> int | None:
    """A ``Field:  123 kB`` line of /proc/self/status or /proc/meminfo, in bytes."""
    match = re.search(rf"^{re.escape(field)}:\s*(\d+)\s*kB\s*$", text, re.MULTILINE)
    return None if match is None else int(match.group(1)) * 1024


def _limit_value(text: str | None) -> int | None:
    """A cgroup limit or usage file's number; None for 'max', no-limit values or unreadable files."""
    if text is None or text.strip() in ("", "max"):
        return None
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _memory_cgroup_paths(cgroup_text: str) -> tuple[str | None, str | None]:
    """The process's (v2, v1 memory-controller) cgroup paths from /proc/self/cgroup."""
    v2 = v1 = None
    for line in cgroup_text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _cgroup_dirs(base: Path, path: str) -> list[Path]:
    """The process's cgroup directory and its ancestors up to ``base``: every level's limit applies.

    Inside a container without a cgroup namespace the host path does not exist under ``base``;
    then ``base`` itself is the container's cgroup.
    """
    leaf = base / path.strip("/")
    if not leaf.is_dir():
        leaf = base
    dirs = [leaf]
    while dirs[-1] != base and base in dirs[-1].parents:
        dirs.append(dirs[-1].parent)
    return dirs


def cgroup_room_bytes(root: Path = Path("/")) -> tuple[int, str] | None:
    """The tightest cgroup memory limit's room (limit - usage), or None when no cgroup limits memory."""
    cgroup_text = _read(root / "proc/self/cgroup")
    if cgroup_text is None:
        return None
    v2, v1 = _memory_cgroup_paths(cgroup_text)
    mount = root / _CGROUP_MOUNT
    candidates: list[tuple[Path, str, str, str]] = []
    if v2 is not None:
        base = mount if (mount / "cgroup.controllers").exists() else mount / "unified"
        candidates += [(d, "memory.max", "memory.current", "cgroup v2 memory.max") for d in _cgroup_dirs(base, v2)]
    if v1 is not None:
        candidates += [
            (d, "memory.limit_in_bytes", "memory.usage_in_bytes", "cgroup v1 memory.limit_in_bytes")
            for d in _cgroup_dirs(mount / "memory", v1)
        ]
    best: tuple[int, str] | None = None
    for directory, limit_file, usage_file, label in candidates:
        limit = _limit_value(_read(directory / limit_file))
        usage = _limit_value(_read(directory / usage_file))
        if limit is None or usage is None:
            continue
        room = max(limit - usage, 0)
        if best is None or room < best[0]:
            best = (room, f"{label} of /{directory.relative_to(root)}")
    return best


def address_space_room_bytes(root: Path = Path("/")) -> int | None:
    """Room under the soft RLIMIT_AS (limit - current virtual size), or None when unlimited or unknown."""
    soft = address_space_limit()
    if soft is None:
        return None
    status = _read(root / "proc/self/status")
    vm_size = None if status is None else proc_field_bytes(status, "VmSize")
    return None if vm_size is None else max(soft - vm_size, 0)


def cpu_room_bytes(root: Path = Path("/"), ranks_on_host: int = 1) -> tuple[int, str]:
    """Bytes this process can still allocate on the host, and which limit set that number.

    The tightest of: the address-space rlimit (this process's own), and the host's share of this process: every
    enclosing cgroup's memory limit and MemAvailable, divided by ``ranks_on_host`` (the ranks on one host share
    its memory, and under torchrun its cgroup). ``root`` relocates ``/proc`` and ``/sys`` (for tests).
    """
    if ranks_on_host < 1:
        raise ValueError(f"ranks_on_host must be >= 1, got {ranks_on_host}")
    limits: list[tuple[int, str]] = []
    address_space = address_space_room_bytes(root)
    if address_space is not None:
        limits.append((address_space, "address-space limit (RLIMIT_AS)"))
    shared: list[tuple[int, str]] = []
    cgroup = cgroup_room_bytes(root)
    if cgroup is not None:
        shared.append(cgroup)
    meminfo = _read(root / "proc/meminfo")
    available = None if meminfo is None else proc_field_bytes(meminfo, "MemAvailable")
    if available is not None:
        shared.append((available, "MemAvailable"))
    if not limits and not shared:
        physical = _physical_memory_bytes()
        if physical is None:
            raise ConfigError(
                "cannot tell how much host memory this process may use; "
                "set adaptive_batching.memory_budget (e.g. '12GiB')"
            )
        shared.append((physical, "physical memory (free memory unknown)"))
    limits += [_host_share(room, label, ranks_on_host) for room, label in shared]
    return min(limits, key=lambda limit: limit[0])


def _host_share(room: int, label: str, ranks_on_host: int) -> tuple[int, str]:
    """One rank's share of a host-wide ``room``: all of it for one rank, else an equal part."""
    if ranks_on_host == 1:
        return room, label
    return room // ranks_on_host, f"{label} {_gib(room)} / {ranks_on_host} ranks on this host"


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
