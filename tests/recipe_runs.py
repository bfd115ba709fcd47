"""Running the recipes as a user does (``tune run`` in a subprocess) and reading their metrics."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

TUNE = str(Path(sys.executable).with_name("tune"))
_STEP = re.compile(r"^Step (\d+) \| (.*)$")
# The batch as written, all epochs: no profiler, no growth.
FIXED_BATCH_SIZE = ("use_maximum_batch_size=False", "batch_increase_function=null")


def tune_run(recipe: str, config: str, overrides: Sequence[str], *, cwd: Path,
             nproc: Optional[int] = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """``tune run [--nproc_per_node N] RECIPE --config CONFIG OVERRIDES...``; output captured."""
    launcher = ["--nproc_per_node", str(nproc)] if nproc else []
    cmd = [TUNE, "run", *launcher, recipe, "--config", config, *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\nSTDOUT\n{result.stdout[-4000:]}\nSTDERR\n{result.stderr[-6000:]}"
    return result


def read_metrics(log_dir: Path) -> list[dict[str, float]]:
    """Per-step metrics written by torchtune's DiskLogger, in file order then step order."""
    rows: dict[int, dict[str, float]] = {}
    for path in sorted(log_dir.glob("log_*.txt"), key=lambda p: p.stat().st_mtime):
        for line in path.read_text().splitlines():
            match = _STEP.match(line.strip())
            if match:
                fields = dict(item.split(":", 1) for item in match.group(2).split())
                rows[int(match.group(1))] = {"step": int(match.group(1)), **{k: float(v) for k, v in fields.items()}}
    return [rows[k] for k in sorted(rows)]


def losses(log_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(log_dir)]
