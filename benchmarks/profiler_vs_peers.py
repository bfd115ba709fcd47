#!/usr/bin/env python
"""Our start-up profiler against Lightning's and Accelerate's batch-size finders, on a real memory limit."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import GIB, fmt, largest_fit, log, report, run_logged, tiny_assets, work_dir, write_json

BAR_PERCENT, BAR_STEPS = 97.0, 6
METHODS = ("ours", "lightning", "accelerate", "exhaustive")
ACCELERATE_START = 1024  # Accelerate's starting_batch_size: the user's guess
EXHAUSTIVE_START = 128  # the exhaustive search's first micro batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--room", type=float, default=1.5, help="GiB each child may add above its set-up (default 1.5)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per worst-case sample (default 256)")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this path")
    p.add_argument("--publish", action="store_true", help="write the table into docs/benchmarks.md")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset (default all, as --publish)")
    p.add_argument("--workdir", type=Path, default=None, help="assets, runs and logs (default: a temporary folder)")
    p.add_argument("--epoch-time-cap", type=float, default=150, help="seconds of ours' epoch check (0: all)")
    p.add_argument("--child", choices=METHODS, default=None, help=argparse.SUPPRESS)  # one method in a child
    p.add_argument("--micro-batch", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--pinned", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown or not args.methods:
        p.error(f"--methods takes a comma-separated subset of {', '.join(METHODS)}; got {unknown or 'none'}")
    if args.publish and set(args.methods) != set(METHODS):
        p.error("--publish writes the whole table: leave --methods at its default (all)")
    if args.room <= 0 or args.seq_len < 1:
        p.error("--room and --seq-len must be positive")
    return args


def _vm_size_bytes() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))


def limit_address_space(room_gib: float) -> dict[str, int]:
    """RLIMIT_AS = the current virtual size + room: the same room above every method's own set-up."""
    import resource

    vm = _vm_size_bytes()
    limit = vm + int(room_gib * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return {"vm_size_at_limit": vm, "rlimit_as": limit}


def set_up_run(args: argparse.Namespace, run_name: str) -> tuple[Any, Any, Any]:
    """The run's parts, set up as the recipe sets them up (before its profile), with its config and settings."""
    from adaptive_batching.config.loading import load_config
    from adaptive_batching.config.settings import validate_config
    from adaptive_batching.training.parts import set_up
    from adaptive_batching.training.recipe_table import method_and_objective

    work = args.workdir
    overrides = [
        f"assets_dir={work / 'assets'}",
        f"output_dir={work / ('run_' + run_name)}",
        f"tokenizer.max_seq_len={args.seq_len}",
        "use_maximum_batch_size=True",
        "adaptive_batching.memory_budget=null",
        "adaptive_batching.memory_fraction=1.0",
        "adaptive_batching.safety_margin=0.05",
        "adaptive_batching.reprofile=True",
        f"adaptive_batching.cache_dir={work / 'cache'}",
        "clip_grad_norm=null",
        "lr_scheduler=null",
        "epochs=1",
        "max_steps_per_epoch=null",
    ]
    cfg = load_config("tiny_full", overrides)
    settings = validate_config(cfg)
    return cfg, settings, set_up(cfg, settings, *method_and_objective(cfg, profiled=settings.needs_profile))


def plain_step(parts: Any, micro_batch: int) -> None:
    """One training step on a worst-case batch, as the trainer trains (no measuring); raises on OOM."""
    from adaptive_batching.batching.data import worst_case_batch

    try:
        batch = worst_case_batch(
            parts.collate,
            micro_batch=micro_batch,
            seq_len=parts.seq_len,
            vocab_size=parts.data.tokenizer.vocab_size,
            packed=parts.data.packed,
        )
        _, tokens = parts.runner.forward_backward(batch)
        del batch
        parts.runner.apply_gradients(tokens)
    finally:
        parts.optimizer.zero_grad(set_to_none=True)


def _describe_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"


class EpochTimeCap(Exception):
    """The epoch check ran out of --epoch-time-cap (not a failure: no OOM happened until then)."""


def _epoch_time_cap_reached(signum: int, frame: Any) -> None:
    raise EpochTimeCap()


def child_ours(args: argparse.Namespace) -> dict[str, Any]:
    from adaptive_batching.batching.sampler import epoch_extent
    from adaptive_batching.faults.oom import is_out_of_memory
    from adaptive_batching.training.trainer import Trainer, plan_training

    cfg, settings, parts = set_up_run(args, "ours")
    out: dict[str, Any] = {"limits": (limits := limit_address_space(args.room))}
    t0 = time.perf_counter()
    try:
        result = parts.profiler.find(parts.trial_step)
    except Exception as error:  # report whatever happened
        out.update(wall_s=time.perf_counter() - t0, error=_describe_error(error))
        return out
    out.update(
        wall_s=time.perf_counter() - t0,
        found=result.max_micro_batch,
        chosen=result.micro_batch,
        trial_steps=result.trial_steps,
        estimate=result.estimate,
        profiler_seconds=result.seconds,
        budget_bytes=result.budget_bytes,
        budget_source=result.budget_source,
        bytes_per_sample=result.bytes_per_sample,
        fixed_bytes=result.fixed_bytes,
        trials=[{k: t[k] for k in ("micro_batch", "ok", "phase", "peak_bytes", "seconds")} for t in result.trials],
        vm_after_profile=_vm_size_bytes() - limits["vm_size_at_limit"],
    )
    # The epoch check: one epoch over the real data set at the chosen micro batch, same limit.
    lr, growth = plan_training(cfg, settings, parts, result)
    trainer = Trainer(cfg, parts, lr=lr, growth=growth)
    first = parts.plan.entries[0].shape
    epoch: dict[str, Any] = {
        "micro_batch": first.micro_batch,
        "capped": False,
        "steps_planned": epoch_extent(len(parts.data.dataset), first.global_batch, None)[0],
    }
    if args.epoch_time_cap > 0:
        signal.signal(signal.SIGALRM, _epoch_time_cap_reached)
        signal.setitimer(signal.ITIMER_REAL, args.epoch_time_cap)
    t0 = time.perf_counter()
    try:
        trainer.train()
        epoch.update(ok=True, steps=parts.progress.global_step)
    except EpochTimeCap:
        epoch.update(ok=True, capped=True, steps=parts.progress.global_step)
    except Exception as error:
        epoch.update(
            ok=False, steps=parts.progress.global_step, error=_describe_error(error), oom=is_out_of_memory(error)
        )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    out["epoch"] = dict(epoch, seconds=time.perf_counter() - t0)
    return out


def child_exhaustive(args: argparse.Namespace) -> dict[str, Any]:
    from adaptive_batching.faults.oom import is_out_of_memory

    if args.pinned:  # the allocator settings ours applies at the start of set-up, same place
        from adaptive_batching.runtime import memory

        if not memory.pin_cpu_allocator():
            raise RuntimeError("pin_cpu_allocator() failed in the exhaustive child")
    _, _, parts = set_up_run(args, f"exhaustive_{args.micro_batch}")
    limits = limit_address_space(args.room)
    t0, steps_done = time.perf_counter(), 0
    try:
        for _ in range(2):  # the first step creates the optimizer state
            plain_step(parts, args.micro_batch)
            steps_done += 1
        outcome, error = "ok", None
    except Exception as err:
        outcome, error = ("OOM" if is_out_of_memory(err) else "error"), _describe_error(err)
    return {
        "limits": limits,
        "micro_batch": args.micro_batch,
        "outcome": outcome,
        "error": error,
        "steps_done": steps_done,
        "wall_s": time.perf_counter() - t0,
    }


def observed(
    trials: list[dict[str, Any]],
    micro_batch: int,
    step: Callable[[], None],
    peer: str,
    recognises: Callable[[BaseException], bool],
) -> None:
    """``step()`` recorded in ``trials``; a failure noted with whether the peer calls it an OOM, and re-raised."""
    trial = {"micro_batch": micro_batch, "ok": False}
    trials.append(trial)
    try:
        step()
    except Exception as error:
        trial.update({"error": _describe_error(error), f"{peer}_recognises_oom": recognises(error)})
        raise
    trial["ok"] = True


def oom_recognised(trials: list[dict[str, Any]], peer: str) -> bool | None:
    failures = [t for t in trials if not t["ok"]]
    return all(t.get(f"{peer}_recognises_oom", False) for t in failures) if failures else None


def child_accelerate(args: argparse.Namespace) -> dict[str, Any]:
    from accelerate.utils import find_executable_batch_size
    from accelerate.utils.memory import should_reduce_batch_size

    _, _, parts = set_up_run(args, "accelerate")
    calls: list[dict[str, Any]] = []

    @find_executable_batch_size(starting_batch_size=ACCELERATE_START)
    def search(batch_size: int) -> int:
        observed(calls, batch_size, lambda: plain_step(parts, batch_size), "accelerate", should_reduce_batch_size)
        return batch_size

    out: dict[str, Any] = {"limits": limit_address_space(args.room), "start": ACCELERATE_START, "trials": calls}
    t0 = time.perf_counter()
    try:
        out["found"] = search()
    except Exception as error:
        out["error"] = _describe_error(error)
    out.update(
        wall_s=time.perf_counter() - t0, trial_steps=len(calls), oom_recognised=oom_recognised(calls, "accelerate")
    )
    return out


def child_lightning(args: argparse.Namespace) -> dict[str, Any]:
    import logging
    import warnings

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.tuner import Tuner
    from lightning.pytorch.utilities.memory import is_oom_error
    from torch.utils.data import DataLoader, Dataset
    from torchtune import training

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    _, _, parts = set_up_run(args, "lightning")
    seq_len, vocab = parts.seq_len, parts.data.tokenizer.vocab_size

    class WorstCaseSamples(Dataset):
        """Full-length samples, labels = tokens (every token in the loss), as many as the real data set."""

        def __len__(self) -> int:
            return len(parts.data.dataset)

        def __getitem__(self, index: int) -> dict[str, list[int]]:
            row = torch.randint(0, vocab, (seq_len,), generator=torch.Generator().manual_seed(index)).tolist()
            return {"tokens": row, "labels": list(row)}

    class TunedModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = parts.model
            self.batch_size = 2  # the tuner sets this attribute
            self.automatic_optimization = False  # the trainer's own step; Lightning counts opt.step()
            self.trials: list[dict[str, Any]] = []

        def train_dataloader(self) -> DataLoader:
            return DataLoader(
                WorstCaseSamples(),
                batch_size=self.batch_size,
                shuffle=False,
                collate_fn=parts.collate,
                num_workers=0,
            )

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return parts.optimizer

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            optimizer = self.optimizers()

            def step() -> None:
                # StepRunner.apply_gradients on one rank without clipping, the optimizer step through Lightning
                try:
                    _, tokens = parts.runner.forward_backward(batch)
                    training.scale_grads(self.net, 1 / tokens.clamp(min=1))
                    optimizer.step()
                finally:
                    optimizer.zero_grad(set_to_none=True)

            observed(self.trials, int(batch["tokens"].shape[0]), step, "lightning", is_oom_error)

    module = TunedModule()
    pl_trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(args.workdir / "run_lightning"),
    )
    tuner = Tuner(pl_trainer)
    out: dict[str, Any] = {"limits": limit_address_space(args.room)}
    t0 = time.perf_counter()
    try:
        out["returned"] = tuner.scale_batch_size(module, mode="binsearch")  # documented defaults otherwise
    except Exception as error:
        out["error"] = _describe_error(error)
    out["wall_s"] = time.perf_counter() - t0
    # A trial is steps_per_trial steps at one size; the answer before the margin is the largest size whose steps all
    # ran, below every size that failed.
    sizes: dict[int, bool] = {}
    for step in module.trials:
        sizes[step["micro_batch"]] = sizes.get(step["micro_batch"], True) and step["ok"]
    smallest_failure = min((b for b, ok in sizes.items() if not ok), default=None)
    out["found"] = max(
        (b for b, ok in sizes.items() if ok and (smallest_failure is None or b < smallest_failure)), default=0
    )
    out.update(
        trial_steps=len(module.trials),
        trials=module.trials,
        sizes=[{"micro_batch": b, "ok": ok} for b, ok in sizes.items()],
        oom_recognised=oom_recognised(module.trials, "lightning"),
    )
    return out


