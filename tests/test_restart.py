"""Guard windows and restarts through torchrun: sync points only while a micro batch is unproven; an OOM
or a crash after that restarts the job, which resumes by itself from its own last checkpoint."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from config_edits import modified
from test_oom_recovery import SAMPLES, faulty_run, ok
from torch import nn

from adaptive_batching.config.settings import ConfigError, validate_config
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
    (folder / MARKER).write_text(json.dumps({"complete": True, "global_step": step, "job_id": job,
                                             "files": {"recipe_state.pt": 1}}))


def test_a_restart_of_this_job_resumes_its_checkpoint(tmp_path: Path) -> None:
    complete_checkpoint(tmp_path, "job-a")
    env = {restart.RESTART_COUNT: "1", restart.RUN_ID: "job-a"}
    resume, why = restart.resume_after_restart(tmp_path, env)
    assert resume and "torchrun restart 1 of job job-a" in why and "(optimizer step 6)" in why


@pytest.mark.parametrize("env, expected", [
    ({}, ""),  # a first start: never resumes by surprise
    ({restart.RESTART_COUNT: "0", restart.RUN_ID: "job-a"}, ""),
    ({restart.RESTART_COUNT: "2", restart.RUN_ID: "job-b"}, "written by job 'job-a', not this job 'job-b'"),
    ({restart.RESTART_COUNT: "1"}, "not this job None"),
])
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


# ---------------------------------------------------------------- two ranks under torchrun
# 40 samples, micro batch 4 on each of 2 ranks: 5 steps per epoch, 10 in all; saves after 2, 4, 5, 6, 8, 10.
TWO_RANKS = ("batch_size=4", "save_every_n_steps=2")
OOM_AT_7 = {"phase": "forward", "from_step": 7, "to_step": 7, "above": 2, "rank": 1}


def final_trajectory(tmp: Path, name: str, resumed_from: int) -> list[dict]:
    """Each rank's finished steps: the first attempt's up to the checkpoint resumed from, then the restart's."""
    steps = []
    for rank in (0, 1):
        first = json.loads((tmp / f"{name}-rank{rank}.json").read_text())
        again = json.loads((tmp / f"{name}-rank{rank}-restart1.json").read_text())
        steps += [s for s in first if s["step"] <= resumed_from] + again
    return steps


def assert_every_sample_once(steps: list[dict]) -> None:
    for epoch in (0, 1):
        counts = Counter(i for s in steps if s["epoch"] == epoch for i in s["samples"])
        assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}, epoch


def losses(output_dir: Path) -> dict[int, float]:
    from recipe_runs import read_metrics
    return {int(r["step"]): r["loss"] for r in read_metrics(output_dir / "logs")}


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_an_oom_outside_the_window_restarts_and_resumes_under_the_cut(runs: Path, assets: Path) -> None:
    """Rank 1 runs out of memory at step 7 (epoch 2, past the 4-step window): it records the cut and exits,
    torchrun restarts both ranks, they resume from step 6 at micro batch 2 and finish. The result equals
    a run that recovered in place at step 7 (a window long enough to hold it)."""
    restarted = ok(faulty_run(runs, "restarted", OOM_AT_7, assets, *TWO_RANKS, nproc=2, timeout=400,
                              launcher=["--max-restarts=1"]))
    # Once in a fresh-clone suite (2026-11-27) the first attempt ended before step 7 for another reason and the clean
    # restart trained through: show how the first attempt ended if it happens again.
    assert "outside the guard window" in restarted and "torchrun restart 1 of job" in restarted, \
        restarted[:4000] + "\n[...]\n" + restarted[-1500:]
    assert "Resuming at step 1 of epoch 2 (optimizer step 6)" in restarted
    assert "Resuming under the cut recorded after an out-of-memory error at optimizer step 7" in restarted
    assert "Rank 1: finished at optimizer step 10, micro batch 2" in restarted
    assert_every_sample_once(final_trajectory(runs, "restarted", 6))
    cut = json.loads((runs / "restarted" / restart.CUT_FILE).read_text())
    started_again = float((runs / "restarted-rank1-attempt1.start").read_text())
    assert started_again - (runs / "restarted" / restart.CUT_FILE).stat().st_mtime < 60
    assert cut["step"] == 7 and cut["failed_micro_batch"] == 4 and cut["recovery"]["oom_cap"] == 2

    in_place = ok(faulty_run(runs, "in-place", OOM_AT_7, assets, *TWO_RANKS, "adaptive_batching.guard_steps=10",
                             nproc=2, timeout=400))
    assert "Out of memory at micro batch 4 in step 2 of epoch 2 (optimizer step 7)" in in_place
    a, b = losses(runs / "restarted"), losses(runs / "in-place")
    assert sorted(a) == sorted(b) == list(range(1, 11))
    for step in range(7, 11):
        assert a[step] == pytest.approx(b[step], rel=1e-4), step


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_without_restarts_the_job_stops_naming_the_cut_and_the_resume_command(runs: Path, assets: Path) -> None:
    stopped = faulty_run(runs, "stopped", OOM_AT_7, assets, *TWO_RANKS, nproc=2, timeout=400)
    ended = time.time()
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode != 0
    assert "outside the guard window" in output and "resume_from_checkpoint=True" in output
    assert "Recorded the cut (micro batch 2)" in output
    assert ended - (runs / "stopped" / restart.CUT_FILE).stat().st_mtime < 60
    latest = (runs / "stopped" / "epoch_1")
    assert json.loads((latest / MARKER).read_text())["global_step"] == 6
    from safetensors.torch import load_file
    assert load_file(next(latest.glob("model-*.safetensors")))


@pytest.mark.multiprocess
@pytest.mark.e2e
def test_one_process_under_torchrun_takes_the_same_restart_path(runs: Path, assets: Path) -> None:
    """``--nproc_per_node 1``: the process group exists, so the window rules and the restart apply too."""
    fault = {"phase": "forward", "from_step": 7, "to_step": 7, "above": 4}
    output = ok(faulty_run(runs, "single", fault, assets, "batch_size=8", "save_every_n_steps=2", nproc=1,
                           timeout=400, launcher=["--max-restarts=1"]))
    assert "outside the guard window" in output and "torchrun restart 1 of job" in output
    assert "Rank 0: finished at optimizer step 10, micro batch 4" in output
    steps = [s for s in json.loads((runs / "single-rank0.json").read_text()) if s["step"] <= 6]
    steps += json.loads((runs / "single-rank0-restart1.json").read_text())
    for epoch in (0, 1):
        counts = Counter(i for s in steps if s["epoch"] == epoch for i in s["samples"])
        assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}, epoch
