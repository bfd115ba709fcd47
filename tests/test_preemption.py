"""Preemption: a stop signal (SIGTERM, SIGUSR1) finishes the step, saves where the run is and exits 75; the
resumed run trains every optimizer step exactly once, with the uninterrupted run's losses bit for bit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
from recipe_runs import losses, unclean_exit
from test_oom_recovery import faulty_run, ok

from adaptive_batching.errors import Preempted
from adaptive_batching.faults import checkpoints
from adaptive_batching.faults.checkpoints import STOPPED_FILE, run_status
from adaptive_batching.faults.preemption import EXIT_CODE, Preemption
from adaptive_batching.runtime.distributed import ParallelInfo

STEP_LINE = re.compile(r"^Step (\d+) \|", re.M)
SAVE_EVERY_2 = ("save_every_n_steps=2", "batch_size=4")  # 40 samples: 10 steps an epoch, 20 in all


def logged_steps(log_dir: Path) -> list[int]:
    """Every ``Step N`` line of every log file of a run (runs of one output folder share it): each step once."""
    return sorted(int(n) for path in log_dir.glob("log_*.txt") for n in STEP_LINE.findall(path.read_text()))


def stopped(result: subprocess.CompletedProcess, signal_name: str) -> int:
    """The optimizer step a run stopped after, from its one line; checks the exit code."""
    assert result.returncode == EXIT_CODE, f"exit {result.returncode}\n{result.stderr[-4000:]}"
    assert unclean_exit(result) is None, unclean_exit(result)
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("stopped: ")]
    step = int(re.search(r"after optimizer step (\d+)", line).group(1))
    assert line.startswith(
        f"stopped: {signal_name} received by the end of optimizer step {step}; stopped after optimizer step {step} "
    )
    assert "resume_from_checkpoint=True" in line
    return step


def test_the_flag_is_set_by_the_signal_and_the_handler_put_back() -> None:
    previous = signal.getsignal(signal.SIGUSR1)
    stop = Preemption(["SIGUSR1"], ParallelInfo(), None)
    stop.install()
    try:
        assert not stop.end_step(1)
        signal.raise_signal(signal.SIGUSR1)
        assert (
            stop.received == signal.SIGUSR1
            and stop.end_step(2)
            and stop.signal_name == "SIGUSR1 received by the end of optimizer step 2"
        )
        assert stop.end_step(3) and stop.seen_at == 2  # the step it was first seen at stays in the stop line
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_each_rank_says_its_stop_line_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``python -u`` (torchrun's workers) ``print`` writes the text and the newline apart, so two ranks' lines
    ran into one (the SLURM test saw one ``stopped:`` line of two); one write keeps each line whole."""
    writes: list[str] = []

    class Stderr:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Stderr())
    stop = Preemption(["SIGUSR1"], ParallelInfo(), None)
    stop.received, stop.seen_at = signal.SIGUSR1, 2
    with pytest.raises(Preempted):
        stop.stop("after optimizer step 2", "saved step 2")
    assert writes == [
        "stopped: SIGUSR1 received by the end of optimizer step 2; stopped after optimizer step 2: saved "
        "step 2. Continue with resume_from_checkpoint=True (a torchrun restart resumes by itself)\n"
    ]


def forked(target: Callable[[], None], cwd: Path, env: dict[str, str] | None = None) -> int:
    """Fork a child that runs ``target`` in ``cwd`` with ``env`` added, its stdout and stderr appended to
    ``cwd/stdout`` and ``cwd/stderr``, and exits 0 once it returns (1 on an exception); returns its pid. The
    child has the library imported already: a fresh interpreter spends seconds importing torch first."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.chdir(cwd)
        os.environ.update(env or {})
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(cwd / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
        sys.stdout, sys.stderr = open(1, "w", buffering=1, closefd=False), open(2, "w", buffering=1, closefd=False)
        target()
        code = 0
    except BaseException:  # noqa: BLE001 - reported as an interpreter would
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def exit_status(pid: int, seconds: float = 120) -> int:
    """The forked child's exit code, or minus the signal that ended it, as subprocess gives it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child did not end in {seconds:.0f} s")


def python(code: str) -> Callable[[], None]:
    """Running ``python -c code`` in the process that calls the result."""
    return lambda: exec(compile(code, "<child>", "exec"), {"__name__": "__main__"})


