"""Run a function on several ranks, forked from the test process, with a deadline that turns a hang into a failure."""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import torch.multiprocessing as mp


def run_forked_ranks(worker: Callable[..., None], args: tuple[Any, ...], ranks: int, *, seconds: float,
                     what: str) -> None:
    """``worker(rank, *args)`` on ``ranks`` processes. Forked: the children inherit the imported torch (a spawn
    re-imports it, about 10 s on a busy machine). Past ``seconds`` every child is killed and the test fails."""
    context = mp.start_processes(worker, args=args, nprocs=ranks, join=False, start_method="fork")
    deadline = time.monotonic() + seconds
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{what} did not finish in {seconds:.0f} s")
