"""A fork server for the recipe tests: imports torch, torchtune and the library once, then forks
one child per run (a child of the tests, never used by the product).

A recipe process spends ~5.5 s importing torchtune, torchao and torch._dynamo before its first
line runs. A forked child starts with those modules loaded, runs the same entry point a user's
command would (``tune run ...``, ``adaptive-batching ...``, ``python -m module ...`` or
``python script.py ...``) in a fresh
address space, and exits. Output goes to files, the exit status is a subprocess-style return code.

Protocol, one JSON object per line. Request on stdin:
``{"kind": "tune"|"cli"|"module"|"script", "argv": [...], "cwd": ..., "env": {...}, "stdout": path, "stderr": path,
"fork_python": bool}`` (``fork_python``: the run's own ``python`` children forked too, see
:func:`fork_python_children`).
Replies on stdout: ``{"pid": N}`` once the child runs, then ``{"returncode": R}`` when it ends.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import json
import os
import signal
import subprocess
import sys
import traceback
from typing import Any


def preload() -> None:
    """The imports every recipe run pays for; no tensor is created, so no thread pool starts."""
    # The profiler's plot child (``python -m adaptive_batching.profiling.plot``), forked with this loaded: ~0.2 s
    # of CPU instead of ~1 s for a new interpreter importing it, once per profiled run.
    import matplotlib
    import torch._inductor.compile_fx  # noqa: F401  (1.3 s: compiled runs and bitsandbytes' import need it)
    import torch.distributed.run  # noqa: F401
    import torchtune._cli.tune  # noqa: F401
    import torchtune.datasets  # noqa: F401
    import torchtune.models.llama3  # noqa: F401
    import torchtune.training  # noqa: F401

    import adaptive_batching.cli  # noqa: F401
    import adaptive_batching.profiling.plot  # noqa: F401
    import adaptive_batching.training.trainer  # noqa: F401

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401

    # What a run's first collection (runtime.memory.freeze_long_lived_objects) would walk, done once here: each
    # child then collects only its own objects (~0.3 s less per run and per forked rank).
    gc.collect()
    gc.freeze()


def fork_torchrun_workers() -> None:
    """Have torchrun (its own elastic agent: rendezvous, restarts, signal forwarding) start each worker by forking
    this process, which has everything imported, instead of a new interpreter (~7 s of imports per worker).

    The worker then runs the script or module torchrun would have run, with the same argv and environment; it
    leaves by ``os._exit`` like every child of this server, so the interpreter's finalisation is not exercised
    here (``benchmarks/clean_exits.py`` and the two-node test start real interpreters)."""
    import torch.distributed.run as torchrun

    original = torchrun.config_from_args

    def config_from_args(args):  # type: ignore[no-untyped-def]
        config, cmd, cmd_args = original(args)
        if cmd != sys.executable or cmd_args[:1] != ["-u"]:
            return config, cmd, cmd_args
        config.start_method = "fork"
        return config, forked_worker, cmd_args

    torchrun.config_from_args = config_from_args


def forked_worker(*cmd_args: str) -> None:
    """A torchrun worker's ``python -u [-m] TARGET ARGS...``, in this forked process."""
    import runpy

    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):  # a new interpreter's, not the agent's handlers
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = list(cmd_args[1:])
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise  # the worker's exit code, as an interpreter would give it
    # A clean return: torchrun's worker wrapper then hands the agent its (empty) result and exits 0.


# What every run forks, ``fork_python`` or not: a child whose work is not what any test measures, only its output.
ALWAYS_FORKED = {"adaptive_batching.profiling.plot"}


def fork_python_children(modules: set[str] | None = None) -> None:
    """Have this process start each ``python [-u] SCRIPT ...`` or ``python [-u] -m MODULE ...`` that it runs through
    ``subprocess`` by forking itself instead of a new interpreter (~4 s of imports each); ``modules``: only
    ``python -m`` of these.

    For a benchmark script whose figures do not depend on a fresh interpreter (step times, losses, collectives): the
    child is still a child process with its own pid, session, working directory, environment, standard streams and
    exit code, so ``Popen``'s waiting, signals and ``preexec_fn`` work as they would. Scripts that measure a fresh
    process (its memory, its exit) are not run so, nor is any child of a process whose forked children cannot run
    autograd (:func:`autograd_forks`)."""
    original = subprocess.Popen._execute_child
    signature = inspect.signature(original)

    def execute_child(self: subprocess.Popen, *args: Any, **kwargs: Any) -> None:
        call = signature.bind(self, *args, **kwargs).arguments
        target = python_target(call["args"], call["executable"], call["shell"])
        if modules is not None and (target is None or target[0] != "module" or target[1][0] not in modules):
            target = None
        if target is None or any(call[key] is not None for key in ("gid", "gids", "uid")) or not autograd_forks():
            return original(self, *args, **kwargs)
        pid = os.fork()
        if pid == 0:
            forked_python_child(call, *target)
        self.pid, self._child_created = pid, True
        self._close_pipe_fds(
            call["p2cread"], call["p2cwrite"], call["c2pread"], call["c2pwrite"], call["errread"], call["errwrite"]
        )

    subprocess.Popen._execute_child = execute_child


