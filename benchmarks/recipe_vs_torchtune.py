#!/usr/bin/env python
"""Our full fine-tune recipe against torchtune's stock single-device one: optimizer steps per second.

    python benchmarks/recipe_vs_torchtune.py [--steps 200] [--warmup 3] [--repeats 3] [--threads 1] [--json out.json]
                                            [--compile] [--together] [--publish]
    python benchmarks/recipe_vs_torchtune.py --switch-only      # only the epoch-switch cost

Both run as a user runs them, ``tune run RECIPE --config FILE``, each in a fresh child with the same
environment and threads: ours (``adaptive_full_finetune``, ``tiny_full``, a fixed batch: no profiling, no
growth) and stock (``full_finetune_single_device``) with a config built from ours' resolved one: the keys the
stock recipe reads, plus those it requires switched off. Same model, data, order (seed 0: the stock recipe's
sampler always uses 0), optimizer, loss, schedule, fp32 on CPU; the per-step losses of the two are compared as a
check that they compute the same thing.

Timing: the child stamps torchtune's ``DiskLogger.log_dict``, which both recipes call once per optimizer step
(``common.step_stamps``). Steps per second = ``--steps`` / (the last step's stamp - the ``--warmup``-th one's):
start-up, warm-up and the final save are left out. Runs alternate (``--repeats`` each), or with ``--together``
run side by side, each pinned to its own core (swapped every repeat), with each pair's ratio added. The bar:
ours / stock >= 0.99 by steps per second and by median step time. ``--compile``: both with ``compile: True``
(raise ``--warmup`` to leave the compiles out).

Epoch switch: ours once more with per-epoch growth (``--switch-*``); the median of the recipe's ``Epoch switch
... (took X ms)`` lines. The exit code is 1 only when a run itself failed. The page: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from common import fmt, log, step_stamps, tiny_assets, tune_in_process, write_json
from doc_tables import report

BAR_RATIO = 0.99
OURS_RECIPE = "adaptive_full_finetune"
STOCK_RECIPE = "full_finetune_single_device"
CONFIG = "tiny_full"

# Top-level keys torchtune 0.6.1's full_finetune_single_device reads (cfg.x / cfg.get("x")).
STOCK_KEYS = (
    "output_dir", "model", "tokenizer", "dataset", "seed", "shuffle", "checkpointer", "resume_from_checkpoint",
    "batch_size", "epochs", "max_steps_per_epoch", "gradient_accumulation_steps", "optimizer", "lr_scheduler",
    "loss", "optimizer_in_bwd", "clip_grad_norm", "compile", "device", "dtype", "enable_activation_checkpointing",
    "enable_activation_offloading", "metric_logger", "log_every_n_steps", "log_peak_memory_stats", "profiler",
    "collate_fn", "cudnn_deterministic_mode",
)
# What the stock recipe requires (or would otherwise turn on) that ours' config does not say.
STOCK_REQUIRED = {
    "optimizer_in_bwd": False,
    "enable_activation_offloading": False,
    "log_peak_memory_stats": False,
    "profiler": {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
    "resume_from_checkpoint": False,
    "compile": False,
}
SWITCH_LINE = re.compile(r"Epoch switch.*?took ([0-9]+(?:\.[0-9]+)?) ?ms")


# --------------------------------------------------------------------------- child side: timed `tune run`
def _number(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def tune_child(stamps_path: str, tune_args: list[str]) -> int:
    """Run ``tune TUNE_ARGS`` in this process, recording when each metric line is logged."""

    def figures(payload: Any, step: int) -> dict[str, Any]:
        return {"loss": _number(payload.get("loss")), "lr": _number(payload.get("lr")),
                "batch": _number(payload.get("micro_batch_size")),
                "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt}

    with step_stamps(figures) as stamps:
        try:
            tune_in_process(tune_args)
        finally:
            import torch

            Path(stamps_path).write_text(json.dumps({"threads": torch.get_num_threads(), "stamps": stamps}))
    return 0


# --------------------------------------------------------------------------- arguments
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200,
                   help="optimizer steps measured per run (default 200, about 20 s per run here)")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps run first and not measured (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each recipe, alternating (default 3)")
    p.add_argument("--batch-size", type=int, default=8, help="micro batch, same for both (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokenizer.max_seq_len (default 256)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for both (default 0: the stock recipe's sampler always uses 0, so only then "
                        "do both see the same batches)")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP/MKL threads and torch.set_num_threads for every child (default 1)")
    p.add_argument("--switch-only", action="store_true", help="only measure the epoch-switch cost")
    p.add_argument("--no-switch", action="store_true", help="skip the epoch-switch run")
    p.add_argument("--switch-epochs", type=int, default=3, help="epochs of the epoch-switch run (default 3)")
    p.add_argument("--switch-steps", type=int, default=5, help="steps per epoch of the epoch-switch run (default 5)")
    p.add_argument("--switch-function", default="adaptive_batching.growth.linear_ramp",
                   help="batch_increase_function._component_ of the epoch-switch run "
                        "(default adaptive_batching.growth.linear_ramp)")
    p.add_argument("--switch-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="keyword argument of the growth function, YAML value; repeatable (default increment=4)")
    p.add_argument("--assets", type=Path, default=None,
                   help="tiny assets directory (default: written into the work directory)")
    p.add_argument("--compile", action="store_true", help="both recipes with compile=True")
    p.add_argument("--together", action="store_true",
                   help="run each repeat's two recipes at the same time, each pinned to its own core (swapped every "
                        "repeat): a machine whose speed drifts then slows both alike; needs 2 cores")
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON to this path")
    p.add_argument("--publish", action="store_true", help="write the report into docs/benchmarks.md")
    p.add_argument("--workdir", type=Path, default=None,
                   help="configs, run outputs and child logs (default: a temporary directory, removed afterwards)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    p.add_argument("--child-timeout", type=int, default=900, help="seconds before a child is killed (default 900)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1 or args.batch_size < 1 or args.seq_len < 1:
        p.error("--steps, --warmup, --repeats, --batch-size and --seq-len must be positive")
    if args.threads < 1 or args.switch_epochs < 2 or args.switch_steps < 1:
        p.error("--threads and --switch-steps must be positive, --switch-epochs at least 2")
    if args.switch_only and args.no_switch:
        p.error("--switch-only and --no-switch exclude each other")
    if args.together and len(os.sched_getaffinity(0)) < 2:
        p.error("--together needs 2 cores")
    if args.switch_arg is None:
        args.switch_arg = ["increment=4"]
    return args


# --------------------------------------------------------------------------- configs
def ours_config(args: argparse.Namespace, output_dir: Path, epochs: int, steps_per_epoch: int) -> dict[str, Any]:
    """``tiny_full`` as our recipe reads it, with this benchmark's settings, fully resolved."""
    from omegaconf import OmegaConf

    from adaptive_batching.config.loading import load_config

    cfg = load_config(CONFIG, [
        f"assets_dir={args.assets}",
        f"output_dir={output_dir}",
        f"tokenizer.max_seq_len={args.seq_len}",
        f"batch_size={args.batch_size}",
        "gradient_accumulation_steps=1",
        f"epochs={epochs}",
        f"max_steps_per_epoch={steps_per_epoch}",
        f"seed={args.seed}",
        "use_maximum_batch_size=False",
        "device=cpu",
        "dtype=fp32",
        f"compile={args.compile}",
        "log_every_n_steps=1",
    ])
    out = OmegaConf.to_container(cfg, resolve=True)
    out["batch_increase_function"] = None
    if "save_every_n_steps" in out:  # mid-epoch checkpoints: the stock recipe has none
        out["save_every_n_steps"] = None
    out["metric_logger"] = {"_component_": "torchtune.training.metric_logging.DiskLogger",
                            "log_dir": str(output_dir / "logs")}
    return out