def run_child(args: argparse.Namespace) -> int:
    handler = {
        "ours": child_ours,
        "lightning": child_lightning,
        "accelerate": child_accelerate,
        "exhaustive": child_exhaustive,
    }[args.child]
    args.result.write_text(json.dumps(handler(args), indent=2, default=str))
    return 0


def spawn(
    args: argparse.Namespace, method: str, micro_batch: int | None = None, pinned: bool = False
) -> dict[str, Any]:
    """Run one method in a fresh child process; return its result (or how it died)."""
    tag = method + ("_pinned" if pinned else "") + ("" if micro_batch is None else f"_{micro_batch}")
    log_path, result_path = args.workdir / "logs" / f"{tag}.log", args.workdir / "results" / f"{tag}.json"
    result_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.unlink(missing_ok=True)
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        method,
        "--workdir",
        str(args.workdir),
        "--room",
        str(args.room),
        "--seq-len",
        str(args.seq_len),
        "--epoch-time-cap",
        str(args.epoch_time_cap),
        "--result",
        str(result_path),
        *(["--micro-batch", str(micro_batch)] if micro_batch else []),
        *(["--pinned"] if pinned else []),
    ]
    started, code = time.perf_counter(), run_logged(command, log_path)
    elapsed = time.perf_counter() - started
    if code == 0 and result_path.exists():
        return dict(json.loads(result_path.read_text()), child_seconds=elapsed)
    why = "timed out" if code is None else f"exit code {code}"
    tail = " | ".join(log_path.read_text().strip().splitlines()[-3:])[-300:]
    return {"crashed": f"child {why}: {tail}", "child_seconds": elapsed}


