"""The profiler's report: a table for the log, a JSON file, and a PNG plot drawn by ``profile_plot``."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from adaptive_batching.profiling.max_micro_batch import ProfileResult
from adaptive_batching.runtime.files import write_atomically

GIB = 2**30
log = logging.getLogger(__name__)


def format_table(result: ProfileResult) -> str:
    """One line per probe and trial (ok, over the budget, or out of memory), then the outcome."""
    lines = [f"{'phase':<7}{'micro batch':>12}{'peak GiB':>10}{'fits':>6}{'seconds':>9}"]
    for t in result.trials:
        peak = "-" if t["peak_bytes"] is None else f"{t['peak_bytes'] / GIB:.3f}"
        outcome = "ok" if t["ok"] else ("OOM" if t["peak_bytes"] is None else "over")
        lines.append(f"{t['phase']:<7}{t['micro_batch']:>12}{peak:>10}{outcome:>6}{t['seconds']:>9.2f}")
    fit = (
        ""
        if result.bytes_per_sample is None or result.fixed_bytes is None
        else f"fit: peak = {result.fixed_bytes / GIB:.3f} GiB + "
        f"{result.bytes_per_sample / 2**20:.2f} MiB x micro batch; "
    )
    lines.append(
        f"{fit}budget {result.budget_bytes / GIB:.3f} GiB ({result.budget_source}); "
        f"estimate {result.estimate}; largest micro batch that ran {result.max_micro_batch}; "
        f"chosen micro batch {result.micro_batch}; {result.trial_steps} trial steps in {result.seconds:.1f} s; "
        + (f"compiled before them in {result.compile_seconds:.1f} s; " if result.compile_seconds is not None else "")
        + f"samples of {result.seq_len} tokens"
        + (f" ({result.seq_len_source})" if result.seq_len_source else "")
        + (" (from cache)" if result.from_cache else "")
    )
    return "\n".join(lines)


def write_json(result: ProfileResult, path: Path) -> Path:
    write_atomically(path, json.dumps(result.to_dict(), indent=2, sort_keys=True) + "\n")
    return path


def write_report(result: ProfileResult, directory: Path) -> dict[str, Any]:
    """``profile.json`` and ``profile.png`` in ``directory``; returns their paths.

    The plot is drawn by a child process: importing matplotlib here would take tens of MiB of the
    memory the profiler has just measured, and a CPU run under a memory limit would lose them.
    """
    json_path = write_json(result, directory / "profile.json")
    png_path = directory / "profile.png"
    done = subprocess.run(
        [sys.executable, "-m", "adaptive_batching.profiling.plot", str(json_path), str(png_path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        log.warning(f"Could not draw {png_path}: {done.stderr.strip()[-500:]}")
    return {"json": json_path, "png": png_path}
