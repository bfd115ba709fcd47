#!/usr/bin/env python
"""How long ``adaptive-batching estimate`` takes, layer extrapolation against the full trace (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common import GIB, publish, run_checked

HERE = Path(__file__).resolve()
CONFIGS = HERE.parents[1] / "configs"
MODELS = {"tiny": ("tiny_full", ["model.max_seq_len={seq_len}"]),  # name: (config, model-specific overrides)
          "llama3_2_1b": ("llama3_2_1b", []), "llama3_8b": ("llama3_8b", [])}
COMMON = ["tokenizer.max_seq_len={seq_len}", "dtype=bf16", "enable_activation_checkpointing=True",
          "optimizer._component_=torch.optim.AdamW"]
METHODS = {"fast": False, "full": True}  # method: exact
DEVICE_MEMORY = "80GiB"


def child(model: str, method: str, seq_len: int, out: str) -> None:
    """One estimate in this process; its result, times and probes go to ``out`` as JSON."""
    from adaptive_batching.config.loading import load_config
    from adaptive_batching.estimate.prediction import predict, trace_steps
    from adaptive_batching.training.methods import method_for
    from adaptive_batching.units import parse_bytes

    config, extra = MODELS[model]
    overrides = [o.format(seq_len=seq_len) for o in (*COMMON, *extra)]
    local = CONFIGS / f"{config}.yaml"
    cfg = load_config(str(local) if local.is_file() else config, overrides)
    wall, cpu = time.perf_counter(), time.process_time()
    trace = trace_steps(cfg, method_for(cfg), seq_len=seq_len, exact=METHODS[method])
    steps = dict(trace.probes)  # and every step the verification measures at one rank
    if trace.measure is not None:
        measure = trace.measure

        def recorded(micro_batch: int, ranks: int = 1) -> Any:
            memory = measure(micro_batch, ranks)
            if ranks == 1:
                steps[micro_batch] = memory
            return memory

        trace = dataclasses.replace(trace, measure=recorded)
    estimate = predict(trace, device_memory_bytes=parse_bytes(DEVICE_MEMORY))
    Path(out).write_text(json.dumps({
        "estimate": estimate.to_dict(), "estimate_wall_s": time.perf_counter() - wall,
        "estimate_cpu_s": time.process_time() - cpu, "probes": sorted(trace.probes),
        "steps": {str(b): vars(m) for b, m in sorted(steps.items())}, "overrides": overrides}, indent=2))


def run(model: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    out = args.out_dir / f"estimate_speed_{model}_{method}.json"
    started = time.perf_counter()
    run_checked([sys.executable, str(HERE), "--child", model, method, str(args.seq_len), str(out)],
                f"{model} {method}", env=dict(os.environ, OMP_NUM_THREADS="1"))
    result = json.loads(out.read_text())
    out.unlink()
    return dict(result, model=model, method=method, process_wall_s=time.perf_counter() - started)


def _step_peak(row: dict[str, Any], micro_batch: int) -> int:
    """A measured step's forward/backward peak once the optimizer state exists (as the fit sees it)."""
    return row["steps"][str(micro_batch)]["steady_bytes"] + row["steps"][str(micro_batch)]["activation_bytes"]


def compare(rows: list[dict[str, Any]]) -> None:
    """Add, to each row, its step peak at its answer and its largest difference to the full trace."""
    full = {r["model"]: r for r in rows if r["method"] == "full"}
    for row in rows:
        answer = row["estimate"]["max_micro_batch"]
        if str(answer) in row["steps"]:
            row["step_peak_at_answer_bytes"] = _step_peak(row, answer)
        reference = full.get(row["model"])
        if reference is None:
            continue
        shared = sorted(set(row["steps"]) & set(reference["steps"]), key=int)
        row["compared_micro_batches"] = [int(b) for b in shared]
        row["max_peak_vs_full"] = max(
            (abs(_step_peak(row, int(b)) - _step_peak(reference, int(b))) / _step_peak(reference, int(b))
             for b in shared), default=None)
        row["same_micro_batch"] = answer == reference["estimate"]["max_micro_batch"]


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"{args.seq_len}-token samples, bf16, AdamW, activation checkpointing, {DEVICE_MEMORY} x 0.9, "
             f"1 rank; {os.cpu_count()} CPU cores, torch {torch.__version__}", "",
             "| model | layers traced | method | fit predicts | verified micro batch | step peak there | fake steps "
             "| vs full trace (micro batches) | estimate wall s | estimate CPU s | process wall s |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        e, peak, vs = r["estimate"], r.get("step_peak_at_answer_bytes"), r.get("max_peak_vs_full")
        compared = ", ".join(str(b) for b in r.get("compared_micro_batches", []))
        lines.append(
            f"| {r['model']} | {e['traced_layers']} of {e['num_layers']} | {e['method']} | {e['fit_micro_batch']} "
            f"| {e['max_micro_batch']} | {'-' if peak is None else f'{peak / GIB:.2f} GiB'} | {len(r['steps'])} "
            f"| {'-' if vs is None else f'max {vs:.3%} ({compared})'} "
            f"| {r['estimate_wall_s']:.1f} | {r['estimate_cpu_s']:.1f} | {r['process_wall_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--methods", default="fast,full", help="comma-separated, of fast, full")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--out-dir", type=Path, default=Path("."))
    p.add_argument("--publish", action="store_true", help="write the table into docs/benchmarks.md")
    args = p.parse_args()
    models, methods = ([m for m in arg.split(",") if m] for arg in (args.models, args.methods))
    unknown = [m for m in models if m not in MODELS] + [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown --models/--methods entries {unknown}; models: {list(MODELS)}, methods: {list(METHODS)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for model, method in ((a, b) for a in models for b in methods):
        rows.append(r := run(model, method, args))
        print(f"{model} {method}: micro batch {r['estimate']['max_micro_batch']} "
              f"(fit {r['estimate']['fit_micro_batch']}), "
              f"{r['estimate_wall_s']:.1f} s wall, {r['estimate_cpu_s']:.1f} s CPU", flush=True)
    compare(rows)
    table = markdown(rows, args)
    print("\n" + table)
    (args.out_dir / "estimate_speed.md").write_text(table)
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "device_memory": DEVICE_MEMORY,
            "seq_len": args.seq_len}
    (args.out_dir / "estimate_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"written: {args.out_dir / 'estimate_speed.md'}, {args.out_dir / 'estimate_speed.json'}")
    if args.publish:
        print(f"written to {publish('benchmarks.md', 'estimate-speed', table)}")


if __name__ == "__main__":
    main()
