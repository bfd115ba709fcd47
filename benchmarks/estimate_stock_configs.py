#!/usr/bin/env python
"""``adaptive-batching estimate`` on every full, LoRA, QLoRA, DPO, KD and QAT config torchtune 0.6.1 ships:
docs/estimates.md; with --full-trace, its layer extrapolation against tracing every layer: docs/benchmarks.md."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import time
from pathlib import Path
from typing import Any

from common import GIB, ROOT, in_fork, machine_line, report

PAGE = ROOT / "docs" / "estimates.md"
DEVICES_GIB = (24, 40, 80)
RANKS = (1, 8)
FIDELITY = "## Fidelity against published GPU measurements"  # the section estimate_fidelity.py writes
DPO_RECIPES = ("lora_dpo_single_device", "lora_dpo_distributed", "full_dpo_distributed")
KD_RECIPES = ("knowledge_distillation_single_device", "knowledge_distillation_distributed")
QAT_RECIPES = ("qat_distributed", "qat_lora_finetune_distributed")
FULL_TRACE_GIB = 80  # --full-trace: both methods' answer for one device of this size
METHODS = (("fast", "layer extrapolation"), ("full", "full trace"))  # --full-trace's: key, name


def method_of(cfg: Any) -> str:
    component = str(cfg.model.get("_component_", ""))
    name = component.rsplit(".", 1)[-1]
    dpo = " DPO" if "DPO" in str(cfg.get("loss", {}).get("_component_", "")) else ""
    dpo = " KD" if cfg.get("teacher_model", None) is not None else " QAT" if cfg.get("quantizer", None) else dpo
    if cfg.model.get("use_dora", False):
        return "DoRA" + dpo
    if "qlora" in name or cfg.model.get("quantize_base", False):
        return "QLoRA" + dpo
    return ("LoRA" if "lora" in name else "full") + dpo


def savers(cfg: Any) -> list[str]:
    """The memory savers the config turns on, as the table names them."""
    optimizer = str(cfg.optimizer.get("_component_", ""))
    named = [optimizer.rsplit(".", 1)[-1]] if optimizer.startswith("bitsandbytes.") else []
    return named + [
        name
        for key, name in (
            ("optimizer_in_bwd", "optimizer_in_bwd"),
            ("enable_activation_checkpointing", "activation checkpointing"),
            ("enable_activation_offloading", "activation offloading"),
            ("fsdp_cpu_offload", "fsdp_cpu_offload"),
            ("compile", "compile"),
        )
        if cfg.get(key, False)
    ]


def traced(cfg: Any, seq_len: int, exact: bool = False) -> tuple[Any, Any]:
    """The config's method and its fake steps at ``seq_len`` tokens (``exact``: every layer traced)."""
    from adaptive_batching.estimate.prediction import trace_steps
    from adaptive_batching.training.recipe_table import traced_parts

    inputs, method, objective = traced_parts(cfg)
    return method, trace_steps(inputs, method, objective, seq_len=seq_len, seq_len_source="--seq-len", exact=exact)


def estimate_one(name: str, path: str, seq_len: int) -> dict[str, Any]:
    """``name``'s row, or its one-line reason (run in a child)."""
    from adaptive_batching.config.loading import load_config
    from adaptive_batching.core.nodes import one_line
    from adaptive_batching.estimate.prediction import predict

    row: dict[str, Any] = {"config": name}
    try:
        cfg = load_config(path)
        row.update(model=model_of(cfg), method=method_of(cfg), savers=savers(cfg))
        start = time.perf_counter()
        method, trace = traced(cfg, seq_len)
        estimates = {
            f"{gib}GiB/{ranks}": predict(trace, device_memory_bytes=gib * GIB, world_size=ranks)
            for gib in DEVICES_GIB
            for ranks in RANKS
        }
        row["micro_batch"] = {key: e.max_micro_batch for key, e in estimates.items()}
        paged_out = {
            key: e.max_micro_batch_paged_out for key, e in estimates.items() if e.max_micro_batch_paged_out is not None
        }
        if paged_out:
            row["micro_batch_paged_out"] = paged_out
            row["paged_state_evicted"] = sorted(key for key, e in estimates.items() if e.paged_state_evicted)
        if trace.savers.activation_offloading:
            row["host_gib_per_sample"] = round(estimates["24GiB/1"].host_bytes_per_sample / GIB, 3)
        row.update(seconds=round(time.perf_counter() - start, 1), layers=trace.num_layers)
        row.update(parameters(cfg, method))
    except BaseException as error:  # noqa: BLE001 - every failure becomes the row's reason
        reason = one_line(error).split(" Are you sure")[0][:200]
        row["reason"] = reason
    return row


