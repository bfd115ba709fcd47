#!/usr/bin/env python
"""The CPU profiler under a whole-process memory limit, as a user sets it (``ulimit -v``): docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import fmt, largest_fit, report, tiny_assets

TUNE = str(Path(sys.executable).with_name("tune"))
TUNABLES = "glibc.malloc.mmap_threshold=131072:glibc.malloc.arena_max=1"
IN_BWD = [
    "optimizer_in_bwd=True",
    "clip_grad_norm=null",
    "gradient_accumulation_steps=1",
    "adaptive_batching.grow_past_memory=skip",
    "optimizer._component_=bitsandbytes.optim.PagedAdamW8bit",
]
LAUNCHERS = ("python", "tune")
# objective: its recipe, its config and what makes the config profile
OBJECTIVES = {
    "finetune": ("adaptive_full_finetune", "tiny_full", []),
    "dpo": ("adaptive_lora_dpo", "tiny_lora_dpo", ["use_maximum_batch_size=True"]),
    "kd": ("adaptive_knowledge_distillation", "tiny_kd", ["use_maximum_batch_size=True"]),
}


def run_env(tuned: bool) -> dict[str, str]:
    """The runs' environment: 1 thread; ``tuned``: glibc tuned from the start (a profiled run tunes)."""
    env = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **({"GLIBC_TUNABLES": TUNABLES} if tuned else {}))
    return env


def under_limit(limit_kib: int, cmd: list[str], tuned: bool, **kwargs: Any) -> subprocess.CompletedProcess:
    """``cmd`` under ``ulimit -v limit_kib`` in :func:`run_env`."""
    return subprocess.run(
        ["bash", "-c", f"ulimit -v {limit_kib} && exec {shlex.join(cmd)}"],
        env=run_env(tuned),
        capture_output=True,
        text=True,
        timeout=600,
        **kwargs,
    )


def mapped_after_import(objective: str) -> int:
    """KiB of address space (VmSize, what ``ulimit -v`` counts) that a fresh process of this interpreter has mapped
    once it has imported the objective's recipe, in the profiled run's environment: the floor of any limit, which
    depends on the torch build (PyPI's CUDA build maps about 2.5 GiB more than the CPU build, with no GPU)."""
    code = (
        f"import re, {OBJECTIVES[objective][0]}; "
        "print(re.search(r'VmSize:\\s+(\\d+)', open('/proc/self/status').read())[1])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=run_env(tuned=False), capture_output=True, text=True, timeout=600, check=True
    )
    return int(result.stdout.split()[-1])


def trains(
    limit_kib: int, work: Path, assets: Path, micro_batch: int, launcher: str, in_bwd: bool, objective: str
) -> bool:
    """Two worst-case steps at ``micro_batch`` in a fresh ``python`` or ``tune run`` process under the limit."""
    child_args = [
        "--child",
        str(micro_batch),
        "--assets",
        str(assets),
        "--out",
        str(work / f"fixed-{micro_batch}"),
        "--objective",
        objective,
        *(["--optimizer-in-bwd"] if in_bwd else []),
    ]
    if launcher == "tune":  # ``tune run`` runs a module from the working directory, and wants a --config
        cmd = [TUNE, "run", Path(__file__).stem, "--config", OBJECTIVES[objective][1], *child_args]
    else:
        cmd = [sys.executable, __file__, *child_args]
    ok = under_limit(limit_kib, cmd, tuned=True, cwd=Path(__file__).parent).returncode == 0
    print(f"  fresh {launcher} process, micro batch {micro_batch}: {'trains' if ok else 'fails'}", flush=True)
    return ok


def child(micro_batch: int, assets: Path, out: Path, in_bwd: bool, objective: str) -> int:
    from adaptive_batching.config.loading import load_config
    from adaptive_batching.config.settings import validate_config
    from adaptive_batching.training.parts import set_up
    from adaptive_batching.training.recipe_table import method_and_objective

    _, config, profiles = OBJECTIVES[objective]
    cfg = load_config(
        config,
        [
            f"assets_dir={assets}",
            f"output_dir={out}",
            "batch_increase_function=null",
            *profiles,
            *(IN_BWD if in_bwd else []),
        ],
    )
    settings = validate_config(cfg)
    parts = set_up(cfg, settings, *method_and_objective(cfg, profiled=settings.needs_profile))  # the worst case
    for _ in range(2):  # no profile: two trial steps at the size asked
        parts.trial_step(micro_batch)
    return 0


