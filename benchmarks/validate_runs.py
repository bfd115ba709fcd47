"""Runs for ``validate_device.py``, each in its own child process, instrumented from outside; and the helpers it
runs in children (device, assets, data sets, padding), so that the parent never creates a tensor.

A child is a fresh interpreter (``spawn``; on CUDA, where a context never crosses a fork) or a fork of the parent,
which has the imports done (``fork``; about 5 s saved per run on CPU). It measures through the trainer's
hooks (``training/hooks.py``), in itself only: each step in the library's ``memory.PeakMeter`` (peak, reservation,
allocator retries), tokens and seconds, out-of-memory errors counted; the checkpoints and the profile's plot are
skipped. With ``cap_bytes`` on CUDA the caching allocator is capped at the budget, so a run over it fails for real.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from common import padding

HERE = Path(__file__).resolve()


# --------------------------------------------------------------------------- child side
def _instrument(record: dict[str, Any], no_save: bool) -> None:
    """Measure each step and time each epoch through the trainer's hooks (and skip its saves), in this process."""
    from adaptive_batching.runtime import memory
    from adaptive_batching.training import hooks

    class Measured(hooks.TrainerHooks):
        meter: Any = None
        samples = 0
        epoch_start = 0.0

        def after_setup(self, trainer: Any) -> None:
            if no_save:  # no checkpoint (the epoch's save of an 8B model takes minutes)
                trainer.parts.checkpoints.save = lambda *args, **kwargs: None

        def before_epoch(self, trainer: Any, epoch: int) -> None:
            self.epoch_start = time.perf_counter()

        def after_epoch(self, trainer: Any, epoch: int) -> None:
            record["epoch_seconds"].append(time.perf_counter() - self.epoch_start)

        def before_step(self, trainer: Any, micro_batches: list) -> None:
            self.samples = sum(len(b["tokens"]) for b in micro_batches)
            self.meter = memory.PeakMeter(trainer.device, trainer.parts.model, trainer.parts.optimizer).__enter__()

        def after_step(self, trainer: Any, stats: Any) -> None:
            meter, self.meter = self.meter, None
            meter.__exit__(None, None, None)
            if stats is None:  # out of memory, recovered in place by the library
                record["oom_errors"] += 1
                return
            record["steps"].append({"samples": self.samples, "tokens": stats.tokens, "seconds": stats.seconds,
                                    "peak_bytes": meter.peak_bytes, "reserved_peak_bytes": meter.reserved_peak_bytes,
                                    "alloc_retries": meter.alloc_retries})

    hooks.install(Measured())
    if no_save:  # nor the profile's plot (a Python process with matplotlib per profile)
        from adaptive_batching.profiling import report as profile_report
        from adaptive_batching.profiling import run as profiling_run

        profiling_run.write_report = lambda result, directory: {
            "json": profile_report.write_json(result, Path(directory) / "profile.json"), "png": "(not drawn)"}


def _cap_cuda_memory(cap_bytes: int) -> None:
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), 0)