def stock_config(ours: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The stock recipe's config from ours: the keys it reads, plus the ones it requires switched off."""
    out = {k: v for k, v in ours.items() if k in STOCK_KEYS}
    dropped = sorted(k for k in ours if k not in STOCK_KEYS)
    for key, value in STOCK_REQUIRED.items():
        out.setdefault(key, value)
    out["profiler"] = dict(STOCK_REQUIRED["profiler"], output_dir=str(Path(out["output_dir"]) / "profiling_outputs"))
    return out, dropped


def write_yaml(data: dict[str, Any], path: Path) -> Path:
    from omegaconf import OmegaConf

    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(data), path)
    return path


def _yaml_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


# --------------------------------------------------------------------------- running
def child_env(args: argparse.Namespace) -> dict[str, str]:
    threads = str(args.threads)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
               BENCH_THREADS=threads, TOKENIZERS_PARALLELISM="false")
    return env


def run_recipe(args: argparse.Namespace, tag: str, recipe: str, cfg: dict[str, Any],
               cpu: Optional[int] = None) -> dict[str, Any]:
    """``tune run RECIPE --config <cfg>`` in a fresh child (pinned to core ``cpu`` when given); its per-step log
    stamps and output."""
    config_path = write_yaml(cfg, args.workdir / "configs" / f"{tag}.yaml")
    stamps_path = args.workdir / "stamps" / f"{tag}.json"
    stamps_path.parent.mkdir(parents=True, exist_ok=True)
    stamps_path.unlink(missing_ok=True)
    log_path = args.workdir / "logs" / f"{tag}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, os.path.abspath(__file__), "--tune-child", str(stamps_path),
               "run", recipe, "--config", str(config_path)]
    started = time.perf_counter()
    with open(log_path, "w") as log_file:
        try:
            pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
            code: Optional[int] = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT,
                                                 env=child_env(args), cwd=args.workdir, preexec_fn=pin,
                                                 timeout=args.child_timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    result: dict[str, Any] = {"tag": tag, "recipe": recipe, "exit_code": code,
                              "child_seconds": time.perf_counter() - started, "log": str(log_path),
                              "output": log_path.read_text(errors="replace")}
    if stamps_path.exists():
        result.update(json.loads(stamps_path.read_text()))
    else:
        result["stamps"] = []
    if code != 0:
        tail = " | ".join(result["output"].strip().splitlines()[-4:])[-400:]
        result["error"] = f"{'timed out' if code is None else f'exit code {code}'}: {tail}"
    return result


