"""Record what a fixed set of tiny runs does, and compare two recordings (a refactor must not change it).

    python tests/behaviour_record.py record OUT_DIR [--only NAME ...]
    python tests/behaviour_record.py compare BEFORE_DIR AFTER_DIR

Each scenario is a recipe run (or a kill and its resume) on the offline tiny model with fixed batch
sizes (no profiler, whose answer depends on measured memory). A recording keeps, per scenario, every
optimizer step's loss, LR, micro batch and global batch (the metrics log) in ``behaviour.json`` and
the final weights in ``NAME.weights.pt``. ``compare`` prints, per scenario, whether the two are bit
for bit equal, or the largest relative difference, and exits 1 if any exceeds 1e-6.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from recipe_runs import FAULTY_RUN, read_metrics, run_command  # noqa: E402

FIXED = ["use_maximum_batch_size=False", "lr_scheduler.num_warmup_steps=2"]
SAMPLES = 40
KEYS = ("loss", "lr", "micro_batch_size", "max_tokens", "global_batch_size")


def faulty(
    out: Path,
    name: str,
    fault: dict[str, Any],
    assets: Path,
    *overrides: str,
    recipe: str = "adaptive_full_finetune",
    config: str = "tiny_full",
    nproc: int | None = None,
) -> None:
    how = (
        ("script", [])
        if nproc is None
        else ("module", ["torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"])
    )
    argv = [
        *how[1],
        str(FAULTY_RUN),
        json.dumps(fault),
        str(out / f"{name}-"),
        recipe,
        "--config",
        config,
        f"assets_dir={assets}",
        f"output_dir={out / name}",
        *FIXED,
        *overrides,
    ]
    result = run_command(how[0], argv, cwd=out)
    expected_kill = "kill_after" in fault
    if (result.returncode != 0) != expected_kill:
        raise SystemExit(f"{name}: exit {result.returncode}\n{result.stderr[-4000:]}")


def scenarios(out: Path, assets: Path) -> dict[str, Callable[[], Path]]:
    data = f"dataset.split=train[:{SAMPLES}]"
    return {
        "growth": lambda: (
            faulty(out, "growth", {}, assets, "batch_size=4", "epochs=3", "max_steps_per_epoch=5"),
            out / "growth",
        )[1],
        "token_budget": lambda: (
            faulty(
                out,
                "token_budget",
                {},
                assets,
                "batch_increase_function=null",
                "adaptive_batching.max_tokens=512",
                data,
                "epochs=2",
                "max_steps_per_epoch=null",
            ),
            out / "token_budget",
        )[1],
        "lora": lambda: (
            faulty(
                out,
                "lora",
                {},
                assets,
                "batch_increase_function=null",
                "batch_size=4",
                data,
                "epochs=2",
                "max_steps_per_epoch=null",
                recipe="adaptive_lora_finetune",
                config="tiny_lora",
            ),
            out / "lora",
        )[1],
        "oom_grow_back_samples": lambda: (
            faulty(
                out,
                "oom_grow_back_samples",
                {"phase": "forward", "from_step": 2, "to_step": 2, "above": 2},
                assets,
                "batch_increase_function=null",
                "batch_size=4",
                data,
                "epochs=2",
                "max_steps_per_epoch=null",
                "adaptive_batching.oom_grow_back_after=2",
            ),
            out / "oom_grow_back_samples",
        )[1],
        "oom_grow_back_tokens": lambda: (
            faulty(
                out,
                "oom_grow_back_tokens",
                {"phase": "forward", "from_step": 2, "to_step": 2, "above": 1},
                assets,
                "batch_increase_function=null",
                "adaptive_batching.max_tokens=512",
                data,
                "epochs=2",
                "max_steps_per_epoch=null",
                "adaptive_batching.oom_grow_back_after=2",
            ),
            out / "oom_grow_back_tokens",
        )[1],
        "two_ranks": lambda: (
            faulty(
                out,
                "two_ranks",
                {},
                assets,
                "batch_increase_function=null",
                "batch_size=2",
                data,
                "epochs=2",
                "max_steps_per_epoch=null",
                nproc=2,
            ),
            out / "two_ranks",
        )[1],
        "kill_and_resume": lambda: kill_and_resume(out, assets, data),
        "growth_in_epoch": lambda: (
            faulty(
                out,
                "growth_in_epoch",
                {},
                assets,
                "batch_size=2",
                data,
                "epochs=2",
                "max_steps_per_epoch=null",
                "adaptive_batching.growth_interval=3 steps",
                "adaptive_batching.memory_budget=1GiB",
            ),
            out / "growth_in_epoch",
        )[1],
    }


def kill_and_resume(out: Path, assets: Path, data: str) -> Path:
    common = [
        "batch_increase_function=null",
        "batch_size=4",
        data,
        "epochs=2",
        "max_steps_per_epoch=null",
        "save_every_n_steps=2",
    ]
    faulty(out, "kill_and_resume", {"kill_after": 5}, assets, *common)
    faulty(out, "kill_and_resume", {}, assets, *common, "resume_from_checkpoint=True")
    return out / "kill_and_resume"


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    folder = max((p for p in run.glob("epoch_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))
    files = sorted(folder.glob("adapter_model.safetensors")) or sorted(folder.glob("model-*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(path))
    return weights


def record(out: Path, only: list[str]) -> None:
    from adaptive_batching.assets.tiny import write_tiny_assets

    out.mkdir(parents=True, exist_ok=True)
    assets = write_tiny_assets(out / "assets").root
    summary: dict[str, Any] = {}
    for name, run in scenarios(out, assets).items():
        if only and name not in only:
            continue
        shutil.rmtree(out / name, ignore_errors=True)
        folder = run()
        rows = read_metrics(folder / "logs")
        summary[name] = [{"step": r["step"], **{k: r[k] for k in KEYS if k in r}} for r in rows]
        torch.save(final_weights(folder), out / f"{name}.weights.pt")
        print(f"{name}: {len(rows)} steps, final loss {rows[-1]['loss']:.6f}", flush=True)
    (out / "behaviour.json").write_text(json.dumps(summary, indent=1))


def relative(a: float, b: float) -> float:
    return 0.0 if a == b else abs(a - b) / max(abs(a), abs(b), 1e-30)


def compare(before: Path, after: Path) -> int:
    a, b = (json.loads((d / "behaviour.json").read_text()) for d in (before, after))
    worst_all = 0.0
    for name in a:
        if name not in b:
            print(f"{name}: missing after")
            worst_all = float("inf")
            continue
        steps_a, steps_b = a[name], b[name]
        if [s["step"] for s in steps_a] != [s["step"] for s in steps_b]:
            print(f"{name}: different steps")
            worst_all = float("inf")
            continue
        if any(x.keys() != y.keys() for x, y in zip(steps_a, steps_b)):
            print(f"{name}: different metrics")
            worst_all = float("inf")
            continue
        worst = max((relative(x[k], y[k]) for x, y in zip(steps_a, steps_b) for k in x if k != "step"), default=0.0)
        wa, wb = (torch.load(d / f"{name}.weights.pt") for d in (before, after))
        exact = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
        weight_diff = (
            0.0
            if exact
            else max(
                ((wa[k].double() - wb[k].double()).abs().max() / wa[k].double().abs().max().clamp(min=1e-30)).item()
                for k in wa
            )
        )
        worst = max(worst, weight_diff)
        worst_all = max(worst_all, worst)
        verdict = "bit for bit" if worst == 0.0 else f"max relative difference {worst:.2e}"
        print(f"{name}: {len(steps_a)} steps, {verdict}")
    return 0 if worst_all <= 1e-6 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("--only", nargs="*", default=[])
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("before", type=Path)
    cmp_.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        record(args.out, args.only)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
