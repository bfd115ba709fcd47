"""Stopping cleanly when a scheduler says so: SIGTERM (Kubernetes, SLURM's preemption) and SIGUSR1 (SLURM's
``--signal=B:USR1@120`` before a time limit), or the signals of ``adaptive_batching.stop_signals``.

A Python signal handler only runs between bytecodes, so it sets a flag and the run acts on it at a step
boundary: it finishes the optimizer step it is in (or abandons a profiler trial), saves an atomic
mid-epoch checkpoint with everything an exact resume needs, and exits with :data:`EXIT_CODE`. A second
signal while stopping (a scheduler that will not wait) ends the process at once; the save is atomic, so
the last complete checkpoint stays loadable either way. SIGINT (Ctrl-C) keeps Python's meaning: stop now.

Under torchrun every rank must stop at the same step, or the others would wait forever in the next
collective. The signal may reach the ranks at different steps, or only one of them, so each step starts
a non-blocking all-reduce (MAX) of the rank's flag and reads it at the step's end, after the step's own
host synchronisation: all ranks stop after the step in which every rank's flag was in, the step the
signal arrived in or the next. One process needs no collective.

The handlers are in from the trainer's start: a signal during the set-up (data, model, token counts) stops the run at
the set-up's end, one during the profile (or the compiling before it) at the next trial, with nothing to save. Until
the run has a checkpoint, the first signal is also recorded in the output folder at once
(:func:`~adaptive_batching.faults.checkpoints.mark_stopped`), so that a job script sees a stopped run even if the
scheduler kills it before it stops: the run is then to go on from the beginning.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from adaptive_batching.core import logs
from adaptive_batching.errors import Preempted
from adaptive_batching.faults.checkpoints import STOPPED_FILE, mark_stopped
from adaptive_batching.runtime.distributed import ParallelInfo, barrier, launched_by_torchrun

EXIT_CODE = 75  # sysexits' EX_TEMPFAIL: stopped on request, resumable; a crash exits 1
ALLOWED = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
DEFAULT = ("SIGTERM", "SIGUSR1")
# What a worker asks the kernel to send when its launcher dies (Linux), a signal of its own: the kernel sends it
# again each time it hands the orphan on, once per thread of the dying agent, which as SIGTERM would read as a
# scheduler's second signal ("end now, do not save").
PARENT_DEATH: int | None = signal.SIGRTMIN + 6 if sys.platform.startswith("linux") else None


def check_signals(value: Any) -> str | None:
    """None when ``value`` is a list of signal names we may handle, else what is allowed."""
    ok = isinstance(value, (list, tuple)) and all(v in ALLOWED for v in value) and len(set(value)) == len(value)
    return None if ok else f"a list of distinct signal names among {', '.join(ALLOWED)} ([] turns it off)"


class Preemption:
    """The stop flag, its signal handlers and the ranks' agreement (see the module docstring)."""

    def __init__(
        self, signals: Sequence[str], parallel: ParallelInfo, device: torch.device, output_dir: Path | None = None
    ) -> None:
        self.signals = [getattr(signal, name) for name in signals]
        self.parallel, self.device = parallel, device
        self.output_dir = output_dir  # where a stop is recorded while the run has no checkpoint (None: it has one)
        self.received: int | None = None  # the first stop signal this process received
        self.seen_at: int | None = None  # the optimizer step at whose end this rank first saw it
        self.stopping = False  # every rank agreed to stop
        self._previous: dict[int, Any] = {}
        self._flag: torch.Tensor | None = None
        self._work: Any = None
        self.launcher_death: int | None = None  # the signal this worker gets when its torchrun agent dies
        if launched_by_torchrun():  # no worker outlives its agent: the agent's death stops it as a stop signal does
            self.launcher_death = PARENT_DEATH or (self.signals[0] if self.signals else signal.SIGTERM)
            stop_with_launcher(self.launcher_death)

    @property
    def signal_name(self) -> str:
        if self.received is None:
            return "a stop signal on another rank"
        seen = "" if self.seen_at is None else f" by the end of optimizer step {self.seen_at}"
        if self.received == PARENT_DEATH:
            return f"the torchrun agent's death seen{seen}"
        return f"{signal.Signals(self.received).name} received{seen}"

    def install(self) -> None:
        """Handle the stop signals from now on (in the main thread: Python delivers signals there), and the
        launcher's death as one of them (when stop signals are handled at all). Then an earlier attempt's stop record
        goes (once every rank has decided whether to resume from it): it is this attempt's to write."""
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)
        if self.signals and self.launcher_death is not None and self.launcher_death not in self.signals:
            self._previous[self.launcher_death] = signal.signal(self.launcher_death, self._launcher_died)
        if self.output_dir is not None and self.signals:
            barrier(self.parallel)
            if self.parallel.is_rank_zero:
                (self.output_dir / STOPPED_FILE).unlink(missing_ok=True)
            run_pending_handlers()
            if self.received is not None:  # it came before the record went
                self._record(self.signal_name)

    def saved(self) -> None:
        """The run has a checkpoint now (the save deleted the stop record): a stop is no longer recorded."""
        self.output_dir = None

    def _record(self, why: str) -> None:
        if self.output_dir is not None:
            mark_stopped(self.output_dir, why)

    def uninstall(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = number
            self._record(self.signal_name)
            return
        # A second signal while stopping: the scheduler will not wait for the save. End now, by that signal.
        self.uninstall()
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)

    def _launcher_died(self, number: int, frame: FrameType | None) -> None:
        if self.received is None:  # repeats are the kernel's, not a scheduler's second signal
            self.received = number
            self._record(self.signal_name)

    @property
    def _agreeing(self) -> bool:
        """Whether the ranks must agree on a stop: several ranks, and signals to handle."""
        return self.parallel.is_distributed and bool(self.signals)

    def begin_step(self) -> None:
        """Start this step's agreement: a non-blocking all-reduce of this rank's flag (several ranks only; one
        process reads its flag in :meth:`end_step`, which runs the pending handlers itself)."""
        if self._agreeing:
            run_pending_handlers()
            self._flag = torch.tensor([int(self.received is not None)], device=self.device)
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)

    def end_step(self, step: int) -> bool:
        """Whether every rank stops after optimizer step ``step`` (read after the step's own synchronisation)."""
        run_pending_handlers()
        if self.received is not None and self.seen_at is None:
            self.seen_at = step
        if self._work is not None and self._flag is not None:  # set together by begin_step
            self._work.wait()
            self._work = None
            self.stopping = bool(self._flag.item())
        else:
            self.stopping = self.received is not None
        return self.stopping

    def agree_now(self) -> bool:
        """Whether any rank received a stop signal, agreed at once (between profiler trials)."""
        run_pending_handlers()
        if self._agreeing:
            flag = torch.tensor([int(self.received is not None)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self.stopping = bool(flag.item())
        else:
            self.stopping = self.received is not None
        return self.stopping

    def between_trials(self) -> None:
        """Before a profiler trial: stop if any rank received a stop signal (nothing is trained yet, so
        nothing is saved; the profiler puts the training state back on its way out)."""
        self.before_training("while profiling")

    def before_training(self, where: str) -> None:
        """Stop ``where`` the run is (set-up, profile) if any rank received a stop signal: nothing is trained yet."""
        if self.agree_now():
            nothing = (
                "nothing to save, and no checkpoint yet: a resume starts from the beginning"
                if self.output_dir
                else "nothing new to save"
            )
            self.stop(f"{where}, before any step trained", nothing)

    def stop(self, where: str, saved: str) -> NoReturn:
        """End the run after a stop signal: ``where`` it stopped and what was ``saved``. Every rank says its line
        here, before the ranks leave the process group together: the first rank to exit makes torchrun end the
        others, so a line said after the teardown could be lost."""
        if self.output_dir is not None and self.parallel.is_rank_zero:
            self._record(f"{self.signal_name}; stopped {where}")
        message = (
            f"{self.signal_name}; stopped {where}: {saved}. Continue with "
            f"resume_from_checkpoint=True (a torchrun restart resumes by itself)"
        )
        logs.say_line(f"stopped: {message}")
        raise Preempted(message)


def run_pending_handlers() -> None:
    """Run the Python handlers of signals that arrived, now (one system call, no device work).

    The kernel may hand a process's signal to any of its threads, and the process has threads of its own
    (torch starts one at import). CPython 3.11 on Linux then records the signal but does not make the main
    thread look, so its handler waited, measured, up to the next call that checks for signals: a minute in a
    loop that made none. ``pthread_sigmask`` checks on return."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, ())


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_launcher(number: int = signal.SIGTERM, *, poll_seconds: float = 1.0) -> None:
    """Have this process receive ``number`` when its parent dies, by any signal, SIGKILL included.

    For a worker under torchrun, whose parent is the elastic agent: a worker that outlives its agent would
    train on as an orphan, beside the requeued job that shares its output folder. With the stop handlers
    installed the signal stops the run as a scheduler's SIGTERM does (finish the step, save, exit 75); before
    that it ends the process, which has nothing to save yet. Linux: the kernel's parent-death signal
    (``prctl(PR_SET_PDEATHSIG)``), which may come more than once; elsewhere a thread that polls the parent's pid.
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(number), 0, 0, 0) == 0:
            if os.getppid() != parent:  # it died before the prctl took effect
                os.kill(os.getpid(), number)
            return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os.kill(os.getpid(), number)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