SECOND_SIGNAL = """
import signal, time
from adaptive_batching.faults.preemption import Preemption
from adaptive_batching.runtime.distributed import ParallelInfo
p = Preemption(['SIGTERM'], ParallelInfo(), None)
p.install()
signal.raise_signal(signal.SIGTERM)
print('first', p.received, flush=True)
signal.raise_signal(signal.SIGTERM)
time.sleep(5)
print('alive')
"""


def test_a_second_signal_ends_the_process_at_once(tmp_path: Path) -> None:
    assert exit_status(forked(python(SECOND_SIGNAL), tmp_path)) == -signal.SIGTERM
    printed = (tmp_path / "stdout").read_text()
    assert "first 15" in printed and "alive" not in printed


ANOTHER_THREAD = """
import ctypes, os, signal, time
from adaptive_batching.faults.preemption import Preemption
from adaptive_batching.runtime.distributed import ParallelInfo
libc, held = ctypes.CDLL(None), ctypes.PyDLL(None)  # PyDLL: calls that keep the GIL
stop = Preemption(["SIGUSR1"], ParallelInfo(), None)
stop.install()
before = set(os.listdir("/proc/self/task"))
thread = ctypes.c_ulong()  # a thread of the process that is not Python's, as torch starts one
assert libc.pthread_create(ctypes.byref(thread), None, ctypes.cast(libc.sleep, ctypes.c_void_p),
                           ctypes.c_void_p(30)) == 0
(tid,) = set(os.listdir("/proc/self/task")) - before
while open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0] != "S":  # in its sleep
    time.sleep(0.01)
signal.pthread_kill(thread.value, signal.SIGUSR1)
while held.pthread_tryjoin_np(thread, None) != 0:  # until its C handler ran and sleep() returned
    pass
print(stop.received is None, stop.end_step(1))
"""


def test_a_signal_another_thread_took_stops_at_the_steps_end(tmp_path: Path) -> None:
    """The kernel may hand the stop signal to any thread; CPython 3.11 then leaves the main thread unaware until
    some call checks for signals. The step's end checks: it stops there, not a minute later."""
    assert exit_status(forked(python(ANOTHER_THREAD), tmp_path)) == 0, (tmp_path / "stderr").read_text()
    seen_before, stopped = (tmp_path / "stdout").read_text().split()
    assert stopped == "True", (seen_before, (tmp_path / "stderr").read_text())


def launcher(worker: Callable[[], None]) -> Callable[[], None]:
    """A launcher with 17 threads that forks ``worker`` and waits: the kernel sends the parent-death signal once per
    thread of the dying parent."""

    def launch() -> None:
        for _ in range(16):
            threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        forked(worker, Path.cwd(), {"RANK": "0", "WORLD_SIZE": "1"})
        time.sleep(600)

    return launch


WORKER = """
import os, time
from adaptive_batching.faults.preemption import Preemption
from adaptive_batching.runtime.distributed import ParallelInfo
stop = Preemption(["SIGTERM", "SIGUSR1"], ParallelInfo(), None)
stop.install()
open("ready", "w").close()
step, end = 0, time.monotonic() + 60
while time.monotonic() < end and not stop.end_step(step):  # steps, as the trainer takes them
    step += 1
    sum(range(1000))
for _ in range(10**6):  # the repeats come while it saves
    sum(range(10))
open("stopping", "w").write(stop.signal_name)
os.rename("stopping", "stopped")  # whole: the test reads it once it exists
"""


def test_the_launchers_death_stops_a_worker_once_however_often_the_kernel_signals_it(tmp_path: Path) -> None:
    """SIGKILL to a launcher with 17 threads: its worker gets the parent-death signal up to 17 times, which must
    stop it as one stop signal does (finish, save, exit), not as a scheduler's second signal (end at once)."""
    pid = forked(launcher(python(WORKER)), tmp_path)
    deadline = time.monotonic() + 300
    while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert exit_status(pid) == -signal.SIGKILL
    while not (tmp_path / "stopped").exists() and time.monotonic() < started + 60:
        time.sleep(0.01)
    assert (tmp_path / "stopped").exists(), (tmp_path / "stderr").read_text()
    assert re.fullmatch(
        r"the torchrun agent's death seen by the end of optimizer step \d+", (tmp_path / "stopped").read_text()
    )


