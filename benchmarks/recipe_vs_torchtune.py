#!/usr/bin/env python
"""Our full fine-tune recipe (``--objective dpo``: LoRA DPO; ``kd``: LoRA knowledge distillation; ``vision_full`` and
``vision_lora``: a ``tune cp`` copy of a stock Llama 3.2 Vision config on the tiny vision assets) against torchtune's
stock single-device one: optimizer steps per second, per-step losses, and the epoch switch's cost. What it runs and how
to read it: docs/benchmarks.md (vision: docs/vision.md)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import fmt, log, report, tiny_assets, tune_child, tune_in_child, work_dir, write_json

HERE = Path(__file__).resolve()
BAR_RATIO = 0.99
BATCH, SEQ_LEN, SEED = 8, 256, 0  # seed 0: the stock recipe's sampler always uses 0
SWITCH_EPOCHS, SWITCH_STEPS = (
    3,
    2,
)  # the epoch-switch run: linear_ramp +4 at each epoch; 2 steps: the one after a switch in it
# --objective: (ours, stock, config)
OBJECTIVES = {
    "finetune": ("adaptive_full_finetune", "full_finetune_single_device", "tiny_full"),
    "dpo": ("adaptive_lora_dpo", "lora_dpo_single_device", "tiny_lora_dpo"),
    "kd": ("adaptive_knowledge_distillation", "knowledge_distillation_single_device", "tiny_kd"),
    # the config: torchtune's, copied by ``tune cp`` and pointed at the tiny vision assets (vision_overrides)
    "vision_full": ("adaptive_full_finetune", "full_finetune_single_device", "llama3_2_vision/11B_full_single_device"),
    "vision_lora": ("adaptive_lora_finetune", "lora_finetune_single_device", "llama3_2_vision/11B_lora_single_device"),
}
VISION_SEQ_LEN = 128  # the tiny vision configs' (the tiny model holds 512)
# Where stock's updates differ from ours, the losses are compared at step 1 (before any update) only; the drift after
# it is printed with its cause (docs/distillation.md).
DRIFT = {
    "kd": "stock as it is divides each step's gradients by its tokens again, which AdamW's eps does not ignore; "
    "bit for bit against stock with that division fixed (tests/test_kd.py)"
}
# What a stock recipe requires (or would otherwise turn on) that ours' config does not say, where it reads it.
STOCK_REQUIRED = {
    "optimizer_in_bwd": False,
    "enable_activation_offloading": False,
    "log_peak_memory_stats": False,
    "resume_from_checkpoint": False,
    "compile": False,
}
SWITCH_LINE = re.compile(r"Epoch switch.*?took ([0-9]+(?:\.[0-9]+)?) ?ms")


def figures(payload: Any, step: int) -> dict[str, Any]:
    """What a child records per step beside its time stamp."""
    return {
        key: None if (value := payload.get(logged)) is None else float(value)
        for key, logged in (("loss", "loss"), ("lr", "lr"), ("batch", "micro_batch_size"), ("grad_norm", "grad_norm"))
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps measured per run (default 200)")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps run first and not measured (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each recipe, alternating (default 3)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of every child (default 1)")
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="finetune",
        help="finetune (tiny_full), dpo, kd, vision_full or vision_lora (a stock Llama 3.2 Vision config, tiny assets)",
    )
    p.add_argument(
        "--accumulation",
        type=int,
        default=None,
        help="gradient accumulation steps (default: 1; vision: the stock config's)",
    )
    p.add_argument(
        "--vision-seq-len",
        type=int,
        default=VISION_SEQ_LEN,
        help=f"vision objectives: the texts' tokenizer.max_seq_len (default {VISION_SEQ_LEN})",
    )
    p.add_argument("--no-switch", action="store_true", help="skip the epoch-switch run")
    p.add_argument("--compile", action="store_true", help="both recipes with compile=True")
    p.add_argument("--together", action="store_true", help="each repeat's two runs at once, each on its own core")
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON to this path")
    p.add_argument("--publish", action="store_true", help="write the report into docs/benchmarks.md")
    p.add_argument("--workdir", type=Path, default=None, help="configs, runs and logs (default: a temporary folder)")
    p.add_argument("--assets", type=Path, default=None, help="tiny assets to use (default: written to the workdir)")
    args = p.parse_args(argv)
    if min(args.steps, args.warmup, args.repeats, args.threads, args.accumulation or 1, args.vision_seq_len) < 1:
        p.error("--steps, --warmup, --repeats, --threads, --accumulation and --vision-seq-len must be positive")
    if args.together and len(os.sched_getaffinity(0)) < 2:
        p.error("--together needs 2 cores")
    args.ours, args.stock, args.config = OBJECTIVES[args.objective]
    args.vision = args.objective.startswith("vision")
    args.batch, args.seq_len, args.dtype = (
        (None, args.vision_seq_len, "bf16") if args.vision else (BATCH, SEQ_LEN, "fp32")
    )
    if not args.vision:
        args.accumulation = args.accumulation or 1
    return args


def ours_config(args: argparse.Namespace, output_dir: Path, epochs: int, steps_per_epoch: int) -> dict[str, Any]:
    """The config both recipes start from, with this benchmark's settings, fully resolved."""
    make = vision_config if args.vision else text_config
    return make(args, output_dir, epochs, steps_per_epoch)