def exhaustive_search(args: argparse.Namespace, pinned: bool = False) -> dict[str, Any]:
    """The largest micro batch whose 2 steps run in a fresh child: doubling, then bisection."""
    children: list[dict[str, Any]] = []
    started = time.perf_counter()
    label = "exhaustive (glibc as ours sets it)" if pinned else "exhaustive"

    def fits(b: int, recheck: bool = False) -> bool:
        r = spawn(args, "exhaustive", b, pinned)
        outcome, error = r.get("outcome", "crashed"), r.get("error") or r.get("crashed")
        children.append(
            {
                "micro_batch": b,
                "outcome": outcome,
                "seconds": r["child_seconds"],
                "error": error,
                "steps_done": r.get("steps_done"),
                "recheck": recheck,
            }
        )
        where = f" in step {r['steps_done'] + 1}" if outcome == "OOM" else ""
        log(
            f"  {label}: micro batch {b}: {outcome}{where} ({r['child_seconds']:.1f} s)"
            + (" [re-check]" if recheck else "")
        )
        if outcome not in ("ok", "OOM"):
            raise RuntimeError(f"exhaustive child at micro batch {b} failed: {error}")
        return outcome == "ok"

    (lo, hi, _), seconds = largest_fit(fits, EXHAUSTIVE_START), time.perf_counter() - started
    # Outcomes at the boundary are noisy (address-space layout): run both sides once more and report it.
    recheck = {"max_ok_again": fits(lo, recheck=True) if lo > 0 else None, "above_ok_again": fits(hi, recheck=True)}
    return {
        "true_max": lo,
        "smallest_oom": hi,
        "pinned": pinned,
        "children": children,
        "seconds": seconds,
        "recheck": recheck,
    }


