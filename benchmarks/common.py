"""What the benchmark scripts share: tiny assets, a work folder, a recipe run in this process with a time stamp per
logged step, a child process with its log or a readable failure, the largest size that fits, an unclean exit.

A script imports it as a sibling (``from common import ...``): Python puts the script's own folder first on
``sys.path``, so ``python benchmarks/x.py`` finds it from anywhere. Tables go into the docs through
:mod:`doc_tables`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

# What a process prints when it aborts at exit, or when the process group outlived the run (see
# ``runtime.distributed.release_destroyed_group``): never acceptable after a run, whatever its exit code.
UNCLEAN_EXIT = ("terminate called", "gloo worker thread(s) still running", "Fatal Python error")


def tiny_assets(given: Optional[Path], work: Path) -> Path:
    """``given`` (resolved) when a user named assets, else the tiny offline assets written under ``work``."""
    if given is not None:
        return Path(given).resolve()
    from adaptive_batching.assets.tiny import write_tiny_assets

    return write_tiny_assets(work / "assets").root


@contextlib.contextmanager
def work_dir(given: Optional[Path], prefix: str) -> Iterator[Path]:
    """``given`` (resolved, made, kept), or a temporary folder removed afterwards."""
    if given is not None:
        Path(given).mkdir(parents=True, exist_ok=True)
        yield Path(given).resolve()
        return
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def threads_env(threads: int, **extra: str) -> dict[str, str]:
    """This environment with ``threads`` intra-op threads for a child (``BENCH_THREADS``: :func:`tune_in_process`)."""
    n = str(threads)
    return dict(os.environ, OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, BENCH_THREADS=n, PYTHONUNBUFFERED="1",
                TOKENIZERS_PARALLELISM="false", **extra)


def run_logged(command: Sequence[str], log_path: Path, timeout: float = 900, **kwargs: Any) -> Optional[int]:
    """``command`` with its stdout and stderr in ``log_path``; its exit code, None when killed after ``timeout``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as out:
        try:
            return subprocess.run(list(command), stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                  **kwargs).returncode
        except subprocess.TimeoutExpired:
            return None


def largest_fit(fits: Callable[[int], bool], start: int, trials: Optional[int] = None
                ) -> tuple[int, Optional[int], list[str]]:
    """The largest size ``fits`` accepts: doubling from ``start``, then bisection, at most ``trials`` sizes. Returns
    it (0 when none fitted), the smallest that failed, and every size tried in order (``x``: failed)."""
    tried: list[str] = []

    def attempt(size: int) -> bool:
        ok = fits(size)
        tried.append(f"{size}{'' if ok else 'x'}")
        return ok

    lo, hi, size = 0, None, start
    while hi is None and len(tried) != trials:
        if attempt(size):
            lo, size = size, size * 2
        else:
            hi = size
    while hi is not None and hi - lo > 1 and len(tried) != trials:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if attempt(mid) else (lo, mid)
    return lo, hi, tried