def steps_per_second(stamps: list[dict[str, Any]], warmup: int, steps: int) -> Optional[float]:
    """Steps after the first ``warmup`` per second, from the log-call times (None if too few steps)."""
    if len(stamps) < warmup + steps:
        return None
    times = [s["t"] for s in stamps[: warmup + steps]]
    return steps / (times[-1] - times[warmup - 1])


def median_step_rate(stamps: list[dict[str, Any]], warmup: int, steps: int) -> Optional[float]:
    """1 / the median step interval over the same steps: less sensitive to bursts from other processes."""
    if len(stamps) < warmup + steps:
        return None
    times = [s["t"] for s in stamps[warmup - 1: warmup + steps]]
    return 1.0 / statistics.median(b - a for a, b in zip(times, times[1:]))


def faults_per_step(stamps: list[dict[str, Any]], warmup: int, steps: int) -> Optional[float]:
    """Minor page faults per measured step: memory the allocator handed out fresh (zeroed by the kernel) in the
    step, which slows the kernels that first touch it."""
    if len(stamps) < warmup + steps or "minor_faults" not in stamps[0]:
        return None
    return (stamps[warmup + steps - 1]["minor_faults"] - stamps[warmup - 1]["minor_faults"]) / steps


def throughput_runs(args: argparse.Namespace) -> dict[str, Any]:
    total = args.warmup + args.steps
    runs: dict[str, list[dict[str, Any]]] = {"stock": [], "ours": []}
    dropped: list[str] = []
    cores = sorted(os.sched_getaffinity(0))[:2]

    def one(i: int, name: str) -> dict[str, Any]:
        nonlocal dropped
        tag = f"{name}_{i + 1}"
        output_dir = args.workdir / "runs" / tag
        ours = ours_config(args, output_dir, epochs=1, steps_per_epoch=total)
        if name == "ours":
            recipe, cfg = OURS_RECIPE, ours
        else:
            recipe, (cfg, dropped) = STOCK_RECIPE, stock_config(ours)
        # together: the two share a time window, each on its own core, the cores swapped every repeat
        cpu = cores[(i + (name == "ours")) % 2] if args.together else None
        log(f"run {i + 1}/{args.repeats}: {name} ({recipe}, {total} steps"
            + (f", core {cpu}" if cpu is not None else "") + ") ...")
        result = run_recipe(args, tag, recipe, cfg, cpu=cpu)
        result["steps_per_second"] = steps_per_second(result["stamps"], args.warmup, args.steps)
        result["median_step_rate"] = median_step_rate(result["stamps"], args.warmup, args.steps)
        result["faults_per_step"] = faults_per_step(result["stamps"], args.warmup, args.steps)
        if result["steps_per_second"] is None and "error" not in result:
            result["error"] = (f"only {len(result['stamps'])} steps logged, need {total} "
                               f"(is the dataset too small for batch {args.batch_size}?)")
        sps = result["steps_per_second"]
        log(f"  {name}: " + (f"{sps:.3f} steps/s" if sps else "no figure")
            + f", child {result['child_seconds']:.1f} s, {result.get('threads', '?')} thread(s)"
            + (f" [{result['error']}]" if "error" in result else ""))
        shutil.rmtree(output_dir, ignore_errors=True)  # checkpoints: not needed, and they take space
        return result

    for i in range(args.repeats):
        if args.together:
            with ThreadPoolExecutor(max_workers=2) as pool:
                pair = dict(zip(("stock", "ours"), pool.map(lambda name: one(i, name), ("stock", "ours"))))
        else:
            pair = {name: one(i, name) for name in ("stock", "ours")}  # alternate so that noise hits both
        for name, result in pair.items():
            runs[name].append(result)
    return {"runs": runs, "dropped_keys": dropped}