def text_config(args: argparse.Namespace, output_dir: Path, epochs: int, steps_per_epoch: int) -> dict[str, Any]:
    """``args.config`` as our recipe reads it, with this benchmark's settings, fully resolved."""
    from omegaconf import OmegaConf

    from adaptive_batching.config.loading import load_config

    cfg = load_config(
        args.config,
        [
            f"assets_dir={args.assets}",
            f"output_dir={output_dir}",
            f"tokenizer.max_seq_len={SEQ_LEN}",
            f"batch_size={BATCH}",
            f"gradient_accumulation_steps={args.accumulation}",
            f"epochs={epochs}",
            f"max_steps_per_epoch={steps_per_epoch}",
            f"seed={SEED}",
            "use_maximum_batch_size=False",
            "device=cpu",
            "dtype=fp32",
            f"compile={args.compile}",
            "log_every_n_steps=1",
        ],
    )
    out = OmegaConf.to_container(cfg, resolve=True)
    out["batch_increase_function"] = None
    if "save_every_n_steps" in out:  # mid-epoch checkpoints: the stock recipe has none
        out["save_every_n_steps"] = None
    out["metric_logger"] = {
        "_component_": "torchtune.training.metric_logging.DiskLogger",
        "log_dir": str(output_dir / "logs"),
    }
    return out


def copy_stock_config(args: argparse.Namespace) -> Path:
    """``tune cp`` of the stock vision config into the work directory, as a user starts from it."""
    copy = args.workdir / "configs" / f"{Path(args.config).name}.yaml"
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.unlink(missing_ok=True)
    tune = [sys.executable, "-c", "from torchtune._cli.tune import main; main()"]
    subprocess.run([*tune, "cp", args.config, str(copy)], check=True, capture_output=True, text=True)
    return copy


def vision_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """What the tiny vision assets change in the stock config (the rest of its keys stay as they are)."""
    assets, lora = args.assets, args.objective == "vision_lora"
    return {
        "model._component_": "adaptive_batching.assets.tiny_vision."
        + ("lora_tiny_llama3_2_vision" if lora else "tiny_llama3_2_vision"),
        "model.image_size": 56,
        "tokenizer.path": str(assets / "tokenizer" / "tokenizer.model"),
        "tokenizer.special_tokens_path": str(assets / "tokenizer" / "special_tokens.json"),
        "tokenizer.image_size": 56,
        "tokenizer.max_seq_len": args.seq_len,
        "checkpointer.checkpoint_dir": str(args.assets / "vision" / "model"),
        "checkpointer.checkpoint_files": ["model.safetensors"],
        "dataset": {
            "_component_": "torchtune.datasets.multimodal.multimodal_chat_dataset",
            "packed": False,
            "source": "json",
            "data_files": str(assets / "vision" / "data" / "vision_tiny.json"),
            "split": "train",
            "image_tag": "<image>",
            "image_dir": str(assets / "vision" / "images"),
        },
        # bitsandbytes' paged 8-bit AdamW needs CUDA: torch's AdamW at the stock LR (the LoRA config's fused one runs)
        **({} if lora else {"optimizer": {"_component_": "torch.optim.AdamW", "lr": 2e-5}}),
    }