def run_checked(command: Sequence[str], what: str, **kwargs: Any) -> subprocess.CompletedProcess:
    """``command`` run to its end with its output captured; a failure ends the benchmark with ``what failed:`` and
    the last 3000 characters of its stderr, the part that names the error."""
    result = subprocess.run(list(command), capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        sys.exit(f"{what} failed:\n{result.stderr[-3000:]}")
    return result


def unclean_exit(result: subprocess.CompletedProcess) -> Optional[str]:
    """The first line of ``result``'s output that shows an unclean exit, or None."""
    for line in (result.stdout + result.stderr).splitlines():
        if any(mark in line for mark in UNCLEAN_EXIT):
            return line
    return None


@contextlib.contextmanager
def step_stamps(on_step: Optional[Callable[[dict[str, Any], int], dict[str, Any]]] = None
                ) -> Iterator[list[dict[str, Any]]]:
    """Within the block, every metric line a recipe logs (torchtune's ``DiskLogger.log_dict``, once per optimizer
    step in ours and in stock's) appends ``{"step", "t", "cpu"}`` (``time.perf_counter()`` and this process's CPU
    time, ``time.process_time()``, at the call), plus what ``on_step(payload, step)`` returns, to the list it yields."""
    from torchtune.training.metric_logging import DiskLogger

    stamps: list[dict[str, Any]] = []
    original = DiskLogger.log_dict

    def stamped(self: Any, payload: Any, step: int) -> None:
        stamps.append({"step": int(step), "t": time.perf_counter(), "cpu": time.process_time(),
                       **(on_step(payload, step) if on_step else {})})
        original(self, payload, step)

    DiskLogger.log_dict = stamped
    try:
        yield stamps
    finally:
        DiskLogger.log_dict = original


def tune_child(stamps_path: str, tune_args: list[str],
               on_step: Optional[Callable[[dict[str, Any], int], dict[str, Any]]] = None,
               same_adapters: bool = False) -> int:
    """``tune TUNE_ARGS`` in this process (a ``--tune-child`` of a script), with ``BENCH_THREADS`` torch threads
    when the parent set it; writes to ``stamps_path`` the :func:`step_stamps` of its steps, the torch threads, and
    when training started and ended. ``same_adapters``: every LoRA A matrix drawn from a generator of its own, as
    tests/dpo_parity_run.py does, so that stock's recipe (adapters initialised between the base weights' random
    initialisations) and ours (on the meta device) start from the same adapters."""
    import torch
    import torchtune.modules.peft.lora as lora
    from torchtune._cli.tune import main as tune_main

    from adaptive_batching.training import hooks

    if os.environ.get("BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
    if same_adapters:
        generator = torch.Generator().manual_seed(0)
        lora._lora_a_init_params = lambda x: torch.nn.init.kaiming_uniform_(x.weight, a=math.sqrt(5),
                                                                            generator=generator)
    record: dict[str, Any] = {"train_start": None, "train_end": None}

    class TrainTimer(hooks.TrainerHooks):
        def before_train(self, trainer: Any) -> None:
            record["train_start"] = time.perf_counter()

        def after_train(self, trainer: Any) -> None:
            record["train_end"] = time.perf_counter()

    hooks.install(TrainTimer())
    sys.argv = ["tune", *tune_args]
    with step_stamps(on_step) as record["stamps"]:
        try:
            tune_main()  # the recipes end with ``sys.exit(recipe_main())``: a SystemExit passes through
        finally:
            record["threads"] = torch.get_num_threads()
            Path(stamps_path).write_text(json.dumps(record))
    return 0


def log(message: str) -> None:
    """Progress, on stderr: stdout is the report."""
    print(message, file=sys.stderr, flush=True)


def fmt(value: Any, spec: str = "", none: str = "-") -> str:
    """``value`` formatted by ``spec``, or ``none`` when it is missing."""
    return none if value is None else format(value, spec)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))


def token_lengths(config: str, overrides: list[str]) -> list[int]:
    """Every sample's token count as the recipe's data pipeline gives it (truncated to max_seq_len)."""
    from torchtune import config as tune_config

    from adaptive_batching.batching.data import build_dataset
    from adaptive_batching.config.loading import load_config

    cfg = load_config(config, overrides)
    dataset, _ = build_dataset(cfg.dataset, tune_config.instantiate(cfg.tokenizer))
    return [len(dataset[i]["tokens"]) for i in range(len(dataset))]


def padding(config: str, overrides: list[str], micro_batch: int, max_tokens: Optional[int]) -> dict[str, Any]:
    """Padding waste of one epoch cut by both samplers the runs use: fixed micro batches of ``micro_batch``
    samples (shuffled), and ``max_tokens`` padded tokens per micro batch (similar lengths together)."""
    from adaptive_batching.batching.sampler import StepBatchSampler
    from adaptive_batching.batching.token_sampler import TokenBudgetBatchSampler, padding_waste

    lengths = token_lengths(config, overrides)
    fixed = list(StepBatchSampler(len(lengths), micro_batch=micro_batch, accumulation=1, rank=0, world_size=1,
                                  shuffle=True, seed=0))
    result: dict[str, Any] = {"samples": len(lengths), "real_tokens": sum(lengths), "max_length": max(lengths),
                              "fixed": {"micro_batches": len(fixed), "waste": padding_waste(lengths, fixed)}}
    if max_tokens is not None:
        token = list(TokenBudgetBatchSampler(lengths, max_tokens=max_tokens, picking_order="seqlen",
                                             min_batch_size=None, max_batch_size=None, accumulation=1, rank=0,
                                             world_size=1, shuffle=True, seed=0))
        result["token budget"] = {"micro_batches": len(token), "waste": padding_waste(lengths, token)}
    return result


def in_fork(function: Callable[..., dict[str, Any]], args: tuple, timeout: float) -> dict[str, Any]:
    """``function(*args)`` in a forked child, so that one that fails or hangs cannot stop the others: its dict, or
    ``{"reason": ...}`` in one line when it raised or gave no answer in ``timeout`` seconds."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        from adaptive_batching.core.nodes import one_line

        try:
            send.send(function(*args))
        except BaseException as error:  # noqa: BLE001 - a failure becomes the reason
            send.send({"reason": one_line(error)[:200]})

    process = context.Process(target=child)
    process.start()
    send.close()
    got = receive.recv() if receive.poll(timeout) else {"reason": f"no answer in {timeout:.0f} s"}
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
    return got