def run_in_child(spec: dict[str, Any]) -> int:
    """Run ``spec`` in this process and write its record to ``spec['result']``; returns the exit code."""
    record: dict[str, Any] = {"steps": [], "oom_errors": 0, "epoch_seconds": [], "error": None}
    code = 1
    try:
        if spec.get("threads"):
            import torch

            torch.set_num_threads(int(spec["threads"]))  # a forked child's pool follows its parent's, not the env
        if spec.get("pin_cpu_allocator"):
            # The recipe does this itself whenever it profiles on CPU; runs without a profile do it here,
            # so their memory follows the same allocator rules as the profiler's trial steps.
            from adaptive_batching.runtime import memory

            memory.pin_cpu_allocator()
        if spec.get("cap_bytes"):
            _cap_cuda_memory(int(spec["cap_bytes"]))
        if spec["kind"] == "function":  # a helper below, away from the parent's memory
            record["value"] = HELPERS[spec["function"]](*spec.get("args", []))
            code = 0
        else:
            _instrument(record, spec.get("no_save", True))
            code = _entry_point(spec["kind"], spec["argv"])
    except BaseException as error:  # noqa: BLE001 - recorded, then reported as the exit code
        from adaptive_batching.faults.oom import is_out_of_memory

        if isinstance(error, Exception) and is_out_of_memory(error):
            record["oom_errors"] += 1
        record["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()[-2000:]
        traceback.print_exc()
        code = 1
    finally:
        record["exit_code"] = code
        Path(spec["result"]).write_text(json.dumps(record))
    return code


def _entry_point(kind: str, argv: list[str]) -> int:
    """``tune ARGV`` or ``adaptive-batching ARGV`` in this process; a SystemExit becomes the exit code."""
    try:
        if kind == "tune":
            from torchtune._cli.tune import main as tune_main

            sys.argv = ["tune", *argv]
            tune_main()
            return 0
        from adaptive_batching.cli import main as cli_main

        sys.argv = ["adaptive-batching", *argv]
        return int(cli_main(argv) or 0)
    except SystemExit as stop:
        if stop.code is None or stop.code == 0:
            return 0
        if not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
            return 1
        return stop.code


# --------------------------------------------------------------------------- parent side
def preload() -> None:
    """Import what every run needs once, before forking (no tensor is created), then ``gc.freeze()`` those objects:
    a full collection then skips millions of them (0.5 s each here, and the library collects around every trial
    step), and a forked child's collector stops copying the parent's pages."""
    import gc

    import torchtune._cli.tune  # noqa: F401
    import torchtune.datasets  # noqa: F401
    import torchtune.models.llama3  # noqa: F401
    import torchtune.training  # noqa: F401

    import adaptive_batching.cli  # noqa: F401
    import adaptive_batching.estimate.prediction  # noqa: F401
    import adaptive_batching.training.trainer  # noqa: F401

    gc.collect()
    gc.freeze()


def launch(spec: dict[str, Any], *, log: Path, launcher: str, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run ``spec`` in a child (``fork`` or ``spawn``) and return its record with ``wall_seconds`` and ``log``.

    A child past ``timeout`` seconds is killed and recorded as timed out."""
    spec = dict(spec, result=str(log.with_suffix(".json")))
    Path(spec["result"]).unlink(missing_ok=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        if launcher == "spawn":
            spec_path = log.with_suffix(".spec.json")
            spec_path.write_text(json.dumps(spec))
            try:
                subprocess.run([sys.executable, str(HERE), "--child", str(spec_path)], stdout=out,
                               stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=log.parent)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
        else:
            timed_out = _fork_and_wait(spec, out, env, timeout, log.parent)
    record = json.loads(Path(spec["result"]).read_text()) if Path(spec["result"]).exists() else \
        {"steps": [], "oom_errors": 0, "epoch_seconds": [], "exit_code": None, "error": "no result written"}
    if timed_out:
        record.update(exit_code=None, error=f"timed out after {timeout:.0f} s")
    record["wall_seconds"] = time.perf_counter() - started
    record["log"] = str(log)
    return record


def _fork_and_wait(spec: dict[str, Any], out: Any, env: dict[str, str], timeout: float, cwd: Path) -> bool:
    """Fork; the child runs the spec with its output in ``out``; True if it was killed for the timeout."""
    import signal

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.setsid()
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            code = run_in_child(spec)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code & 0xFF)
    deadline = time.monotonic() + timeout
    while True:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return True
        time.sleep(0.05)


# --------------------------------------------------------------------------- helpers run in a child
def device_info(kind: str) -> dict[str, Any]:
    """The device of ``kind`` (cuda or cpu): name, memory and versions, for the results file."""
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cpu_count": os.cpu_count(), "platform": platform.platform()}
    if kind == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(type="cuda", name=props.name, memory_bytes=int(props.total_memory), cuda=torch.version.cuda)
    else:
        info.update(type="cpu", name=platform.processor() or platform.machine(),
                    memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return info


def write_assets(root: str, model: str) -> dict[str, Any]:
    """The tiny assets, or ``model``'s random-initialised checkpoint next to them (as the CLI writes them)."""
    if model == "tiny":
        from adaptive_batching.assets.tiny import write_tiny_assets

        paths = write_tiny_assets(root)
        return {"root": str(paths.root), "model_dir": str(paths.model_dir)}
    from adaptive_batching.assets.models import write_model_assets

    paths = write_model_assets(root, model)
    size = (paths.model_dir / "model.safetensors").stat().st_size
    return {"root": str(paths.tiny.root), "model_dir": str(paths.model_dir), "checkpoint_bytes": size}


def write_long_dataset(source: str, target: str, seq_len: int, num_samples: int) -> dict[str, Any]:
    """Alpaca records every one of which is longer than ``seq_len`` tokens once tokenized (so truncated
    to exactly ``seq_len``): each output joins the tiny data set's outputs until it has ``seq_len``
    words, and every word is at least one token. A micro batch of them has the profiler's worst-case
    shape, so fixed-batch runs on them meet the memory the profiler measured."""
    records = json.loads(Path(source).read_text())
    out, index = [], 0
    for _ in range(num_samples):
        words: list[str] = []
        instruction = records[index % len(records)]["instruction"]
        while len(words) < seq_len:
            words.extend(records[index % len(records)]["output"].split())
            index += 1
        out.append({"instruction": instruction, "input": "", "output": " ".join(words)})
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    Path(target).write_text(json.dumps(out))
    return {"path": target, "samples": num_samples, "min_words": min(len(r["output"].split()) for r in out)}


HELPERS = {"write_assets": write_assets, "write_long_dataset": write_long_dataset, "padding": padding}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        preload()  # the imports the run makes anyway, frozen, as in a forked child
        sys.exit(run_in_child(json.loads(Path(sys.argv[2]).read_text())))
    sys.exit("usage: validate_runs.py --child SPEC.json (started by validate_device.py)")
