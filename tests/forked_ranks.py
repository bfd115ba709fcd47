"""Run a function on several ranks, forked from a process that has run no autograd, with a deadline that turns a hang
into a failure.

torch refuses autograd in a child forked from a process whose autograd engine has started threads ("Unable to handle
autograd's threading in combination with fork-based multiprocessing"): device threads on a build that sees a device
(PyPI's CUDA build of torch 2.14), or the thread that takes over a deep re-entrant backward on any build. The test
process has run autograd, so the ranks are not forked from it: this file, run as a script by the suite's fork server
(``recipe_runs.run_command``, a process that imports the library and creates no tensor), imports the worker's module
and forks the ranks there.

Run as ``python forked_ranks.py MODULE FUNCTION RANKS ARGS_JSON SYS_PATH_JSON``.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent


def run_forked_ranks(
    worker: Callable[..., None], args: tuple[Any, ...], ranks: int, *, seconds: float, what: str
) -> None:
    """``worker(rank, *args)`` on ``ranks`` processes (``worker``: a module-level function of a file in tests/;
    ``args``: JSON values). Forked from a child of the fork server, which has torch imported (a spawn re-imports it,
    about 10 s on a busy machine). Past ``seconds`` the ranks are killed and the test fails; so it does if a rank
    raises."""
    from recipe_runs import run_command

    argv = [
        str(Path(__file__)),
        worker.__module__,
        worker.__qualname__,
        str(ranks),
        json.dumps(list(args)),
        json.dumps(sys.path),
    ]
    try:
        result = run_command("script", argv, cwd=HERE, timeout=int(seconds))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish in {seconds:.0f} s")
    if result.returncode != 0:
        pytest.fail(f"{what} failed, exit {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")


def fork_ranks(module: str, function: str, ranks: int, args: list[Any], path: list[str]) -> None:
    """In this process (which has run no autograd): fork ``ranks`` processes running ``module.function(rank, *args)``
    and wait for them; a rank's exception is raised here. ``path``: the test process's ``sys.path`` (pytest's
    pythonpath adds to it), searched after this one."""
    import torch.multiprocessing as mp

    sys.path.extend(entry for entry in path if entry not in sys.path)

    worker = getattr(importlib.import_module(module), function)
    mp.start_processes(worker, args=tuple(args), nprocs=ranks, join=True, start_method="fork")


if __name__ == "__main__":
    fork_ranks(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), json.loads(sys.argv[5]))