def vision_settings(args: argparse.Namespace, output_dir: Path, epochs: int, steps_per_epoch: int) -> dict[str, Any]:
    """This benchmark's settings on the stock vision config (the text runs' in :func:`text_config`)."""
    return {
        "output_dir": str(output_dir),
        "epochs": epochs,
        "max_steps_per_epoch": steps_per_epoch,
        "seed": SEED,
        "device": "cpu",
        "compile": args.compile,
        **({} if args.accumulation is None else {"gradient_accumulation_steps": args.accumulation}),
    }


def vision_config(args: argparse.Namespace, output_dir: Path, epochs: int, steps_per_epoch: int) -> dict[str, Any]:
    """The ``tune cp`` copy of the stock vision config with :func:`vision_overrides` and :func:`vision_settings`;
    ours reads it with a fixed batch (stock_config leaves out the two keys only ours reads)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(args.stock_copy)
    for key, value in {**vision_overrides(args), **vision_settings(args, output_dir, epochs, steps_per_epoch)}.items():
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    out = OmegaConf.to_container(cfg, resolve=True)
    out.update(use_maximum_batch_size=False, batch_increase_function=None)
    return out


def stock_keys(recipe: str) -> set[str]:
    """The top-level keys torchtune's ``recipe`` reads (``cfg.x``, ``cfg.get("x")``), from its source."""
    import torchtune

    source = (Path(torchtune.__file__).parent.parent / "recipes" / f"{recipe}.py").read_text()
    return {a or b for a, b in re.findall(r"\bcfg\.(?:get\(\s*[\"'](\w+)|(?!get\b)(\w+))", source)}


def stock_config(ours: dict[str, Any], recipe: str) -> tuple[dict[str, Any], list[str]]:
    """The stock recipe's config from ours: the keys it reads, plus the ones it requires switched off."""
    keys = stock_keys(recipe)
    out = {k: v for k, v in ours.items() if k in keys}
    out.update({key: value for key, value in STOCK_REQUIRED.items() if key in keys and key not in out})
    if "profiler" in keys:
        out["profiler"] = {
            "_component_": "torchtune.training.setup_torch_profiler",
            "enabled": False,
            "output_dir": str(Path(out["output_dir"]) / "profiling_outputs"),
        }
    return out, sorted(set(ours) - keys)


def run_recipe(
    args: argparse.Namespace, tag: str, recipe: str, cfg: dict[str, Any], cpu: int | None = None
) -> dict[str, Any]:
    """``tune run RECIPE --config <cfg>`` in a fresh child (pinned to core ``cpu`` if given): stamps and output."""
    from omegaconf import OmegaConf

    (config_path := args.workdir / "configs" / f"{tag}.yaml").parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(cfg), config_path)
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    result = tune_in_child(
        HERE,
        ["run", recipe, "--config", str(config_path)],
        args.workdir / "stamps" / f"{tag}.json",
        args.workdir / "logs" / f"{tag}.log",
        threads=args.threads,
        cwd=args.workdir,
        preexec_fn=pin,
    )
    return {"tag": tag, "recipe": recipe, **result}


RATES = ("steps_per_second", "median_step_rate", "cpu_step_rate")


def step_rates(stamps: list[dict[str, Any]], warmup: int, steps: int) -> dict[str, float | None]:
    """The ``steps`` after the first ``warmup``: per second, 1 / their median interval (less sensitive to bursts),
    and per second of the child's CPU time (least touched by load); None when too few steps were logged."""
    if len(stamps) < warmup + steps:
        return dict.fromkeys(RATES)
    times, cpu = ([s[key] for s in stamps[warmup - 1 : warmup + steps]] for key in ("t", "cpu"))
    return {
        "steps_per_second": steps / (times[-1] - times[0]),
        "cpu_step_rate": steps / (cpu[-1] - cpu[0]),
        "median_step_rate": 1.0 / statistics.median(b - a for a, b in zip(times, times[1:])),
    }


