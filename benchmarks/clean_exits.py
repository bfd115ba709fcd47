#!/usr/bin/env python
"""Do two-rank runs exit clean, every time? Counts the runs that exit non-zero or print an abort."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import report, tiny_assets, unclean_exit

SHORT = ("epochs=1", "max_steps_per_epoch=4")
SETTINGS = {
    "full": ("adaptive_full_finetune", "tiny_full", SHORT),
    "lora": ("adaptive_lora_finetune", "tiny_lora", SHORT),
    "token": (
        "adaptive_full_finetune",
        "tiny_full",
        (
            *SHORT,
            "batch_increase_function=null",
            "adaptive_batching.max_tokens=auto",
            "adaptive_batching.picking_order=seqlen",
            "adaptive_batching.grow_past_memory=skip",
        ),
    ),
    "saves": (
        "adaptive_full_finetune",
        "tiny_full",
        (
            "epochs=1",
            "max_steps_per_epoch=6",
            "use_maximum_batch_size=False",
            "batch_increase_function=null",
            "batch_size=8",
            "save_every_n_steps=2",
        ),
    ),
}
TUNE = str(Path(sys.executable).with_name("tune"))


def one_run(setting: str, assets: Path, out: Path) -> dict:
    recipe, config, overrides = SETTINGS[setting]
    cmd = [
        TUNE,
        "run",
        "--nproc_per_node",
        "2",
        recipe,
        "--config",
        config,
        f"assets_dir={assets}",
        f"output_dir={out}",
        *overrides,
    ]
    start = time.monotonic()
    result = subprocess.run(
        cmd,
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
    )
    return {
        "setting": setting,
        "exit": result.returncode,
        "unclean": unclean_exit(result),
        "seconds": round(time.monotonic() - start, 1),
        "tail": None if result.returncode == 0 else result.stderr[-2000:],
    }


def runs(args: argparse.Namespace) -> None:
    chosen = args.settings.split(",")
    if not set(chosen) <= set(SETTINGS):
        sys.exit(f"--settings: a comma-separated list of {', '.join(SETTINGS)}")
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        assets = tiny_assets(None, work)
        for index in range(args.runs):
            setting = chosen[index % len(chosen)]
            records.append(record := one_run(setting, assets, work / f"run{index}"))
            bad = record["exit"] != 0 or record["unclean"]
            print(
                f"run {index + 1}/{args.runs} {setting}: exit {record['exit']}, {record['seconds']} s"
                f"{'  UNCLEAN: ' + str(record['unclean']) if bad else ''}",
                flush=True,
            )
    lines = [
        "| setting | runs | exit non-zero | abort or warning printed | seconds per run (median) |",
        "|---|---|---|---|---|",
    ]
    for setting in chosen:
        mine = [r for r in records if r["setting"] == setting]
        seconds = sorted(r["seconds"] for r in mine)
        lines.append(
            f"| {setting} | {len(mine)} | {sum(r['exit'] != 0 for r in mine)} | "
            f"{sum(bool(r['unclean']) for r in mine)} | {seconds[len(seconds) // 2]:.0f} |"
        )
    unclean = sum(r["exit"] != 0 or bool(r["unclean"]) for r in records)
    lines.append(
        f"| **all** | **{len(records)}** | **{sum(r['exit'] != 0 for r in records)}** | "
        f"**{sum(bool(r['unclean']) for r in records)}** | |"
    )
    print(f"\n{unclean} of {len(records)} two-rank runs exited unclean")
    with report("clean-exits" if args.publish else None, "fault-tolerance.md"):
        print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(records, indent=2))
    if unclean:
        sys.exit(1)


MECHANISM = """
import atexit, os, sys, time
rank = int(os.environ["RANK"])
if rank == 0:  # registered first, so it runs last: holds the GIL into finalisation, as a busy main thread can
    atexit.register(lambda: (open(os.environ["READY"], "w").close(), b"x" * (2 * 10**9)))
import torch, torch.distributed as dist
from adaptive_batching.runtime.distributed import ParallelInfo, release_destroyed_group, shutdown
dist.init_process_group("gloo")
holder = dist.group.WORLD  # what FSDP2's mesh does: the group outlives destroy_process_group()
if rank == 0:
    tensor = torch.ones(4)
    work = dist.all_reduce(tensor, async_op=True)  # completes once rank 1 joins, during rank 0's finalisation
    del tensor, work  # the Python tensor now lives on in the gloo worker's work item
    shutdown(ParallelInfo(2, 0, 0))
    if os.environ["RELEASE"] == "1":
        open(os.environ["READY"], "w").close()  # rank 1 joins the all-reduce; ending the group waits for it
        del holder
        print("release_destroyed_group:", release_destroyed_group(), flush=True)
else:
    while not os.path.exists(os.environ["READY"]):
        time.sleep(0.01)
    dist.all_reduce(torch.ones(4))
"""


def mechanism() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "mechanism.py"
        script.write_text(MECHANISM)
        for release in ("0", "1"):  # without the release, rank 1's late join reaches rank 0 as it finalises
            env = dict(os.environ, RELEASE=release, READY=str(Path(tmp) / f"ready{release}"), OMP_NUM_THREADS="1")
            result = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
                capture_output=True,
                text=True,
                env=env,
                timeout=300,
            )
            abort = next((line for line in result.stderr.splitlines() if "terminate called" in line), "none")
            print(
                f"release {'on ' if release == '1' else 'off'}: torchrun exit {result.returncode}, "
                f"abort printed: {abort}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--publish", action="store_true", help="write the table into docs/fault-tolerance.md")
    parser.add_argument("--mechanism", action="store_true", help="show the abort's cause and the release")
    args = parser.parse_args()
    mechanism() if args.mechanism else runs(args)


if __name__ == "__main__":
    main()