def model_of(cfg: Any) -> str:
    """The model's builder; for KD the student's, then the teacher's."""
    name = str(cfg.model._component_).rsplit(".", 1)[-1]
    teacher = cfg.get("teacher_model", None)
    return name if teacher is None else f"{name}, teacher {str(teacher._component_).rsplit('.', 1)[-1]}"


def parameters(cfg: Any, method: Any) -> dict[str, int]:
    """Total and trainable parameters of the model as the recipe configures it (built on the meta device)."""
    import torch
    from torchtune import config

    with torch.device("meta"):
        model = config.instantiate(cfg.model)
    method.configure(model)
    return {
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "trainable": int(sum(p.numel() for p in model.parameters() if p.requires_grad)),
    }


def trace_one(path: str, seq_len: int, exact: bool) -> dict[str, Any]:
    """One method's answer for FULL_TRACE_GIB x 1 rank, its seconds, and each one-rank step's peak (in a child)."""
    from adaptive_batching.config.loading import load_config
    from adaptive_batching.estimate.prediction import predict

    cfg = load_config(path)
    wall, cpu = time.perf_counter(), time.process_time()
    _, trace = traced(cfg, seq_len, exact)
    peaks, measure = {}, trace.measure

    def recorded(micro_batch: int, ranks: int = 1) -> Any:
        memory = measure(micro_batch, ranks)
        if ranks == 1:
            peaks[str(micro_batch)] = memory.steady_bytes + memory.activation_bytes
        return memory

    answer = predict(dataclasses.replace(trace, measure=recorded), device_memory_bytes=FULL_TRACE_GIB * GIB)
    return {
        "micro_batch": answer.max_micro_batch,
        "layers": f"{trace.traced_layers} of {trace.num_layers}",
        "wall_s": round(time.perf_counter() - wall, 1),
        "cpu_s": round(time.process_time() - cpu, 1),
        "savers": savers(cfg),
        "peaks": peaks,
    }


def compared(name: str, path: str, seq_len: int, timeout: float) -> dict[str, Any]:
    """``name`` by layer extrapolation and by full trace (a child each); how far their steps' peaks differ."""
    row: dict[str, Any] = {"config": name}
    for key, method in METHODS:
        row[key] = in_fork(trace_one, (path, seq_len, key == "full"), timeout)
        if "reason" in row[key]:
            return row | {"reason": f"{method}: {row[key]['reason']}"}
    fast, full = row["fast"]["peaks"], row["full"]["peaks"]
    row["compared"] = sorted(int(b) for b in set(fast) & set(full))
    row["max_difference"] = max(abs(fast[str(b)] - full[str(b)]) / full[str(b)] for b in row["compared"])
    return row


