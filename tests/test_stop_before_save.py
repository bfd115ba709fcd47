"""A stop signal before the run's first checkpoint (issue 40.1): during the token counts, the profile, its compiling
or the steps before the first save, the stop line, ``adaptive-batching status`` and ``resume_from_checkpoint=True``
agree, and the run goes on, from the beginning when nothing was saved. Also: ``profile`` and ``plan`` leave no log
file."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from recipe_runs import check, run_command, unclean_exit
from test_oom_recovery import COMMON, faulty_run, ok
from test_preemption import logged_steps

from adaptive_batching.faults import checkpoints
from adaptive_batching.faults.checkpoints import STOPPED_FILE, mark_stopped, run_status
from adaptive_batching.faults.preemption import EXIT_CODE, Preemption
from adaptive_batching.faults.restart import resume_decision
from adaptive_batching.runtime.distributed import ParallelInfo

FEW_STEPS = ("epochs=1", "max_steps_per_epoch=3", "batch_size=4")  # after COMMON: 3 steps of 4 samples
PROFILED = ("use_maximum_batch_size=True", "adaptive_batching.memory_budget=64MiB")  # a short profile
COMPILE_ENV = {"TORCH_COMPILE_BACKEND": "aot_eager"}  # torchtune's compile reads it: traced, not built by inductor
NO_CHECKPOINT = "nothing to save, and no checkpoint yet: a resume starts from the beginning"
MOMENTS = {  # where the signal lands: the fault (benchmarks/faulty_run.py) and the overrides
    "token_counts": ({"signal": "SIGUSR1", "signal_in": "token_counts"}, PROFILED),
    "profile": ({"signal": "SIGTERM", "signal_in": "profile"}, PROFILED),
    "compile": ({"signal": "SIGUSR1", "signal_in": "compile"}, (*PROFILED, "compile=True")),
    "first_step": ({"signal": "SIGUSR1", "signal_at": 1}, ()),
    "first_step_killed_in_its_save": ({"signal": "SIGTERM", "signal_at": 1, "kill_in_save": 1}, ()),
}


def resume_line(output_dir: Path, why: str) -> str:
    """The one line ``resume_from_checkpoint=True`` logs on a folder stopped before its first checkpoint."""
    return (
        f"resume_from_checkpoint=True: no checkpoint in {output_dir}, the run was stopped before its first one "
        f"({why}): starting from the beginning (what it cached, token counts or profile, is reused)"
    )


def fake_checkpoint(output_dir: Path, epoch: int, *, epochs_run: int, total_epochs: int) -> Path:
    """A complete ``epoch_N`` folder as checkpoints.latest_complete_checkpoint reads it (no real weights)."""
    folder = output_dir / f"epoch_{epoch}"
    folder.mkdir(parents=True)
    (folder / checkpoints.RECIPE_STATE_FILE).write_bytes(b"state")
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"weights")
    files = {path.name: path.stat().st_size for path in folder.iterdir()}
    (folder / checkpoints.MARKER).write_text(
        json.dumps(
            {"complete": True, "global_step": 5, "files": files, "epochs_run": epochs_run, "total_epochs": total_epochs}
        )
    )
    return folder


# ---------------------------------------------------------------- the record, without a run


def test_a_stop_record_says_stopped_and_a_resume_starts_from_the_beginning_in_one_line(
    tmp_path: Path, said: Callable[[], list[str]]
) -> None:
    assert run_status(tmp_path).startswith("none: no complete checkpoint")
    assert resume_decision(True, tmp_path) == (True, None) and said() == []  # no record: the config error follows
    mark_stopped(tmp_path, "SIGTERM received")
    assert run_status(tmp_path) == (
        "stopped: SIGTERM received, before the first checkpoint; "
        "resume_from_checkpoint=True starts it from the beginning"
    )
    assert resume_decision(True, tmp_path) == (False, None)
    assert said() == [resume_line(tmp_path, "SIGTERM received")]


def test_a_stop_record_never_makes_a_finished_or_a_broken_run_look_stopped(tmp_path: Path) -> None:
    finished, broken = tmp_path / "finished", tmp_path / "broken"
    fake_checkpoint(finished, 0, epochs_run=1, total_epochs=1)
    mark_stopped(finished, "SIGTERM received")
    assert run_status(finished).startswith(f"finished: {finished / 'epoch_0'}")
    assert resume_decision(True, finished) == (True, None)
    (fake_checkpoint(broken, 0, epochs_run=0, total_epochs=1) / checkpoints.MARKER).unlink()  # a broken save
    mark_stopped(broken, "SIGTERM received")
    assert run_status(broken).startswith("none: no complete checkpoint")
    assert resume_decision(True, broken) == (True, None)  # and the resume stops on it, not started over


def test_the_first_signal_is_recorded_at_once_until_the_run_has_a_checkpoint(tmp_path: Path) -> None:
    mark_stopped(tmp_path, "an earlier attempt's stop")
    previous = signal.getsignal(signal.SIGUSR1)
    stop = Preemption(["SIGUSR1"], ParallelInfo(), None, output_dir=tmp_path)
    stop.install()
    try:
        assert not (tmp_path / STOPPED_FILE).exists()  # this attempt's to write
        signal.raise_signal(signal.SIGUSR1)
        assert run_status(tmp_path).startswith("stopped: SIGUSR1 received, before the first checkpoint")
        stop.received = None
        (tmp_path / STOPPED_FILE).unlink()
        stop.saved()
        signal.raise_signal(signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1 and not (tmp_path / STOPPED_FILE).exists()
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is previous


# ---------------------------------------------------------------- recipe runs, one process


@pytest.fixture(scope="module")
def stopped(assets: Path, runs: Path) -> dict[str, subprocess.CompletedProcess]:
    """One run per moment, each stopped there."""
    return {
        moment: faulty_run(runs, moment, fault, assets, *FEW_STEPS, *overrides, env=COMPILE_ENV)
        for moment, (fault, overrides) in MOMENTS.items()
    }


@pytest.mark.e2e
@pytest.mark.parametrize("moment", ["token_counts", "profile", "compile"])
def test_a_stop_before_training_says_stopped_everywhere(stopped: dict, runs: Path, moment: str) -> None:
    result, name = stopped[moment], MOMENTS[moment][0]["signal"]
    assert result.returncode == EXIT_CODE and unclean_exit(result) is None, result.stderr[-3000:]
    where = "during set-up (data, model, token counts)" if moment == "token_counts" else "while profiling"
    if moment == "compile":  # the compiling before the trials: stopped at the first trial, once compiled
        assert "Profiler: compiled in" in result.stderr and "trial steps in" not in result.stderr
    assert (
        f"stopped: {name} received; stopped {where}, before any step trained: {NO_CHECKPOINT}. Continue with "
        "resume_from_checkpoint=True" in result.stderr
    )
    assert run_status(runs / moment) == (
        f"stopped: {name} received; stopped {where}, before any step trained, before "
        "the first checkpoint; resume_from_checkpoint=True starts it from the beginning"
    )
    assert not (runs / moment / "logs").exists()  # the metric logger is built when training starts


@pytest.mark.e2e
def test_a_stop_in_the_first_step_saves_it_and_one_killed_in_that_save_says_stopped(stopped: dict, runs: Path) -> None:
    saved = stopped["first_step"]
    assert "saved the checkpoint of optimizer step 1 in" in saved.stderr, saved.stderr[-3000:]
    assert (
        run_status(runs / "first_step").startswith("resumable:") and not (runs / "first_step" / STOPPED_FILE).exists()
    )
    killed = stopped["first_step_killed_in_its_save"]
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert run_status(runs / "first_step_killed_in_its_save") == (
        "stopped: SIGTERM received, before the first checkpoint; resume_from_checkpoint=True starts it from the "
        "beginning"
    )  # recorded when the signal came: the kill left no stop line


@pytest.mark.e2e
def test_resuming_a_run_stopped_while_profiling_starts_it_over_once(stopped: dict, assets: Path, runs: Path) -> None:
    (lengths,) = (runs / "profile" / "profile_cache").glob("lengths-*.json")
    counted = lengths.stat().st_mtime_ns
    fault, overrides = MOMENTS["profile"]
    resumed = ok(faulty_run(runs, "profile", {}, assets, *FEW_STEPS, *overrides, "resume_from_checkpoint=True"))
    why = "SIGTERM received; stopped while profiling, before any step trained"
    assert resumed.count("resume_from_checkpoint=True: ") == 1 and resume_line(runs / "profile", why) in resumed
    assert "config error" not in resumed and lengths.stat().st_mtime_ns == counted  # token counts read, not redone
    assert run_status(runs / "profile").startswith("finished:") and not (runs / "profile" / STOPPED_FILE).exists()
    assert logged_steps(runs / "profile" / "logs") == [1, 2, 3]


# ---------------------------------------------------------------- two ranks
# The documented SLURM script with a stop while profiling, then one after optimizer step 1 (both ranks stop after one
# step, save it before their first scheduled save, status says resumable, the stop record is gone; the resume trains
# to the end, each step logged once): test_preemption.py's SLURM test. One rank alone signalled, the other stopping
# for "a stop signal on another rank" at the same step: test_chaos.py's kill_in_save+worker_sigusr1.


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_two_ranks_stop_together_at_the_set_ups_end_when_one_is_signalled_in_the_token_counts(
    assets: Path, runs: Path
) -> None:
    """SIGTERM to rank 1 alone while it counts the tokens: both ranks stop at the set-up's end, nothing saved, and
    status says stopped (rank 0's line, written after the ranks agreed)."""
    result = faulty_run(
        runs,
        "ranks",
        {"signal": "SIGTERM", "signal_in": "token_counts", "rank": 1},
        assets,
        *FEW_STEPS,
        *PROFILED,
        nproc=2,
    )
    where = "stopped during set-up (data, model, token counts), before any step trained"
    assert f"SIGTERM received; {where}: {NO_CHECKPOINT}" in result.stderr, result.stderr[-3000:]
    assert f"a stop signal on another rank; {where}: {NO_CHECKPOINT}" in result.stderr
    assert run_status(runs / "ranks") == (
        f"stopped: a stop signal on another rank; {where}, before the first "
        "checkpoint; resume_from_checkpoint=True starts it from the beginning"
    )


# ---------------------------------------------------------------- profile and plan: no log file


@pytest.mark.e2e
def test_plan_leaves_no_log_file(assets: Path, tmp_path: Path) -> None:
    """``plan`` sets up, profiles and plans as ``profile`` does, and logs no metric: no ``logs/log_*.txt``."""
    out = tmp_path / "run"
    check(
        run_command(
            "cli",
            ["plan", "--config", "tiny_full", f"assets_dir={assets}", f"output_dir={out}", *COMMON, *PROFILED],
            cwd=tmp_path,
        )
    )
    assert (out / "profile" / "profile.json").is_file() and not (out / "logs").exists()
