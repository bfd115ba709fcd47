"""``benchmarks/chaos.py`` at its smallest: one two-rank run per fault kind, 12 optimizer steps with a save every
3, each resumed until done, checked as the benchmark checks its 20 runs of 60 steps: every step logged exactly
once, every loss bit for bit the uninterrupted run's, every checkpoint loadable after each piece. The same runs
carry the two-rank checks of the stop lines (the ranks agree on one step), of a torchrun restart after a kill
(every sample once per epoch), and, against the same uninterrupted run, a killed agent's workers stopping.

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
from pathlib import Path

import pytest
from recipe_runs import run_command
from test_oom_recovery import ok

from adaptive_batching.faults import checkpoints

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "chaos.py"
sys.path.insert(0, str(_PATH.parent))  # its siblings (common, doc_tables), as running the script puts them there
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
    lags = [int(stop) - int(seen) for seen, stop in re.findall(
        r"received by the end of optimizer step (\d+); stopped after optimizer step (\d+)", result.stderr)]
    return stops, lags


def samples_once_per_epoch(runs: Path, name: str, resumed_from: int) -> None:
    """Each rank's finished steps (the first attempt's up to the checkpoint resumed from, then the torchrun
    restart's) trained every sample exactly once per epoch."""
    steps = []
    for rank in (0, 1):
        first = json.loads((runs / f"{name}-rank{rank}.json").read_text())
        again = json.loads((runs / f"{name}-rank{rank}-restart1.json").read_text())
        steps += [s for s in first if s["step"] <= resumed_from] + again
    for epoch in (0, 1):
        counts = Counter(i for s in steps if s["epoch"] == epoch for i in s["samples"])
        assert sorted(counts) == list(range(PLAN.samples)) and set(counts.values()) == {1}, epoch


# Each kind once, at a step inside the second epoch or across its boundary; the rank that gets it varies.
@pytest.mark.parametrize("fault", [
    chaos.Fault("kill9", 7, 1, PLAN.save_every),
    chaos.Fault("agent_sigterm", 8, 0, PLAN.save_every),
    chaos.Fault("worker_sigusr1", 6, 1, PLAN.save_every),
    chaos.Fault("oom", 9, 0, PLAN.save_every),
    chaos.Fault("kill_in_save", 7, 0, PLAN.save_every),  # the third save, of step 9
], ids=lambda fault: fault.kind)
def test_a_fault_then_resume_trains_every_step_once_with_the_uninterrupted_losses(
        fault, reference: dict[int, str], assets: Path, runs: Path) -> None:
    outcome = chaos.chaos_run(fault, runs / fault.kind, assets, PLAN, reference, runner=forked)
    assert outcome.problems == []
    first = PIECES[fault.kind][0]
    if fault.kind in ("agent_sigterm", "worker_sigusr1"):
        # the workers save and exit 75, the agent then exits 1 (docs/preemption.md); the resumed piece ends the run
        assert outcome.pieces == [1, 0]
        stops, lags = stops_of_ranks(first)
        assert first.stderr.count("stopped after optimizer step") == 2  # both ranks stopped, saying why
    else:
        assert outcome.pieces == [0]  # restarted by torchrun, or the OOM retried in place
    if fault.kind == "agent_sigterm":
        # The agent forwards the signal to both workers, a few steps later here; a worker it reaches after the ranks
        # agreed stops for "a stop signal on another rank", at the same step.
        assert len(stops) == 1 and min(stops) >= fault.step and 1 <= len(lags) <= 2 and all(0 <= lag <= 1 for lag in lags)
    if fault.kind == "worker_sigusr1":  # rank 0 stops with rank 1, at the signal's step or the next
        assert len(stops) == 1 and stops <= {fault.step, fault.step + 1} and len(lags) == 1 and lags[0] <= 1
        assert "a stop signal on another rank; stopped after optimizer step" in first.stderr
    if fault.kind == "kill9":
        assert outcome.redone >= 1  # the steps after the last save trained again, with the same losses
        # rank 1 killed after step 7: torchrun restarts both ranks, which resume from the save of step 6 by themselves
        resumed = int(re.search(r"Resuming at .* \(optimizer step (\d+)\)", first.stderr).group(1))
        assert resumed == 6 and "Rank 0: finished at optimizer step 12" in first.stderr
        samples_once_per_epoch(runs, fault.kind, resumed)


def running(stat: str) -> bool:
    """Whether the process whose ``/proc/PID/stat`` read ``stat`` still runs: same pid and start time, not a
    zombie (Linux)."""
    pid, started = stat.split()[0], stat.rsplit(")", 1)[1].split()[19]
    try:
        now = (Path("/proc") / pid / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return now[19] == started and now[0] != "Z"


def test_a_killed_agent_leaves_no_worker_and_the_run_resumes(reference: dict[int, str], assets: Path,
                                                             runs: Path) -> None:
    """SIGKILL to the torchrun agent after step 5: its workers get the parent-death signal, save where they are and
    exit instead of training on as orphans; the resumed run trains every step once, as the uninterrupted one."""
    out = runs / "orphans"
    agent = chaos.launch(out, assets, PLAN, {"signal": "SIGKILL", "signal_at": 5, "to": "parent", "rank": 0},
                         runner=forked)
    assert agent.returncode == -signal.SIGKILL
    workers = [path.read_text() for path in runs.glob("orphans-rank*-attempt0.pid")]
    assert len(workers) == 2
    deadline = time.monotonic() + 60
    while any(map(running, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(running, workers)), "workers outlived their killed agent"
    latest = checkpoints.latest_complete_checkpoint(out)
    assert latest is not None and 5 <= json.loads((latest / checkpoints.MARKER).read_text())["global_step"] < PLAN.steps, \
        "the workers did not stop and save after the agent died"
    ok(chaos.launch(out, assets, PLAN, {}, "resume_from_checkpoint=True", runner=forked))
    logged = [entry for entries in chaos.logged(out / "logs") for entry in entries]
    assert sorted(step for step, _ in logged) == list(range(1, PLAN.steps + 1))  # every step once, none redone
    assert dict(logged) == reference  # the losses, bit for bit as logged
