#!/usr/bin/env python
"""Chaos: two-rank runs, each hit by one random fault and resumed until done, must train every step once with
the uninterrupted run's losses bit for bit, and every checkpoint must load (docs/fault-tolerance.md).

``--objective`` picks what the runs train, each a shipped tiny config: ``finetune`` (full fine-tuning),
``lora_dpo``, ``full_dpo``, ``kd`` (knowledge distillation) or ``qat`` (LoRA with fake quantization switched on
inside the run, ``fake_quant_after_n_steps`` = a third of the steps); ``all`` runs each in turn."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from common import ROOT, command_line, commit, machine, report, tiny_assets, unclean_exit, write_json

HERE = Path(__file__).resolve()
FAULTY_RUN = HERE.parent / "faulty_run.py"  # the recipe with a fault injected, run as a script
RESULTS = ROOT / "benchmarks" / "results"

KINDS = ("kill9", "agent_sigterm", "worker_sigusr1", "oom", "kill_in_save")
SAMPLES_PER_STEP = 8  # micro batch 2 x accumulation 2 x 2 ranks
FIRST_FAULT_STEP = 6  # after the first guard window (steps 1-4) and the step after it
_STEP = re.compile(r"^Step (\d+) \| .*?loss:(\S+)", re.M)
_WORKER_ERROR = re.compile(r"^\[rank\d+\]: ((?:\w+\.)*\w*(?:Error|Exception|Interrupt)\b.*)$", re.M)
# (command, cwd, env, timeout) -> the finished process; the suite passes one that forks from its warm server
Runner = Callable[[list[str], Path, dict[str, str], int], subprocess.CompletedProcess]


def run_process(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@dataclass(frozen=True)
class Objective:
    """What the runs train: a recipe and its shipped tiny config, with ``overrides`` that keep its steps short."""

    title: str
    recipe: str
    config: str
    overrides: tuple[str, ...] = ()
    samples: int = 64  # the plan's defaults: 2 epochs of 8 steps, a save every 4
    save_every: int = 4


SHORT = ("tokenizer.max_seq_len=96",)  # samples cut to 96 tokens (alpaca: 64 would make two the same)
OBJECTIVES = {
    "finetune": Objective("Full fine-tuning", "adaptive_full_finetune", "tiny_full", samples=240, save_every=5),
    "lora_dpo": Objective("LoRA DPO", "adaptive_lora_dpo", "tiny_lora_dpo", SHORT),
    "full_dpo": Objective("Full DPO", "adaptive_full_dpo", "tiny_full_dpo", SHORT),
    "kd": Objective("Knowledge distillation (LoRA student)", "adaptive_knowledge_distillation", "tiny_kd", SHORT),
    "qat": Objective(
        "QAT (LoRA), fake quantization from a third of the steps on", "adaptive_lora_finetune", "tiny_qat_lora", SHORT
    ),
}


@dataclass(frozen=True)
class Plan:
    """The run every piece belongs to: two epochs of ``samples`` samples (pairs for DPO), a save every
    ``save_every`` steps, training ``objective`` (a key of OBJECTIVES)."""

    samples: int = 240
    save_every: int = 5
    objective: str = "finetune"

    @property
    def steps(self) -> int:
        return 2 * self.samples // SAMPLES_PER_STEP

    @property
    def fake_quant_after(self) -> int | None:
        """QAT: the optimizer steps trained before fake quantization switches on: a third of the run's, rounded up,
        inside the first epoch and off its saves at the default plans, so resumes land on either side."""
        return (self.steps + 2) // 3 if self.objective == "qat" else None

    def overrides(self) -> tuple[str, ...]:
        delayed = () if self.fake_quant_after is None else (f"fake_quant_after_n_steps={self.fake_quant_after}",)
        return (
            "use_maximum_batch_size=False",
            "batch_increase_function=null",
            "batch_size=2",
            "gradient_accumulation_steps=2",
            f"dataset.split=train[:{self.samples}]",
            "epochs=2",
            "max_steps_per_epoch=null",
            f"save_every_n_steps={self.save_every}",
            *OBJECTIVES[self.objective].overrides,
            *delayed,
        )


@dataclass
class Fault:
    kind: str
    step: int
    rank: int
    save_every: int = 5

    def spec(self) -> dict:
        """The fault as benchmarks/faulty_run.py reads it."""
        return {
            "kill9": {"kill_after": self.step, "rank": self.rank},
            "agent_sigterm": {"signal": "SIGTERM", "signal_at": self.step, "to": "parent", "rank": 0},
            "worker_sigusr1": {"signal": "SIGUSR1", "signal_at": self.step, "rank": self.rank},
            "oom": {"phase": "optimizer", "from_step": self.step, "to_step": self.step, "rank": self.rank},
            "kill_in_save": {"kill_in_save": self.step // self.save_every + 1, "rank": 0},
        }[self.kind]

    def describe(self) -> str:
        if self.kind == "kill_in_save":
            save = self.step // self.save_every + 1
            return f"rank 0 killed in save {save} (of step {self.save_every * save})"
        where = "the agent" if self.kind == "agent_sigterm" else f"rank {self.rank}"
        return {
            "kill9": f"SIGKILL to {where}",
            "agent_sigterm": "SIGTERM to the agent",
            "worker_sigusr1": f"SIGUSR1 to {where}",
            "oom": f"OOM in {where}'s optimizer step",
        }[self.kind]


@dataclass
class Outcome:
    pieces: list[int] = field(default_factory=list)  # exit codes
    redone: int = 0
    problems: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # exceptions the workers printed, to say why a run failed
    seconds: float = 0.0

    def verdict(self) -> str:
        return "pass" if not self.problems else "FAIL: " + "; ".join((self.problems + self.errors[:1])[:4])


def launch(
    out: Path, assets: Path, plan: Plan, fault: dict, *extra: str, restarts: int = 0, runner: Runner = run_process
) -> subprocess.CompletedProcess:
    objective = OBJECTIVES[plan.objective]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        f"--max-restarts={restarts}",
        str(FAULTY_RUN),
        json.dumps(fault),
        f"{out}-",
        objective.recipe,
        "--config",
        objective.config,
        f"assets_dir={assets}",
        f"output_dir={out}",
        *plan.overrides(),
        *extra,
    ]
    return runner(cmd, out.parent, dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), 1200)


def reference_losses(out: Path, assets: Path, plan: Plan, runner: Runner = run_process) -> dict[int, str]:
    """The uninterrupted run's loss (as logged) of each step."""
    if (whole := launch(out, assets, plan, {}, runner=runner)).returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{whole.stderr[-3000:]}")
    switch = f"Step {plan.fake_quant_after}: fake quantization on"
    if plan.fake_quant_after is not None and switch not in whole.stdout + whole.stderr:
        raise RuntimeError(f"the uninterrupted run did not say {switch!r}")
    (entries,) = logged(out / "logs")
    return dict(entries)


