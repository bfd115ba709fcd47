#!/usr/bin/env python
"""Batch-growth strategies compared by real training runs on CPU, at equal samples (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Iterable, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any

from common import fmt, publish, tiny_assets, tune_child, tune_in_child, work_dir

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results"
RECIPE, CONFIG = "adaptive_full_finetune", "tiny_full"
BASE_LR, REFERENCE_BATCH, LARGE_BATCH, WARMUP_SAMPLES = 1e-3, 8, 64, 128
BUDGET, TARGET_AT = "512MiB", 0.8  # the memory budget (never reached); the target: fixed small's loss at 80%
RAMP_EVERY, NOISE_EVERY, SEESAW_EVERY = 32, 16, 8  # optimizer steps per growth period


def common_overrides(args: argparse.Namespace, work: Path) -> list[str]:
    """What every run shares: data, epochs, sequence length, seed, LR rule, memory budget, profile cache."""
    return [
        f"assets_dir={args.assets}",
        f"dataset.split=train[:{args.samples}]",
        f"epochs={args.epochs}",
        "max_steps_per_epoch=null",
        f"tokenizer.max_seq_len={args.seq_len}",
        "seed=0",
        "shuffle=True",
        "use_maximum_batch_size=False",
        "lr_scaling=sqrt",
        f"optimizer.lr={BASE_LR}",
        f"batch_size={REFERENCE_BATCH}",
        "gradient_accumulation_steps=1",
        f"lr_scheduler.num_warmup_steps={WARMUP_SAMPLES // REFERENCE_BATCH}",
        f"adaptive_batching.memory_budget={BUDGET}",
        f"adaptive_batching.cache_dir={work / 'profile_cache'}",
        "adaptive_batching.grow_past_memory=accumulate",
        "log_every_n_steps=1",
    ]


def run_overrides(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each run's own overrides, applied after the common ones."""
    return {
        "fixed small": ["batch_increase_function=null"],
        "fixed large": [
            "batch_increase_function=null",
            f"batch_size={LARGE_BATCH}",
            f"optimizer.lr={BASE_LR * math.sqrt(LARGE_BATCH / REFERENCE_BATCH)!r}",
            f"lr_scheduler.num_warmup_steps={WARMUP_SAMPLES // LARGE_BATCH}",
        ],
        "per-epoch x2": [
            "batch_increase_function._component_=adaptive_batching.growth.geometric",
            "batch_increase_function.factor=2",
            "adaptive_batching.growth_interval=epoch",
        ],
        "linear ramp": [
            "batch_increase_function._component_=adaptive_batching.growth.linear_ramp",
            "~batch_increase_function.factor",
            f"batch_increase_function.increment={REFERENCE_BATCH}",
            "batch_increase_function.start_epoch=1",
            f"adaptive_batching.growth_interval={RAMP_EVERY} steps",
        ],
        "noise scale": [
            "batch_size=4",
            "gradient_accumulation_steps=2",
            "batch_increase_function._component_=adaptive_batching.growth.noise_scale",
            "~batch_increase_function.factor",
            "batch_increase_function.fraction=0.5",
            "batch_increase_function.max_factor=2",
            f"adaptive_batching.growth_interval={NOISE_EVERY} steps",
        ],
        "seesaw": [
            "batch_increase_function._component_=adaptive_batching.growth.seesaw",
            "batch_increase_function.factor=2",
            "batch_increase_function.max_steps=1",
            f"adaptive_batching.growth_interval={SEESAW_EVERY} steps",
        ],
    }


def numbers(payload: Any, step: int) -> dict[str, float]:
    return {k: float(v) for k, v in payload.items() if isinstance(v, (int, float)) or hasattr(v, "item")}


