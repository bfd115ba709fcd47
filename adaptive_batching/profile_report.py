"""The profiler's report: a table for the log, a JSON file and a PNG plot of memory against micro batch."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from adaptive_batching.profiler import ProfileResult

GIB = 2**30


def format_table(result: ProfileResult) -> str:
    """One line per probe and trial (ok, over the budget, or out of memory), then the outcome."""
    lines = [f"{'phase':<7}{'micro batch':>12}{'peak GiB':>10}{'fits':>6}{'seconds':>9}"]
    for t in result.trials:
        peak = "-" if t["peak_bytes"] is None else f"{t['peak_bytes'] / GIB:.3f}"
        outcome = "ok" if t["ok"] else ("OOM" if t["peak_bytes"] is None else "over")
        lines.append(f"{t['phase']:<7}{t['micro_batch']:>12}{peak:>10}{outcome:>6}"
                     f"{t['seconds']:>9.2f}")
    fit = ("" if result.bytes_per_sample is None else
           f"fit: peak = {result.fixed_bytes / GIB:.3f} GiB + {result.bytes_per_sample / 2**20:.2f} MiB x micro batch; ")
    lines.append(
        f"{fit}budget {result.budget_bytes / GIB:.3f} GiB ({result.budget_source}); "
        f"estimate {result.estimate}; largest micro batch that ran {result.max_micro_batch}; "
        f"chosen micro batch {result.micro_batch}; {result.trial_steps} trial steps in {result.seconds:.1f} s; "
        f"samples of {result.seq_len} tokens" + (" (from cache)" if result.from_cache else "")
    )
    return "\n".join(lines)


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_json(result: ProfileResult, path: Path) -> Path:
    _atomic_write(path, json.dumps(result.to_dict(), indent=2, sort_keys=True).encode())
    return path


def write_plot(result: ProfileResult, path: Path) -> Path:
    """Measured peaks (ok and out-of-memory), the fitted line, the budget and the chosen micro batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    measured = [t for t in result.trials if t["peak_bytes"] is not None]
    for ok, marker, label in ((True, "o", "ran"), (False, "x", "over budget")):
        xs = [t["micro_batch"] for t in measured if t["ok"] == ok]
        ys = [t["peak_bytes"] / GIB for t in measured if t["ok"] == ok]
        if xs:
            ax.scatter(xs, ys, marker=marker, label=label, zorder=3)
    oom = [t["micro_batch"] for t in result.trials if t["peak_bytes"] is None]
    if oom:
        ax.scatter(oom, [result.budget_bytes / GIB] * len(oom), marker="v", color="red",
                   label="out of memory", zorder=3)
    right = max([t["micro_batch"] for t in result.trials] + [result.micro_batch, 1]) * 1.1
    if result.bytes_per_sample is not None:
        ax.plot([0, right], [result.fixed_bytes / GIB, (result.fixed_bytes + result.bytes_per_sample * right) / GIB],
                "--", color="gray", label="fit")
    ax.axhline(result.budget_bytes / GIB, color="red", linewidth=1, label="budget")
    ax.axvline(result.micro_batch, color="green", linewidth=1, label=f"chosen micro batch {result.micro_batch}")
    ax.set_xlabel("micro batch (samples per forward, one rank)")
    ax.set_ylabel("peak tensor memory of a step (GiB)")
    ax.set_title(f"Largest micro batch that ran: {result.max_micro_batch} ({result.seq_len}-token samples)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(result: ProfileResult, directory: Path) -> dict[str, Any]:
    """``profile.json`` and ``profile.png`` in ``directory``; returns their paths."""
    return {"json": write_json(result, directory / "profile.json"), "png": write_plot(result, directory / "profile.png")}
