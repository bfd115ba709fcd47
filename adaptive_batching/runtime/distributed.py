"""Process-group set-up that works on CPU (gloo) and CUDA (NCCL), single process or under torchrun."""

from __future__ import annotations

import functools
import gc
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from adaptive_batching.errors import ConfigError


@dataclass(frozen=True)
class ParallelInfo:
    """Where this process sits: data-parallel size and rank."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher) set the rendezvous environment."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def local_world_size() -> int:
    """How many ranks run on this host: torchrun's ``LOCAL_WORLD_SIZE``, else 1 (one process)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA, gloo for everything else (CPU included)."""
    return "nccl" if device.type == "cuda" else "gloo"


def available_devices() -> list[str]:
    """The device types this machine can train on, CPU first."""
    found = ["cpu"]
    for name in ("cuda", "xpu", "mps", "npu"):
        module = getattr(torch, name, None) if name != "mps" else getattr(torch.backends, "mps", None)
        try:
            if module is not None and module.is_available():
                found.append(name)
        except Exception:  # noqa: BLE001 - a backend that cannot even say is not available
            continue
    return found


def device_for(device_type: str, local_rank: int) -> torch.device:
    """The device this process trains on: ``cuda:<local_rank>`` under torchrun, else as configured."""
    device_type = device_type or "cpu"
    available = available_devices()
    if device_type not in available:
        raise ConfigError(
            f"config key 'device' = {device_type!r} is not available on this machine; available: {', '.join(available)}"
        )
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(device_type)


def init_parallel(device_type: str) -> tuple[torch.device, ParallelInfo]:
    """Pick the device and, under torchrun, join the process group."""
    if not launched_by_torchrun():
        return device_for(device_type, 0), ParallelInfo()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = device_for(device_type, local_rank)
    if not dist.is_initialized():
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if attempt in ("", "0"):
            dist.init_process_group(backend=backend_for(device))
        else:
            # A restart may find the job's store still holding the dead attempt's addresses: keep apart.
            store, rank, world_size = next(dist.rendezvous("env://"))
            dist.init_process_group(
                backend=backend_for(device),
                store=dist.PrefixStore(f"attempt_{attempt}", store),
                rank=rank,
                world_size=world_size,
            )
    return device, ParallelInfo(dist.get_world_size(), dist.get_rank(), local_rank)


def all_reduce_sum(value: torch.Tensor, parallel: ParallelInfo) -> torch.Tensor:
    """Sum over ranks in place (a no-op in a single process)."""
    if parallel.is_distributed:
        dist.all_reduce(value)
    return value


def barrier(parallel: ParallelInfo) -> None:
    if parallel.is_distributed:
        dist.barrier()


_DESTROYED_HERE = False  # this process left a process group through shutdown(): release_destroyed_group() applies


def shutdown(parallel: ParallelInfo, *, together: bool = False) -> None:
    """Leave the process group. When every rank leaves at one place (a finished run, an agreed stop), a barrier
    first, so that no rank tears its group down while another is still sending (never after an error: the other
    ranks may not come).
    :func:`release_destroyed_group` then ends the group's worker threads, once nothing of the run is left."""
    global _DESTROYED_HERE
    if parallel.is_distributed and dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()
        _DESTROYED_HERE = True


# Caches of torch.distributed that keep a DeviceMesh, and through its ``_pg_registry`` the process group, alive
# after destroy_process_group(): named ones, then every functools cache of these modules and their classes.
_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed.device_mesh", "torch.distributed.fsdp")


def _clear_torch_distributed_caches() -> None:
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()  # the C++ fast path's cache of the main thread, where every DTensor op of a run runs
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    if redistribute is not None and hasattr(redistribute, "clear_redistribute_planner_cache"):
        redistribute.clear_redistribute_planner_cache()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_DTENSOR_MODULES):
            continue
        for value in list(vars(module).values()):
            members = list(vars(value).values()) if isinstance(value, type) else [value]
            for member in members:
                member = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                if isinstance(member, functools._lru_cache_wrapper):
                    member.cache_clear()
    dtensor = sys.modules.get("torch.distributed.tensor")
    propagator = getattr(
        getattr(getattr(dtensor, "DTensor", None), "_op_dispatcher", None), "sharding_propagator", None
    )
    clear = getattr(getattr(propagator, "propagate_op_sharding", None), "cache_clear", None)
    if clear is not None:
        clear()


def backend_threads() -> list[str]:
    """Names of this process's threads that belong to a gloo process group (Linux; elsewhere none are seen)."""
    names = []
    for task in Path("/proc/self/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)


def release_destroyed_group() -> list[str]:
    """End the worker threads of the group :func:`shutdown` destroyed, while the interpreter is whole; return the
    names of any such thread still running (none when it worked).

    ``destroy_process_group()`` does not end them: FSDP2's DeviceMesh holds the group, and torch's DTensor
    caches hold the mesh until the interpreter finalises. Only then would the group's destructor join its
    threads, and a thread that is still releasing a finished collective's tensor needs the GIL to free its
    Python object; while finalising, taking the GIL ends the thread (pthread_exit), unwinding through a C++
    destructor, which aborts the process: "terminate called without an active exception" after a finished
    run. Call this once the run's objects are unreachable (after the recipe returned): it drops those caches
    and collects, so the group is destroyed now and its threads joined.
    """
    if not _DESTROYED_HERE:
        return []
    _clear_torch_distributed_caches()
    gc.collect()  # the run's own objects: the entry point froze the imports' (memory.freeze_long_lived_objects)
    if backend_threads():  # a run that froze its own objects too (an in-process caller): collect everything
        gc.unfreeze()
        gc.collect()
    return backend_threads()


def mesh_holders(depth: int = 6) -> str:
    """What keeps a DeviceMesh alive, as chains of referrer types: for a warning when threads outlive a release."""
    meshes = [obj for obj in gc.get_objects() if type(obj).__name__ == "DeviceMesh"]
    if not meshes:
        return "no DeviceMesh is alive (a C++ owner, or another holder of the group)"
    chain: list[str] = []
    obj, seen = meshes[0], {id(meshes), id(chain), id(sys._getframe())}
    for _ in range(depth):
        found = gc.get_referrers(obj)
        seen.add(id(found))
        referrers = [r for r in found if id(r) not in seen]
        seen.add(id(referrers))
        if not referrers:
            break
        obj = referrers[0]
        seen.add(id(obj))
        name = type(obj).__name__
        if isinstance(obj, dict):
            name += "{" + ", ".join(str(key)[:24] for key in list(obj)[:3]) + "}"
        elif hasattr(obj, "f_code"):
            name += f"({obj.f_code.co_name})"
        elif hasattr(obj, "__qualname__"):
            name += f"({obj.__qualname__})"
        chain.append(name)
    return f"{len(meshes)} DeviceMesh alive, held by " + " <- ".join(chain)


def agree_on_trial(parallel: ParallelInfo, device: torch.device):
    """A profiler ``Agree``: a trial is ok only if it was ok on every rank; values take their maximum."""

    def agree(ok: bool, values: list[float]) -> tuple[bool, list[float]]:
        if not parallel.is_distributed:
            return ok, list(values)
        packed = torch.tensor([0.0 if ok else 1.0, *values], dtype=torch.float64, device=device)
        dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        return bool(packed[0].item() == 0.0), packed[1:].tolist()

    return agree


def minimum_over_ranks(value: int, parallel: ParallelInfo, device: torch.device) -> int:
    """The smallest ``value`` over all ranks (the value itself in a single process)."""
    if not parallel.is_distributed:
        return value
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())
