#!/usr/bin/env python
"""The README's two commands, each from a fresh clone of this repository's last commit, install included.

``make demo`` and ``CI=true bash .ci/run`` (``make test``), each in its own ``git clone`` of ``HEAD``, one after the
other: wall time, what the demo did (from its log) and how many tests passed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from common import ROOT, commit, report


def minutes(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60} s" if whole >= 60 else f"{whole} s"


def demo_summary(log: str) -> str:
    """What the demo's log says it did: the profile, the optimizer steps and the global batches."""
    profile = re.search(r"chosen micro batch (\d+); (\d+) trial steps in ([\d.]+) s", log)
    steps = re.search(r"finished at optimizer step (\d+)", log)
    first = re.findall(r"^Epoch \d+/\d+: .*= global batch (\d+)", log, re.M)
    later = re.findall(r"global batch \d+ -> (\d+)", log)
    batches = list(dict.fromkeys(first + later))
    parts = []
    if profile:
        parts.append(f"profile: {profile[2]} trial steps in {profile[3]} s, micro batch {profile[1]}")
    if steps:
        parts.append(f"{steps[1]} optimizer steps at global batch {', '.join(batches)}")
    return "; ".join(parts) or "its log did not say"


def passed(log: str) -> Optional[int]:
    """The number of tests pytest's summary line counts as passed."""
    found = re.findall(r"(\d+) passed", log)
    return int(found[-1]) if found else None


def fresh_run(command: list[str], work: Path, name: str) -> tuple[float, int, str]:
    clone = work / name
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=clone, capture_output=True, text=True, env={**os.environ, "CI": "true"})
    return time.perf_counter() - started, proc.returncode, proc.stdout + proc.stderr


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--test-runs", type=int, default=1, help="fresh clones that run the tests (default 1)")
    p.add_argument("--publish", action="store_true", help="write the table into docs/benchmarks.md")
    args = p.parse_args(argv)
    if args.test_runs < 0:
        p.error("--test-runs must be >= 0")
    rows = []
    with tempfile.TemporaryDirectory(prefix="two_commands_") as tmp:
        seconds, code, log = fresh_run(["make", "demo"], Path(tmp), "demo")
        outcome = demo_summary(log) if code == 0 else f"FAILED (exit {code}): {log.strip()[-300:]}"
        rows.append(f"| `make demo` | {minutes(seconds)} | {outcome} |")
        print(f"make demo: {minutes(seconds)}, exit {code}", file=sys.stderr)
        for run in range(args.test_runs):
            seconds, code, log = fresh_run(["bash", ".ci/run"], Path(tmp), f"test{run}")
            outcome = (f"{passed(log)} tests passed, 2 workers" if code == 0
                       else f"FAILED (exit {code}): {log.strip()[-300:]}")
            rows.append(f"| `make test` (`CI=true bash .ci/run`, run {run + 1}) | {minutes(seconds)} | {outcome} |")
            print(f"make test: {minutes(seconds)}, exit {code}", file=sys.stderr)
    with report("two-commands" if args.publish else None):
        print(f"Each from its own fresh clone of commit {commit()}, install included, one after the other:\n")
        print("\n".join(["| command | time | what it did |", "| --- | --- | --- |", *rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
