"""Draws the profiler's PNG from its JSON report: measured peaks, the fit, the budget, the chosen size.

    python -m adaptive_batching.profiling.plot profile.json profile.png

A module of its own, without torch, so the recipe can draw in a child process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

GIB = 2**30


def write_plot(result: dict[str, Any], path: Path) -> Path:
    """Measured peaks (ok and out-of-memory), the fitted line, the budget and the chosen micro batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    measured = [t for t in result["trials"] if t["peak_bytes"] is not None]
    for ok, marker, label in ((True, "o", "ran"), (False, "x", "over budget")):
        xs = [t["micro_batch"] for t in measured if t["ok"] == ok]
        ys = [t["peak_bytes"] / GIB for t in measured if t["ok"] == ok]
        if xs:
            ax.scatter(xs, ys, marker=marker, label=label, zorder=3)
    oom = [t["micro_batch"] for t in result["trials"] if t["peak_bytes"] is None]
    if oom:
        ax.scatter(
            oom, [result["budget_bytes"] / GIB] * len(oom), marker="v", color="red", label="out of memory", zorder=3
        )
    right = max([t["micro_batch"] for t in result["trials"]] + [result["micro_batch"], 1]) * 1.1
    if result["bytes_per_sample"] is not None:
        ax.plot(
            [0, right],
            [result["fixed_bytes"] / GIB, (result["fixed_bytes"] + result["bytes_per_sample"] * right) / GIB],
            "--",
            color="gray",
            label="fit",
        )
    ax.axhline(result["budget_bytes"] / GIB, color="red", linewidth=1, label="budget")
    ax.axvline(result["micro_batch"], color="green", linewidth=1, label=f"chosen micro batch {result['micro_batch']}")
    ax.set_xlabel("micro batch (samples per forward, one rank)")
    ax.set_ylabel("peak tensor memory of a step (GiB)")
    ax.set_title(f"Largest micro batch that ran: {result['max_micro_batch']} ({result['seq_len']}-token samples)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    json_path, png_path = argv
    write_plot(json.loads(Path(json_path).read_text()), Path(png_path))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