def _pct(found: int | None, true_max: int | None) -> float | None:
    return None if found is None or not true_max else 100.0 * found / true_max


def _trial_list(trials: list[dict[str, Any]], limit: int = 20) -> str:
    marks = [f"{t['micro_batch']}{'' if t['ok'] else '✗'}" for t in trials]
    return " ".join(marks if len(marks) <= limit else marks[:limit] + [f"... (+{len(marks) - limit})"])


def _peer_note(r: dict[str, Any], note: str, missed: str) -> str:
    if "crashed" in r:
        return r["crashed"]
    note = (f"raised {r['error']}; " if r.get("error") else "") + note
    return note + (f"; did NOT recognise the CPU OOM{missed}" if r.get("oom_recognised") is False else "")


def build_rows(results: dict[str, Any], exhaustive: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours (against the true maximum under glibc as it sets it) and the peers (under default glibc)."""
    ours, light, acc = results["ours"], results["lightning"], results["accelerate"]
    if "found" in ours:
        ours_note = (
            f"trains at {ours['chosen']} (5% margin); estimate {ours['estimate']}; trials: "
            f"{_trial_list(ours['trials'])}; set-up set glibc mallopt (true max measured the same way)"
        )
    else:
        ours_note = ours.get("error") or ours.get("crashed", "")
    light_note = (
        f"returns {light.get('returned')} after its margin 0.05; 3 steps per size: "
        f"{_trial_list(light.get('sizes', []))}"
    )
    acc_note = f"start {ACCELERATE_START} (the user's guess), x0.9 per OOM: {_trial_list(acc.get('trials', []))}"
    rows = []
    for method, note, regime, r in (
        ("ours (adaptive_batching profiler)", ours_note, "pinned", ours),
        ("Lightning Tuner.scale_batch_size(binsearch)", _peer_note(light, light_note, ""), "default", light),
        ("Accelerate find_executable_batch_size", _peer_note(acc, acc_note, " (would crash)"), "default", acc),
    ):
        true_max = exhaustive.get(regime, {}).get("true_max")
        rows.append(
            {
                "method": method,
                "note": note,
                "regime": regime,
                "found": r.get("found"),
                "trial_steps": r.get("trial_steps"),
                "wall_s": r.get("wall_s"),
                "true_max": true_max,
                "percent": _pct(r.get("found"), true_max),
            }
        )
    return rows


REGIME_NAMES = {
    "default": "exhaustive: true maximum, default glibc (not compared)",
    "pinned": "exhaustive: true maximum, glibc as ours sets it (not compared)",
}


def _ok_word(ok: bool | None) -> str:
    return "-" if ok is None else ("ok" if ok else "OOM")


def markdown_table(rows: list[dict[str, Any]], exhaustive: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| method | found micro batch | true maximum | found/true (%) | trial steps | wall seconds | notes |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {fmt(r['found'])} | {fmt(r['true_max'])} | {fmt(r['percent'], '.1f')} | "
            f"{fmt(r['trial_steps'])} | {fmt(r['wall_s'], '.1f')} | {r['note']} |"
        )
    for regime, ex in exhaustive.items():
        search, again = [c for c in ex["children"] if not c["recheck"]], ex["recheck"]
        sizes = _trial_list([{"micro_batch": c["micro_batch"], "ok": c["outcome"] == "ok"} for c in search])
        recheck = (
            f"re-check: {ex['true_max']} {_ok_word(again['max_ok_again'])}, "
            f"{ex['smallest_oom']} {_ok_word(again['above_ok_again'])}"
        )
        lines.append(
            f"| {REGIME_NAMES[regime]} | {ex['true_max']} | {ex['true_max']} | 100.0 | "
            f"{len(search)} children x 2 | {ex['seconds']:.1f} | fresh child per size: {sizes}; {recheck} |"
        )
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ours, light, acc = rows
    peer_times = [r["wall_s"] for r in (light, acc) if r["wall_s"] is not None]
    checks = {
        f"found >= {BAR_PERCENT:g}% of true max": ours["percent"] is not None and ours["percent"] >= BAR_PERCENT,
        f"trial steps <= {BAR_STEPS}": ours["trial_steps"] is not None and ours["trial_steps"] <= BAR_STEPS,
        "faster than both peers": (
            ours["wall_s"] is not None and len(peer_times) == 2 and all(ours["wall_s"] < t for t in peer_times)
        ),
    }
    details = [
        f"{fmt(ours['percent'], '.1f')}% ({fmt(ours['found'])} of {ours['true_max']})",
        f"{fmt(ours['trial_steps'])} steps",
        f"{fmt(ours['wall_s'], '.1f')} s vs Lightning {fmt(light['wall_s'], '.1f')} s, "
        f"Accelerate {fmt(acc['wall_s'], '.1f')} s",
    ]
    return {"checks": checks, "detail": dict(zip(checks, details)), "met": all(checks.values())}


def epoch_summary(epoch: dict[str, Any] | None, cap: float) -> str:
    if epoch is None:
        return "epoch at chosen size: not run (the profiler did not finish)"
    where = f"micro batch {epoch['micro_batch']}, real data, same limit"
    if epoch["ok"] and epoch["capped"]:
        return (
            f"epoch at chosen size: no OOM in {epoch['steps']} of {epoch['steps_planned']} steps, "
            f"{epoch['seconds']:.1f} s ({where}); stopped by --epoch-time-cap {cap:g} s: NOT a full epoch"
        )
    if epoch["ok"]:
        return f"epoch at chosen size: ok, {epoch['steps']} steps, {epoch['seconds']:.1f} s ({where})"
    return (
        f"epoch at chosen size: FAILED after {epoch['steps']} of {epoch['steps_planned']} steps "
        f"({'OOM' if epoch.get('oom') else 'error'}; {where}): {epoch['error']}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        return run_child(args)
    command = shlex.join([sys.executable, *sys.argv])
    print(f"$ {command}", flush=True)
    with work_dir(args.workdir, "profiler_vs_peers_") as args.workdir:
        tiny_assets(None, args.workdir)
        log(f"work directory {args.workdir} (child logs in {args.workdir / 'logs'})")
        results: dict[str, Any] = {}
        for method in ("ours", "lightning", "accelerate"):
            if method not in args.methods:
                results[method] = {"crashed": "not run (--methods)"}
                continue
            log(f"running {method} ...")
            r = results[method] = spawn(args, method)
            log(
                f"  {method}: found {r.get('found')} in {r.get('trial_steps')} trial steps, "
                f"{fmt(r.get('wall_s'), '.1f')} s" + (f" [{r['crashed']}]" if "crashed" in r else "")
            )
        ours = results["ours"]
        exhaustive = (
            {r: exhaustive_search(args, pinned=(r == "pinned")) for r in ("default", "pinned")}
            if "exhaustive" in args.methods
            else {}
        )
        rows = build_rows(results, exhaustive)
        bar, epoch = verdict(rows), ours.get("epoch")
        with report("profiler-vs-peers" if args.publish else None):
            print(
                f"\nSet-up: tiny Llama-3 (tiny_full), AdamW, fp32, CPU, worst-case samples of {args.seq_len} tokens "
                f"(all in the loss); each method in a fresh child with RLIMIT_AS = its VmSize after set-up "
                f"+ {args.room:g} GiB. ✗ = that size did not fit (OOM; for ours also: over its budget).\n"
            )
            print(f"{markdown_table(rows, exhaustive)}\n\n{epoch_summary(epoch, args.epoch_time_cap)}")
            if "found" in ours:
                true_max = rows[0]["true_max"]
                fit = (
                    ""
                    if ours.get("bytes_per_sample") is None
                    else f"; fit {ours['fixed_bytes'] / GIB:.3f} GiB + {ours['bytes_per_sample'] / 2**20:.2f} "
                    "MiB/sample"
                )
                print(
                    f"ours: budget {ours['budget_bytes'] / GIB:.3f} GiB ({ours.get('budget_source', '')}){fit}; "
                    f"estimate {ours['estimate']} = {fmt(_pct(ours['estimate'], true_max), '.1f')}% of its true "
                    f"maximum {fmt(true_max)}; profiler's own clock {ours['profiler_seconds']:.1f} s of "
                    f"{ours['wall_s']:.1f} s in profile()"
                )
                if exhaustive:
                    default_max = exhaustive["default"]["true_max"]
                    print(
                        f"ours against the default-glibc true maximum {default_max} (what the peers ran under): "
                        f"{fmt(_pct(ours['found'], default_max), '.1f')}%"
                    )
            print(
                f"\nBar (ours >= {BAR_PERCENT:g}% of the true max, <= {BAR_STEPS} trial steps, faster than both "
                f"peers): {'MET' if bar['met'] else 'NOT MET'}"
            )
            for name, ok in bar["checks"].items():
                print(f"  {'ok  ' if ok else 'MISS'} {name}: {bar['detail'][name]}")

        if args.json is not None:
            write_json(
                args.json,
                {
                    "command": command,
                    "room_gib": args.room,
                    "seq_len": args.seq_len,
                    "accelerate_start": ACCELERATE_START,
                    "epoch_time_cap": args.epoch_time_cap,
                    "rows": rows,
                    "exhaustive": exhaustive,
                    "epoch": epoch,
                    "bar": bar,
                    "raw": results,
                },
            )
            print(f"\nJSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
