"""Running the recipes as a user does (``tune run``, ``adaptive-batching``, ``python script.py``) and
reading their metrics.

Each run is a separate process. By default it is forked from a fork server that has torch,
torchtune and the library imported (``forkserver.py``), which saves ~5.5 s of imports per run;
``ADAPTIVE_TESTS_FORKSERVER=0`` starts every run as a fresh interpreter instead.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO

HERE = Path(__file__).parent
# The fault harness the fault tests and benchmarks/chaos.py run as a script (a recipe with faults injected).
FAULTY_RUN = HERE.parent / "benchmarks" / "faulty_run.py"
TUNE = str(Path(sys.executable).with_name("tune"))
CLI = str(Path(sys.executable).with_name("adaptive-batching"))
_COMMANDS = {"tune": [TUNE], "cli": [CLI], "module": [sys.executable, "-m"], "script": [sys.executable]}
_STEP = re.compile(r"^Step (\d+) \| (.*)$")
# The batch as written, all epochs: no profiler, no growth.
FIXED_BATCH_SIZE = ("use_maximum_batch_size=False", "batch_increase_function=null")


def tune_run(
    recipe: str, config: str, overrides: Sequence[str], *, cwd: Path, nproc: int | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    """``tune run [--nproc_per_node N] RECIPE --config CONFIG OVERRIDES...``; output captured."""
    launcher = ["--nproc_per_node", str(nproc)] if nproc else []
    return run_command("tune", ["run", *launcher, recipe, "--config", config, *overrides], cwd=cwd, timeout=timeout)


def run_command(
    kind: str,
    argv: Sequence[str],
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: int = 600,
    fork_python: bool = False,
) -> subprocess.CompletedProcess:
    """``tune ARGV``, ``adaptive-batching ARGV``, ``python -m ARGV`` or ``python ARGV`` (``kind``), as a
    separate process in ``cwd`` with OMP_NUM_THREADS=1; output captured, like ``subprocess.run``. ``fork_python``:
    the ``python`` processes the run starts are forked from it too (``forkserver.fork_python_children``)."""
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [*_COMMANDS[kind], *argv]
    if os.environ.get("ADAPTIVE_TESTS_FORKSERVER", "1") == "0":
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return _fork_server().run(kind, list(argv), cmd, cwd=cwd, env=env, timeout=timeout, fork_python=fork_python)


class _ForkServer:
    """The client side of ``forkserver.py``: one server per test process, runs one at a time."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "forkserver.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.pending = b""

    def alive(self) -> bool:
        return self.process.poll() is None

    def _reply(self, stream: IO[str], timeout: float | None) -> dict | None:
        """The next reply line, or None after ``timeout`` seconds (read unbuffered, for select)."""
        while b"\n" not in self.pending:
            ready, _, _ = select.select([stream], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the test fork server exited ({self.process.poll()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(
        self,
        kind: str,
        argv: list[str],
        cmd: list[str],
        *,
        cwd: Path,
        env: dict[str, str],
        timeout: int,
        fork_python: bool,
    ) -> subprocess.CompletedProcess:
        assert self.process.stdin is not None and self.process.stdout is not None
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {
                "kind": kind,
                "argv": argv,
                "cwd": str(cwd),
                "env": env,
                "stdout": str(out),
                "stderr": str(err),
                "fork_python": fork_python,
            }
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            pid = self._reply(self.process.stdout, None)["pid"]
            done = self._reply(self.process.stdout, timeout)
            if done is None:
                os.killpg(pid, signal.SIGKILL)
                self._reply(self.process.stdout, None)
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(
                cmd, done["returncode"], out.read_text(errors="replace"), err.read_text(errors="replace")
            )


_SERVER: _ForkServer | None = None


def _fork_server() -> _ForkServer:
    global _SERVER
    if _SERVER is None or not _SERVER.alive():
        _SERVER = _ForkServer()
    return _SERVER


# What a process prints when it aborts at exit, or when the process group outlived the run (see
# ``runtime.distributed.release_destroyed_group``): never acceptable after a run, whatever its exit code.
UNCLEAN_EXIT = ("terminate called", "gloo worker thread(s) still running", "Fatal Python error")


def unclean_exit(result: subprocess.CompletedProcess) -> str | None:
    """The first line of ``result``'s output that shows an unclean exit, or None."""
    for line in (result.stdout + result.stderr).splitlines():
        if any(mark in line for mark in UNCLEAN_EXIT):
            return line
    return None


def check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nSTDOUT\n{result.stdout[-4000:]}\nSTDERR\n{result.stderr[-6000:]}"
    )
    assert unclean_exit(result) is None, f"unclean exit: {unclean_exit(result)}\nSTDERR\n{result.stderr[-6000:]}"
    return result


def read_metrics(log_dir: Path) -> list[dict[str, float]]:
    """Per-step metrics written by torchtune's DiskLogger, in file order then step order."""
    rows: dict[int, dict[str, float]] = {}
    for path in sorted(log_dir.glob("log_*.txt"), key=lambda p: p.stat().st_mtime):
        for line in path.read_text().splitlines():
            match = _STEP.match(line.strip())
            if match:
                fields = dict(item.split(":", 1) for item in match.group(2).split())
                rows[int(match.group(1))] = {"step": int(match.group(1)), **{k: float(v) for k, v in fields.items()}}
    return [rows[k] for k in sorted(rows)]


def losses(log_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(log_dir)]