def pair_ratios(runs: dict[str, list[dict[str, Any]]], key: str = "steps_per_second") -> list[float]:
    """ours / stock by ``key`` (steps per second, or ``median_step_rate``), for each repeat in which both ran."""
    return [o[key] / s[key] for o, s in zip(runs["ours"], runs["stock"]) if o[key] and s[key]]


def window_overlaps(runs: dict[str, list[dict[str, Any]]], warmup: int, steps: int) -> list[float]:
    """For each repeat, the share of the shorter measured window (from the ``warmup``-th step's log line to the
    last measured one) that the other run's window covers: 1.0 when the two ran side by side throughout."""
    shares = []
    for ours, stock in zip(runs["ours"], runs["stock"]):
        if len(ours["stamps"]) < warmup + steps or len(stock["stamps"]) < warmup + steps:
            continue
        a = (ours["stamps"][warmup - 1]["t"], ours["stamps"][warmup + steps - 1]["t"])
        b = (stock["stamps"][warmup - 1]["t"], stock["stamps"][warmup + steps - 1]["t"])
        common = min(a[1], b[1]) - max(a[0], b[0])
        shares.append(max(common, 0.0) / min(a[1] - a[0], b[1] - b[0]))
    return shares


def loss_check(runs: dict[str, list[dict[str, Any]]]) -> Optional[dict[str, Any]]:
    """Same batches, same LR schedule? The first runs' per-step losses and LRs, ours vs stock."""
    stock = next((r for r in runs["stock"] if r["stamps"]), None)
    ours = next((r for r in runs["ours"] if r["stamps"]), None)
    if stock is None or ours is None:
        return None
    out: dict[str, Any] = {}
    for key in ("loss", "lr"):
        a = {s["step"]: s[key] for s in stock["stamps"] if s.get(key) is not None}
        b = {s["step"]: s[key] for s in ours["stamps"] if s.get(key) is not None}
        common = sorted(set(a) & set(b))
        if not common:
            return None
        out[key] = {"steps": len(common), "max_abs_diff": max(abs(a[k] - b[k]) for k in common),
                    "max_rel_diff": max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for k in common)}
    return out


def switch_run(args: argparse.Namespace) -> dict[str, Any]:
    """Ours with per-epoch batch growth; the recipe's own 'Epoch switch ... took X ms' lines."""
    tag = "ours_switch"
    output_dir = args.workdir / "runs" / tag
    cfg = ours_config(args, output_dir, epochs=args.switch_epochs, steps_per_epoch=args.switch_steps)
    function: dict[str, Any] = {"_component_": args.switch_function}
    for item in args.switch_arg:
        key, _, value = item.partition("=")
        function[key.strip()] = _yaml_value(value)
    cfg["batch_increase_function"] = function
    log(f"epoch-switch run: ours, {args.switch_epochs} epochs x {args.switch_steps} steps, "
        f"batch_increase_function = {function} ...")
    result = run_recipe(args, tag, OURS_RECIPE, cfg)
    shutil.rmtree(output_dir, ignore_errors=True)
    lines = [line.strip() for line in result["output"].splitlines() if "Epoch switch" in line]
    took = [float(m.group(1)) for line in lines if (m := SWITCH_LINE.search(line))]
    # Context from the log-call times: the whole gap at an epoch boundary (end-of-epoch checkpoint save,
    # the switch, the first step of the new epoch) against an ordinary step's time.
    t = {s["step"]: s["t"] for s in result["stamps"]}
    boundaries = [e * args.switch_steps for e in range(1, args.switch_epochs)]
    gaps = [(t[b + 1] - t[b]) * 1e3 for b in boundaries if b in t and b + 1 in t]
    ordinary = [(t[b + 2] - t[b + 1]) * 1e3 for b in boundaries if b + 1 in t and b + 2 in t]  # same batch size
    out = {"function": function, "epochs": args.switch_epochs, "steps_per_epoch": args.switch_steps,
           "boundary_gap_ms": gaps, "ordinary_step_ms": statistics.median(ordinary) if ordinary else None,
           "exit_code": result["exit_code"], "switch_ms": took, "lines": lines[:20],
           "median_ms": statistics.median(took) if took else None,
           "batches": sorted({s["batch"] for s in result["stamps"] if s.get("batch") is not None}),
           "log": result["log"]}
    if "error" in result:
        out["error"] = result["error"]
    log(f"  epoch switch: {len(took)} line(s) with a time" + (f" [{out['error']}]" if "error" in out else ""))
    return out