def run_one(args: argparse.Namespace, work: Path, name: str, overrides: list[str]) -> dict[str, Any]:
    tag = name.replace(" ", "_").replace("-", "")
    tune_args = [
        "run",
        RECIPE,
        "--config",
        CONFIG,
        *common_overrides(args, work),
        *overrides,
        f"output_dir={work / tag}",
    ]
    run = tune_in_child(HERE, tune_args, work / f"{tag}.json", work / f"{tag}.log", timeout=3600, cwd=work)
    if run["exit_code"] != 0:
        sys.exit(f"{name} failed (exit {run['exit_code']}); log {run['log']}:\n{run['output'][-4000:]}")
    growth_lines = [
        line for line in split_log_lines(run["output"]) if line.startswith(("Growth period", "Epoch switch"))
    ]
    return {
        "name": name,
        "command": "tune " + shlex.join(tune_args),
        "child_seconds": run["child_seconds"],
        "train_start": run["train_start"],
        "train_end": run["train_end"],
        "rows": run["stamps"],
        "growth_log": growth_lines,
    }


def split_log_lines(text: str) -> list[str]:
    """The log's lines, with tqdm's carriage-return redraws split off (log lines can share one with a bar)."""
    lines: list[str] = []
    for chunk in text.replace("\r", "\n").split("\n"):
        for marker in ("Growth period", "Epoch switch"):
            chunk = chunk[chunk.find(marker) :] if chunk.find(marker) > 0 else chunk
        lines.append(chunk.strip())
    return [line for line in lines if line]


def cumulative(values: Iterable[float]) -> list[float]:
    """The running totals of ``values``, as floats."""
    return list(accumulate(values, initial=0.0))[1:]


def smooth_by_samples(losses: Sequence[float], batches: Sequence[float], window: float) -> list[float | None]:
    """At each step, the sample-weighted mean loss of the last ``window`` samples; None until there are as many."""
    if window <= 0:
        raise ValueError(f"window must be > 0, got {window}")
    if len(losses) != len(batches):
        raise ValueError(f"{len(losses)} losses for {len(batches)} batches")
    out: list[float | None] = []
    for i in range(len(losses)):
        need, total, weighted = window, 0.0, 0.0
        for j in range(i, -1, -1):
            take = min(batches[j], need)
            weighted += losses[j] * take
            total += take
            need -= take
            if need <= 0:
                break
        out.append(weighted / total if need <= 1e-9 else None)
    return out


def value_at_samples(samples: Sequence[float], values: Sequence[float | None], at: float) -> float | None:
    """The value at the first step whose cumulative samples reach ``at`` (None past the end)."""
    return next((v for s, v in zip(samples, values) if s >= at - 1e-9), None)


def first_at_or_below(values: Sequence[float | None], target: float) -> int | None:
    """The 0-based index of the first value at or below ``target`` (None values skipped), or None."""
    return next((i for i, v in enumerate(values) if v is not None and v <= target), None)


def curves(rows: list[dict[str, Any]], window: float) -> tuple[list[float], list[float], list[float | None]]:
    """A run's global batches, cumulative samples and smoothed loss, step by step."""
    batches = [r["global_batch_size"] for r in rows]
    return batches, cumulative(batches), smooth_by_samples([r["loss"] for r in rows], batches, window)


def summarise(run: dict[str, Any], targets: dict[str, float], window: float) -> dict[str, Any]:
    """Steps, samples and seconds to each target; final smoothed loss; totals; noise-scale trace."""
    rows = run["rows"]
    (batches, samples, smooth), start = curves(rows, window), run["train_start"]
    out: dict[str, Any] = {
        "steps": len(rows),
        "samples": samples[-1] if samples else 0,
        "train_seconds": (run["train_end"] or rows[-1]["t"]) - start,
        "final_loss": smooth[-1],
        "to_target": {},
    }
    for label, target in targets.items():
        i = first_at_or_below(smooth, target)
        out["to_target"][label] = (
            None
            if i is None
            else {"target": target, "steps": i + 1, "samples": samples[i], "seconds": rows[i]["t"] - start}
        )
    noise = [(s, r["gradient_noise_scale"]) for s, r in zip(samples, rows) if "gradient_noise_scale" in r]
    out["noise_scale"] = {
        "measured_steps": len(noise),
        "first": noise[0][1] if noise else None,
        "last": noise[-1][1] if noise else None,
        "max": max(v for _, v in noise) if noise else None,
    }
    out["global_batches"] = sorted({int(b) for b in batches[:-1]} | ({int(batches[-1])} if batches else set()))
    return out


