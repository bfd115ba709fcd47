#!/usr/bin/env python
"""The fault handling's cost when nothing goes wrong: steps/s and collectives per step (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import report, run_checked, step_stamps, tiny_assets

HERE = Path(__file__).resolve()
NPROC, BATCH = 2, 8  # ranks, micro batch per rank
COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather",
    "broadcast",
    "reduce_scatter",
    "barrier",
    "all_to_all_single",
)


def child(stamps_path: str, module: str, argv: list[str]) -> None:
    """One rank of a run in this process; rank 0 stamps each logged step with the collectives and stop time since."""
    import torch.distributed as dist

    calls = [0]

    def counted(function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return function(*args, **kwargs)

        return wrapper

    for name in COLLECTIVES:
        setattr(dist, name, counted(getattr(dist, name)))
    from adaptive_batching.faults.preemption import Preemption

    inside = [0.0]  # seconds spent in the ranks' stop agreement since the previous step

    def clocked(function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - start

        return wrapper

    Preemption.begin_step = clocked(Preemption.begin_step)
    Preemption.end_step = clocked(Preemption.end_step)

    def since_last(payload: Any, step: int) -> dict[str, Any]:
        row = {"collectives": calls[0], "stop_seconds": inside[0]}
        calls[0], inside[0] = 0, 0.0
        return row

    sys.argv = [module, *argv]
    with step_stamps(since_last) as stamps:
        try:
            importlib.import_module(module).recipe_main()
        except SystemExit as stop:
            if stop.code not in (None, 0):
                raise
        finally:
            if int(os.environ.get("RANK", 0)) == 0:
                Path(stamps_path).write_text(
                    json.dumps(
                        {
                            key: [s[field] for s in stamps]
                            for key, field in (
                                ("stamps", "t"),
                                ("collectives", "collectives"),
                                ("stop_seconds", "stop_seconds"),
                            )
                        }
                    )
                )


NO_STOP = "adaptive_batching.stop_signals=[]"
SETTINGS = {
    "none": ["adaptive_batching.oom_recovery=False", NO_STOP],
    "stop": ["adaptive_batching.oom_recovery=False"],
    "oom": ["adaptive_batching.oom_recovery=True", NO_STOP],
    "default": [],
    "always": ["adaptive_batching.oom_recovery=True", "adaptive_batching.guard_steps=100000", NO_STOP],
}


def run(args: argparse.Namespace, work: Path, tag: str, setting: str) -> tuple[float, float, float]:
    """One run's steps/s, median collectives per timed step, and share of the time in the stop agreement."""
    stamps = work / f"{tag}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={NPROC}",
        str(HERE),
        "--child",
        str(stamps),
        "adaptive_full_finetune",
        "--config",
        "tiny_full",
        f"assets_dir={args.assets}",
        f"output_dir={work / tag}",
        "use_maximum_batch_size=False",
        "batch_increase_function=null",
        f"batch_size={BATCH}",
        "gradient_accumulation_steps=1",
        "epochs=1",
        f"max_steps_per_epoch={args.warmup + args.steps}",
        "dataset.split=train",
        "log_every_n_steps=1",
        *SETTINGS[setting],
    ]
    run_checked(cmd, tag, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), cwd=work, timeout=1800)
    record = json.loads(stamps.read_text())
    times, timed = record["stamps"], slice(args.warmup, args.warmup + args.steps)
    elapsed = times[args.warmup + args.steps - 1] - times[args.warmup - 1]
    stop = sum(record["stop_seconds"][timed]) / elapsed
    return args.steps / elapsed, statistics.median(record["collectives"][timed]), stop


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=6, help="untimed steps first (more than guard_steps, 4)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--assets", type=Path, default=None, help="tiny assets to use (default: written anew)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated of {', '.join(SETTINGS)}")
    p.add_argument("--publish", action="store_true", help="write the table into docs/benchmarks.md")
    args = p.parse_args()
    chosen = args.settings.split(",")
    if "none" not in chosen or not set(chosen) <= set(SETTINGS):
        p.error(f"--settings: some of {', '.join(SETTINGS)}, with none (the baseline)")
    figures: dict[str, dict[str, list[float]]] = {
        key: {name: [] for name in chosen} for key in ("speeds", "collectives", "stop_share")
    }
    speeds, collectives, stop_share = figures.values()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        args.assets = tiny_assets(args.assets, work)
        for repeat in range(args.repeats):
            for setting in chosen:
                speed, count, share = run(args, work, f"{setting}-{repeat}", setting)
                for figure, value in zip(figures.values(), (speed, count, share)):
                    figure[setting].append(value)
                print(
                    f"repeat {repeat + 1}: {setting}: {speed:.2f} steps/s, {count:g} collectives per step, "
                    f"{share:.4%} of the time in the stop agreement",
                    flush=True,
                )
    median = statistics.median
    off = median(speeds["none"])
    lines = [
        f"{NPROC} ranks, micro batch {BATCH}, {args.steps} timed steps after {args.warmup}, "
        f"median of {args.repeats} alternating repeats:",
        "",
        "| setting | steps/s (median) | ratio to none | runs | collectives per step | time in the stop agreement |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {s} | {median(speeds[s]):.2f} | {median(speeds[s]) / off:.3f} | "
        f"{', '.join(f'{v:.2f}' for v in speeds[s])} | {median(collectives[s]):g} | {median(stop_share[s]):.3%} |"
        for s in chosen
    ]
    with report("step-overhead" if args.publish else None):
        print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
