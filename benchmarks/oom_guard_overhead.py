#!/usr/bin/env python
"""What OOM recovery costs when nothing runs out of memory: steps per second with it on and off.

    python benchmarks/oom_guard_overhead.py [--nproc 2] [--steps 60] [--warmup 3] [--repeats 3] [--batch-size 8]

Our full fine-tune recipe on the offline tiny model (``tiny_full``, fixed micro batch, no profiler,
no growth), run under ``torchrun --nproc_per_node N`` (FSDP on CPU with gloo) once with
``adaptive_batching.oom_recovery=True`` (the default: with several ranks, every FSDP module gets
sync points that exchange a flag, 3 per module per micro batch plus 1 per backward) and once with
``False``, alternating, ``--repeats`` times each. Each rank-0 child records when each optimizer
step's metrics are logged; steps per second = ``--steps`` / (time of the last step - time of the
``--warmup``-th). The table shows the median of each setting and their ratio.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def child(stamps_path: str, module: str, argv: list[str]) -> None:
    """One rank of a run: the recipe in this process, rank 0 recording when each step is logged."""
    from torchtune.training.metric_logging import DiskLogger

    stamps: list[float] = []
    original = DiskLogger.log_dict

    def timed(self: Any, payload: Any, step: int) -> None:
        stamps.append(time.perf_counter())
        original(self, payload, step)

    DiskLogger.log_dict = timed
    sys.argv = [module, *argv]
    try:
        importlib.import_module(module).recipe_main()
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    finally:
        if int(os.environ.get("RANK", 0)) == 0:
            Path(stamps_path).write_text(json.dumps(stamps))


def run(args: argparse.Namespace, work: Path, tag: str, recovery: bool) -> float:
    stamps = work / f"{tag}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(HERE), "--child", str(stamps), "adaptive_full_finetune", "--config", "tiny_full",
           f"assets_dir={args.assets}", f"output_dir={work / tag}", "use_maximum_batch_size=False",
           "batch_increase_function=null", f"batch_size={args.batch_size}", "gradient_accumulation_steps=1",
           "epochs=1", f"max_steps_per_epoch={args.warmup + args.steps}", "dataset.split=train",
           f"adaptive_batching.oom_recovery={recovery}", "log_every_n_steps=1"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    result = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        sys.exit(f"{tag} failed:\n{result.stderr[-3000:]}")
    times = json.loads(stamps.read_text())
    return args.steps / (times[args.warmup + args.steps - 1] - times[args.warmup - 1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="micro batch per rank")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--assets", type=Path, default=None, help="tiny assets (written to a temporary folder if absent)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.assets is None:
            from adaptive_batching.tiny_assets import write_tiny_assets

            args.assets = write_tiny_assets(work / "assets").root
        speeds: dict[bool, list[float]] = {True: [], False: []}
        for repeat in range(args.repeats):
            for recovery in (False, True):
                speed = run(args, work, f"{'on' if recovery else 'off'}-{repeat}", recovery)
                speeds[recovery].append(speed)
                print(f"repeat {repeat + 1}: oom_recovery={recovery}: {speed:.2f} steps/s", flush=True)
    on, off = statistics.median(speeds[True]), statistics.median(speeds[False])
    print(f"\n{args.nproc} ranks, micro batch {args.batch_size}, {args.steps} timed steps, median of {args.repeats}:")
    print(f"  oom_recovery=False  {off:.2f} steps/s")
    print(f"  oom_recovery=True   {on:.2f} steps/s")
    print(f"  ratio on/off        {on / off:.3f}")


if __name__ == "__main__":
    main()
