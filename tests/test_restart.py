"""Guard windows and restarts through torchrun: sync points only while a micro batch is unproven; an OOM
or a crash after that restarts the job, which resumes by itself from its own last checkpoint."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from config_edits import modified
from test_oom_recovery import SAMPLES, faulty_run, ok
from torch import nn

from adaptive_batching.config.settings import validate_config
from adaptive_batching.errors import ConfigError
from adaptive_batching.faults import guard as oom_recovery
from adaptive_batching.faults import restart
from adaptive_batching.faults.checkpoints import MARKER
from adaptive_batching.faults.guard import StepGuard
from adaptive_batching.faults.recovery import OomRecovery, SampleCuts
from adaptive_batching.runtime.distributed import ParallelInfo

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---------------------------------------------------------------- windows
def test_the_sync_points_exist_only_inside_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hooks are attached when a window opens and removed by its last step; a 0-step window removes them."""
    monkeypatch.setattr(oom_recovery, "FSDPModule", nn.Linear)  # stand-in for FSDP-wrapped modules
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    guard = StepGuard(ParallelInfo(world_size=2), torch.device("cpu"))
    guard.install(model)
    hooks = lambda: sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model)  # noqa: E731
    assert hooks() == 0 and not guard.protecting
    guard.open_window(3)
    assert hooks() == 6 and guard.protecting
    guard.open_window(3)  # idempotent: a second window attaches nothing more
    assert hooks() == 6
    for _ in range(2):
        guard.step_done()
        assert hooks() == 6
    guard.step_done()
    assert hooks() == 0 and not guard.protecting and guard.window == 0
    guard.step_done()
    assert hooks() == 0
    guard.attach()  # profiling
    assert hooks() == 6
    guard.open_window(0)
    assert hooks() == 0


def test_one_process_is_always_protected_without_sync_points() -> None:
    guard = StepGuard(ParallelInfo(), torch.device("cpu"))
    guard.install(nn.Linear(2, 2))
    guard.open_window(0)
    assert guard.protecting and not guard.synced


@pytest.mark.parametrize("value", [-1, 1.5, "4", True])
def test_guard_steps_must_be_a_non_negative_integer(base_cfg, value) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=r"adaptive_batching\.guard_steps.*an integer >= 0"):
        validate_config(modified(base_cfg, {"adaptive_batching.guard_steps": value}))


# ---------------------------------------------------------------- restart decisions
def complete_checkpoint(output_dir: Path, job: str | None, step: int = 6, name: str = "epoch_1") -> None:
    folder = output_dir / name
    folder.mkdir(parents=True)
    (folder / "recipe_state.pt").write_bytes(b"x")
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"w")
    (folder / MARKER).write_text(
        json.dumps({"complete": True, "global_step": step, "job_id": job, "files": {"recipe_state.pt": 1}})
    )


def test_a_restart_of_this_job_resumes_its_checkpoint(tmp_path: Path) -> None:
    complete_checkpoint(tmp_path, "job-a")
    env = {restart.RESTART_COUNT: "1", restart.RUN_ID: "job-a"}
    resume, why = restart.resume_after_restart(tmp_path, env)
    assert resume and "torchrun restart 1 of job job-a" in why and "(optimizer step 6)" in why


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, ""),  # a first start: never resumes by surprise
        ({restart.RESTART_COUNT: "0", restart.RUN_ID: "job-a"}, ""),
        ({restart.RESTART_COUNT: "2", restart.RUN_ID: "job-b"}, "written by job 'job-a', not this job 'job-b'"),
        ({restart.RESTART_COUNT: "1"}, "not this job None"),
    ],
)
def test_a_new_job_or_another_jobs_checkpoint_is_not_resumed(tmp_path: Path, env: dict, expected: str) -> None:
    complete_checkpoint(tmp_path, "job-a")
    resume, why = restart.resume_after_restart(tmp_path, env)
    assert not resume and expected in why


def test_a_restart_resumes_its_own_latest_checkpoint_beside_an_older_jobs_later_one(tmp_path: Path) -> None:
    """Job b reuses job a's folder: a's step-10 checkpoint is later, but b's restart resumes b's step 2."""
    complete_checkpoint(tmp_path, "job-a", step=10, name="epoch_1")
    complete_checkpoint(tmp_path, "job-b", step=2, name="epoch_0")
    resume, why = restart.resume_after_restart(tmp_path, {restart.RESTART_COUNT: "1", restart.RUN_ID: "job-b"})
    assert resume and "epoch_0" in why and "(optimizer step 2)" in why
    from adaptive_batching.faults.checkpoints import latest_complete_checkpoint

    assert latest_complete_checkpoint(tmp_path).name == "epoch_1"
    assert latest_complete_checkpoint(tmp_path, "job-b").name == "epoch_0"


def test_a_restart_without_a_checkpoint_starts_over(tmp_path: Path) -> None:
    resume, why = restart.resume_after_restart(tmp_path, {restart.RESTART_COUNT: "1", restart.RUN_ID: "j"})
    assert not resume and "no complete checkpoint" in why


def test_the_recorded_cut_is_adopted_only_where_it_cuts_deeper(tmp_path: Path) -> None:
    recovery = OomRecovery(SampleCuts(), None)
    recovery.out_of_memory(8, 8)  # cap 4, split 2
    path = restart.record_cut(tmp_path, recovery.state_dict(), step=7)
    recorded = restart.recorded_cut(tmp_path)
    assert recorded is not None and recorded["step"] == 7 and path.name == restart.CUT_FILE
    fresh = OomRecovery(SampleCuts(), None)
    assert fresh.adopt(recorded["recovery"]) and (fresh.split, fresh.oom_cap) == (2, 4)
    deeper = OomRecovery(SampleCuts(), None)
    deeper.out_of_memory(8, 8)
    deeper.out_of_memory(4, 8)  # cap 2
    assert not deeper.adopt(recorded["recovery"]) and deeper.oom_cap == 2
    (tmp_path / restart.CUT_FILE).write_text("{half")
    assert restart.recorded_cut(tmp_path) is None


# ---------------------------------------------------------------- under torchrun
# Two ranks, an OOM outside the window: the restart, and the stop line a job without restarts ends with, are read from
# one run against test_oom_recovery.py's two-rank reference: its
# test_an_oom_outside_the_window_restarts_two_ranks_and_resumes_under_the_cut.


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_one_process_under_torchrun_takes_the_same_restart_path(runs: Path, assets: Path) -> None:
    """``--nproc_per_node 1``: the process group exists, so the window rules and the restart apply too."""
    fault = {"phase": "forward", "from_step": 7, "to_step": 7, "above": 4}
    output = ok(
        faulty_run(
            runs,
            "single",
            fault,
            assets,
            "batch_size=8",
            "save_every_n_steps=2",
            nproc=1,
            timeout=400,
            launcher=["--max-restarts=1"],
        )
    )
    assert "outside the guard window" in output and "torchrun restart 1 of job" in output
    assert "Rank 0: finished at optimizer step 10, micro batch 4" in output
    steps = [s for s in json.loads((runs / "single-rank0.json").read_text()) if s["step"] <= 6]
    steps += json.loads((runs / "single-rank0-restart1.json").read_text())
    for epoch in (0, 1):
        counts = Counter(i for s in steps if s["epoch"] == epoch for i in s["samples"])
        assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}, epoch
