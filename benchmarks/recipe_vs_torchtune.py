#!/usr/bin/env python
"""Our full fine-tune recipe against torchtune's stock single-device one: optimizer steps per second.

    python benchmarks/recipe_vs_torchtune.py [--steps 200] [--warmup 3] [--repeats 3] [--threads 1] [--json out.json]
                                            [--compile] [--glibc-tunables T] [--phases] [--publish]
    python benchmarks/recipe_vs_torchtune.py --switch-only      # only the epoch-switch cost

Both recipes run as a user runs them, ``tune run RECIPE --config FILE``, each in its own fresh
child process with the same environment (``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` = ``--threads``,
``torch.set_num_threads`` too):

* ours: ``tune run adaptive_full_finetune`` with ``tiny_full`` and a fixed batch
  (``use_maximum_batch_size=False``, ``batch_increase_function=null``: no profiling, no growth);
* stock: ``tune run full_finetune_single_device`` (torchtune's own recipe) with a config built from
  the very same resolved ``tiny_full`` config: only the keys the stock recipe reads are kept (ours'
  ``assets_dir``, ``use_maximum_batch_size``, ``adaptive_batching``, ``batch_increase_function``,
  ``lr_scaling`` go) and the keys it requires are added with their "off" value
  (``optimizer_in_bwd: False``, ``enable_activation_offloading: False``, ``log_peak_memory_stats:
  False``, a disabled ``profiler``).

Same model and checkpoint (the offline tiny Llama-3), tokenizer, data set, AdamW, chunked CE loss,
cosine LR schedule, ``clip_grad_norm``, fp32, CPU, ``batch_size`` (default 8) x 1 accumulation,
``max_seq_len`` (default 256), one epoch of ``--warmup + --steps`` optimizer steps, each with its
own temporary ``output_dir``. The seed is 0 by default because the stock recipe always shuffles
with sampler seed 0 while ours shuffles with ``seed``: only then do both see the same batches in
the same order (the per-step losses of the two are compared and printed as a check of that).

Timing: a small wrapper (this file, ``--tune-child``) patches torchtune's ``DiskLogger.log_dict``,
which both recipes call once per optimizer step, to record ``time.perf_counter()`` per call, then
runs ``tune run`` in-process. Steps per second = ``--steps`` / (time of the last step's log call -
time of the ``--warmup``-th step's log call): start-up, the first ``--warmup`` steps and the final
checkpoint save are excluded, and both recipes are measured exactly the same way. Runs alternate
(stock, ours, stock, ours, ... ``--repeats`` each) so noise from other processes hits both; the
table shows the median of each and the ratio of the medians. Bar: ours / stock >= 0.99, by steps per second
and by median step time.

``--compile``: both with ``compile: True`` (torchtune's per-layer compile; ours marks the batch's sizes
dynamic); raise ``--warmup`` so the measured steps do not include compiling. ``--glibc-tunables T``: both
children get ``GLIBC_TUNABLES=T`` (e.g. a fixed ``glibc.malloc.mmap_threshold``, which takes glibc's dynamic
threshold, and so the process's allocation history, out of the comparison). ``--prefree-mib N``: each child first
allocates and frees one N MiB block, which raises glibc's dynamic thresholds in both (mmap N MiB, trim 2N MiB; left
alone they stay at 1.84 and 3.67 MiB in every run here), so that little of the heap's top is given back between
steps, wherever the process's long-lived blocks lie. ``--phases``: the child also
wraps the functions both recipes call in a step (data loader, model forward, loss, backward, clipping, optimizer step,
zero_grad) and counts the page faults and time inside each; a table gives the median per step of each, and the
rest of the step as ``other`` (the wrappers and the reads below add to both), with glibc's heap at its largest
(``mallinfo2``) and its trim and mmap thresholds (read from its ``mp_``, found with ``gdb`` when installed).
``--together``: each repeat's two runs at the same time, each pinned to its own core (swapped every repeat), so
that a machine whose speed drifts slows both alike; the table adds how much their measured windows overlap, each
pair's ratio by steps/s and by median step time, and the bar applied to the medians of those paired ratios (the
estimate a paired design calls for) beside the bar on the ratio of the two recipes' medians.

Epoch switch: ours runs once more with per-epoch batch growth (``--switch-epochs`` epochs of
``--switch-steps`` steps, ``batch_increase_function`` = ``--switch-function`` with
``--switch-arg`` keyword arguments); the recipe logs a line with ``Epoch switch`` and ``(took X ms)``
at every switch; the median of those is reported ("n/a" when the recipe logs no such line).

With the defaults the whole script takes about 4 minutes on 2 busy CPU cores (each child spends
about 7 s starting up, then about 0.1 s per step). Timings on a shared machine are noisy: prefer
more ``--repeats`` to more ``--steps``; the table also shows 1 / the median step time, which
bursts of load from other processes move less. At glibc's defaults a run's minor page faults per step (printed
for each run) differ from one process to the next, for either recipe, and its speed with them (about 2.4 us a
fault on the 2-core machine): ``--glibc-tunables`` takes that out.

The exit code is 0 whether or not the bar is met (PASS/FAIL is printed); it is 1 only when a run
itself failed.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib
import json
import os
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_tables import report  # noqa: E402

BAR_RATIO = 0.99
OURS_RECIPE = "adaptive_full_finetune"
STOCK_RECIPE = "full_finetune_single_device"
CONFIG = "tiny_full"
TINY_DIR = Path("/tmp/adaptive-batching/tiny")

# Top-level keys torchtune 0.6.1's full_finetune_single_device reads (cfg.x / cfg.get("x")).
STOCK_KEYS = (
    "output_dir", "model", "tokenizer", "dataset", "seed", "shuffle", "checkpointer", "resume_from_checkpoint",
    "batch_size", "epochs", "max_steps_per_epoch", "gradient_accumulation_steps", "optimizer", "lr_scheduler",
    "loss", "optimizer_in_bwd", "clip_grad_norm", "compile", "device", "dtype", "enable_activation_checkpointing",
    "enable_activation_offloading", "metric_logger", "log_every_n_steps", "log_peak_memory_stats", "profiler",
    "collate_fn", "cudnn_deterministic_mode",
)
# What the stock recipe requires (or would otherwise turn on) that ours' config does not say.
STOCK_REQUIRED = {
    "optimizer_in_bwd": False,
    "enable_activation_offloading": False,
    "log_peak_memory_stats": False,
    "profiler": {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
    "resume_from_checkpoint": False,
    "compile": False,
}
SWITCH_LINE = re.compile(r"Epoch switch.*?took ([0-9]+(?:\.[0-9]+)?) ?ms")


# --------------------------------------------------------------------------- child side: timed `tune run`
def _number(value: Any) -> Optional[float]:
    return None if value is None else float(value)


PHASES = {  # name: (module, attribute path) of a function both recipes call in each step
    "data": ("torch.utils.data.dataloader", "_BaseDataLoaderIter.__next__"),
    "forward": ("torchtune.modules", "TransformerDecoder.forward"),
    "loss": ("torchtune.modules.loss", "CEWithChunkedOutputLoss.forward"),
    "backward": ("torch.autograd", "backward"),
    "clip": ("torch.nn.utils", "clip_grad_norm_"),
    "optimizer": ("torch.optim", "AdamW.step"),
    "zero_grad": ("torch.optim", "Optimizer.zero_grad"),
}


def _malloc_and_free(size: int) -> None:
    """One glibc block of ``size`` bytes, allocated and freed: above glibc's mmap threshold (128 KiB at start) it is
    mmapped, and freeing it raises the dynamic threshold to ``size`` and the trim threshold to twice that (glibc moves
    them only for a block of at most 32 MiB, its header included)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(size))


