"""Process-group set-up that works on CPU (gloo) and CUDA (NCCL), single process or under torchrun."""

from __future__ import annotations

import os
from dataclasses import dataclass

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


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA, gloo for everything else (CPU included)."""
    return "nccl" if device.type == "cuda" else "gloo"


def device_for(device_type: str, local_rank: int) -> torch.device:
    """The device this process trains on: ``cuda:<local_rank>`` under torchrun, else as configured."""
    device_type = device_type or "cpu"
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("config key 'device' = 'cuda' but no CUDA device is available; use device=cpu")
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
            dist.init_process_group(backend=backend_for(device), store=dist.PrefixStore(f"attempt_{attempt}", store),
                                    rank=rank, world_size=world_size)
    return device, ParallelInfo(dist.get_world_size(), dist.get_rank(), local_rank)


def all_reduce_sum(value: torch.Tensor, parallel: ParallelInfo) -> torch.Tensor:
    """Sum over ranks in place (a no-op in a single process)."""
    if parallel.is_distributed:
        dist.all_reduce(value)
    return value


def barrier(parallel: ParallelInfo) -> None:
    if parallel.is_distributed:
        dist.barrier()


def shutdown(parallel: ParallelInfo, *, finished: bool = False) -> None:
    """Leave the process group. After a run every rank finished, a barrier first, so that no rank tears its
    group down while another is still sending (never after an error: the other ranks may not come)."""
    if parallel.is_distributed and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


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
