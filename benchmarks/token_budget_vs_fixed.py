#!/usr/bin/env python
"""Token-budget batching against fixed-size batches: padding waste and real tokens per second (docs/benchmarks.md).

Under one memory budget, fixed micro batches of the profiled size against ``max_tokens=auto`` with
``picking_order=seqlen``, in fresh children, alternating, the median reported.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import padding, report, run_checked, tiny_assets

HERE = Path(__file__).resolve()
BUDGET = "512MiB"  # adaptive_batching.memory_budget of both
MODES = {"fixed": [], "token budget": ["adaptive_batching.max_tokens=auto", "adaptive_batching.picking_order=seqlen"]}


def child(result_path: str, module: str, argv: list[str]) -> None:
    """A run that records the wall time of its training loop."""
    from adaptive_batching.training import hooks

    timing: dict[str, Any] = {}

    class EpochTimer(hooks.TrainerHooks):
        def before_epoch(self, trainer: Any, epoch: int) -> None:
            timing["start"] = time.perf_counter()

        def after_epoch(self, trainer: Any, epoch: int) -> None:
            timing["seconds"] = time.perf_counter() - timing.pop("start")
            timing["steps"] = trainer.feed.epoch_steps

    hooks.install(EpochTimer())
    sys.argv = [module, *argv]
    try:
        importlib.import_module(module).recipe_main()
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    Path(result_path).write_text(json.dumps(timing))


def common(args: argparse.Namespace, work: Path) -> list[str]:
    return [f"assets_dir={args.assets}", f"dataset.split=train[:{args.samples}]", "epochs=1",
            "max_steps_per_epoch=null", "batch_increase_function=null", "use_maximum_batch_size=True",
            f"adaptive_batching.memory_budget={BUDGET}", f"adaptive_batching.cache_dir={work / 'cache'}",
            "seed=0", "lr_scheduler=null"]


def run(args: argparse.Namespace, work: Path, tag: str, mode: str) -> dict[str, Any]:
    result = work / f"{tag}.json"
    cmd = [sys.executable, str(HERE), "--child", str(result), "adaptive_full_finetune", "--config", "tiny_full",
           *common(args, work), f"output_dir={work / tag}", *MODES[mode]]
    done = run_checked(cmd, tag, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1"),
                       cwd=work, timeout=3600)
    return {**json.loads(result.read_text()), "output": done.stdout + done.stderr}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--publish", action="store_true", help="write the table into docs/benchmarks.md")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        args.assets = tiny_assets(None, work)
        seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
        outputs: dict[str, str] = {}
        for repeat in range(args.repeats):
            for mode in MODES:
                timing = run(args, work, f"{mode.replace(' ', '_')}-{repeat}", mode)
                seconds[mode].append(timing["seconds"])
                outputs[mode] = timing["output"]
                print(f"repeat {repeat + 1}: {mode}: {timing['steps']} steps in {timing['seconds']:.1f} s", flush=True)
        micro = int(re.search(r"chosen micro batch (\d+);", outputs["fixed"]).group(1))
        budget = int(re.search(r"Token budget: (\d+) padded tokens", outputs["token budget"]).group(1))
        waste = padding("tiny_full", common(args, work), micro, budget)
    real = waste["real_tokens"]
    lines = [f"{args.samples} samples, {real:,} real tokens, memory budget {BUDGET} for both, {args.threads} "
             f"thread(s), one epoch each, median of {args.repeats} alternating runs:", "",
             "| mode | micro batches | padding waste | real tokens/s |", "| --- | --- | --- | --- |"]
    for mode, detail in (("fixed", f"{micro} samples"), ("token budget", f"{budget:,} padded tokens")):
        speed = real / statistics.median(seconds[mode])
        lines.append(f"| {mode}, {detail} | {waste[mode]['micro_batches']} | {100 * waste[mode]['waste']:.1f}% "
                     f"| {speed:,.0f} |")
    ratio_waste = waste["token budget"]["waste"] / waste["fixed"]["waste"]
    ratio_speed = statistics.median(seconds["fixed"]) / statistics.median(seconds["token budget"])
    verdict = "PASS" if ratio_waste <= 1 / 3 and ratio_speed > 1 else "FAIL"
    lines += ["", f"The token budget wastes {ratio_waste:.3f} times the padding of fixed batches (bar <= 0.333) and "
                  f"trains {ratio_speed:.2f} times the real tokens per second (bar > 1): {verdict}."]
    with report("token-budget-vs-fixed" if args.publish else None):
        print("\n".join(lines))


if __name__ == "__main__":
    main()