def profiled(
    limit_kib: int, work: Path, assets: Path, name: str, tolerance: float | None, in_bwd: bool, objective: str
) -> dict[str, Any]:
    out, (recipe, config, profiles) = work / name, OBJECTIVES[objective]
    result = under_limit(
        limit_kib,
        [
            TUNE,
            "run",
            recipe,
            "--config",
            config,
            f"assets_dir={assets}",
            f"output_dir={out}",
            "epochs=1",
            "max_steps_per_epoch=2",
            "lr_scheduler=null",
            *profiles,
            "adaptive_batching.memory_budget=null",
            "adaptive_batching.memory_fraction=1.0",
            f"adaptive_batching.cache_dir={out}/profile_cache",  # a profile each
            *(IN_BWD if in_bwd else []),
            *([] if tolerance is None else [f"adaptive_batching.search_tolerance={tolerance}"]),
        ],
        tuned=False,
    )
    profile_path = out / "profile" / "profile.json"
    found = json.loads(profile_path.read_text()) if profile_path.exists() else {}
    trials = " ".join(f"{t['micro_batch']}{'' if t['ok'] else 'x'}" for t in found.get("trials", []))
    restarted = "this process starts again with GLIBC_TUNABLES" in result.stdout + result.stderr
    print(
        f"  profiled run {name}: exit {result.returncode}, largest that ran {found.get('max_micro_batch')}, "
        f"chose {found.get('micro_batch')}, trials {trials}, restarted {restarted}",
        flush=True,
    )
    return {
        "returncode": result.returncode,
        "profile_seconds": found.get("seconds"),
        "trials": trials,
        **{
            key: found.get(key)
            for key in ("max_micro_batch", "micro_batch", "budget_source", "budget_bytes", "trial_steps")
        },
        "restarted": restarted,
        "stderr_tail": result.stderr[-1500:] if result.returncode else "",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--limit-gib", type=float, default=3.5, help="ulimit -v for the whole process (GiB)")
    limit.add_argument(
        "--above-import-gib",
        type=float,
        default=None,
        help="instead of --limit-gib: the limit is what a fresh process has mapped after importing the "
        "recipe (measured first, in this run) plus this many GiB",
    )
    parser.add_argument("--repeats", type=int, default=2, help="profiled runs (default 2)")
    parser.add_argument("--start", type=int, default=64, help="first micro batch of the fresh-process search")
    parser.add_argument("--tolerance", type=float, help="adaptive_batching.search_tolerance (default: the recipe's)")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS), help="python, tune or both")
    parser.add_argument("--optimizer-in-bwd", action="store_true", help="optimizer_in_bwd with PagedAdamW8bit")
    parser.add_argument("--objective", choices=OBJECTIVES, default="finetune", help="finetune (tiny_full), dpo or kd")
    parser.add_argument("--fresh-trials", type=int, help="at most this many fresh processes per search (a lower bound)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--publish", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--assets", type=Path, default=None, help="tiny assets to use (default: written anew)")
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)  # what ``tune run`` requires
    args = parser.parse_args(argv)
    launchers = tuple(args.launchers.split(","))
    if not launchers or not set(launchers) <= set(LAUNCHERS):
        parser.error(f"--launchers: a comma-separated list of {', '.join(LAUNCHERS)}")
    if args.child is not None:
        return child(args.child, args.assets, args.out, args.optimizer_in_bwd, args.objective)

    import_kib = None if args.above_import_gib is None else mapped_after_import(args.objective)
    if import_kib is not None:
        limit_kib = import_kib + int(args.above_import_gib * 2**20)
        args.limit_gib = round(limit_kib / 2**20, 3)
    else:
        limit_kib = int(args.limit_gib * 2**20)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        assets = tiny_assets(args.assets, work)
        runs = [
            profiled(limit_kib, work, assets, f"profiled-{i}", args.tolerance, args.optimizer_in_bwd, args.objective)
            for i in range(args.repeats)
        ]
        # the fresh-process maximum: double from --start, then bisect; (largest, the sizes tried)
        maxima = {
            launcher: largest_fit(
                lambda size, launcher=launcher: trains(
                    limit_kib, work, assets, size, launcher, args.optimizer_in_bwd, args.objective
                ),
                args.start,
                args.fresh_trials,
            )[::2]
            for launcher in launchers
        }

    def percent(found: int | None, launcher: str) -> float | None:
        maximum = maxima[launcher][0] if launcher in maxima else None
        return 100 * found / maximum if found and maximum else None

    rows = [
        {
            "run": i + 1,
            **r,
            **{f"percent_of_fresh_{launcher}_max": percent(r["max_micro_batch"], launcher) for launcher in LAUNCHERS},
        }
        for i, r in enumerate(runs)
    ]
    import_gib = None if import_kib is None else round(import_kib / 2**20, 3)
    result = {
        "limit_gib": args.limit_gib,
        "import_gib": import_gib,
        "above_import_gib": args.above_import_gib,
        "tolerance": args.tolerance,
        "optimizer_in_bwd": args.optimizer_in_bwd,
        "objective": args.objective,
        **{
            f"fresh_{launcher}_{key}": value
            for launcher in launchers
            for key, value in zip(("max", "trials"), maxima[launcher])
        },
        "runs": rows,
        "seconds": time.perf_counter() - started,
    }
    tolerance = "default" if args.tolerance is None else args.tolerance
    name = (
        "whole-process-limit"
        + ("" if args.objective == "finetune" else f"-{args.objective}")
        + ("-in-bwd" if args.optimizer_in_bwd else "")
        + f"-tolerance-{tolerance}"
    )
    with report(name if args.publish else None):
        above = (
            ""
            if import_kib is None
            else f", {args.above_import_gib} GiB above the {import_kib / 2**20:.2f} GiB mapped after the imports"
        )
        print(
            f"{' '.join(OBJECTIVES[args.objective][:2])}: whole-process limit ulimit -v {limit_kib} KiB "
            f"({args.limit_gib} GiB{above}), GLIBC_TUNABLES={TUNABLES} in the fresh processes"
            + (f"; {' '.join(IN_BWD)}" if args.optimizer_in_bwd else "")
        )
        for launcher in launchers:
            print(f"fresh {launcher} process maximum {maxima[launcher][0]} (trials {' '.join(maxima[launcher][1])})")
        print(
            "\n| run | largest micro batch that ran | chosen | trained | % of fresh python max | % of fresh tune max "
            "| trial steps | profile seconds | trials (x: failed) |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            shown = [
                fmt(row[key], ".1f", "n/a")
                for key in ("percent_of_fresh_python_max", "percent_of_fresh_tune_max", "profile_seconds")
            ]
            print(
                f"| {row['run']} | {row['max_micro_batch']} | {row['micro_batch']} | "
                f"{'yes' if row['returncode'] == 0 else 'no'} | {shown[0]} | {shown[1]} | {row['trial_steps']} | "
                f"{shown[2]} | {row['trials']} |"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
