"""What the benchmark scripts share: tiny assets when none are given, a recipe run in this process with a time stamp
per logged step, a subprocess whose failure reads, and how a run's output shows an unclean exit.

A script imports it as a sibling (``from common import ...``): Python puts the script's own folder first on
``sys.path``, so ``python benchmarks/x.py`` finds it from anywhere. Tables go into the docs through
:mod:`doc_tables`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

# What a process prints when it aborts at exit, or when the process group outlived the run (see
# ``runtime.distributed.release_destroyed_group``): never acceptable after a run, whatever its exit code.
UNCLEAN_EXIT = ("terminate called", "gloo worker thread(s) still running", "Fatal Python error")


def tiny_assets(given: Optional[Path], work: Path) -> Path:
    """``given`` (resolved) when a user named assets, else the tiny offline assets written under ``work``."""
    if given is not None:
        return Path(given).resolve()
    from adaptive_batching.assets.tiny import write_tiny_assets

    return write_tiny_assets(work / "assets").root


def run_checked(command: Sequence[str], what: str, **kwargs: Any) -> subprocess.CompletedProcess:
    """``command`` run to its end with its output captured; a failure ends the benchmark with ``what failed:`` and
    the last 3000 characters of its stderr, the part that names the error."""
    result = subprocess.run(list(command), capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        sys.exit(f"{what} failed:\n{result.stderr[-3000:]}")
    return result


def unclean_exit(result: subprocess.CompletedProcess) -> Optional[str]:
    """The first line of ``result``'s output that shows an unclean exit, or None."""
    for line in (result.stdout + result.stderr).splitlines():
        if any(mark in line for mark in UNCLEAN_EXIT):
            return line
    return None


@contextlib.contextmanager
def step_stamps(on_step: Optional[Callable[[dict[str, Any], int], dict[str, Any]]] = None
                ) -> Iterator[list[dict[str, Any]]]:
    """Within the block, every metric line a recipe logs (torchtune's ``DiskLogger.log_dict``, once per optimizer
    step in ours and in stock's) appends ``{"step", "t"}`` (``time.perf_counter()`` at the call), plus what
    ``on_step(payload, step)`` returns, to the list it yields."""
    from torchtune.training.metric_logging import DiskLogger

    stamps: list[dict[str, Any]] = []
    original = DiskLogger.log_dict

    def stamped(self: Any, payload: Any, step: int) -> None:
        stamps.append({"step": int(step), "t": time.perf_counter(), **(on_step(payload, step) if on_step else {})})
        original(self, payload, step)

    DiskLogger.log_dict = stamped
    try:
        yield stamps
    finally:
        DiskLogger.log_dict = original


def tune_in_process(tune_args: list[str]) -> None:
    """``tune TUNE_ARGS`` in this process (the recipes end with ``sys.exit(recipe_main())``: a SystemExit passes
    through), with ``BENCH_THREADS`` torch threads when the parent set it."""
    threads = os.environ.get("BENCH_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    from torchtune._cli.tune import main as tune_main

    sys.argv = ["tune", *tune_args]
    tune_main()


def log(message: str) -> None:
    """Progress, on stderr: stdout is the report."""
    print(message, file=sys.stderr, flush=True)


def fmt(value: Any, spec: str = "", none: str = "-") -> str:
    """``value`` formatted by ``spec``, or ``none`` when it is missing."""
    return none if value is None else format(value, spec)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))