def markdown_table(summaries: dict[str, dict[str, Any]], targets: dict[str, float]) -> str:
    (main_label, main), *rest = targets.items()
    head = (
        f"| run | global batch | steps | train time (s) | steps to {main:.3f} | samples to {main:.3f} | "
        f"time to {main:.3f} (s) |"
    )
    extra = "".join(f" steps to {t:.3f} |" for _, t in rest)
    lines = [
        head + extra + " final loss | noise scale (first -> last, max) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(rest) + " ---: | --- |",
    ]
    for name, s in summaries.items():
        hit, batches, ns = s["to_target"][main_label], s["global_batches"], s["noise_scale"]
        span = f"{batches[0]}" if len(batches) == 1 else f"{batches[0]} -> {max(batches)}"
        noise = (
            "not measured"
            if not ns["measured_steps"]
            else f"{ns['first']:.1f} -> {ns['last']:.1f}, max {ns['max']:.1f} ({ns['measured_steps']} steps)"
        )
        cells = [
            name,
            span,
            str(s["steps"]),
            f"{s['train_seconds']:.1f}",
            fmt(hit and hit["steps"], "d", "never"),
            fmt(hit and hit["samples"], ".0f", "never"),
            fmt(hit and hit["seconds"], ".1f", "never"),
        ]
        cells += [fmt(s["to_target"][label] and s["to_target"][label]["steps"], "d", "never") for label, _ in rest]
        cells += [fmt(s["final_loss"], ".3f", "n/a"), noise]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], targets: dict[str, float], window: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 13), sharex=True)
    low = math.inf
    for run in runs:
        rows, (batches, samples, smooth) = run["rows"], curves(run["rows"], window)
        low = min(low, min(v for v in smooth if v is not None))
        (line,) = axes[0].plot(
            [s for s, v in zip(samples, smooth) if v is not None],
            [v for v in smooth if v is not None],
            label=run["name"],
            lw=1.4,
        )
        axes[1].step(samples, batches, where="pre", color=line.get_color(), lw=1.4)
        axes[2].plot(samples, [r["lr"] for r in rows], color=line.get_color(), lw=1.4)
        noise = [(s, r["gradient_noise_scale"]) for s, r in zip(samples, rows) if "gradient_noise_scale" in r]
        if noise:
            axes[3].plot(*zip(*noise), color=line.get_color(), lw=1.4, label=run["name"])
            axes[3].step(
                samples,
                batches,
                where="pre",
                color=line.get_color(),
                lw=0.8,
                ls=":",
                label=f"{run['name']}: its global batch",
            )
    for label, target in targets.items():
        axes[0].axhline(target, color="grey", lw=0.8, ls="--")
        axes[0].annotate(f"target ({label})", (0, target), fontsize=7, color="grey", va="bottom")
    axes[0].set_ylabel(f"training loss\n(mean over the last {window:.0f} samples)")
    axes[0].set_ylim(low - 0.1, low + 2.5)  # the late part, where the runs differ; the early fall is cut off
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("global batch (samples)")
    axes[1].set_yscale("log", base=2)
    axes[2].set_ylabel("learning rate")
    axes[3].set_ylabel("gradient noise scale\n(samples; where measured)")
    axes[3].set_yscale("log")
    if axes[3].has_data():
        axes[3].legend(fontsize=8)
    axes[3].set_xlabel("samples consumed")
    fig.suptitle("Batch-growth strategies at equal samples (tiny Llama-3, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=1024, help="samples per epoch: the first N of the data set")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128, help="tokenizer.max_seq_len (samples are truncated)")
    p.add_argument("--window", type=float, default=256, help="loss smoothing window, in samples")
    p.add_argument("--only", nargs="*", default=None, help="run only these (the fixed-small baseline always runs)")
    p.add_argument("--assets", type=Path, default=None, help="tiny assets (written under --work if absent)")
    p.add_argument("--work", type=Path, default=None, help="keep run outputs here (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--from-json", type=Path, help="no runs: re-analyse and re-plot an earlier growth_runs.json")
    p.add_argument("--publish", action="store_true", help="write the table into docs/benchmarks.md")
    return p.parse_args(argv)


def load_runs(path: Path) -> tuple[str, float, list[dict[str, Any]], dict[str, Any]]:
    """The command, wall time and runs of a growth_runs.json, as :func:`run_one` returns runs (times from 0)."""
    data = json.loads(path.read_text())
    runs = [
        {
            "name": r["name"],
            "command": r["command"],
            "child_seconds": r["child_seconds"],
            "growth_log": r["growth_log"],
            "rows": r["steps"],
            "train_start": 0.0,
            "train_end": data["summaries"][r["name"]]["train_seconds"],
        }
        for r in data["runs"]
    ]
    return data["command"], data["wall_seconds"], runs, data["setup"]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--tune-child"]:
        tune_child(argv[1], argv[2:], numbers)
        return
    args = parse_args(argv)
    if args.from_json is not None:
        command, wall, runs, setup = load_runs(args.from_json)
        report(args, command, wall, runs, work=None, setup=setup)
        return
    command = shlex.join(["python", "benchmarks/growth_runs.py", *argv])
    print(f"$ {command}", flush=True)
    started = time.perf_counter()
    with work_dir(args.work, "growth_runs_") as work:
        args.assets = tiny_assets(args.assets, work)
        runs = []
        for name, overrides in run_overrides(args).items():
            if args.only and name not in args.only and name != "fixed small":
                continue
            runs.append(run := run_one(args, work, name, overrides))
            rows = run["rows"]
            print(
                f"{name}: {len(rows)} steps, {sum(r['global_batch_size'] for r in rows):.0f} samples, "
                f"last loss {rows[-1]['loss']:.4f}, {run['child_seconds']:.1f} s",
                flush=True,
            )
        report(args, command, time.perf_counter() - started, runs, work)


def report(
    args: argparse.Namespace,
    command: str,
    wall: float,
    runs: list[dict[str, Any]],
    work: Path | None,
    setup: dict[str, Any] | None = None,
) -> None:
    """Targets, summaries, the table, the figure and the JSON, from the runs (the first is fixed small)."""
    _, base_samples, base_smooth = curves(runs[0]["rows"], args.window)
    targets = {
        f"fixed small at {int(round(100 * f))}%": value_at_samples(base_samples, base_smooth, f * base_samples[-1])
        for f in (TARGET_AT, 0.5)
    }
    summaries = {run["name"]: summarise(run, targets, args.window) for run in runs}
    table = markdown_table(summaries, targets)
    print("\n" + table)
    print(f"\ntotal wall time {wall:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    plot(runs, targets, args.window, args.out / "growth_runs.png")
    if setup is None:
        setup = {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("out", "work", "from_json")
        }
        setup["assets"] = f"{setup['assets']}: adaptive_batching.assets.tiny.write_tiny_assets (seed 0, 3000 samples)"
    (args.out / "growth_runs.json").write_text(
        json.dumps(
            {
                "command": command,
                "wall_seconds": wall,
                "setup": setup,
                "targets": targets,
                "summaries": summaries,
                "runs": [
                    {
                        "name": r["name"],
                        "command": r["command"].replace(str(work), "<work>") if work else r["command"],
                        "child_seconds": r["child_seconds"],
                        "growth_log": r["growth_log"],
                        "steps": [
                            {k: v for k, v in row.items() if k != "t"} | {"t": row["t"] - r["train_start"]}
                            for row in r["rows"]
                        ],
                    }
                    for r in runs
                ],
            },
            indent=1,
        )
    )
    text = (
        f"Runs: `{command}`, {wall:.0f} s wall time in all ({len(runs)} runs, one after the other).\n\n"
        f"Targets: {', '.join(f'{label}: {t:.3f}' for label, t in targets.items())} (loss smoothed over the "
        f"last {args.window:.0f} samples).\n\n{table}\n"
    )
    (args.out / "growth_runs.md").write_text(text)
    if args.publish:
        print(f"written to {publish('benchmarks.md', 'growth-runs', text)}")
    print(f"wrote {args.out / 'growth_runs.png'}, growth_runs.json, growth_runs.md", flush=True)


if __name__ == "__main__":
    main()
