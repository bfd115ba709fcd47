"""``benchmarks/chaos.py`` at its smallest: one two-rank run per fault kind, 12 optimizer steps with a save every
3, each resumed until done, checked as the benchmark checks its 20 runs of 60 steps: every step logged exactly
once, every loss bit for bit the uninterrupted run's, every checkpoint loadable after each piece.

The runs fork from the suite's warm server (torchrun and its agent as they are, the workers forked instead of
started); ``python benchmarks/chaos.py`` runs the same code with fresh interpreters.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_runs import run_command

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "chaos.py"
sys.path.insert(0, str(_PATH.parent))  # its siblings (common, doc_tables), as running the script puts them there
_SPEC = importlib.util.spec_from_file_location("chaos", _PATH)
chaos = importlib.util.module_from_spec(_SPEC)
sys.modules["chaos"] = chaos  # dataclasses look their module up there
_SPEC.loader.exec_module(chaos)

pytestmark = [pytest.mark.e2e, pytest.mark.multiprocess]
PLAN = chaos.Plan(samples=48, save_every=3)  # 2 epochs of 6 steps


def forked(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    return run_command("module", cmd[2:], cwd=cwd, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def reference(assets: Path, runs: Path) -> dict[int, str]:
    return chaos.reference_losses(runs / "reference", assets, PLAN, runner=forked)


def test_the_plan_is_small_and_the_uninterrupted_run_logs_each_step_once(reference: dict[int, str]) -> None:
    assert PLAN.steps == 12 and sorted(reference) == list(range(1, 13))


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
    if fault.kind in ("agent_sigterm", "worker_sigusr1"):
        # the workers save and exit 75, the agent then exits 1 (docs/preemption.md); the resumed piece ends the run
        assert outcome.pieces == [1, 0]
    else:
        assert outcome.pieces == [0]  # restarted by torchrun, or the OOM retried in place
    if fault.kind == "kill9":
        assert outcome.redone >= 1  # the steps after the last save trained again, with the same losses