@pytest.fixture(scope="module")
def chain(assets: Path, runs: Path) -> dict[str, object]:
    """One process: the whole run; and the same run stopped by SIGTERM after step 3, resumed and stopped by
    SIGUSR1 after step 13 (epoch 2), resumed to the end."""
    whole = ok(faulty_run(runs, "whole", {}, assets, *SAVE_EVERY_2))
    first = faulty_run(runs, "chain", {"signal": "SIGTERM", "signal_at": 3}, assets, *SAVE_EVERY_2)
    second = faulty_run(
        runs, "chain", {"signal": "SIGUSR1", "signal_at": 13}, assets, *SAVE_EVERY_2, "resume_from_checkpoint=True"
    )
    last = ok(faulty_run(runs, "chain", {}, assets, *SAVE_EVERY_2, "resume_from_checkpoint=True"))
    return {"whole": whole, "first": first, "second": second, "last": last}


@pytest.mark.e2e
def test_a_signal_stops_after_the_step_it_came_in_and_saves_there(chain: dict) -> None:
    assert stopped(chain["first"], "SIGTERM") == 3
    assert (
        "Saved the checkpoint of step 3 of epoch 1 (optimizer step 3)" in chain["first"].stdout + chain["first"].stderr
    )
    assert stopped(chain["second"], "SIGUSR1") == 13
    assert "Resuming at step 3 of epoch 1 (optimizer step 3)" in chain["second"].stdout + chain["second"].stderr
    assert "Resuming at step 3 of epoch 2 (optimizer step 13)" in chain["last"]


@pytest.mark.e2e
def test_the_resumed_runs_train_every_step_once_with_the_uninterrupted_losses(chain: dict, runs: Path) -> None:
    assert logged_steps(runs / "chain" / "logs") == list(range(1, 21))
    assert losses(runs / "chain" / "logs") == losses(runs / "whole" / "logs")  # bit for bit


@pytest.mark.e2e
def test_a_second_signal_inside_the_save_leaves_the_last_complete_checkpoint(
    assets: Path, runs: Path, chain: dict
) -> None:
    killed = faulty_run(
        runs, "twice", {"signal": "SIGTERM", "signal_at": 3, "again_in_save": True}, assets, *SAVE_EVERY_2
    )
    assert killed.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), killed.stderr[-3000:]
    latest = checkpoints.latest_complete_checkpoint(runs / "twice")
    assert latest is not None and latest.name == "epoch_0"
    assert '"global_step": 2' in (latest / checkpoints.MARKER).read_text()  # the save of step 2, untouched
    resumed = ok(faulty_run(runs, "twice", {}, assets, *SAVE_EVERY_2, "resume_from_checkpoint=True"))
    assert "Resuming at step 2 of epoch 1 (optimizer step 2)" in resumed
    assert losses(runs / "twice" / "logs") == losses(runs / "whole" / "logs")


def documented_slurm_script() -> str:
    """The SLURM script of docs/preemption.md, as written there."""
    page = (Path(__file__).parent.parent / "docs" / "preemption.md").read_text()
    section = page[page.index("## SLURM") :]
    return section[section.index("```bash\n") + len("```bash\n") : section.index("\n```", section.index("```bash"))]


