"""``benchmarks/chaos.py`` at its smallest: two-rank runs of 12 optimizer steps with a save every 3, each resumed
until done, checked as the benchmark checks its 20 runs of 60 steps: every step logged exactly once, every loss bit
for bit the uninterrupted run's, every checkpoint loadable after each piece. Each fault kind is run once, the five
in three runs: an OOM then a kill; a kill inside a save, then SIGUSR1 in the restarted attempt; SIGTERM to the
agent in the resume of a run whose agent was killed. The same runs carry the two-rank checks of the stop lines (the
ranks agree on one step), of a torchrun restart after a kill (every sample once per epoch), and, against the same
uninterrupted run, a killed agent's workers stopping. Each other objective of ``--objective`` (LoRA and full DPO,
KD, QAT switching fake quantization on mid-run) gets one run against its own uninterrupted run: an OOM in the
optimizer step and a kill, resumed by torchrun from a save before the kill.

The runs fork from the suite's warm server (torchrun and its agent as they are, the workers forked instead of
started); ``python benchmarks/chaos.py`` runs the same code with fresh interpreters.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from recipe_runs import run_command, unclean_exit
from test_oom_recovery import ok

from adaptive_batching.faults import checkpoints

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "chaos.py"
_SPEC = importlib.util.spec_from_file_location("chaos", _PATH)
chaos = importlib.util.module_from_spec(_SPEC)
sys.modules["chaos"] = chaos  # dataclasses look their module up there
_SPEC.loader.exec_module(chaos)

pytestmark = [pytest.mark.e2e, pytest.mark.multiprocess]
PLAN = chaos.Plan(samples=48, save_every=3)  # 2 epochs of 6 steps
PIECES: dict[str, list[subprocess.CompletedProcess]] = {}  # each output folder's pieces, in order


def forked(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    """The benchmark's runner, forked from the warm server; keeps each piece's output for the checks below."""
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    result = run_command("module", cmd[2:], cwd=cwd, env=env, timeout=timeout)
    (out,) = [arg.split("=", 1)[1] for arg in cmd if arg.startswith("output_dir=")]
    PIECES.setdefault(Path(out).name, []).append(result)
    return result


@pytest.fixture(scope="module")
def reference(assets: Path, runs: Path) -> dict[int, str]:
    return chaos.reference_losses(runs / "reference", assets, PLAN, runner=forked)


def test_the_plan_is_small_and_the_uninterrupted_run_logs_each_step_once(reference: dict[int, str]) -> None:
    assert PLAN.steps == 12 and sorted(reference) == list(range(1, 13))
    assert "Rank 1: finished at optimizer step 12" in PIECES["reference"][0].stderr  # both ranks trained to the end


def stops_of_ranks(result: subprocess.CompletedProcess) -> tuple[set[int], list[int]]:
    """Under torchrun: the steps the ranks stopped after, and for each rank that received the signal, how many
    steps after the one by whose end it saw it."""
    stops = {int(n) for n in re.findall(r"stopped after optimizer step (\d+)", result.stderr)}
    lags = [
        int(stop) - int(seen)
        for seen, stop in re.findall(
            r"received by the end of optimizer step (\d+); stopped after optimizer step (\d+)", result.stderr
        )
    ]
    return stops, lags


def samples_once_per_epoch(runs: Path, name: str, resumed_from: int, samples: int = PLAN.samples) -> None:
    """Each rank's finished steps (the first attempt's up to the checkpoint resumed from, then the torchrun
    restart's) trained every sample exactly once per epoch."""
    steps = []
    for rank in (0, 1):
        first = json.loads((runs / f"{name}-rank{rank}.json").read_text())
        again = json.loads((runs / f"{name}-rank{rank}-restart1.json").read_text())
        steps += [s for s in first if s["step"] <= resumed_from] + again
    for epoch in (0, 1):
        counts = Counter(i for s in steps if s["epoch"] == epoch for i in s["samples"])
        assert sorted(counts) == list(range(samples)) and set(counts.values()) == {1}, epoch


