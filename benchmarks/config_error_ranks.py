#!/usr/bin/env python
"""Is a config error under torchrun said exactly once, every time, at any number of ranks?

    python benchmarks/config_error_ranks.py --ranks 2,8 --runs 20

Each run is the user's command, ``tune run --nproc_per_node N adaptive_full_dpo --config tiny_full_dpo
use_maximum_batch_size=maybe``, with new interpreters for the agent and every rank; the error fails in the first
key check, before any model or data. A run passes when it exits 1, its output holds the config error's line exactly
once and no traceback of ours, and torchrun's first observed failure is rank zero's exit 1 (the other ranks waited
for it: ``config.loading.wait_for_rank_zero``). Writes benchmarks/results/config_error_ranks.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, command_line, commit, machine

TUNE = str(Path(sys.executable).with_name("tune"))
LINE = "config error: config key 'use_maximum_batch_size' = 'maybe' is invalid: expected true or false"
OUR_FRAME = re.compile(r'File ".*/(adaptive_batching|recipes)/')
ROOT_CAUSE_RANK_ZERO = re.compile(r"rank\s*: 0 \(local_rank: 0\)\s+exitcode\s*: 1 ")
RESULTS = ROOT / "benchmarks" / "results"


def one_run(ranks: int, cwd: Path) -> dict:
    """One ``tune run`` of the bad config at ``ranks`` ranks: what a user would see of it."""
    cmd = [
        TUNE,
        "run",
        "--nproc_per_node",
        str(ranks),
        "adaptive_full_dpo",
        "--config",
        "tiny_full_dpo",
        "use_maximum_batch_size=maybe",
    ]
    start = time.monotonic()
    result = subprocess.run(
        cmd,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
    )
    return verdict(ranks, result, round(time.monotonic() - start, 1))


def verdict(ranks: int, result: subprocess.CompletedProcess, seconds: float) -> dict:
    """What a run at ``ranks`` ranks showed: exit code, how often the line was said, a traceback of ours, whether
    torchrun's first observed failure was rank zero's exit 1; ``ok`` when all are as they should be."""
    lines = sum(line == LINE for line in result.stderr.splitlines())
    root_cause = result.stderr.split("Root Cause (first observed failure):", 1)[-1]
    record = {
        "ranks": ranks,
        "exit": result.returncode,
        "lines": lines,
        "our_traceback": bool(OUR_FRAME.search(result.stderr)),
        "root_cause_rank_zero": bool(ROOT_CAUSE_RANK_ZERO.search(root_cause)),
        "seconds": seconds,
    }
    record["ok"] = record["exit"] == 1 and lines == 1 and not record["our_traceback"] and record["root_cause_rank_zero"]
    if not record["ok"]:
        record["tail"] = result.stderr[-3000:]
    return record


def table(records: list[dict], rank_counts: list[int]) -> str:
    lines = [
        "| ranks | runs | line once | line missing | line more than once | our traceback | "
        "first failure rank 0 | seconds per run (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ranks in rank_counts:
        mine = [r for r in records if r["ranks"] == ranks]
        seconds = sorted(r["seconds"] for r in mine)
        lines.append(
            f"| {ranks} | {len(mine)} | {sum(r['lines'] == 1 for r in mine)} | "
            f"{sum(r['lines'] == 0 for r in mine)} | {sum(r['lines'] > 1 for r in mine)} | "
            f"{sum(r['our_traceback'] for r in mine)} | {sum(r['root_cause_rank_zero'] for r in mine)} | "
            f"{seconds[len(seconds) // 2]:.0f} |"
        )
    return "\n".join(lines)


def write(out: Path, records: list[dict], rank_counts: list[int]) -> None:
    """The runs so far, as out.json (every run) and out.md (the table), with the command, date, commit, machine."""
    provenance = {
        "command": command_line(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "machine": machine(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**provenance, "runs": records}, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        f"Measured by `{provenance['command']}`, {provenance['date']}, commit "
        f"{provenance['commit']}, {provenance['machine']}:\n\n"
        f"{table(records, rank_counts)}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="2,8", help="comma-separated rank counts (default 2,8)")
    parser.add_argument("--runs", type=int, default=20, help="runs per rank count (default 20)")
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS / "config_error_ranks",
        help="where the results go, without suffix: .json and .md (default benchmarks/results/)",
    )
    args = parser.parse_args()
    try:
        rank_counts = [int(n) for n in args.ranks.split(",")]
    except ValueError:
        sys.exit("--ranks: a comma-separated list of rank counts, such as 2,8")
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as folder:
        for index in range(args.runs):  # the rank counts in turn: a stopped benchmark has written all of them
            for ranks in rank_counts:
                records.append(record := one_run(ranks, Path(folder)))
                print(
                    f"{ranks} ranks, run {index + 1}/{args.runs}: exit {record['exit']}, line x{record['lines']}, "
                    f"{record['seconds']} s{'' if record['ok'] else '  FAILED'}",
                    flush=True,
                )
                write(args.out, records, [n for n in rank_counts if any(r["ranks"] == n for r in records)])
    print(table(records, rank_counts))
    failed = sum(not r["ok"] for r in records)
    print(f"\n{failed} of {len(records)} runs failed")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
