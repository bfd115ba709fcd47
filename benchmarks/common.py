"""What the benchmark scripts share (imported as a sibling: ``python benchmarks/<script>.py`` puts benchmarks/ on
sys.path)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import multiprocessing
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GIB = 2**30
# Printed on an abort at exit, or when the process group outlived the run (``release_destroyed_group``): never fine.
UNCLEAN_EXIT = ("terminate called", "gloo worker thread(s) still running", "Fatal Python error")


def tiny_assets(given: Path | None, work: Path) -> Path:
    """``given`` (resolved) when a user named assets, else the tiny offline assets written under ``work``."""
    if given is not None:
        return Path(given).resolve()
    from adaptive_batching.assets.tiny import write_tiny_assets

    return write_tiny_assets(work / "assets").root


@contextlib.contextmanager
def work_dir(given: Path | None, prefix: str) -> Iterator[Path]:
    """``given`` (resolved, made, kept), or a temporary folder removed afterwards."""
    if given is not None:
        Path(given).mkdir(parents=True, exist_ok=True)
        yield Path(given).resolve()
    else:
        with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as folder:
            yield Path(folder)


def run_logged(command: Sequence[str], log_path: Path, timeout: float = 900, **kwargs: Any) -> int | None:
    """``command`` with its stdout and stderr in ``log_path``; its exit code, None when killed after ``timeout``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as out, contextlib.suppress(subprocess.TimeoutExpired):
        return subprocess.run(list(command), stdout=out, stderr=subprocess.STDOUT, timeout=timeout, **kwargs).returncode
    return None