def slurm_job(tmp_path: Path, assets: Path, fault: dict, *overrides: str) -> Callable[[], subprocess.CompletedProcess]:
    """The SLURM script of docs/preemption.md as written there, at 2 ranks on CPU with a stub scontrol (its calls in
    ``tmp_path/scontrol_calls``), torchrun's workers forked from tune, and benchmarks/faulty_run.py's ``fault`` (the
    script's pid in SCRIPT_PID); output folder ``tmp_path/run``. Returns a function that runs the job once, as SLURM
    starts it and requeues it."""
    out, calls = tmp_path / "run", tmp_path / "scontrol_calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    # tune itself, its torchrun workers forked from it with everything imported (tests/forkserver.py) instead of
    # two fresh interpreters per job: the script, its signals and torchrun's agent are unchanged. Real workers'
    # start and exit: tests/test_two_nodes.py.
    (bin_dir / "tune").write_text(
        f"#!{sys.executable}\nimport sys\nfrom forkserver import fork_torchrun_workers, "
        "preload\npreload()\nfork_torchrun_workers()\nfrom torchtune._cli.tune import "
        "main\nsys.argv[0] = 'tune'\nsys.exit(main())\n"
    )
    (bin_dir / "tune").chmod(0o755)
    run = [
        "faulty_run",
        f"'{json.dumps(fault)}'",
        f"{tmp_path}/rec-",
        "adaptive_full_finetune",
        "--config",
        "tiny_full",
        f"assets_dir={assets}",
        "output_dir=$OUT",
        *SAVE_EVERY_2,
        "batch_size=2",
        "use_maximum_batch_size=False",
        "batch_increase_function=null",
        "dataset.split=train[:40]",
        "epochs=2",
        "max_steps_per_epoch=null",
        *overrides,
    ]
    script = documented_slurm_script()
    for old, new in (
        ("OUT=/checkpoints/run", f"OUT={out}"),
        ("--nproc_per_node 8", "--nproc_per_node 2"),
        ("adaptive_full_finetune --config llama3_8b output_dir=$OUT", " ".join(run)),
    ):
        assert old in script, f"the documented script changed: {old!r} is gone"
        script = script.replace(old, new)
    (tmp_path / "job.sh").write_text("export SCRIPT_PID=$$\n" + script)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        SLURM_JOB_ID="42",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(str(Path(__file__).parent.parent / folder) for folder in ("tests", "benchmarks")),
    )

    def job() -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(tmp_path / "job.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )

    return job


def stubbed_slurm_job(tmp_path: Path, *, scontrol_exit: int = 0) -> Callable[[str, int], subprocess.CompletedProcess]:
    """The SLURM script of docs/preemption.md as written there, with stubs for ``tune`` (it records its arguments,
    leaves the folder as ``status`` says and exits with ``code``), ``adaptive-batching status`` (what the last run
    left, else ``none``) and ``scontrol`` (its calls in ``tmp_path/scontrol_calls``, exit ``scontrol_exit``): the
    script's own logic, in a few milliseconds. Returns ``job(status, code)``: one job whose run ends so."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    stubs = {
        "scontrol": f'echo "$@" >> {tmp_path}/scontrol_calls\nexit {scontrol_exit}',
        "tune": f'echo "$@" >> {tmp_path}/tune_calls\nprintf "%s\\n" "$END_STATUS" > {state}\nexit $END_CODE',
        "adaptive-batching": f'cat {state} 2>/dev/null || echo "none: no complete checkpoint in $2"',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    script = documented_slurm_script()
    assert "OUT=/checkpoints/run" in script, "the documented script changed: OUT=/checkpoints/run is gone"
    (tmp_path / "job.sh").write_text(script.replace("OUT=/checkpoints/run", f"OUT={tmp_path / 'run'}"))

    def job(status: str, code: int) -> subprocess.CompletedProcess:
        env = dict(
            os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="42", END_STATUS=status, END_CODE=str(code)
        )
        return subprocess.run(
            ["bash", str(tmp_path / "job.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )

    return job


FINISHED = "finished: run/epoch_1 (optimizer step 8, 2 of 2 epochs done)"
RESUMABLE = "resumable: run/epoch_0 (optimizer step 3, 0 of 2 epochs done); continue with resume_from_checkpoint=True"
STOPPED = "stopped: SIGUSR1 received; stopped while profiling, before any step trained, before the first checkpoint"
NOTHING = "none: no complete checkpoint in run"


@pytest.mark.parametrize(
    "status, code, exit_code, requeues",
    [
        (FINISHED, 0, 0, 0),  # finished: 0, so SLURM marks the job COMPLETED (the page's script once exited 1 here)
        (RESUMABLE, EXIT_CODE, 0, 1),  # stopped after a save: requeued
        (STOPPED, EXIT_CODE, 0, 1),  # stopped before its first checkpoint: requeued, to start over
        (RESUMABLE, 1, 0, 1),  # a crash after a save: requeued, to go on from the disk
        (NOTHING, 1, 1, 0),  # broken, nothing to resume: the run's exit code, FAILED
        (NOTHING, 0, 1, 0),  # nothing to resume though the run said 0: still a failure
    ],
    ids=[
        "finished",
        "stopped-after-a-save",
        "stopped-before-a-checkpoint",
        "crashed-after-a-save",
        "broken",
        "broken-though-exit-0",
    ],
)
def test_the_documented_slurm_scripts_exit_code_tells_how_the_job_ended(
    tmp_path: Path, status: str, code: int, exit_code: int, requeues: int
) -> None:
    job = stubbed_slurm_job(tmp_path)
    result = job(status, code)
    assert result.returncode == exit_code, result.stderr
    calls = tmp_path / "scontrol_calls"
    assert (calls.read_text() if calls.exists() else "") == "requeue 42\n" * requeues
    assert ("nothing to resume in" in result.stderr) == (exit_code != 0), result.stderr
    if requeues:  # the requeued job resumes from the disk
        job(FINISHED, 0)
        first, second = (tmp_path / "tune_calls").read_text().splitlines()
        assert first.endswith("resume_from_checkpoint=False") and second.endswith("resume_from_checkpoint=True")


def test_the_documented_slurm_script_fails_when_its_requeue_fails(tmp_path: Path) -> None:
    result = stubbed_slurm_job(tmp_path, scontrol_exit=1)(RESUMABLE, EXIT_CODE)
    assert result.returncode == 1 and (tmp_path / "scontrol_calls").read_text() == "requeue 42\n"


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_the_documented_slurm_script_requeues_a_job_stopped_while_profiling_and_one_stopped_mid_run(
    assets: Path, tmp_path: Path
) -> None:
    """The script as the docs show it, at 2 ranks on CPU with a stub scontrol; SIGUSR1 to the script as SLURM's
    --signal=B:USR1 sends it (torchrun passes it to both ranks). First during the profile: the job stops with
    nothing saved, status says stopped, the script requeues it. The requeued job starts over, and the signal comes
    again after optimizer step 1: it saves, status says resumable, the script requeues it. The third run resumes
    and finishes; every step is logged once."""
    out, calls = tmp_path / "run", tmp_path / "scontrol_calls"
    job = slurm_job(
        tmp_path,
        assets,
        {"signal": "SIGUSR1", "signal_in": "profile", "once": True, "signal_at": 1, "to": "env:SCRIPT_PID", "rank": 0},
        "use_maximum_batch_size=True",
        "adaptive_batching.memory_budget=64MiB",
    )
    first = job()
    assert "stopped while profiling, before any step trained" in first.stderr, first.stderr[-3000:]
    assert first.returncode == 0, first.stderr[-3000:]  # requeued: not a failed job
    assert run_status(out).startswith("stopped: SIGUSR1 received") and calls.read_text() == "requeue 42\n"
    second = job()
    assert (
        f"resume_from_checkpoint=True: no checkpoint in {out}, the run was stopped before its first one (SIGUSR1 "
        "received" in second.stderr
    ), second.stderr[-3000:]
    assert "SIGUSR1 received by the end of optimizer step" in second.stderr and unclean_exit(second) is None
    assert second.returncode == 0, second.stderr[-3000:]
    # Both ranks stopped at one place (after a step, or at the epoch's end: the profile may pick 2 steps an epoch),
    # each line saying so, and saved it.
    places = re.findall(r"stopped: .*?; stopped (.*)", second.stderr)
    assert len(places) == 2 and len(set(places)) == 1 and ": saved " in places[0], second.stderr[-4000:]
    assert run_status(out).startswith("resumable") and calls.read_text() == "requeue 42\nrequeue 42\n"
    assert not (out / STOPPED_FILE).exists()  # the save removed the first job's stop record
    third = job()  # resumes after the stop's step, so the signal after step 1 never fires again
    assert unclean_exit(third) is None and run_status(out).startswith("finished"), third.stderr[-3000:]
    assert third.returncode == 0, third.stderr[-3000:]  # finished: SLURM marks the job COMPLETED
    assert calls.read_text() == "requeue 42\nrequeue 42\n"
    (last,) = {int(step) for step in re.findall(r"finished at optimizer step (\d+)", third.stderr)}
    assert last > 1 and logged_steps(out / "logs") == list(range(1, last + 1))