def logged(log_dir: Path) -> list[list[tuple[int, str]]]:
    """Each log file's (step, loss text) pairs, files in the order they were started."""
    files = sorted(log_dir.glob("log_*.txt"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    return [[(int(s), loss) for s, loss in _STEP.findall(path.read_text())] for path in files]


def checkpoints_load(out: Path) -> str | None:
    """None when every ``epoch_N`` folder is complete and its recipe state and weights load, else why not."""
    import torch
    from safetensors.torch import load_file

    from adaptive_batching.faults import checkpoints

    if checkpoints.latest_complete_checkpoint(out) is None:
        return "no complete checkpoint"
    for folder in sorted(out.glob("epoch_*")):
        if (inspected := checkpoints._inspect(folder))[0] is None:
            return f"{folder.name}: {inspected[1]}"
        torch.load(folder / checkpoints.RECIPE_STATE_FILE, weights_only=False)
        for weights in folder.glob("*.safetensors"):
            load_file(weights)
    return None


def chaos_run(
    fault: Fault, out: Path, assets: Path, plan: Plan, reference: dict[int, str], runner: Runner = run_process
) -> Outcome:
    outcome, start = Outcome(), time.monotonic()
    restarts = 1 if fault.kind in ("kill9", "kill_in_save") else 0
    spec, extra = fault.spec(), ()
    for _ in range(4):
        result = launch(out, assets, plan, spec, *extra, restarts=restarts, runner=runner)
        outcome.pieces.append(result.returncode)
        outcome.errors += [f"piece {len(outcome.pieces)}: {error}" for error in _WORKER_ERROR.findall(result.stderr)]
        for why in (unclean_exit(result), checkpoints_load(out)):
            if why:
                outcome.problems.append(f"piece {len(outcome.pieces)}: {why}")
        if result.returncode == 0:
            break
        spec, extra, restarts = {}, ("resume_from_checkpoint=True",), 0
    else:
        outcome.problems.append("not finished after 4 pieces")
    files = logged(out / "logs")
    kept: list[tuple[int, str]] = []
    for index, entries in enumerate(files):
        resumed_after = files[index + 1][0][0] - 1 if index + 1 < len(files) and files[index + 1] else None
        for step, loss in entries:
            if resumed_after is not None and step > resumed_after:
                outcome.redone += 1
            else:
                kept.append((step, loss))
            if reference.get(step) != loss:
                outcome.problems.append(f"step {step}: loss {loss}, uninterrupted {reference.get(step)}")
    steps = [step for step, _ in kept]
    if steps != list(range(1, plan.steps + 1)):
        missing = sorted(set(range(1, plan.steps + 1)) - set(steps))
        twice = sorted({s for s in steps if steps.count(s) > 1})
        outcome.problems.append(f"steps logged: missing {missing[:6]}, twice {twice[:6]}")
    outcome.seconds = time.monotonic() - start
    return outcome


def draw(rng: random.Random, kinds: list[str], index: int, plan: Plan) -> Fault:
    """Each kind once first, then kinds at random; a step from FIRST_FAULT_STEP to three before the end."""
    kind = kinds[index % len(kinds)] if index < len(kinds) else rng.choice(kinds)
    return Fault(kind, rng.randint(FIRST_FAULT_STEP, plan.steps - 3), rng.randint(0, 1), plan.save_every)


def table(rows: list[dict]) -> str:
    lines = [
        "| run | fault | at step | exit codes of the pieces | steps redone | outcome |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        at = "-" if row["kind"] == "kill_in_save" else row["step"]
        lines.append(
            f"| {row['run']} | {row['fault']} | {at} | {', '.join(map(str, row['pieces']))} | "
            f"{row['redone']} | {row['verdict']} |"
        )
    return "\n".join(lines)


def chaos_runs(plan: Plan, runs: int, seed: int, work: Path, assets: Path) -> list[dict]:
    """``runs`` chaos runs of ``plan`` against one uninterrupted run, faults drawn from ``seed``; a row per run."""
    rng, rows = random.Random(seed), []
    work.mkdir(parents=True, exist_ok=True)
    reference = reference_losses(work / "reference", assets, plan)
    for index in range(runs):
        fault = draw(rng, list(KINDS), index, plan)
        outcome = chaos_run(fault, work / f"run{index}", assets, plan, reference)
        verdict = outcome.verdict()
        rows.append(
            {
                "objective": plan.objective,
                "run": index + 1,
                "fault": fault.describe(),
                "kind": fault.kind,
                "step": fault.step,
                "pieces": outcome.pieces,
                "redone": outcome.redone,
                "verdict": verdict,
                "seconds": round(outcome.seconds, 1),
            }
        )
        print(
            f"{plan.objective} run {index + 1}/{runs}: {fault.describe()} after step {fault.step}: exits "
            f"{outcome.pieces}, {outcome.redone} steps redone, {verdict} ({outcome.seconds:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--objective",
        default="finetune",
        help=f"what the runs train: one of {', '.join(OBJECTIVES)}, several joined by commas, or all",
    )
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples per epoch, 8 per optimizer step (default: the objective's, see OBJECTIVES)",
    )
    parser.add_argument(
        "--save-every", type=int, default=None, help="optimizer steps between saves (default: the objective's)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every run's row here")
    parser.add_argument(
        "--publish",
        action="store_true",
        help="write each objective's table into "
        "docs/fault-tolerance.md and its rows into benchmarks/results/chaos-OBJECTIVE.json",
    )
    args = parser.parse_args()
    names = list(OBJECTIVES) if args.objective == "all" else args.objective.split(",")
    if unknown := [name for name in names if name not in OBJECTIVES]:
        parser.error(f"--objective: {', '.join(unknown)} is not one of {', '.join(OBJECTIVES)} or all")
    plans = [
        Plan(args.samples or OBJECTIVES[name].samples, args.save_every or OBJECTIVES[name].save_every, name)
        for name in names
    ]
    if (short := next((plan for plan in plans if plan.steps < FIRST_FAULT_STEP + 3), None)) is not None:
        parser.error(
            f"--samples: at least {(FIRST_FAULT_STEP + 3) * SAMPLES_PER_STEP // 2} (two epochs of 8 per "
            f"step), not {short.samples}"
        )
    every_row: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        assets = tiny_assets(None, Path(tmp))
        for plan in plans:
            rows = chaos_runs(plan, args.runs, args.seed, Path(tmp) / plan.objective, assets)
            every_row += rows
            objective, passed = OBJECTIVES[plan.objective], sum(row["verdict"] == "pass" for row in rows)
            with report(publish_name(plan.objective) if args.publish else None, "fault-tolerance.md"):
                print(
                    f"{objective.title}: `{objective.recipe}`, config `{objective.config}` with "
                    f"`{' '.join(plan.overrides())}`; {plan.steps} optimizer steps. "
                    f"{passed} of {len(rows)} runs passed."
                )
                print(table(rows))
            if args.publish:
                write_json(
                    RESULTS / f"chaos-{plan.objective}.json",
                    {
                        "command": command_line(),
                        "date": date.today().isoformat(),
                        "commit": commit(),
                        "machine": machine(),
                        "plan": {
                            "samples": plan.samples,
                            "save_every": plan.save_every,
                            "steps": plan.steps,
                            "overrides": plan.overrides(),
                        },
                        "passed": passed,
                        "runs": rows,
                    },
                )
    if args.json:
        args.json.write_text(json.dumps(every_row, indent=2))
    if any(row["verdict"] != "pass" for row in every_row):
        sys.exit(1)


def publish_name(objective: str) -> str:
    """The docs markers of ``objective``'s table: ``chaos`` for fine-tuning (its table came first)."""
    return "chaos" if objective == "finetune" else f"chaos-{objective}"


if __name__ == "__main__":
    main()