def throughput_runs(args: argparse.Namespace) -> dict[str, Any]:
    total = args.warmup + args.steps
    runs: dict[str, list[dict[str, Any]]] = {"stock": [], "ours": []}
    dropped: list[str] = []
    cores = sorted(os.sched_getaffinity(0))[:2]

    def one(i: int, name: str) -> dict[str, Any]:
        nonlocal dropped
        tag = f"{name}_{i + 1}"
        ours = ours_config(args, output_dir := args.workdir / "runs" / tag, epochs=1, steps_per_epoch=total)
        if name == "ours":
            recipe, cfg = args.ours, ours
        else:
            recipe, (cfg, dropped) = args.stock, stock_config(ours, args.stock)
        # together: the two share a time window, each on its own core, the cores swapped every repeat
        cpu = cores[(i + (name == "ours")) % 2] if args.together else None
        log(
            f"run {i + 1}/{args.repeats}: {name} ({recipe}, {total} steps"
            + (f", core {cpu}" if cpu is not None else "")
            + ") ..."
        )
        result = run_recipe(args, tag, recipe, cfg, cpu=cpu)
        result.update(step_rates(result["stamps"], args.warmup, args.steps))
        if result["steps_per_second"] is None and "error" not in result:
            result["error"] = f"only {len(result['stamps'])} steps logged, need {total}"
        sps = result["steps_per_second"]
        log(
            f"  {name}: "
            + (f"{sps:.3f} steps/s" if sps else "no figure")
            + f", child {result['child_seconds']:.1f} s, {result.get('threads', '?')} thread(s)"
            + (f" [{result['error']}]" if "error" in result else "")
        )
        shutil.rmtree(output_dir, ignore_errors=True)  # checkpoints: not needed, and they take space
        return result

    for i in range(args.repeats):
        if args.together:
            with ThreadPoolExecutor(max_workers=2) as pool:
                pair = dict(zip(("stock", "ours"), pool.map(lambda name, i=i: one(i, name), ("stock", "ours"))))
        else:
            # alternate, each first in every other repeat, so that noise hits both alike
            pair = {name: one(i, name) for name in (("stock", "ours") if i % 2 == 0 else ("ours", "stock"))}
        for name, result in pair.items():
            runs[name].append(result)
    return {"runs": runs, "dropped_keys": dropped}


def pair_ratios(runs: dict[str, list[dict[str, Any]]], key: str = "steps_per_second") -> list[float]:
    """ours / stock by ``key`` (steps per second, or ``median_step_rate``), for each repeat in which both ran."""
    return [o[key] / s[key] for o, s in zip(runs["ours"], runs["stock"]) if o[key] and s[key]]


def window_overlaps(runs: dict[str, list[dict[str, Any]]], warmup: int, steps: int) -> list[float]:
    """For each repeat, the share of the shorter measured window the other run's covers (1.0: side by side)."""
    shares = []
    for ours, stock in zip(runs["ours"], runs["stock"]):
        if len(ours["stamps"]) < warmup + steps or len(stock["stamps"]) < warmup + steps:
            continue
        a = (ours["stamps"][warmup - 1]["t"], ours["stamps"][warmup + steps - 1]["t"])
        b = (stock["stamps"][warmup - 1]["t"], stock["stamps"][warmup + steps - 1]["t"])
        common = min(a[1], b[1]) - max(a[0], b[0])
        shares.append(max(common, 0.0) / min(a[1] - a[0], b[1] - b[0]))
    return shares