def largest_fit(
    fits: Callable[[int], bool], start: int, trials: int | None = None
) -> tuple[int, int | None, list[str]]:
    """The largest size ``fits`` accepts (0: none) by doubling then bisection, at most ``trials`` sizes; the smallest
    that failed, and every size tried in order (``x``: failed)."""
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
    """``command`` with its output captured; a failure ends the benchmark with ``what failed:`` and its stderr's end."""
    result = subprocess.run(list(command), capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        sys.exit(f"{what} failed:\n{result.stderr[-3000:]}")
    return result


def unclean_exit(result: subprocess.CompletedProcess) -> str | None:
    """The first line of ``result``'s output that shows an unclean exit, or None."""
    return next(
        (line for line in (result.stdout + result.stderr).splitlines() if any(m in line for m in UNCLEAN_EXIT)), None
    )


@contextlib.contextmanager
def step_stamps(
    on_step: Callable[[dict[str, Any], int], dict[str, Any]] | None = None,
) -> Iterator[list[dict[str, Any]]]:
    """Within the block, each metric line a recipe logs (once per optimizer step) appends ``{"step", "t", "cpu"}``
    (``perf_counter``, ``process_time``) and ``on_step(payload, step)``'s items to the list it yields."""
    from torchtune.training.metric_logging import DiskLogger

    stamps: list[dict[str, Any]] = []
    original = DiskLogger.log_dict

    def stamped(self: Any, payload: Any, step: int) -> None:
        stamps.append(
            {
                "step": int(step),
                "t": time.perf_counter(),
                "cpu": time.process_time(),
                **(on_step(payload, step) if on_step else {}),
            }
        )
        original(self, payload, step)

    DiskLogger.log_dict = stamped
    try:
        yield stamps
    finally:
        DiskLogger.log_dict = original


def tune_child(
    stamps_path: str,
    tune_args: list[str],
    on_step: Callable[[dict[str, Any], int], dict[str, Any]] | None = None,
    same_adapters: bool = False,
) -> int:
    """``tune TUNE_ARGS`` in this process (``--tune-child``); writes its :func:`step_stamps`, threads and training
    start and end to ``stamps_path``. ``same_adapters``: LoRA A matrices from one seeded generator (stock's = ours)."""
    import torch
    import torchtune.modules.peft.lora as lora
    from torchtune._cli.tune import main as tune_main

    from adaptive_batching.training import hooks

    if os.environ.get("BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
    if same_adapters:
        generator = torch.Generator().manual_seed(0)
        lora._lora_a_init_params = lambda x: torch.nn.init.kaiming_uniform_(
            x.weight, a=math.sqrt(5), generator=generator
        )
        if not tune_args[1].startswith("adaptive_"):
            _adapters_in_module_order(generator)
    record: dict[str, Any] = {"train_start": None, "train_end": None}

    class TrainTimer(hooks.TrainerHooks):
        def before_train(self, parts: Any) -> None:
            record["train_start"] = time.perf_counter()

        def after_train(self, parts: Any) -> None:
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


def _adapters_in_module_order(generator: Any) -> None:
    """A stock recipe draws its LoRA A matrices as it builds the model; ours builds it on the meta device and draws
    them in ``model.modules()`` order. For a model listed in another order than it is built (a ``DeepFusionModel``'s
    encoder is built before its decoder and listed after it) the stock recipe's first ``get_adapter_params`` of the
    built model draws them again, in ours' order, from the generator's start; a text model's are the same as before."""
    import torchtune.modules.peft as peft

    original, drawn = peft.get_adapter_params, set()

    def in_module_order(model: Any) -> Any:
        if id(model) not in drawn and not any(p.is_meta for p in model.parameters()):
            drawn.add(id(model))
            generator.manual_seed(0)
            for module in model.modules():
                if hasattr(module, "lora_a") and hasattr(module, "initialize_parameters"):
                    module.initialize_parameters()
        return original(model)

    peft.get_adapter_params = in_module_order


def tune_in_child(
    script: Path,
    tune_args: list[str],
    stamps: Path,
    log_path: Path,
    threads: int = 1,
    timeout: float = 900,
    **kwargs: Any,
) -> dict[str, Any]:
    """``tune TUNE_ARGS`` in a fresh ``script --tune-child``: exit code (None: timed out), seconds, log, output, the
    child's record, and an ``error`` line if it failed."""
    stamps.parent.mkdir(parents=True, exist_ok=True)
    stamps.unlink(missing_ok=True)
    started = time.perf_counter()
    n = str(threads)  # intra-op threads: OpenMP/MKL pools, and torch's (BENCH_THREADS: tune_child)
    env = dict(
        os.environ,
        OMP_NUM_THREADS=n,
        MKL_NUM_THREADS=n,
        BENCH_THREADS=n,
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    code = run_logged(
        [sys.executable, str(script), "--tune-child", str(stamps), *tune_args], log_path, timeout, env=env, **kwargs
    )
    output = log_path.read_text(errors="replace")
    result = {
        "exit_code": code,
        "child_seconds": time.perf_counter() - started,
        "log": str(log_path),
        "output": output,
        **(json.loads(stamps.read_text()) if stamps.exists() else {"stamps": []}),
    }
    if code != 0:
        tail = " | ".join(output.strip().splitlines()[-4:])[-400:]
        result["error"] = f"{'timed out' if code is None else f'exit code {code}'}: {tail}"
    return result


def log(message: str) -> None:
    """Progress, on stderr: stdout is the report."""
    print(message, file=sys.stderr, flush=True)


def fmt(value: Any, spec: str = "", none: str = "-") -> str:
    """``value`` formatted by ``spec``, or ``none`` when it is missing."""
    return none if value is None else format(value, spec)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))


def padding(config: str, overrides: list[str], micro_batch: int, max_tokens: int | None) -> dict[str, Any]:
    """Padding waste of one epoch of the recipe's samples, in fixed micro batches and in ``max_tokens`` ones."""
    from torchtune import config as tune_config

    from adaptive_batching.batching.data import build_dataset
    from adaptive_batching.batching.sampler import StepBatchSampler
    from adaptive_batching.batching.token_sampler import TokenBudgetBatchSampler, padding_waste
    from adaptive_batching.config.loading import load_config

    cfg = load_config(config, overrides)
    dataset, _ = build_dataset(cfg.dataset, tune_config.instantiate(cfg.tokenizer))
    lengths = [len(dataset[i]["tokens"]) for i in range(len(dataset))]
    fixed = list(
        StepBatchSampler(
            len(lengths), micro_batch=micro_batch, accumulation=1, rank=0, world_size=1, shuffle=True, seed=0
        )
    )
    result: dict[str, Any] = {
        "samples": len(lengths),
        "real_tokens": sum(lengths),
        "max_length": max(lengths),
        "fixed": {"micro_batches": len(fixed), "waste": padding_waste(lengths, fixed)},
    }
    if max_tokens is not None:
        token = list(
            TokenBudgetBatchSampler(
                lengths,
                max_tokens=max_tokens,
                picking_order="seqlen",
                min_batch_size=None,
                max_batch_size=None,
                accumulation=1,
                rank=0,
                world_size=1,
                shuffle=True,
                seed=0,
            )
        )
        result["token budget"] = {"micro_batches": len(token), "waste": padding_waste(lengths, token)}
    return result


def machine_line(command: str) -> str:
    """The command, today's date and this machine, as a docs page written by a script names them."""
    import torch

    return (
        f"Command: `{command}`. Date: {date.today().isoformat()}. Machine: {platform.machine()}, "
        f"{multiprocessing.cpu_count()} CPU cores, no GPU (torch {torch.__version__})."
    )


def in_fork(function: Callable[..., dict[str, Any]], args: tuple, timeout: float) -> dict[str, Any]:
    """``function(*args)``'s dict from a forked child, or ``{"reason": ...}`` when it raised or hung ``timeout`` s."""
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


def machine() -> str:
    """The machine in a few words: cores and processor, and the GPU when one is used."""
    import torch

    cores = os.cpu_count() or 0
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, {cores} CPU cores"
    return f"{cores} CPU cores ({platform.machine()}), no GPU"


def commit() -> str:
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)

    try:
        out, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no").stdout
        return out.stdout.strip() + ("+changes" if dirty.strip() else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def command_line() -> str:
    """The command that is running, as a user would type it from the repository's root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return " ".join(["python", str(shown), *sys.argv[1:]])


def markdown_of(text: str) -> str:
    """A printed report as markdown: tables kept whole, every other line a paragraph of its own."""
    blocks: list[str] = []
    for line in text.strip().splitlines():
        if line.startswith("|") and blocks and blocks[-1].startswith("|"):
            blocks[-1] += "\n" + line
        elif line.strip():
            blocks.append(line)
    return "\n\n".join(blocks)


def publish(page: str, name: str, body: str, *, docs: Path = DOCS) -> Path:
    """Put ``body`` with a line naming command, date, commit and machine between ``name``'s markers on
    ``docs/<page>``."""
    path = docs / page
    text = path.read_text(encoding="utf-8")
    pattern = re.compile(rf"(<!-- table: {re.escape(name)} -->\n).*?(<!-- /table: {re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path} has no markers <!-- table: {name} --> ... <!-- /table: {name} -->")
    stamp = f"`{command_line()}`, {date.today().isoformat()}, commit {commit()}, {machine()}"
    block = f"Measured by {stamp}:\n\n{body.rstrip()}\n"
    path.write_text(pattern.sub(lambda m: m.group(1) + block + m.group(2), text, count=1), encoding="utf-8")
    return path


@contextlib.contextmanager
def report(name: str | None, page: str = "benchmarks.md", *, docs: Path = DOCS) -> Iterator[None]:
    """What the block prints is the report: printed when complete, and with a ``name`` also published on ``page``."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        yield
    print(f"\n{text.getvalue()}", end="")
    if name is not None:
        print(f"written to {publish(page, name, markdown_of(text.getvalue()), docs=docs)}")