@dataclass
class Faults(chaos.Fault):
    """Two faults in one run, on one rank: this one (its kind decides torchrun's restarts), then ``then``; a
    torchrun restart runs without the first (benchmarks/faulty_run.py), so ``then`` must come later or in the
    restart."""

    then: chaos.Fault | None = None

    @property
    def kinds(self) -> tuple[str, ...]:
        return (self.kind,) + ((self.then.kind,) if self.then else ())

    def spec(self) -> dict:
        # kill_in_save kills rank 0 whatever the rank (only rank 0 saves); every other kind names this run's rank
        assert self.then is None or self.then.rank == self.rank or self.kind == "kill_in_save", "one rank per run"
        return {**super().spec(), **(self.then.spec() if self.then else {})}


# Each kind once, at a step inside the second epoch or across its boundary; the rank that gets it varies (agent_sigterm:
# in test_a_killed_agent_leaves_no_worker_and_the_run_resumes, the resume of its killed agent's run).
# kill9+oom: rank 0's optimizer step 6 runs out of memory (retried in place, outside the guard window; rank 0 says
# so), then rank 0 is killed after step 8 (before logging it: step 7 is the one logged twice); torchrun restarts both
# ranks from the save of step 6, which holds the retried step.
# kill_in_save+worker_sigusr1: rank 0 is killed inside the second save (of step 6); torchrun restarts both ranks
# from the save of step 3, and in that attempt rank 1 gets SIGUSR1 after step 8: the ranks save and exit 75.
@pytest.mark.parametrize(
    "fault",
    [
        Faults("kill9", 8, 0, PLAN.save_every, then=chaos.Fault("oom", 6, 0, PLAN.save_every)),
        Faults("kill_in_save", 3, 0, PLAN.save_every, then=chaos.Fault("worker_sigusr1", 8, 1, PLAN.save_every)),
    ],
    ids=lambda fault: "+".join(fault.kinds),
)
def test_a_fault_then_resume_trains_every_step_once_with_the_uninterrupted_losses(
    fault: Faults, reference: dict[int, str], assets: Path, runs: Path
) -> None:
    name = "+".join(fault.kinds)
    outcome = chaos.chaos_run(fault, runs / name, assets, PLAN, reference, runner=forked)
    assert outcome.problems == []
    first = PIECES[name][0]
    if "worker_sigusr1" in fault.kinds:
        # the workers save and exit 75, the agent then exits 1 (docs/preemption.md); the resumed piece ends the run
        assert outcome.pieces == [1, 0]
        stops, lags = stops_of_ranks(first)
        assert first.stderr.count("stopped after optimizer step") == 2  # both ranks stopped, saying why
        # rank 0 stops with rank 1, at the signal's step or the next
        step = fault.then.step
        assert len(stops) == 1 and stops <= {step, step + 1} and len(lags) == 1 and lags[0] <= 1
        assert "a stop signal on another rank; stopped after optimizer step" in first.stderr
    else:
        assert outcome.pieces == [0]  # restarted by torchrun, the OOM retried in place before
    if "oom" in fault.kinds:
        assert (
            "Out of memory in the optimizer step of optimizer step 6: memory released, the optimizer step "
            "retried with the same gradients" in first.stdout + first.stderr
        )
    if "kill9" in fault.kinds:
        assert outcome.redone >= 1  # the steps after the last save trained again, with the same losses
        # rank 0 killed after step 8: torchrun restarts both ranks, which resume from the save of step 6 by themselves
        resumed = int(re.search(r"Resuming at .* \(optimizer step (\d+)\)", first.stderr).group(1))
        assert resumed == 6 and "Rank 0: finished at optimizer step 12" in first.stderr
        samples_once_per_epoch(runs, name, resumed)
    if "kill_in_save" in fault.kinds:
        # the save of step 6 was killed before it was marked complete: the restart deletes it and resumes from step 3
        assert re.search(r"Deleting \S+/\.incomplete-epoch_\d+-\d+, a save that a kill interrupted", first.stderr)
        assert re.search(r"torchrun restart 1 of job \S+: resuming from \S+ \(optimizer step 3\)", first.stderr)


# Full DPO once more (LoRA DPO's kill and torchrun restart at 2 ranks: test_dpo_faults; KD's resume bit for bit against
# stock: test_kd; QAT's across the switch of fake quantization: test_qat), on its tiny config as
# the benchmark's --objective runs it, at 12 steps with a save
# every 3: rank 0's optimizer step 5 runs out of memory (retried in place), then rank 0 is killed after step 5,
# before it logs it; torchrun restarts both ranks from the save of step 3, and step 4 is trained and logged again.
OBJECTIVE_PLANS = {name: chaos.Plan(samples=48, save_every=3, objective=name) for name in ("full_dpo",)}