@functools.lru_cache(maxsize=None)
def _libc() -> Optional[tuple[str, int]]:
    """This process's libc.so.6: its path and the address it is loaded at (read once: reading the maps takes ms)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if fields[-1].endswith("/libc.so.6") and fields[2] == "00000000":
            return fields[-1], int(fields[0].split("-")[0], 16)
    return None


def _mp_offset() -> Optional[int]:
    """Where glibc keeps its malloc parameters (``mp_``, a static symbol) in libc.so.6, from ``gdb``; None without."""
    libc = _libc()
    if libc is None or shutil.which("gdb") is None:
        return None
    out = subprocess.run(["gdb", "-batch", "-ex", "info address mp_", libc[0]], capture_output=True, text=True,
                         timeout=60).stdout
    match = re.search(r"at address (0x[0-9a-f]+)", out)
    return int(match.group(1), 16) if match else None


def _glibc_thresholds() -> Optional[tuple[int, int]]:
    """glibc's trim and mmap thresholds now, read from its ``mp_`` (``trim_threshold``, ``top_pad``,
    ``mmap_threshold`` are its first fields), at the offset the parent found (``BENCH_MP_OFFSET``)."""
    offset, libc = os.environ.get("BENCH_MP_OFFSET"), _libc()
    if not offset or libc is None:
        return None
    fields = (ctypes.c_ulong * 3).from_address(libc[1] + int(offset))
    return int(fields[0]), int(fields[2])


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.lru_cache(maxsize=None)
def _mallinfo2() -> Optional[Any]:
    try:
        function = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


def _heap_bytes() -> Optional[int]:
    """glibc's main heap plus its mmapped blocks (``mallinfo2``), or None without glibc."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return int(info.arena + info.hblkhd)