def autograd_forks() -> bool:
    """Whether a child forked from this process can run autograd. torch refuses it in a child forked after the
    parent's autograd engine started a thread (device threads on a build that sees a device, such as PyPI's CUDA
    build of 2.14; the thread that takes over a deep re-entrant backward): then :func:`fork_python_children` starts a
    new interpreter instead. Asked of a forked child that runs a one-element backward (a few milliseconds)."""
    if "torch" not in sys.modules:
        return True
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import torch

            torch.ones(1, requires_grad=True).sum().backward()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def python_target(args: Any, executable: str | None, shell: bool) -> tuple[str, list[str]] | None:
    """``("script", [path, ...])`` or ``("module", [name, ...])`` for a command line of this interpreter, else None."""
    if shell or executable is not None or isinstance(args, (str, bytes, os.PathLike)):
        return None
    args = [os.fspath(arg) for arg in args]
    if not args or args[0] != sys.executable:
        return None
    rest = args[2:] if args[1:2] == ["-u"] else args[1:]
    if rest[:1] == ["-m"] and len(rest) > 1:
        return "module", rest[1:]
    if rest and rest[0].endswith(".py"):
        return "script", rest
    return None


def forked_python_child(call: dict[str, Any], kind: str, argv: list[str]) -> None:
    """In the forked child: what ``Popen`` and a new interpreter would set up, then the command; never returns."""
    try:
        gc.freeze()  # the parent's objects stay as they are
        if call["start_new_session"]:
            os.setsid()
        if call.get("process_group", -1) >= 0:
            os.setpgid(0, call["process_group"])
        p2cread, c2pwrite, errwrite = call["p2cread"], call["c2pwrite"], call["errwrite"]
        if c2pwrite == 0:
            c2pwrite = os.dup(c2pwrite)
        while errwrite in (0, 1):
            errwrite = os.dup(errwrite)
        for source, fd in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2)):
            if source != -1:
                os.dup2(source, fd)
        for source in {p2cread, c2pwrite, errwrite} - {-1, 0, 1, 2}:
            os.close(source)
        for fd in (call["p2cwrite"], call["c2pread"], call["errread"]):
            if fd != -1:
                os.close(fd)
        if call["cwd"] is not None:
            os.chdir(call["cwd"])
        if call["umask"] >= 0:
            os.umask(call["umask"])
        if call["env"] is not None:
            os.environ.clear()
            os.environ.update(call["env"])
        for number in signal.valid_signals():  # a new interpreter's handlers, not the parent script's
            handler = signal.getsignal(number)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if call["restore_signals"]:
            for name in ("SIGPIPE", "SIGXFSZ"):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, 0)
        atexit._clear()
        if call["preexec_fn"] is not None:
            call["preexec_fn"]()
    except BaseException:  # noqa: BLE001 - a set-up that failed, as Popen's child would report it
        traceback.print_exc()
        os._exit(1)
    run_and_exit(kind, argv)


def run_entry_point(kind: str, argv: list[str]) -> int:
    """What the command line would run, in this process; returns its exit code."""
    import runpy

    if kind == "tune" or (kind == "module" and argv[:1] == ["torch.distributed.run"]):
        fork_torchrun_workers()
    try:
        if kind == "tune":
            from torchtune._cli.tune import main as tune_main

            sys.argv = ["tune", *argv]
            tune_main()
        elif kind == "cli":
            from adaptive_batching.cli import main as cli_main

            sys.argv = ["adaptive-batching", *argv]
            return int(cli_main() or 0)
        elif kind == "module" and argv[0] == "torch.distributed.run":
            # Its main() as imported, not a fresh copy run as __main__: that copy would not see the patch above
            # and would start each worker as a new interpreter.
            import torch.distributed.run as torchrun

            sys.argv = [torchrun.__file__, *argv[1:]]
            torchrun.main()
        elif kind == "module":
            sys.argv = ["-m", *argv[1:]]
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        elif kind == "script":
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        else:
            raise ValueError(f"unknown kind {kind!r}")
    except SystemExit as done:
        code = done.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - report like the interpreter does
        traceback.print_exc()
        return 1
    return 0


def child(request: dict) -> None:
    """Become the requested process: its own session, directory, environment, argv and output."""
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    fork_python_children(None if request.get("fork_python") else ALWAYS_FORKED)
    run_and_exit(request["kind"], request["argv"])


def run_and_exit(kind: str, argv: list[str]) -> None:
    """With file descriptors 0-2, directory and environment in place: a new interpreter's standard streams, then the
    command, its exit functions and its exit code; never returns."""
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    code = 1
    try:
        code = run_entry_point(kind, argv)
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF)


def serve() -> None:
    preload()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints of the server never corrupt the protocol
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        replies.write(json.dumps({"returncode": code}) + "\n")


if __name__ == "__main__":
    serve()