def run(names: dict[str, Path], seq_len: int, timeout: float, full_trace: bool = False) -> list[dict[str, Any]]:
    rows = []
    for i, (name, path) in enumerate(sorted(names.items()), 1):
        start = time.perf_counter()
        row = (
            compared(name, str(path), seq_len, timeout)
            if full_trace
            else {"config": name, **in_fork(estimate_one, (name, str(path), seq_len), timeout)}
        )
        row["process_seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        said = f"{row.get('micro_batch', row.get('reason'))} ({row.get('seconds', '-')} s)"
        if full_trace and "reason" not in row:
            said = ", ".join(f"{method} {row[key]['micro_batch']} ({row[key]['wall_s']} s)" for key, method in METHODS)
        print(f"[{i}/{len(names)}] {name}: {said}", flush=True)
    return rows


def count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def saver_cell(r: dict[str, Any]) -> str:
    named = list(r.get("savers", []))
    if "host_gib_per_sample" in r:
        named = [
            f"activation offloading ({r['host_gib_per_sample']} GiB host a sample)"
            if n == "activation offloading"
            else n
            for n in named
        ]
    return ", ".join(named) or "-"


def cell(r: dict[str, Any], key: str) -> str:
    """The micro batch; ``3 / 5``: also the one with paged state evicted; ``2 paged``: only evicted fits."""
    mb = r["micro_batch"][key]
    out = r.get("micro_batch_paged_out", {}).get(key)
    if key in r.get("paged_state_evicted", ()):
        return f"{mb} paged"
    return f"{mb}" if out is None or out == mb else f"{mb} / {out}"


def page_head(seq_len: int) -> str:
    """docs/estimates.md's text above its command line (written in the page, kept), at ``seq_len`` tokens."""
    head = PAGE.read_text().split("\nCommand: `", 1)
    if len(head) != 2:
        raise SystemExit(f"{PAGE} has no line 'Command: `...' under its text: nothing to keep above the table")
    return re.sub(r"\b\d+-token samples", f"{seq_len}-token samples", head[0], count=1)


def markdown(rows: list[dict[str, Any]], seq_len: int, command: str) -> str:
    columns = [f"{gib} GiB x{ranks}" for gib in DEVICES_GIB for ranks in RANKS]
    done = [r for r in rows if "micro_batch" in r]
    slowest = max(done, key=lambda r: r["seconds"]) if done else None
    lines = [
        page_head(seq_len),
        machine_line(command),
        "",
        f"{len(done)} of {len(rows)} configs estimated"
        + (f"; the slowest took {slowest['seconds']} s ({slowest['config']})." if slowest else "."),
        "",
        "| config | model | method | parameters (trainable) | memory savers | " + " | ".join(columns) + " | seconds |",
        "| --- | --- | --- | --- | --- | " + " | ".join("---:" for _ in columns) + " | ---: |",
    ]
    for r in rows:
        head = f"| `{r['config']}` | {r.get('model', '-')} | {r.get('method', '-')} | "
        if "micro_batch" in r:
            params = f"{count(r['parameters'])} ({count(r['trainable'])})"
            cells = [cell(r, f"{gib}GiB/{ranks}") for gib in DEVICES_GIB for ranks in RANKS]
            lines.append(head + params + f" | {saver_cell(r)} | " + " | ".join(cells) + f" | {r['seconds']} |")
        else:
            lines.append(
                head
                + f"not estimated: {r['reason'].replace('|', '/')} | {saver_cell(r)} |"
                + " |" * len(columns)
                + " |"
            )
    return "\n".join(lines) + "\n"


def full_trace_table(rows: list[dict[str, Any]], seq_len: int) -> str:
    """--full-trace's rows: each method's answer and seconds, and how far apart their steps' peaks are."""
    lines = [
        f"{seq_len}-token samples, {FULL_TRACE_GIB} GiB x 0.9, 1 rank, as configured; seconds after imports",
        "",
        "| config | memory savers | layers traced | micro batch: layer extrapolation | full trace | seconds, wall "
        "(CPU): layer extrapolation | full trace | largest difference of a step's peak (micro batches) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if "reason" in r:
            lines.append(f"| `{r['config']}` | not compared: {r['reason'].replace('|', '/')} |" + " |" * 6)
            continue
        fast, full, most = r["fast"], r["full"], r["max_difference"]
        lines.append(
            f"| `{r['config']}` | {saver_cell(fast)} | {fast['layers']}; {full['layers']} "
            f"| {fast['micro_batch']} | {full['micro_batch']} | {fast['wall_s']} ({fast['cpu_s']}) "
            f"| {full['wall_s']} ({full['cpu_s']}) | {most:.3%} "
            f"({', '.join(map(str, r['compared']))}) |"
        )
    return "\n".join(lines) + "\n"


ESTIMATED = re.compile(r"^\d+ of \d+ configs estimated", re.MULTILINE)


def merged_page(page: str, rows: list[dict[str, Any]], seq_len: int) -> str:
    """``page`` with ``rows`` in place of the same configs' rows (new ones where they sort), the count redone."""
    new = {line.split("`", 2)[1]: line for line in markdown(rows, seq_len, "").splitlines() if line.startswith("| `")}
    head, tail = (page.split("\n" + FIDELITY, 1) + [""])[:2]
    lines = head.split("\n")
    table = [i for i, line in enumerate(lines) if line.startswith("| `")]
    if not table:
        raise ValueError("the page has no table of configs to merge into")
    kept = {lines[i].split("`", 2)[1]: lines[i] for i in table} | new
    merged = [kept[name] for name in sorted(kept)]
    lines[table[0] : table[-1] + 1] = merged
    done = sum(1 for line in merged if "| not estimated: " not in line)
    text = ESTIMATED.sub(f"{done} of {len(merged)} configs estimated", "\n".join(lines), count=1)
    return text + ("\n" + FIDELITY + tail if tail else "")


def merged_rows(old: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of ``old`` with ``rows`` in place of those of the same configs, in name order."""
    by_name = {r["config"]: r for r in old} | {r["config"]: r for r in rows}
    return [by_name[name] for name in sorted(by_name)]


def unknown_names(only: list[str], names: list[str]) -> list[str]:
    """The ``--only`` names that are neither stock configs nor files, each with the nearest stock name if close."""
    return [
        f"{name!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(name, names, n=1)) else "")
        for name in only
        if name not in names and not Path(name).exists()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--only", nargs="+", default=[], metavar="NAME", help="only these stock configs or files")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for one config's estimate (or trace)")
    parser.add_argument("--markdown", help="the page of every config's table (default docs/estimates.md; not --only)")
    parser.add_argument(
        "--json", help="default benchmarks/results/estimate_stock_configs.json (--full-trace: estimate_full_trace.json)"
    )
    parser.add_argument("--merge", action="store_true", help="with --only: replace those rows in the page and --json")
    parser.add_argument(
        "--full-trace",
        action="store_true",
        help=f"with --only: layer extrapolation against "
        f"tracing every layer, {FULL_TRACE_GIB} GiB x 1 rank (minutes for an 8B model)",
    )
    parser.add_argument("--publish", action="store_true", help="with --full-trace: its table into docs/benchmarks.md")
    args = parser.parse_args()
    args.json = args.json or str(
        ROOT
        / "benchmarks"
        / "results"
        / ("estimate_full_trace.json" if args.full_trace else "estimate_stock_configs.json")
    )
    if args.only and args.markdown is not None:
        parser.exit(
            2,
            "error: --markdown writes the table of every config; with --only the rows go to --json "
            "alone: drop --markdown, or --only to rewrite the page\n",
        )
    if args.merge and not args.only:
        parser.exit(
            2,
            "error: --merge puts the rows of --only into the page and --json; without --only every row "
            "is written: drop --merge\n",
        )
    if args.full_trace and (not args.only or args.merge):
        parser.exit(
            2,
            "error: --full-trace traces every layer of the configs named by --only (minutes for an 8B "
            "model) and writes its own table: give --only NAME..., without --merge\n",
        )
    if args.publish and not args.full_trace:
        parser.exit(2, "error: --publish writes --full-trace's table into docs/benchmarks.md: add --full-trace\n")

    import torchtune  # noqa: F401 - imported once, before the children fork

    from adaptive_batching.config.loading import FINETUNE_RECIPES, stock_configs

    names = stock_configs((*FINETUNE_RECIPES, *DPO_RECIPES, *KD_RECIPES, *QAT_RECIPES))
    unknown = unknown_names(args.only, sorted(names))
    if unknown:
        parser.exit(
            2,
            f"error: --only: not a stock full, LoRA, QLoRA, DPO, KD or QAT config of torchtune: {', '.join(unknown)}\n",
        )
    if args.only:
        names = {n: p for n, p in names.items() if n in args.only} | {n: Path(n) for n in args.only if Path(n).exists()}
    results, page = Path(args.json), Path(args.markdown or ROOT / "docs" / "estimates.md")
    old = json.loads(results.read_text()) if args.merge and results.exists() else {"seq_len": args.seq_len, "rows": []}
    if old["seq_len"] != args.seq_len:
        parser.exit(2, f"error: --merge: {results} holds rows at --seq-len {old['seq_len']}, not {args.seq_len}\n")
    rows = run(names, args.seq_len, args.timeout, args.full_trace)
    merged = merged_rows(old["rows"], rows) if args.merge else rows
    results.write_text(json.dumps({"seq_len": args.seq_len, "rows": merged}, indent=1) + "\n")
    if args.merge:
        page.write_text(merged_page(page.read_text(), rows, args.seq_len))
        print(f"merged into {results} and {page}")
    elif args.full_trace:
        with report("estimate-full-trace" if args.publish else None):
            print(full_trace_table(rows, args.seq_len))
        print(f"wrote {args.json}")
    elif args.only:
        print(f"wrote {args.json}")
    else:
        kept = page.read_text().split("\n" + FIDELITY, 1) if page.exists() else [""]
        tail = "\n" + FIDELITY + kept[1] if len(kept) == 2 else ""  # estimate_fidelity.py's section stays
        command = f"python benchmarks/estimate_stock_configs.py --seq-len {args.seq_len}"
        page.write_text(markdown(rows, args.seq_len, command) + tail)
        print(f"wrote {args.json} and {args.markdown or page}")


if __name__ == "__main__":
    main()