# --------------------------------------------------------------------------- report
def summarise(args: argparse.Namespace, measured: dict[str, Any]) -> dict[str, Any]:
    rows = []
    medians: dict[str, Optional[float]] = {}
    for name, recipe in (("ours", OURS_RECIPE), ("stock", STOCK_RECIPE)):
        runs = measured["runs"][name]
        figures = [r["steps_per_second"] for r in runs if r["steps_per_second"] is not None]
        medians[name] = statistics.median(figures) if figures else None
        per_step = [r["median_step_rate"] for r in runs if r["median_step_rate"] is not None]
        faults = [r["faults_per_step"] for r in runs if r.get("faults_per_step") is not None]
        rows.append({"recipe": f"{name}: {recipe}", "steps_measured": args.steps, "median": medians[name],
                     "runs": [r["steps_per_second"] for r in runs],
                     "median_step_rate": statistics.median(per_step) if per_step else None,
                     "faults_per_step": statistics.median(faults) if faults else None,
                     "faults_runs": [r.get("faults_per_step") for r in runs],
                     "errors": [r["error"] for r in runs if "error" in r]})
    ratio = (medians["ours"] / medians["stock"]) if medians["ours"] and medians["stock"] else None
    a, b = rows[0]["median_step_rate"], rows[1]["median_step_rate"]
    return {"rows": rows, "ratio": ratio, "median_step_ratio": a / b if a and b else None,
            "passed": ratio is not None and ratio >= BAR_RATIO and a is not None and b is not None and a / b >= BAR_RATIO,
            "same_computation": loss_check(measured["runs"]), "dropped_keys": measured["dropped_keys"]}


def print_table(summary: dict[str, Any]) -> None:
    print("| recipe | steps measured | steps/s (median) | runs (steps/s, in order) | 1 / median step time | "
          "minor page faults / step |")
    print("|---|---:|---:|---|---:|---:|")
    for row in summary["rows"]:
        runs = ", ".join(fmt(v, ".3f") for v in row["runs"])
        print(f"| {row['recipe']} | {row['steps_measured']} | {fmt(row['median'], '.3f')} | {runs} | "
              f"{fmt(row['median_step_rate'], '.3f')} | {fmt(row.get('faults_per_step'), '.0f')} |")
    print("minor page faults / step, runs in the order above: " + "; ".join(
        f"{row['recipe'].split(':')[0]} " + ", ".join(fmt(v, ".0f") for v in row.get("faults_runs", []))
        for row in summary["rows"]))
    for row in summary["rows"]:
        for error in row["errors"]:
            print(f"  {row['recipe']} failed: {error}")
    ratio = summary["ratio"]
    verdict = "PASS" if summary["passed"] else "FAIL"
    print(f"ours / stock = {fmt(ratio, '.3f')}x by steps/s, {fmt(summary.get('median_step_ratio'), '.3f')}x by median "
          f"step time (bar: both >= {BAR_RATIO:g}x): {verdict}")
    check = summary["same_computation"]
    if check is None:
        print("per-step loss and LR, ours vs stock: not compared (no common steps)")
    else:
        loss, lr = check["loss"], check["lr"]
        same = loss["max_rel_diff"] < 1e-4 and lr["max_rel_diff"] < 1e-6
        print(f"per-step loss, ours vs stock: max relative diff {loss['max_rel_diff']:.1e}; LR: {lr['max_rel_diff']:.1e}; "
              f"over {loss['steps']} steps ("
              + ("same batches, same LR schedule: the same computation" if same
                 else "NOT the same computation: the figures are not comparable") + ")")