@pytest.mark.parametrize("objective", OBJECTIVE_PLANS)
def test_each_objective_resumes_a_kill_with_the_uninterrupted_losses(objective: str, assets: Path, runs: Path) -> None:
    plan = OBJECTIVE_PLANS[objective]
    reference = chaos.reference_losses(runs / f"reference-{objective}", assets, plan, runner=forked)
    assert sorted(reference) == list(range(1, plan.steps + 1))
    fault = Faults("kill9", 5, 0, plan.save_every, then=chaos.Fault("oom", 5, 0, plan.save_every))
    outcome = chaos.chaos_run(fault, runs / objective, assets, plan, reference, runner=forked)
    assert outcome.problems == [] and outcome.pieces == [0] and outcome.redone == 1  # step 4, trained again
    piece = PIECES[objective][0].stdout + PIECES[objective][0].stderr
    assert (
        "Out of memory in the optimizer step of optimizer step 5: memory released, the optimizer step "
        "retried with the same gradients" in piece
    )
    assert re.search(r"torchrun restart 1 of job \S+: resuming from \S+ \(optimizer step 3\)", piece)
    assert "Rank 0: finished at optimizer step 12" in piece and "Rank 1: finished at optimizer step 12" in piece
    samples_once_per_epoch(runs, objective, 3, plan.samples)


def running(stat: str) -> bool:
    """Whether the process whose ``/proc/PID/stat`` read ``stat`` still runs: same pid and start time, not a
    zombie (Linux)."""
    pid, started = stat.split()[0], stat.rsplit(")", 1)[1].split()[19]
    try:
        now = (Path("/proc") / pid / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return now[19] == started and now[0] != "Z"


def test_a_killed_agent_leaves_no_worker_and_the_run_resumes(
    reference: dict[int, str], assets: Path, runs: Path
) -> None:
    """SIGKILL to the torchrun agent after step 5: its workers get the parent-death signal, save where they are and
    exit instead of training on as orphans. The resume is the benchmark's agent_sigterm run: SIGTERM to its agent two
    steps in, forwarded to both workers, which stop at one step, save and exit 75 (the agent 1). The next resume
    finishes: every step trained once, as the uninterrupted run, and every checkpoint loads after each piece."""
    out = runs / "orphans"
    agent = chaos.launch(
        out, assets, PLAN, {"signal": "SIGKILL", "signal_at": 5, "to": "parent", "rank": 0}, runner=forked
    )
    assert agent.returncode == -signal.SIGKILL
    workers = [path.read_text() for path in runs.glob("orphans-rank*-attempt0.pid")]
    assert len(workers) == 2
    deadline = time.monotonic() + 60
    while any(map(running, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(running, workers)), "workers outlived their killed agent"
    latest = checkpoints.latest_complete_checkpoint(out)
    assert latest is not None, "the workers did not stop and save after the agent died"
    saved = json.loads((latest / checkpoints.MARKER).read_text())["global_step"]
    assert 5 <= saved < PLAN.steps - 3 and chaos.checkpoints_load(out) is None, saved
    sigterm = chaos.Fault("agent_sigterm", saved + 2, 0, PLAN.save_every)
    stopped = chaos.launch(out, assets, PLAN, sigterm.spec(), "resume_from_checkpoint=True", runner=forked)
    assert stopped.returncode == 1 and unclean_exit(stopped) is None, stopped.stderr[-3000:]
    # The agent forwards the signal to both workers, a few steps later here; a worker it reaches after the ranks
    # agreed stops for "a stop signal on another rank", at the same step.
    stops, lags = stops_of_ranks(stopped)
    assert stopped.stderr.count("stopped after optimizer step") == 2  # both ranks stopped, saying why
    assert len(stops) == 1 and min(stops) >= sigterm.step and 1 <= len(lags) <= 2 and all(0 <= lag <= 1 for lag in lags)
    assert chaos.checkpoints_load(out) is None
    ok(chaos.launch(out, assets, PLAN, {}, "resume_from_checkpoint=True", runner=forked))
    assert chaos.checkpoints_load(out) is None
    logged = [entry for entries in chaos.logged(out / "logs") for entry in entries]
    assert sorted(step for step, _ in logged) == list(range(1, PLAN.steps + 1))  # every step once, none redone
    assert dict(logged) == reference  # the losses, bit for bit as logged