def _watch_phases() -> dict[str, list[float]]:
    """Wrap each function of :data:`PHASES` to sum, per phase, the minor page faults and seconds spent inside
    it (outermost calls only): ``{phase: [faults, seconds]}``, read at each metric line."""
    totals: dict[str, list[float]] = {name: [0.0, 0.0] for name in PHASES}
    depth = [0]

    def wrap(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def watched(*a: Any, **kw: Any) -> Any:
            if depth[0]:
                return fn(*a, **kw)
            depth[0] += 1
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                depth[0] -= 1
                total = totals[name]
                total[0] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                total[1] += time.perf_counter() - t0
        return watched

    for name, (module, path) in PHASES.items():
        owner: Any = importlib.import_module(module)
        *parents, attr = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        setattr(owner, attr, wrap(name, getattr(owner, attr)))
    return totals


def tune_child(stamps_path: str, tune_args: list[str]) -> int:
    """Run ``tune TUNE_ARGS`` in this process, recording when each metric line is logged."""
    prefree = int(os.environ.get("BENCH_PREFREE_MIB") or 0)
    if prefree:
        _malloc_and_free(prefree * 2**20)
    import torch
    from torchtune.training.metric_logging import DiskLogger

    threads = os.environ.get("BENCH_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    stamps: list[dict[str, Any]] = []
    original = DiskLogger.log_dict
    phases = _watch_phases() if os.environ.get("BENCH_PHASES") else None

    def timed_log_dict(self: Any, payload: Any, step: int) -> None:
        now = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        stamps.append({"step": int(step), "t": now, "loss": _number(payload.get("loss")),
                       "lr": _number(payload.get("lr")), "batch": _number(payload.get("micro_batch_size")),
                       "minor_faults": faults})
        if phases is not None:
            stamps[-1]["phases"] = {name: list(v) for name, v in phases.items()}
            stamps[-1]["heap_bytes"] = _heap_bytes()
            stamps[-1]["glibc_thresholds"] = _glibc_thresholds()
        original(self, payload, step)

    DiskLogger.log_dict = timed_log_dict
    from torchtune._cli.tune import main as tune_main

    sys.argv = ["tune", *tune_args]
    try:
        tune_main()  # the recipes end with sys.exit(recipe_main()): that SystemExit passes through
    finally:
        Path(stamps_path).write_text(json.dumps({"threads": torch.get_num_threads(), "stamps": stamps}))
    return 0


# --------------------------------------------------------------------------- arguments
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200,
                   help="optimizer steps measured per run (default 200, about 20 s per run here)")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps run first and not measured (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each recipe, alternating (default 3)")
    p.add_argument("--batch-size", type=int, default=8, help="micro batch, same for both (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokenizer.max_seq_len (default 256)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for both (default 0: the stock recipe's sampler always uses 0, so only then "
                        "do both see the same batches)")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP/MKL threads and torch.set_num_threads for every child (default 1)")
    p.add_argument("--switch-only", action="store_true", help="only measure the epoch-switch cost")
    p.add_argument("--no-switch", action="store_true", help="skip the epoch-switch run")
    p.add_argument("--switch-epochs", type=int, default=3, help="epochs of the epoch-switch run (default 3)")
    p.add_argument("--switch-steps", type=int, default=5, help="steps per epoch of the epoch-switch run (default 5)")
    p.add_argument("--switch-function", default="adaptive_batching.growth.linear_ramp",
                   help="batch_increase_function._component_ of the epoch-switch run "
                        "(default adaptive_batching.growth.linear_ramp)")
    p.add_argument("--switch-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="keyword argument of the growth function, YAML value; repeatable (default increment=4)")
    p.add_argument("--assets", type=Path, default=TINY_DIR,
                   help=f"tiny assets directory, written when missing (default {TINY_DIR})")
    p.add_argument("--compile", action="store_true", help="both recipes with compile=True")
    p.add_argument("--glibc-tunables", default=None, help="GLIBC_TUNABLES for both children")
    p.add_argument("--prefree-mib", type=int, default=0,
                   help="each child first allocates and frees one block of this many MiB (at most 31), which raises "
                        "glibc's dynamic mmap threshold to it and the trim threshold to twice it, in both recipes, "
                        "before anything else runs (default 0: not done)")
    p.add_argument("--together", action="store_true",
                   help="run each repeat's two recipes at the same time, each pinned to its own core (swapped every "
                        "repeat): a machine whose speed drifts then slows both alike; needs 2 cores")
    p.add_argument("--phases", action="store_true",
                   help="also count page faults and time inside each part of a step, and read glibc's heap size and "
                        "thresholds at each (the wrappers sit outside the compiled regions, and add to both recipes)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON to this path")
    p.add_argument("--publish", action="store_true", help="write the report into docs/benchmarks.md")
    p.add_argument("--workdir", type=Path, default=None,
                   help="configs, run outputs and child logs (default: a temporary directory, removed afterwards)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    p.add_argument("--child-timeout", type=int, default=900, help="seconds before a child is killed (default 900)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1 or args.batch_size < 1 or args.seq_len < 1:
        p.error("--steps, --warmup, --repeats, --batch-size and --seq-len must be positive")
    if args.threads < 1 or args.switch_epochs < 2 or args.switch_steps < 1:
        p.error("--threads and --switch-steps must be positive, --switch-epochs at least 2")
    if args.switch_only and args.no_switch:
        p.error("--switch-only and --no-switch exclude each other")
    if args.together and len(os.sched_getaffinity(0)) < 2:
        p.error("--together needs 2 cores")
    if not 0 <= args.prefree_mib <= 31:
        p.error("--prefree-mib must be between 0 and 31 (glibc's dynamic mmap threshold moves only for a block of at "
                "most 32 MiB, its header included)")
    if args.switch_arg is None:
        args.switch_arg = ["increment=4"]
    return args


# --------------------------------------------------------------------------- configs
def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_assets(root: Path) -> Path:
    from adaptive_batching.assets.tiny import TinyAssetPaths, write_tiny_assets

    paths = TinyAssetPaths.from_root(root)
    needed = [paths.model_dir / "config.json", paths.model_dir / "model.safetensors", paths.tokenizer_path,
              paths.special_tokens_path, paths.dataset_path]
    if not all(p.is_file() for p in needed):
        log(f"writing the tiny assets to {root} ...")
        write_tiny_assets(root)
    return root


def ours_config(args: argparse.Namespace, output_dir: Path, epochs: int, steps_per_epoch: int) -> dict[str, Any]:
    """``tiny_full`` as our recipe reads it, with this benchmark's settings, fully resolved."""
    from omegaconf import OmegaConf

    from adaptive_batching.config.loading import load_config

    cfg = load_config(CONFIG, [
        f"assets_dir={args.assets}",
        f"output_dir={output_dir}",
        f"tokenizer.max_seq_len={args.seq_len}",
        f"batch_size={args.batch_size}",
        "gradient_accumulation_steps=1",
        f"epochs={epochs}",
        f"max_steps_per_epoch={steps_per_epoch}",
        f"seed={args.seed}",
        "use_maximum_batch_size=False",
        "device=cpu",
        "dtype=fp32",
        f"compile={args.compile}",
        "log_every_n_steps=1",
    ])
    out = OmegaConf.to_container(cfg, resolve=True)
    out["batch_increase_function"] = None
    if "save_every_n_steps" in out:  # mid-epoch checkpoints: the stock recipe has none
        out["save_every_n_steps"] = None
    out["metric_logger"] = {"_component_": "torchtune.training.metric_logging.DiskLogger",
                            "log_dir": str(output_dir / "logs")}
    return out


def stock_config(ours: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The stock recipe's config from ours: the keys it reads, plus the ones it requires switched off."""
    out = {k: v for k, v in ours.items() if k in STOCK_KEYS}
    dropped = sorted(k for k in ours if k not in STOCK_KEYS)
    for key, value in STOCK_REQUIRED.items():
        out.setdefault(key, value)
    out["profiler"] = dict(STOCK_REQUIRED["profiler"], output_dir=str(Path(out["output_dir"]) / "profiling_outputs"))
    return out, dropped


def write_yaml(data: dict[str, Any], path: Path) -> Path:
    from omegaconf import OmegaConf

    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(data), path)
    return path


def _yaml_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


# --------------------------------------------------------------------------- running
def child_env(args: argparse.Namespace) -> dict[str, str]:
    threads = str(args.threads)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
               BENCH_THREADS=threads, TOKENIZERS_PARALLELISM="false")
    for key in ("GLIBC_TUNABLES", "BENCH_PHASES", "BENCH_MP_OFFSET", "BENCH_PREFREE_MIB"):
        env.pop(key, None)
    if args.phases:
        env["BENCH_PHASES"] = "1"
        if args.mp_offset is not None:
            env["BENCH_MP_OFFSET"] = str(args.mp_offset)
    if args.prefree_mib:
        env["BENCH_PREFREE_MIB"] = str(args.prefree_mib)
    if args.glibc_tunables:
        env["GLIBC_TUNABLES"] = args.glibc_tunables
    return env


def run_recipe(args: argparse.Namespace, tag: str, recipe: str, cfg: dict[str, Any],
               cpu: Optional[int] = None) -> dict[str, Any]:
    """``tune run RECIPE --config <cfg>`` in a fresh child (pinned to core ``cpu`` when given); its per-step log
    stamps and output."""
    config_path = write_yaml(cfg, args.workdir / "configs" / f"{tag}.yaml")
    stamps_path = args.workdir / "stamps" / f"{tag}.json"
    stamps_path.parent.mkdir(parents=True, exist_ok=True)
    stamps_path.unlink(missing_ok=True)
    log_path = args.workdir / "logs" / f"{tag}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, os.path.abspath(__file__), "--tune-child", str(stamps_path),
               "run", recipe, "--config", str(config_path)]
    started = time.perf_counter()
    with open(log_path, "w") as log_file:
        try:
            pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
            code: Optional[int] = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT,
                                                 env=child_env(args), cwd=args.workdir, preexec_fn=pin,
                                                 timeout=args.child_timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    result: dict[str, Any] = {"tag": tag, "recipe": recipe, "exit_code": code,
                              "child_seconds": time.perf_counter() - started, "log": str(log_path),
                              "output": log_path.read_text(errors="replace")}
    if stamps_path.exists():
        result.update(json.loads(stamps_path.read_text()))
    else:
        result["stamps"] = []
    if code != 0:
        tail = " | ".join(result["output"].strip().splitlines()[-4:])[-400:]
        result["error"] = f"{'timed out' if code is None else f'exit code {code}'}: {tail}"
    return result


def steps_per_second(stamps: list[dict[str, Any]], warmup: int, steps: int) -> Optional[float]:
    """Steps after the first ``warmup`` per second, from the log-call times (None if too few steps)."""
    if len(stamps) < warmup + steps:
        return None
    times = [s["t"] for s in stamps[: warmup + steps]]
    return steps / (times[-1] - times[warmup - 1])


def median_step_rate(stamps: list[dict[str, Any]], warmup: int, steps: int) -> Optional[float]:
    """1 / the median step interval over the same steps: less sensitive to bursts from other processes."""
    if len(stamps) < warmup + steps:
        return None
    times = [s["t"] for s in stamps[warmup - 1: warmup + steps]]
    return 1.0 / statistics.median(b - a for a, b in zip(times, times[1:]))


def faults_per_step(stamps: list[dict[str, Any]], warmup: int, steps: int) -> Optional[float]:
    """Minor page faults per measured step: memory the allocator handed out fresh (zeroed by the kernel) in the
    step, which slows the kernels that first touch it."""
    if len(stamps) < warmup + steps or "minor_faults" not in stamps[0]:
        return None
    return (stamps[warmup + steps - 1]["minor_faults"] - stamps[warmup - 1]["minor_faults"]) / steps


def throughput_runs(args: argparse.Namespace) -> dict[str, Any]:
    total = args.warmup + args.steps
    runs: dict[str, list[dict[str, Any]]] = {"stock": [], "ours": []}
    dropped: list[str] = []
    cores = sorted(os.sched_getaffinity(0))[:2]

    def one(i: int, name: str) -> dict[str, Any]:
        nonlocal dropped
        tag = f"{name}_{i + 1}"
        output_dir = args.workdir / "runs" / tag
        ours = ours_config(args, output_dir, epochs=1, steps_per_epoch=total)
        if name == "ours":
            recipe, cfg = OURS_RECIPE, ours
        else:
            recipe, (cfg, dropped) = STOCK_RECIPE, stock_config(ours)
        # together: the two share a time window, each on its own core, the cores swapped every repeat
        cpu = cores[(i + (name == "ours")) % 2] if args.together else None
        log(f"run {i + 1}/{args.repeats}: {name} ({recipe}, {total} steps"
            + (f", core {cpu}" if cpu is not None else "") + ") ...")
        result = run_recipe(args, tag, recipe, cfg, cpu=cpu)
        result["steps_per_second"] = steps_per_second(result["stamps"], args.warmup, args.steps)
        result["median_step_rate"] = median_step_rate(result["stamps"], args.warmup, args.steps)
        result["faults_per_step"] = faults_per_step(result["stamps"], args.warmup, args.steps)
        if result["steps_per_second"] is None and "error" not in result:
            result["error"] = (f"only {len(result['stamps'])} steps logged, need {total} "
                               f"(is the dataset too small for batch {args.batch_size}?)")
        sps = result["steps_per_second"]
        log(f"  {name}: " + (f"{sps:.3f} steps/s" if sps else "no figure")
            + f", child {result['child_seconds']:.1f} s, {result.get('threads', '?')} thread(s)"
            + (f" [{result['error']}]" if "error" in result else ""))
        shutil.rmtree(output_dir, ignore_errors=True)  # checkpoints: not needed, and they take space
        return result

    for i in range(args.repeats):
        if args.together:
            with ThreadPoolExecutor(max_workers=2) as pool:
                pair = dict(zip(("stock", "ours"), pool.map(lambda name: one(i, name), ("stock", "ours"))))
        else:
            pair = {name: one(i, name) for name in ("stock", "ours")}  # alternate so that noise hits both
        for name, result in pair.items():
            runs[name].append(result)
    return {"runs": runs, "dropped_keys": dropped}


def pair_ratios(runs: dict[str, list[dict[str, Any]]], key: str = "steps_per_second") -> list[float]:
    """ours / stock by ``key`` (steps per second, or ``median_step_rate``), for each repeat in which both ran."""
    return [o[key] / s[key] for o, s in zip(runs["ours"], runs["stock"]) if o[key] and s[key]]


def window_overlaps(runs: dict[str, list[dict[str, Any]]], warmup: int, steps: int) -> list[float]:
    """For each repeat, the share of the shorter measured window (from the ``warmup``-th step's log line to the
    last measured one) that the other run's window covers: 1.0 when the two ran side by side throughout."""
    shares = []
    for ours, stock in zip(runs["ours"], runs["stock"]):
        if len(ours["stamps"]) < warmup + steps or len(stock["stamps"]) < warmup + steps:
            continue
        a = (ours["stamps"][warmup - 1]["t"], ours["stamps"][warmup + steps - 1]["t"])
        b = (stock["stamps"][warmup - 1]["t"], stock["stamps"][warmup + steps - 1]["t"])
        common = min(a[1], b[1]) - max(a[0], b[0])
        shares.append(max(common, 0.0) / min(a[1] - a[0], b[1] - b[0]))
    return shares


def loss_check(runs: dict[str, list[dict[str, Any]]]) -> Optional[dict[str, Any]]:
    """Same batches, same LR schedule? The first runs' per-step losses and LRs, ours vs stock."""
    stock = next((r for r in runs["stock"] if r["stamps"]), None)
    ours = next((r for r in runs["ours"] if r["stamps"]), None)
    if stock is None or ours is None:
        return None
    out: dict[str, Any] = {}
    for key in ("loss", "lr"):
        a = {s["step"]: s[key] for s in stock["stamps"] if s.get(key) is not None}
        b = {s["step"]: s[key] for s in ours["stamps"] if s.get(key) is not None}
        common = sorted(set(a) & set(b))
        if not common:
            return None
        out[key] = {"steps": len(common), "max_abs_diff": max(abs(a[k] - b[k]) for k in common),
                    "max_rel_diff": max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for k in common)}
    return out


def switch_run(args: argparse.Namespace) -> dict[str, Any]:
    """Ours with per-epoch batch growth; the recipe's own 'Epoch switch ... took X ms' lines."""
    tag = "ours_switch"
    output_dir = args.workdir / "runs" / tag
    cfg = ours_config(args, output_dir, epochs=args.switch_epochs, steps_per_epoch=args.switch_steps)
    function: dict[str, Any] = {"_component_": args.switch_function}
    for item in args.switch_arg:
        key, _, value = item.partition("=")
        function[key.strip()] = _yaml_value(value)
    cfg["batch_increase_function"] = function
    log(f"epoch-switch run: ours, {args.switch_epochs} epochs x {args.switch_steps} steps, "
        f"batch_increase_function = {function} ...")
    result = run_recipe(args, tag, OURS_RECIPE, cfg)
    shutil.rmtree(output_dir, ignore_errors=True)
    lines = [line.strip() for line in result["output"].splitlines() if "Epoch switch" in line]
    took = [float(m.group(1)) for line in lines if (m := SWITCH_LINE.search(line))]
    # Context from the log-call times: the whole gap at an epoch boundary (end-of-epoch checkpoint save,
    # the switch, the first step of the new epoch) against an ordinary step's time.
    t = {s["step"]: s["t"] for s in result["stamps"]}
    boundaries = [e * args.switch_steps for e in range(1, args.switch_epochs)]
    gaps = [(t[b + 1] - t[b]) * 1e3 for b in boundaries if b in t and b + 1 in t]
    ordinary = [(t[b + 2] - t[b + 1]) * 1e3 for b in boundaries if b + 1 in t and b + 2 in t]  # same batch size
    out = {"function": function, "epochs": args.switch_epochs, "steps_per_epoch": args.switch_steps,
           "boundary_gap_ms": gaps, "ordinary_step_ms": statistics.median(ordinary) if ordinary else None,
           "exit_code": result["exit_code"], "switch_ms": took, "lines": lines[:20],
           "median_ms": statistics.median(took) if took else None,
           "batches": sorted({s["batch"] for s in result["stamps"] if s.get("batch") is not None}),
           "log": result["log"]}
    if "error" in result:
        out["error"] = result["error"]
    log(f"  epoch switch: {len(took)} line(s) with a time" + (f" [{out['error']}]" if "error" in out else ""))
    return out


# --------------------------------------------------------------------------- report
def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summarise(args: argparse.Namespace, measured: dict[str, Any]) -> dict[str, Any]:
    rows = []
    medians: dict[str, Optional[float]] = {}
    for name, recipe in (("ours", OURS_RECIPE), ("stock", STOCK_RECIPE)):
        runs = measured["runs"][name]
        figures = [r["steps_per_second"] for r in runs if r["steps_per_second"] is not None]
        medians[name] = statistics.median(figures) if figures else None
        per_step = [r["median_step_rate"] for r in runs if r["median_step_rate"] is not None]
        faults = [r["faults_per_step"] for r in runs if r.get("faults_per_step") is not None]
        rows.append({"recipe": f"{name}: {recipe}", "steps_measured": args.steps, "median": medians[name],
                     "runs": [r["steps_per_second"] for r in runs],
                     "median_step_rate": statistics.median(per_step) if per_step else None,
                     "faults_per_step": statistics.median(faults) if faults else None,
                     "faults_runs": [r.get("faults_per_step") for r in runs],
                     "errors": [r["error"] for r in runs if "error" in r]})
    ratio = (medians["ours"] / medians["stock"]) if medians["ours"] and medians["stock"] else None
    a, b = rows[0]["median_step_rate"], rows[1]["median_step_rate"]
    return {"rows": rows, "ratio": ratio, "median_step_ratio": a / b if a and b else None,
            "passed": ratio is not None and ratio >= BAR_RATIO and a is not None and b is not None and a / b >= BAR_RATIO,
            "same_computation": loss_check(measured["runs"]), "dropped_keys": measured["dropped_keys"]}


def print_table(summary: dict[str, Any]) -> None:
    print("| recipe | steps measured | steps/s (median) | runs (steps/s, in order) | 1 / median step time | "
          "minor page faults / step |")
    print("|---|---:|---:|---|---:|---:|")
    for row in summary["rows"]:
        runs = ", ".join(_fmt(v, ".3f") for v in row["runs"])
        print(f"| {row['recipe']} | {row['steps_measured']} | {_fmt(row['median'], '.3f')} | {runs} | "
              f"{_fmt(row['median_step_rate'], '.3f')} | {_fmt(row.get('faults_per_step'), '.0f')} |")
    print("minor page faults / step, runs in the order above: " + "; ".join(
        f"{row['recipe'].split(':')[0]} " + ", ".join(_fmt(v, ".0f") for v in row.get("faults_runs", []))
        for row in summary["rows"]))
    for row in summary["rows"]:
        for error in row["errors"]:
            print(f"  {row['recipe']} failed: {error}")
    ratio = summary["ratio"]
    verdict = "PASS" if summary["passed"] else "FAIL"
    print(f"ours / stock = {_fmt(ratio, '.3f')}x by steps/s, {_fmt(summary.get('median_step_ratio'), '.3f')}x by median "
          f"step time (bar: both >= {BAR_RATIO:g}x): {verdict}")
    check = summary["same_computation"]
    if check is None:
        print("per-step loss and LR, ours vs stock: not compared (no common steps)")
    else:
        loss, lr = check["loss"], check["lr"]
        same = loss["max_rel_diff"] < 1e-4 and lr["max_rel_diff"] < 1e-6
        print(f"per-step loss, ours vs stock: max relative diff {loss['max_rel_diff']:.1e}; LR: {lr['max_rel_diff']:.1e}; "
              f"over {loss['steps']} steps ("
              + ("same batches, same LR schedule: the same computation" if same
                 else "NOT the same computation: the figures are not comparable") + ")")


def print_switch(switch: Optional[dict[str, Any]]) -> None:
    if switch is None:
        return
    if switch["switch_ms"]:
        times = ", ".join(f"{t:.1f}" for t in switch["switch_ms"])
        print(f"epoch switch: median {switch['median_ms']:.1f} ms over {len(switch['switch_ms'])} switches "
              f"({times} ms; micro batches seen: {', '.join(f'{b:g}' for b in switch['batches']) or '-'})")
    else:
        why = switch.get("error") or "the recipe logged no 'Epoch switch ... (took X ms)' line"
        print(f"epoch switch: n/a ({why})")
    if switch["boundary_gap_ms"] and switch["ordinary_step_ms"] is not None:
        print(f"  (the recipe times the new dataloader and LR; the whole gap between the last step of an epoch and "
              f"the first of the next, with the checkpoint save, is median {statistics.median(switch['boundary_gap_ms']):.0f} ms "
              f"against {switch['ordinary_step_ms']:.0f} ms for the step after it)")


def phases_per_step(stamps: list[dict[str, Any]], warmup: int, steps: int) -> Optional[dict[str, tuple[float, float]]]:
    """Per measured step, each phase's minor page faults and microseconds, and the rest of the step as ``other``."""
    if len(stamps) < warmup + steps or "phases" not in stamps[0]:
        return None
    first, last = stamps[warmup - 1], stamps[warmup + steps - 1]
    out = {name: ((last["phases"][name][0] - first["phases"][name][0]) / steps,
                  (last["phases"][name][1] - first["phases"][name][1]) * 1e6 / steps) for name in PHASES}
    out["other"] = ((last["minor_faults"] - first["minor_faults"]) / steps - sum(v[0] for v in out.values()),
                    (last["t"] - first["t"]) * 1e6 / steps - sum(v[1] for v in out.values()))
    return out


def median_phases(runs: dict[str, list[dict[str, Any]]], warmup: int,
                  steps: int) -> Optional[dict[str, dict[str, tuple[float, float]]]]:
    """The median over runs of each phase's faults and microseconds per step: ``{recipe: {phase: (faults, us)}}``."""
    per = {name: [p for p in (phases_per_step(r["stamps"], warmup, steps) for r in runs[name]) if p]
           for name in ("ours", "stock")}
    if not per["ours"] or not per["stock"]:
        return None
    medians = {name: {phase: (statistics.median(p[phase][0] for p in per[name]),
                              statistics.median(p[phase][1] for p in per[name])) for phase in [*PHASES, "other"]}
               for name in per}
    heaps = {name: [max(s.get("heap_bytes") or 0 for s in r["stamps"][warmup - 1:warmup + steps]) for r in runs[name]
                    if r["stamps"]] for name in per}
    for name in per:
        medians[name]["heap MB (glibc), the largest at a metric line"] = (statistics.median(heaps[name]) / 2**20, None)
        seen = {tuple(s["glibc_thresholds"]) for r in runs[name] for s in r["stamps"][warmup - 1:warmup + steps]
                if s.get("glibc_thresholds")}
        for label, index in (("trim", 0), ("mmap", 1)):
            values = sorted({t[index] for t in seen})
            if values:  # the lowest and the highest over every measured step of every run
                medians[name][f"glibc {label} threshold MiB, lowest / highest"] = (values[0] / 2**20,
                                                                                   values[-1] / 2**20)
    return medians


def print_phases(phases: dict[str, dict[str, tuple[float, float]]]) -> None:
    print("\nper step, median over runs (--phases): minor page faults, then microseconds\n")
    print("| phase | faults ours | faults stock | us ours | us stock |")
    print("|---|---:|---:|---:|---:|")
    for phase in phases["ours"]:
        ours, stock = phases["ours"][phase], phases["stock"][phase]
        if phase.startswith("glibc"):
            print(f"| {phase} | {ours[0]:.2f} / {ours[1]:.2f} | {stock[0]:.2f} / {stock[1]:.2f} | - | - |")
            continue
        cells = [_fmt(value, ".0f") for value in (ours[0], stock[0], ours[1], stock[1])]
        print(f"| {phase} | " + " | ".join(cells) + " |")


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--tune-child"]:
        return tune_child(argv[1], argv[2:])
    args = parse_args(argv)
    print(f"$ {shlex.join([sys.executable, *sys.argv])}", flush=True)
    temporary = args.workdir is None
    args.workdir = Path(tempfile.mkdtemp(prefix="recipe_vs_torchtune_")) if temporary else args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.assets = args.assets.resolve()
    args.mp_offset = _mp_offset() if args.phases else None
    failed = False
    try:
        ensure_assets(args.assets)
        log(f"work directory {args.workdir} (child logs in {args.workdir / 'logs'})")
        figures: dict[str, Any] = {
            "settings": {"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                         "batch_size": args.batch_size, "gradient_accumulation_steps": 1,
                         "seq_len": args.seq_len, "seed": args.seed, "threads": args.threads,
                         "config": CONFIG, "device": "cpu", "dtype": "fp32", "compile": args.compile,
                         "glibc_tunables": args.glibc_tunables, "prefree_mib": args.prefree_mib,
                         "together": args.together},
            "bar_ratio": BAR_RATIO,
        }
        if not args.switch_only:
            measured = throughput_runs(args)
            summary = summarise(args, measured)
            figures.update(summary)
            figures["phases"] = median_phases(measured["runs"], args.warmup, args.steps) if args.phases else None
            figures["window_overlaps"] = (window_overlaps(measured["runs"], args.warmup, args.steps)
                                          if args.together else None)
            figures["pair_ratios"] = pair_ratios(measured["runs"]) if args.together else None
            figures["pair_step_ratios"] = (pair_ratios(measured["runs"], "median_step_rate") if args.together
                                           else None)
            failed |= any(row["errors"] for row in summary["rows"])
        switch = None if args.no_switch else switch_run(args)
        figures["epoch_switch"] = switch
        name = ("recipe-vs-torchtune" + ("-compiled" if args.compile else "")
                + ("-glibc" if args.glibc_tunables else "") + ("-prefree" if args.prefree_mib else "")
                + ("-together" if args.together else ""))
        with report(name if args.publish else None):
            print(f"{CONFIG}, batch {args.batch_size} x 1, seq {args.seq_len}, fp32, cpu, {args.threads} thread(s), "
                  f"seed {args.seed}" + (", compile=True" if args.compile else "")
                  + (f", GLIBC_TUNABLES={args.glibc_tunables}" if args.glibc_tunables else "")
                  + (f", one {args.prefree_mib} MiB block freed at start" if args.prefree_mib else "")
                  + (", each repeat's two runs at the same time on their own cores" if args.together else "")
                  + ("" if args.switch_only
                                         else f"; {args.warmup} warm-up + {args.steps} measured steps per run"))
            if not args.switch_only:
                print_table(summary)
                pairs = figures["pair_ratios"]
                if figures["window_overlaps"] and pairs:
                    print(f"measured windows of each pair overlap: "
                          f"{', '.join(f'{100 * share:.0f}%' for share in figures['window_overlaps'])}; "
                          f"ours / stock in each pair, by steps/s: {', '.join(f'{r:.3f}' for r in pairs)} "
                          f"(median {statistics.median(pairs):.3f}x)")
                    steps = figures["pair_step_ratios"]
                    if steps:
                        paired = (statistics.median(pairs), statistics.median(steps))
                        print(f"ours / stock in each pair, by median step time: {', '.join(f'{r:.3f}' for r in steps)}"
                              f" (median {paired[1]:.3f}x); the pairs' medians, {paired[0]:.3f}x by steps/s and "
                              f"{paired[1]:.3f}x by median step time (bar: both >= {BAR_RATIO:g}x): "
                              + ("PASS" if min(paired) >= BAR_RATIO else "FAIL"))
                if figures["phases"]:
                    print_phases(figures["phases"])
                if summary["dropped_keys"]:
                    print(f"keys of ours' config the stock recipe does not read (left out of its config): "
                          f"{', '.join(summary['dropped_keys'])}")
            print_switch(switch)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(figures, indent=2, default=str))
            print(f"figures written to {args.json}")
    finally:
        if temporary and not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
        elif temporary:
            log(f"kept {args.workdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