def print_switch(switch: Optional[dict[str, Any]]) -> None:
    if switch is None:
        return
    if switch["switch_ms"]:
        times = ", ".join(f"{t:.1f}" for t in switch["switch_ms"])
        print(f"epoch switch: median {switch['median_ms']:.1f} ms over {len(switch['switch_ms'])} switches "
              f"({times} ms; micro batches seen: {', '.join(f'{b:g}' for b in switch['batches']) or '-'})")
    else:
        why = switch.get("error") or "the recipe logged no 'Epoch switch ... (took X ms)' line"
        print(f"epoch switch: n/a ({why})")
    if switch["boundary_gap_ms"] and switch["ordinary_step_ms"] is not None:
        print(f"  (the recipe times the new dataloader and LR; the whole gap between the last step of an epoch and "
              f"the first of the next, with the checkpoint save, is median {statistics.median(switch['boundary_gap_ms']):.0f} ms "
              f"against {switch['ordinary_step_ms']:.0f} ms for the step after it)")


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--tune-child"]:
        return tune_child(argv[1], argv[2:])
    args = parse_args(argv)
    print(f"$ {shlex.join([sys.executable, *sys.argv])}", flush=True)
    temporary = args.workdir is None
    args.workdir = Path(tempfile.mkdtemp(prefix="recipe_vs_torchtune_")) if temporary else args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    failed = False
    try:
        args.assets = tiny_assets(args.assets, args.workdir)
        log(f"work directory {args.workdir} (child logs in {args.workdir / 'logs'})")
        figures: dict[str, Any] = {
            "settings": {"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                         "batch_size": args.batch_size, "gradient_accumulation_steps": 1,
                         "seq_len": args.seq_len, "seed": args.seed, "threads": args.threads,
                         "config": CONFIG, "device": "cpu", "dtype": "fp32", "compile": args.compile,
                         "together": args.together},
            "bar_ratio": BAR_RATIO,
        }
        if not args.switch_only:
            measured = throughput_runs(args)
            summary = summarise(args, measured)
            figures.update(summary)
            figures["window_overlaps"] = (window_overlaps(measured["runs"], args.warmup, args.steps)
                                          if args.together else None)
            figures["pair_ratios"] = pair_ratios(measured["runs"]) if args.together else None
            figures["pair_step_ratios"] = (pair_ratios(measured["runs"], "median_step_rate") if args.together
                                           else None)
            failed |= any(row["errors"] for row in summary["rows"])
        switch = None if args.no_switch else switch_run(args)
        figures["epoch_switch"] = switch
        name = ("recipe-vs-torchtune" + ("-compiled" if args.compile else "")
                + ("-together" if args.together else ""))
        with report(name if args.publish else None):
            print(f"{CONFIG}, batch {args.batch_size} x 1, seq {args.seq_len}, fp32, cpu, {args.threads} thread(s), "
                  f"seed {args.seed}" + (", compile=True" if args.compile else "")
                  + (", each repeat's two runs at the same time on their own cores" if args.together else "")
                  + ("" if args.switch_only
                                         else f"; {args.warmup} warm-up + {args.steps} measured steps per run"))
            if not args.switch_only:
                print_table(summary)
                pairs = figures["pair_ratios"]
                if figures["window_overlaps"] and pairs:
                    print(f"measured windows of each pair overlap: "
                          f"{', '.join(f'{100 * share:.0f}%' for share in figures['window_overlaps'])}; "
                          f"ours / stock in each pair, by steps/s: {', '.join(f'{r:.3f}' for r in pairs)} "
                          f"(median {statistics.median(pairs):.3f}x)")
                    steps = figures["pair_step_ratios"]
                    if steps:
                        paired = (statistics.median(pairs), statistics.median(steps))
                        print(f"ours / stock in each pair, by median step time: {', '.join(f'{r:.3f}' for r in steps)}"
                              f" (median {paired[1]:.3f}x); the pairs' medians, {paired[0]:.3f}x by steps/s and "
                              f"{paired[1]:.3f}x by median step time (bar: both >= {BAR_RATIO:g}x): "
                              + ("PASS" if min(paired) >= BAR_RATIO else "FAIL"))
                if summary["dropped_keys"]:
                    print(f"keys of ours' config the stock recipe does not read (left out of its config): "
                          f"{', '.join(summary['dropped_keys'])}")
            print_switch(switch)
        if args.json is not None:
            write_json(args.json, figures)
            print(f"figures written to {args.json}")
    finally:
        if temporary and not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
        elif temporary:
            log(f"kept {args.workdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