def loss_check(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """Same batches, same LR schedule? The first runs' per-step losses and LRs, ours vs stock."""
    stock, ours = (next((r for r in runs[name] if r["stamps"]), None) for name in ("stock", "ours"))
    if stock is None or ours is None:
        return None
    out: dict[str, Any] = {}
    for key in ("loss", "lr"):
        a = {s["step"]: s[key] for s in stock["stamps"] if s.get(key) is not None}
        b = {s["step"]: s[key] for s in ours["stamps"] if s.get(key) is not None}
        common = sorted(set(a) & set(b))
        if not common:
            return None
        rel = [abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for k in common]
        out[key] = {
            "steps": len(common),
            "max_abs_diff": max(abs(a[k] - b[k]) for k in common),
            "max_rel_diff": max(rel),
            "first_rel_diff": rel[0],
        }
    return out


def switch_run(args: argparse.Namespace) -> dict[str, Any]:
    """Ours with per-epoch batch growth; the recipe's own 'Epoch switch ... took X ms' lines."""
    tag, function = "ours_switch", {"_component_": "adaptive_batching.growth.linear_ramp", "increment": 4}
    output_dir = args.workdir / "runs" / tag
    cfg = dict(
        ours_config(args, output_dir, epochs=SWITCH_EPOCHS, steps_per_epoch=SWITCH_STEPS),
        batch_increase_function=function,
    )
    log(f"epoch-switch run: ours, {SWITCH_EPOCHS} epochs x {SWITCH_STEPS} steps, batch_increase_function = {function}")
    result = run_recipe(args, tag, args.ours, cfg)
    shutil.rmtree(output_dir, ignore_errors=True)
    lines = [line.strip() for line in result["output"].splitlines() if "Epoch switch" in line]
    took = [float(m.group(1)) for line in lines if (m := SWITCH_LINE.search(line))]
    # Context from the log-call times: the whole gap at an epoch boundary (end-of-epoch checkpoint save,
    # the switch, the first step of the new epoch) against an ordinary step's time.
    t = {s["step"]: s["t"] for s in result["stamps"]}
    boundaries = [e * SWITCH_STEPS for e in range(1, SWITCH_EPOCHS)]
    gaps = [(t[b + 1] - t[b]) * 1e3 for b in boundaries if b in t and b + 1 in t]
    ordinary = [(t[b + 2] - t[b + 1]) * 1e3 for b in boundaries if b + 1 in t and b + 2 in t]  # same batch size
    out = {
        "function": function,
        "boundary_gap_ms": gaps,
        "ordinary_step_ms": statistics.median(ordinary) if ordinary else None,
        "exit_code": result["exit_code"],
        "switch_ms": took,
        "lines": lines[:20],
        "median_ms": statistics.median(took) if took else None,
        "batches": sorted({s["batch"] for s in result["stamps"] if s.get("batch") is not None}),
        "log": result["log"],
    }
    if "error" in result:
        out["error"] = result["error"]
    log(f"  epoch switch: {len(took)} line(s) with a time" + (f" [{out['error']}]" if "error" in out else ""))
    return out


def summarise(args: argparse.Namespace, measured: dict[str, Any]) -> dict[str, Any]:
    """Each recipe's medians over its runs of each of :data:`RATES`, and ours / stock of each."""
    rows = [
        {
            "recipe": f"{name}: {recipe}",
            "steps_measured": args.steps,
            "runs": [r["steps_per_second"] for r in measured["runs"][name]],
            "errors": [r["error"] for r in measured["runs"][name] if "error" in r],
            **{
                key: statistics.median(got) if (got := [r[key] for r in measured["runs"][name] if r.get(key)]) else None
                for key in RATES
            },
        }
        for name, recipe in (("ours", args.ours), ("stock", args.stock))
    ]
    ratios = {key: rows[0][key] / rows[1][key] if rows[0][key] and rows[1][key] else None for key in RATES}
    return {
        "rows": rows,
        "ratio": ratios["steps_per_second"],
        "median_step_ratio": ratios["median_step_rate"],
        "cpu_ratio": ratios["cpu_step_rate"],
        "passed": all((ratios[key] or 0) >= BAR_RATIO for key in RATES[:2]),
        "same_computation": loss_check(measured["runs"]),
        "dropped_keys": measured["dropped_keys"],
    }


def print_table(summary: dict[str, Any], drift: str | None) -> None:
    print(
        "| recipe | steps measured | steps/s (median) | runs (steps/s, in order) | 1 / median step time "
        "| steps per CPU second |"
    )
    print("|---|---:|---:|---|---:|---:|")
    for row in summary["rows"]:
        runs = ", ".join(fmt(v, ".3f") for v in row["runs"])
        print(
            f"| {row['recipe']} | {row['steps_measured']} | {fmt(row['steps_per_second'], '.3f')} | {runs} | "
            f"{fmt(row['median_step_rate'], '.3f')} | {fmt(row['cpu_step_rate'], '.3f')} |"
        )
    for row in summary["rows"]:
        for error in row["errors"]:
            print(f"  {row['recipe']} failed: {error}")
    ratio, verdict = summary["ratio"], "PASS" if summary["passed"] else "FAIL"
    print(
        f"ours / stock = {fmt(ratio, '.3f')}x by steps/s, {fmt(summary.get('median_step_ratio'), '.3f')}x by median "
        f"step time (bar: both >= {BAR_RATIO:g}x): {verdict}; {fmt(summary['cpu_ratio'], '.3f')}x by CPU time"
    )
    check = summary["same_computation"]
    if check is None:
        print("per-step loss and LR, ours vs stock: not compared (no common steps)")
    else:
        loss, lr = check["loss"], check["lr"]
        same = (loss["first_rel_diff"] < 1e-6 if drift else loss["max_rel_diff"] < 1e-4) and lr["max_rel_diff"] < 1e-6
        print(
            f"per-step loss, ours vs stock: max relative diff {loss['max_rel_diff']:.1e}"
            + (f" (step 1, before any update: {loss['first_rel_diff']:.1e}; after it: {drift})" if drift else "")
            + f"; LR: {lr['max_rel_diff']:.1e}; over {loss['steps']} steps ("
            + (
                "same batches, same LR schedule: the same computation"
                if same
                else "NOT the same computation: the figures are not comparable"
            )
            + ")"
        )


def print_switch(switch: dict[str, Any] | None) -> None:
    if switch is None:
        return
    if switch["switch_ms"]:
        times = ", ".join(f"{t:.1f}" for t in switch["switch_ms"])
        print(
            f"epoch switch: median {switch['median_ms']:.1f} ms over {len(switch['switch_ms'])} switches "
            f"({times} ms; micro batches seen: {', '.join(f'{b:g}' for b in switch['batches']) or '-'})"
        )
    else:
        why = switch.get("error") or "the recipe logged no 'Epoch switch ... (took X ms)' line"
        print(f"epoch switch: n/a ({why})")
    if switch["boundary_gap_ms"] and switch["ordinary_step_ms"] is not None:
        print(
            "  (the recipe times the new dataloader and LR; the whole gap between the last step of an epoch and "
            "the first of the next, with the checkpoint save, is median "
            f"{statistics.median(switch['boundary_gap_ms']):.0f} ms "
            f"against {switch['ordinary_step_ms']:.0f} ms for the step after it)"
        )


def prepare_vision(args: argparse.Namespace) -> dict[str, Any]:
    """The ``tune cp`` copy and the stock config's batch (and accumulation,
    unless given); what the tiny assets change in the stock config, for the report."""
    from omegaconf import OmegaConf

    if not (args.assets / "vision" / "model" / "model.safetensors").is_file():
        from adaptive_batching.assets.tiny_vision import write_tiny_vision_assets

        write_tiny_vision_assets(args.assets)
    args.stock_copy = copy_stock_config(args)
    stock = OmegaConf.load(args.stock_copy)
    args.batch = stock.batch_size
    args.accumulation = args.accumulation or stock.gradient_accumulation_steps
    changed = sorted(vision_overrides(args))
    settings = sorted(vision_settings(args, args.workdir, 1, 1))
    return {"copy": str(args.stock_copy), "changed_keys": changed, "settings_keys": settings}


def per_step(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The first runs' loss and gradient norm at each step both logged, ours beside stock."""
    first = {name: next((r for r in runs[name] if r["stamps"]), None) for name in ("ours", "stock")}
    if None in first.values():
        return []
    by_step = {name: {s["step"]: s for s in run["stamps"]} for name, run in first.items()}
    return [
        {
            "step": step,
            **{
                f"{name}_{key}": by_step[name][step].get(key)
                for name in ("ours", "stock")
                for key in ("loss", "grad_norm")
            },
        }
        for step in sorted(set(by_step["ours"]) & set(by_step["stock"]))
    ]


def print_vision(vision: dict[str, Any], steps: list[dict[str, Any]]) -> None:
    print("| step | loss, ours | loss, stock | relative difference | grad norm, ours | grad norm, stock |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in steps:
        ours, stock = row["ours_loss"], row["stock_loss"]
        rel = None if ours is None or stock is None else abs(ours - stock) / max(abs(stock), 1e-12)
        print(
            f"| {row['step']} | {fmt(ours, '.7f')} | {fmt(stock, '.7f')} | {fmt(rel, '.1e')} | "
            f"{fmt(row['ours_grad_norm'], '.6g')} | {fmt(row['stock_grad_norm'], '.6g')} |"
        )
    print(
        f"both recipes read `tune cp`'s copy ({Path(vision['copy']).name}); keys the tiny assets change: "
        f"{', '.join(vision['changed_keys'])}; the benchmark's settings: {', '.join(vision['settings_keys'])}; "
        f"ours adds use_maximum_batch_size=False, batch_increase_function=null (a fixed batch)"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--tune-child"]:
        return tune_child(argv[1], argv[2:], figures, same_adapters=True)
    args = parse_args(argv)
    print(f"$ {shlex.join([sys.executable, *sys.argv])}", flush=True)
    with work_dir(args.workdir, "recipe_vs_torchtune_") as args.workdir:
        args.assets = tiny_assets(args.assets, args.workdir)
        log(f"work directory {args.workdir} (child logs in {args.workdir / 'logs'})")
        vision = prepare_vision(args) if args.vision else None
        figures_ = {
            "settings": {
                "steps": args.steps,
                "warmup": args.warmup,
                "repeats": args.repeats,
                "batch_size": args.batch,
                "gradient_accumulation_steps": args.accumulation,
                "seq_len": args.seq_len,
                "dtype": args.dtype,
                "seed": SEED,
                "threads": args.threads,
                "config": args.config,
                "objective": args.objective,
                "compile": args.compile,
                "together": args.together,
            },
            "bar_ratio": BAR_RATIO,
            "vision": vision,
        }
        measured = throughput_runs(args)
        summary = summarise(args, measured)
        figures_.update(summary)
        runs = measured["runs"]
        figures_["per_step"] = per_step(runs)
        figures_["window_overlaps"] = window_overlaps(runs, args.warmup, args.steps) if args.together else None
        figures_["pair_ratios"], figures_["pair_step_ratios"], figures_["pair_cpu_ratios"] = (
            pair_ratios(runs, key) for key in RATES
        )
        switch = figures_["epoch_switch"] = None if args.no_switch else switch_run(args)
    name = (
        "recipe-vs-torchtune"
        + ("" if args.objective == "finetune" else f"-{args.objective}")
        + ("-compiled" if args.compile else "")
        + ("-together" if args.together else "")
    )
    with report(name if args.publish else None):
        print(
            f"{args.config}, batch {args.batch} x {args.accumulation}, seq {args.seq_len}, {args.dtype}, cpu, "
            f"{args.threads} thread(s), seed {SEED}"
            + (", compile=True" if args.compile else "")
            + (", each repeat's two runs at the same time on their own cores" if args.together else "")
            + f"; {args.warmup} warm-up + {args.steps} measured steps per run"
        )
        print_table(summary, DRIFT.get(args.objective))
        if vision is not None:
            print_vision(vision, figures_["per_step"])
        pairs, steps = figures_["pair_ratios"], figures_["pair_step_ratios"]
        if not args.together and pairs:
            print(
                "ours / stock in each repeat (its two runs one after the other), by steps/s, median step time and "
                "CPU time: "
                + "; ".join(
                    ", ".join(f"{r:.3f}" for r in ratios) for ratios in (pairs, steps, figures_["pair_cpu_ratios"])
                )
            )
        if figures_["window_overlaps"] and pairs and steps:
            print(
                f"measured windows of each pair overlap: "
                f"{', '.join(f'{100 * share:.0f}%' for share in figures_['window_overlaps'])}; "
                f"ours / stock in each pair, by steps/s: {', '.join(f'{r:.3f}' for r in pairs)} "
                f"(median {statistics.median(pairs):.3f}x)"
            )
            paired = (statistics.median(pairs), statistics.median(steps))
            print(
                f"ours / stock in each pair, by median step time: {', '.join(f'{r:.3f}' for r in steps)}"
                f" (median {paired[1]:.3f}x); the pairs' medians, {paired[0]:.3f}x by steps/s and "
                f"{paired[1]:.3f}x by median step time (bar: both >= {BAR_RATIO:g}x): "
                + ("PASS" if min(paired) >= BAR_RATIO else "FAIL")
            )
        if summary["dropped_keys"]:
            print(
                f"keys of ours' config the stock recipe does not read (left out of its config): "
                f"{', '.join(summary['dropped_keys'])}"
            )
        print_switch(switch)
    if args.json is not None:
        write_json(args.json, figures_)
        print(f"figures written to {args.json}")
    return 1 if any(row["errors"] for row in summary["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
