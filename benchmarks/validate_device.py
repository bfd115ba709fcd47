#!/usr/bin/env python
"""Validate the profiler on this device in one command: a JSON of every check and a Markdown table.

Checks and phases: docs/validation.md. Each run is a child: spawned on CUDA (a CUDA context never forks), else forked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # asking for CUDA must not initialise it here

from common import GIB, fmt, padding, run_logged  # noqa: E402

PHASES = (
    "assets",
    "full",
    "lora",
    "qlora",
    "tokens",
    "compile",
    "dpo",
    "kd",
    "qat",
    "bwd",
    "offload",
    "estimate",
    "oom",
    "preempt",
    "nccl",
    "stock",
)
CUDA_ONLY = {
    "offload": "activation offloading (torchtune's OffloadActivations) needs CUDA streams",
    "nccl": "NCCL is CUDA's process-group backend",
}
GPU_CONFIGS = HERE.parent / "configs"  # the 1B's DPO and KD configs (the shipped ones are tiny or need a download)
QAT = ["quantizer._component_=torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer"]
BWD = [
    "optimizer_in_bwd=True",
    "optimizer._component_=bitsandbytes.optim.PagedAdamW8bit",
    "clip_grad_norm=null",
    "adaptive_batching.grow_past_memory=skip",
]


@dataclass(frozen=True)
class Method:
    """A row's recipe, its config and extra overrides per model, and its data: long alpaca samples or long pairs."""

    recipe: str
    configs: dict[str, tuple[str, tuple[str, ...]]]
    data: str = "long"


METHODS = {
    "full": Method("adaptive_full_finetune", {"tiny": ("tiny_full", ()), "llama3_2_1b": ("llama3_2_1b", ())}),
    "lora": Method("adaptive_lora_finetune", {"tiny": ("tiny_lora", ()), "llama3_2_1b": ("llama3_2_1b_lora", ())}),
    # QLoRA of the 1B model: its LoRA config with NF4 base weights (the tiny one has a config of its own).
    "qlora": Method(
        "adaptive_lora_finetune",
        {"tiny": ("tiny_qlora", ()), "llama3_2_1b": ("llama3_2_1b_lora", ("model.quantize_base=True",))},
    ),
    "lora_dpo": Method(
        "adaptive_lora_dpo",
        {"tiny": ("tiny_lora_dpo", ()), "llama3_2_1b": (str(GPU_CONFIGS / "llama3_2_1b_lora_dpo.yaml"), ())},
        data="pairs",
    ),
    "full_dpo": Method(
        "adaptive_full_dpo",
        {"tiny": ("tiny_full_dpo", ()), "llama3_2_1b": (str(GPU_CONFIGS / "llama3_2_1b_full_dpo.yaml"), ())},
        data="pairs",
    ),
    "kd": Method(
        "adaptive_knowledge_distillation",
        {"tiny": ("tiny_kd", ()), "llama3_2_1b": (str(GPU_CONFIGS / "llama3_2_1b_kd.yaml"), ())},
    ),
    # QAT as torchtune's QAT configs: groups of 256 on the 1B; of 32 in the tiny one (its layers are 64 and 192 wide).
    "qat_lora": Method(
        "adaptive_lora_finetune",
        {"tiny": ("tiny_qat_lora", ()), "llama3_2_1b": ("llama3_2_1b_lora", (*QAT, "quantizer.groupsize=256"))},
    ),
    "qat_full": Method(
        "adaptive_full_finetune",
        {
            "tiny": ("tiny_full", (*QAT, "quantizer.groupsize=32")),
            "llama3_2_1b": ("llama3_2_1b", (*QAT, "quantizer.groupsize=256")),
        },
    ),
    # optimizer_in_bwd with bitsandbytes' PagedAdamW8bit, as torchtune's llama3_2/1B_full_single_device.
    "bwd": Method(
        "adaptive_full_finetune",
        {"tiny": ("tiny_full", tuple(BWD)), "llama3_2_1b": ("llama3_2_1b", (*BWD, "~optimizer.fused"))},
    ),
    "offload": Method(
        "adaptive_full_finetune",
        {
            m: (c, ("enable_activation_offloading=True",))
            for m, c in (("tiny", "tiny_full"), ("llama3_2_1b", "llama3_2_1b"))
        },
    ),
}
# Each phase's settings: (method, activation checkpointing, compile).
SETTINGS = {
    "full": (("full", False, False), ("full", True, False)),
    "lora": (("lora", False, False), ("lora", True, False)),
    "qlora": (("qlora", False, False),),
    "compile": (("full", False, True), ("lora", False, True)),
    "dpo": (("lora_dpo", False, False), ("full_dpo", False, False)),
    "kd": (("kd", False, False),),
    "qat": (("qat_lora", False, False), ("qat_full", False, False)),
    "bwd": (("bwd", False, False),),
    "offload": (("offload", True, False),),
}
# Settings that also get the fresh-process truth and the estimate (default of --truth).
TRUTH = ("full/ac_off", "lora/ac_off", "full_dpo/ac_off", "kd/ac_off")
OURS_AT_STOCK_BATCH = ("full/ac_off", "lora/ac_off")  # of the truth settings: also our recipe at torchtune's batch
WARMUP = 1  # first steps left out of tokens/s
STOCK_BATCH = 4  # torchtune's llama3_2/1B_full and 1B_lora configs: batch_size 4 (x 1 here)
# Stock torchtune beside ours (phase stock): (stock recipe, config, our setting it is compared with) per model.
STOCK = {
    "tiny": {
        "finetune": ("full_finetune_single_device", "tiny_full", "full/ac_off"),
        "dpo": ("lora_dpo_single_device", "tiny_lora_dpo", "lora_dpo/ac_off"),
    },
    "llama3_2_1b": {
        "finetune": ("full_finetune_single_device", "llama3_2/1B_full_single_device", "full/ac_off"),
        "dpo": ("lora_dpo_single_device", "llama3_1/8B_lora_dpo_single_device", "lora_dpo/ac_off"),
    },
}
# The stock 1B DPO config is the 8B one: the 1B LoRA model and checkpoint in its place.
STOCK_1B_DPO = [
    "model._component_=torchtune.models.llama3_2.lora_llama3_2_1b",
    "checkpointer.checkpoint_files=[model.safetensors]",
    "checkpointer.model_type=LLAMA3_2",
]
DEFAULTS = {  # per device type: model, seq len, budgets, steps, long and token-phase samples, launcher, threads
    "cpu": dict(
        model="tiny",
        seq_len=128,
        budget="48MiB",
        compile_budget="128MiB",
        steps=5,
        long_samples=1000,
        token_samples=240,
        launcher="fork",
        threads=1,
    ),
    "cuda": dict(
        model="llama3_2_1b",
        seq_len=2048,
        budget=None,
        compile_budget=None,
        steps=50,
        long_samples=4096,
        token_samples=2000,
        launcher="spawn",
        threads=0,
    ),
}


def _instrument(record: dict[str, Any], spec: dict[str, Any]) -> None:
    """Measure each step and time each epoch through the trainer's hooks; skip checkpoints (unless the spec keeps
    them) and the profile's plot. ``spec["fault"]`` plants an out-of-memory error in a step (``oom_at``) or sends
    this process a signal after one (``signal_at``); ``record_samples`` records which samples each step trained."""
    import weakref

    import torch

    from adaptive_batching.profiling import profiler as profiling_run
    from adaptive_batching.profiling import report as profile_report
    from adaptive_batching.runtime import memory
    from adaptive_batching.training import hooks

    fault = spec.get("fault") or {}

    class Measured(hooks.TrainerHooks):
        meter: Any = None
        samples = 0
        epoch_start = 0.0
        parts: Any = staticmethod(lambda: None)
        in_step = False
        ballast: Any = None
        pending: list = []
        taken: list = []
        sizes: list = []

        def collate(self, inner: Any) -> Any:
            if not spec.get("record_samples"):
                return inner

            def collate(samples: list) -> Any:
                self.pending.extend(_sample_key(sample) for sample in samples)
                return inner(samples)

            return collate

        def after_setup(self, parts: Any) -> None:
            import torch.distributed as dist

            from adaptive_batching.training.state import Checkpoints

            self.parts = weakref.ref(parts)
            record["parallel"] = {
                "world_size": parts.parallel.world_size,
                "backend": dist.get_backend() if dist.is_initialized() else None,
                "fsdp": any("FSDP" in type(m).__name__ for m in parts.model.modules()),
            }
            if not spec.get("keep_saves"):
                Checkpoints.save = lambda *args, **kwargs: None  # type: ignore[method-assign]  # this child only

        def before_epoch(self, parts: Any, epoch: int) -> None:
            self.epoch_start = time.perf_counter()

        def after_epoch(self, parts: Any, epoch: int) -> None:
            record["epoch_seconds"].append(time.perf_counter() - self.epoch_start)

        def before_step(self, parts: Any, micro_batches: list) -> None:
            self.taken, self.pending, self.in_step = self.pending, [], True
            self.sizes = [len(b["tokens"]) for b in micro_batches]
            self.samples = sum(self.sizes)
            self.meter = memory.PeakMeter(parts.device, parts.model, parts.optimizer).__enter__()

        def before_forward(self, batch: dict[str, Any]) -> None:
            parts = self.parts()
            if (
                not self.in_step
                or parts is None
                or fault.get("oom_at") != parts.progress.global_step + 1
                or record.get("planted")
            ):
                return
            if torch.cuda.is_available() and batch["tokens"].is_cuda:  # a real one: the allocator cannot serve the step
                torch.cuda.empty_cache()
                free = torch.cuda.mem_get_info()[0]
                self.ballast = torch.empty(max(0, free - 256 * 2**20), dtype=torch.uint8, device=batch["tokens"].device)
                record["planted"] = f"CUDA allocator: {free / GIB:.1f} GiB taken before the forward"
                return
            record["planted"] = "torch.OutOfMemoryError raised before the forward (no device memory to fill)"
            raise torch.OutOfMemoryError("planted: out of memory before the forward")

        def after_step(self, parts: Any, stats: Any) -> None:
            meter, self.meter, self.in_step = self.meter, None, False
            meter.__exit__(None, None, None)
            if self.ballast is not None:  # the planted error's memory back to the device, before the step again
                self.ballast = None
                torch.cuda.empty_cache()
            if stats is None:  # out of memory, recovered in place by the library
                record["oom_errors"] += 1
                record["oom_steps"].append(
                    {"step": parts.progress.global_step + 1, "micro_batches": self.sizes, "samples": self.taken}
                )
                return
            step = parts.progress.global_step + 1
            record["steps"].append(
                {
                    "step": step,
                    "samples": self.samples,
                    "micro_batches": self.sizes,
                    "tokens": stats.tokens,
                    "padded_tokens": stats.padded_tokens,
                    "seconds": stats.seconds,
                    "loss": float(stats.loss),
                    "peak_bytes": meter.peak_bytes,
                    "reserved_peak_bytes": meter.reserved_peak_bytes,
                    "alloc_retries": meter.alloc_retries,
                    **({"sample_keys": self.taken} if spec.get("record_samples") else {}),
                }
            )
            if fault.get("signal_at") == step:
                os.kill(os.getpid(), getattr(signal, fault.get("signal", "SIGUSR1")))

    hooks.install(Measured())
    profiling_run.write_report = lambda result, directory: {
        "json": profile_report.write_json(result, Path(directory) / "profile.json"),
        "png": "(not drawn)",
    }


def _sample_key(sample: dict[str, Any]) -> str:
    """A data set sample (a preference pair: both sequences) as a short stable key, to find it again."""
    import hashlib

    seqs = [sample["tokens"]] if "tokens" in sample else [sample["chosen_input_ids"], sample["rejected_input_ids"]]
    return hashlib.sha1(repr([list(map(int, s)) for s in seqs]).encode()).hexdigest()[:16]


def run_in_child(spec: dict[str, Any]) -> int:
    """Run ``spec`` in this process and write its record to ``spec['result']``; returns the exit code."""
    record: dict[str, Any] = {
        "steps": [],
        "oom_errors": 0,
        "oom_steps": [],
        "epoch_seconds": [],
        "error": None,
        "logged": [],
    }
    code = 1
    try:
        import torch
        from common import step_stamps

        if spec.get("threads"):
            torch.set_num_threads(int(spec["threads"]))  # a forked child's pool follows its parent's, not the env
        if spec.get("pin_cpu_allocator"):  # as the recipe does when it profiles on CPU: the same allocator rules
            from adaptive_batching.runtime import memory

            memory.pin_cpu_allocator()
        if spec.get("cap_bytes") and torch.cuda.is_available():
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, int(spec["cap_bytes"]) / total), 0)
        if spec["kind"] == "function":  # a helper below, away from the parent's memory
            record["value"] = HELPERS[spec["function"]](*spec.get("args", []))
            code = 0
        else:
            if spec["kind"] == "tune" and not spec.get("stock"):
                _instrument(record, spec)
            with step_stamps(_logged) as record["logged"]:  # what the recipe logs each step (stock's too)
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


def _logged(payload: dict[str, Any], step: int) -> dict[str, Any]:
    """Of a recipe's logged step: its tokens per second and loss, and the peaks torchtune logs on CUDA (GiB)."""
    keys = ("tokens_per_second_per_gpu", "loss", "peak_memory_active", "peak_memory_reserved")
    return {key: float(payload[key]) for key in keys if payload.get(key) is not None}


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
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1


def preload() -> None:
    """Import what every run needs before forking, then ``gc.freeze()`` them: collections skip them (0.5 s each)."""
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


def _fork_and_wait(spec: dict[str, Any], out: Any, env: dict[str, str], timeout: float, cwd: Path) -> bool:
    """Fork; the child runs the spec with its output in ``out``; True if it was killed for the timeout."""
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
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return True
        time.sleep(0.05)
    return False


def device_info(kind: str) -> dict[str, Any]:
    """The device of ``kind`` (cuda or cpu): name, memory and versions, for the results file."""
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cpu_count": os.cpu_count(), "platform": platform.platform()}
    if kind != "cuda":
        return dict(
            info,
            type="cpu",
            name=platform.processor() or platform.machine(),
            memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        )
    props = torch.cuda.get_device_properties(0)
    return dict(info, type="cuda", name=props.name, memory_bytes=int(props.total_memory), cuda=torch.version.cuda)


def write_assets(root: str, model: str) -> dict[str, Any]:
    """The tiny assets, or ``model``'s random-initialised checkpoint next to them (as the CLI writes them)."""
    from adaptive_batching.assets.models import write_model_assets
    from adaptive_batching.assets.tiny import write_tiny_assets

    if model == "tiny":
        paths = write_tiny_assets(root)
        return {"root": str(paths.root), "model_dir": str(paths.model_dir)}

    paths = write_model_assets(root, model)
    size = (paths.model_dir / "model.safetensors").stat().st_size
    return {"root": str(paths.tiny.root), "model_dir": str(paths.model_dir), "checkpoint_bytes": size}


def write_long_dataset(source: str, target: str, seq_len: int, num_samples: int) -> dict[str, Any]:
    """Alpaca records of at least ``seq_len`` words (so tokens): micro batches of the profiler's worst-case shape."""
    records = json.loads(Path(source).read_text())
    out, index = [], 0
    for i in range(num_samples):
        words: list[str] = []
        instruction = f"{i}. " + records[index % len(records)]["instruction"]  # numbered: no two samples alike
        while len(words) < seq_len:
            words.extend(records[index % len(records)]["output"].split())
            index += 1
        out.append({"instruction": instruction, "input": "", "output": " ".join(words)})
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    Path(target).write_text(json.dumps(out))
    return {"path": target, "samples": num_samples, "min_words": min(len(r["output"].split()) for r in out)}


def write_long_pairs(source: str, target: str, seq_len: int, num_samples: int) -> dict[str, Any]:
    """Preference pairs whose chosen and rejected answers both have at least ``seq_len`` words (DPO's worst case)."""
    records = json.loads(Path(source).read_text())
    out, index = [], 0
    for _ in range(num_samples):
        answers = []
        for _side in ("chosen", "rejected"):
            words: list[str] = []
            while len(words) < seq_len:
                words.extend(records[index % len(records)]["output"].split())
                index += 1
            answers.append(" ".join(words))
        prompt = {"role": "user", "content": f"{len(out)}. " + records[index % len(records)]["instruction"]}
        out.append(
            {
                side: [prompt, {"role": "assistant", "content": answer}]
                for side, answer in zip(("chosen", "rejected"), answers)
            }
        )
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    Path(target).write_text(json.dumps(out))
    return {"path": target, "samples": num_samples}


HELPERS = {
    "write_assets": write_assets,
    "write_long_dataset": write_long_dataset,
    "write_long_pairs": write_long_pairs,
    "padding": padding,
}


def setting_key(method: str, ac: bool, compiled: bool = False) -> str:
    return f"{method}/ac_{'on' if ac else 'off'}" + ("/compile" if compiled else "")


ALL_SETTINGS = tuple(setting_key(*s) for settings in SETTINGS.values() for s in settings)
PHASE_OF = {setting_key(*s): phase for phase, settings in SETTINGS.items() for s in settings}


class Validation:
    """The checks of one device, run in child processes, accumulated in one JSON file."""

    def __init__(self, args: argparse.Namespace, device: dict[str, Any]) -> None:
        self.args, self.device, self.work = args, device, args.workdir
        self.assets = args.assets or self.work / "assets"
        data = args.data_dir or self.work / "data"
        self.long_data, self.long_pairs = data / f"long_{args.seq_len}.json", data / f"pairs_{args.seq_len}.json"
        self.results: dict[str, Any] = json.loads(args.json.read_text()) if args.json.exists() else {}
        self.results.setdefault("settings", {})
        self.results.setdefault("checks", {})
        self.results["device"] = device
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        if args.threads:  # every child: OpenMP/MKL pools and torch.set_num_threads (run_in_child)
            self.env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        self.count = 0

    def save(self) -> None:
        self.args.json.parent.mkdir(parents=True, exist_ok=True)
        self.args.json.write_text(json.dumps(self.results, indent=2, sort_keys=True, default=str) + "\n")

    def launch(self, tag: str, spec: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
        """Run ``spec`` in a child, killed past ``timeout`` seconds; its record with ``wall_seconds`` and ``log``."""
        self.count += 1
        log = self.work / "logs" / f"{self.count:03d}-{tag}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        (result := log.with_suffix(".json")).unlink(missing_ok=True)
        spec = dict(spec, threads=self.args.threads, result=str(result))
        started = time.perf_counter()
        if self.args.launcher == "spawn" or spec.get("torchrun"):
            log.with_suffix(".spec.json").write_text(json.dumps(spec))
            # torchrun as `tune run --nproc_per_node 1` calls it (standalone), its one worker this script's child
            launcher = (
                ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"] if spec.get("torchrun") else []
            )
            command = [sys.executable, *launcher, str(HERE), "--child", str(log.with_suffix(".spec.json"))]
            timed_out = run_logged(command, log, timeout, env=self.env, cwd=log.parent) is None
        else:
            with open(log, "w") as out:
                timed_out = _fork_and_wait(spec, out, self.env, timeout, log.parent)
        record = (
            json.loads(result.read_text())
            if result.exists()
            else {"steps": [], "oom_errors": 0, "epoch_seconds": [], "exit_code": None, "error": "no result written"}
        )
        if timed_out:
            record.update(exit_code=None, error=f"timed out after {timeout:.0f} s")
        record.update(wall_seconds=time.perf_counter() - started, log=str(log))
        status = (
            "ok"
            if record["exit_code"] == 0
            else f"exit code {record['exit_code']}" + (f" ({record['error']})" if record.get("error") else "")
        )
        print(f"  {tag}: {status}, {record['wall_seconds']:.1f} s", flush=True)
        return record

    def function(self, tag: str, name: str, *args: Any) -> Any:
        if (record := self.launch(tag, {"kind": "function", "function": name, "args": list(args)}))["exit_code"] != 0:
            raise SystemExit(f"{tag} failed: {record['error']} (log {record['log']})")
        return record["value"]

    def config(self, method: str) -> str:
        return METHODS[method].configs[self.args.model][0]

    def overrides(
        self, method: str, ac: bool, out: Path, *, long_data: bool = True, compiled: bool = False
    ) -> list[str]:
        """The config overrides every run of a setting shares."""
        a, spec = self.args, METHODS[method]
        config, extra = spec.configs[a.model]
        if a.model == "tiny" or config.endswith(".yaml"):  # the tiny configs and ours under benchmarks/configs
            base = [f"assets_dir={self.assets}", f"device={self.device['type']}", f"tokenizer.max_seq_len={a.seq_len}"]
        else:
            from adaptive_batching.assets.models import ModelAssetPaths, recipe_overrides

            base = [
                *recipe_overrides(ModelAssetPaths.from_root(self.assets, a.model), a.seq_len),
                f"device={self.device['type']}",
            ]
        if long_data:
            base.append(f"dataset.data_files={self.long_pairs if spec.data == 'pairs' else self.long_data}")
        chosen = a.compile_budget if compiled else a.budget
        budget = [f"adaptive_batching.memory_budget={chosen}"] if chosen else []
        return [
            *base,
            *extra,
            "dtype=bf16",
            f"enable_activation_checkpointing={ac}",
            "epochs=1",
            "adaptive_batching.keep_global_batch=False",
            "gradient_accumulation_steps=1",
            "batch_increase_function=null",
            "adaptive_batching.growth_interval=epoch",
            "lr_scaling=null",
            "lr_scheduler=null",
            "seed=0",
            "compile=False",
            "log_every_n_steps=1",
            "save_every_n_steps=null",
            f"output_dir={out}",
            f"adaptive_batching.cache_dir={out / 'cache'}",
            *budget,
        ]

    def recipe(
        self,
        tag: str,
        method: str,
        ac: bool,
        extra: list[str],
        *,
        long_data: bool = True,
        cap: int | None = None,
        compiled: bool = False,
        fresh: bool = True,
        **spec: Any,
    ) -> tuple[dict[str, Any], Path]:
        """A recipe run; on CPU with the allocator rules the profiler pins, so that runs differ only in the batch.
        ``spec``: the child's fault, ``keep_saves``, ``record_samples`` or ``torchrun``; ``fresh=False`` keeps the
        output folder (a resume)."""
        out = self.work / "runs" / tag.removesuffix("-resumed")
        if fresh:
            shutil.rmtree(out, ignore_errors=True)
        argv = [
            "run",
            METHODS[method].recipe,
            "--config",
            self.config(method),
            *self.overrides(method, ac, out, long_data=long_data, compiled=compiled),
            *extra,
        ]
        spec = {
            "kind": "tune",
            "argv": argv,
            "cap_bytes": cap,
            "pin_cpu_allocator": self.device["type"] == "cpu",
            **spec,
        }
        return self.launch(tag, spec), out

    def phase_assets(self) -> None:
        a = self.args
        marker = self.assets / (a.model if a.model != "tiny" else "model") / "model.safetensors"
        if a.assets is None or not marker.exists():
            self.results["assets"] = self.function("assets", "write_assets", str(self.assets), a.model)
        if a.model == "tiny" and not (self.assets / "tiny_qlora" / "model.safetensors").exists():
            self.results["assets_qlora"] = self.function("assets-qlora", "write_assets", str(self.assets), "tiny_qlora")
        self.results["long_data"] = self.function(
            "long-data",
            "write_long_dataset",
            str(self.assets / "data" / "alpaca_tiny.json"),
            str(self.long_data),
            a.seq_len,
            a.long_samples,
        )
        self.results["long_pairs"] = self.function(
            "long-pairs",
            "write_long_pairs",
            str(self.assets / "data" / "alpaca_tiny.json"),
            str(self.long_pairs),
            a.seq_len,
            a.long_samples,
        )

    def skipped_off_cuda(self, key: str, phase: str) -> bool:
        """A CUDA-only row off CUDA: recorded as such (never silently missing); True when skipped."""
        if self.device["type"] == "cuda" or phase not in CUDA_ONLY:
            return False
        section = "settings" if key in ALL_SETTINGS else "checks"
        self.results[section][key] = {"cuda_only": CUDA_ONLY[phase], "skipped": f"CUDA only: {CUDA_ONLY[phase]}"}
        return True

    def phase_setting(self, method: str, ac: bool, compiled: bool = False) -> None:
        key = setting_key(method, ac, compiled)
        if self.skipped_off_cuda(key, PHASE_OF[key]):
            return
        tag = key.replace("/", "-")
        entry: dict[str, Any] = {
            "method": method,
            "activation_checkpointing": ac,
            "compile": compiled,
            "recipe": METHODS[method].recipe,
            "config": Path(self.config(method)).name,
            "overrides": list(METHODS[method].configs[self.args.model][1]),
        }
        if method == "bwd" and self.device["type"] != "cuda":
            entry["cuda_only"] = "PagedAdamW8bit's paging (bitsandbytes keeps its state in host memory off CUDA)"
        extra = ["use_maximum_batch_size=True", f"max_steps_per_epoch={self.args.steps}"]
        record, out = self.recipe(f"{tag}-profile", method, ac, [*extra, f"compile={compiled}"], compiled=compiled)
        profile_path = out / "profile" / "profile.json"
        self.results["settings"][key] = entry
        if not profile_path.exists():
            why = record.get("error") or _last_line(Path(record["log"])) or f"exit code {record['exit_code']}"
            entry["error"] = f"no profile report ({why}; log {record['log']})"
            return
        profile = json.loads(profile_path.read_text())
        budget = int(profile["budget_bytes"])
        entry["profile"] = {
            k: profile[k]
            for k in (
                "micro_batch",
                "max_micro_batch",
                "estimate",
                "budget_bytes",
                "budget_source",
                "trial_steps",
                "seconds",
                "seq_len",
            )
        }
        # The epoch ends when the long data set does: at a large micro batch that is before --steps steps.
        requested = min(self.args.steps, math.ceil(self.args.long_samples / max(1, profile["micro_batch"])))
        entry["steps"] = dict(
            summarise_steps(record, requested, budget, WARMUP), data_limited=requested < self.args.steps
        )
        if key in self.args.truth and not compiled:
            entry["true_max"] = self.bisect(tag, method, ac, profile["max_micro_batch"], budget)
        if key in self.args.truth and key in OURS_AT_STOCK_BATCH:
            stock, _ = self.recipe(
                f"{tag}-stock",
                method,
                ac,
                ["use_maximum_batch_size=False", f"batch_size={STOCK_BATCH}", f"max_steps_per_epoch={self.args.steps}"],
            )
            entry["stock"] = dict(summarise_steps(stock, self.args.steps, budget, WARMUP), batch=STOCK_BATCH)

    def fits(self, tag: str, method: str, ac: bool, n: int, budget: int) -> dict[str, Any]:
        """One fresh process of 2 steps at micro batch ``n``: did it fit the budget?"""
        record, _ = self.recipe(
            f"{tag}-trial-{n}",
            method,
            ac,
            [
                "use_maximum_batch_size=False",
                f"batch_size={n}",
                "max_steps_per_epoch=2",
                "adaptive_batching.oom_recovery=False",
            ],
            cap=budget if self.device["type"] == "cuda" else None,
        )
        steps, retries = record["steps"], sum(s["alloc_retries"] for s in record["steps"])
        peak = max((s["peak_bytes"] for s in steps[1:]), default=None)
        reserved = max((s["reserved_peak_bytes"] or 0 for s in steps[1:]), default=0)
        ok = (
            record["exit_code"] == 0
            and record["oom_errors"] == 0
            and len(steps) == 2
            and retries == 0
            and peak is not None
            and peak <= budget
            and reserved <= budget
        )
        return {
            "micro_batch": n,
            "fits": ok,
            "peak_bytes": peak,
            "reserved_peak_bytes": reserved or None,
            "alloc_retries": retries,
            "oom_errors": record["oom_errors"],
            "exit_code": record["exit_code"],
            "seconds": round(record["wall_seconds"], 2),
        }

    def bisect(self, tag: str, method: str, ac: bool, start: int, budget: int) -> dict[str, Any]:
        """Gallop up (or halve down) to a bracket [fits, fails), then bisect to ``--tolerance`` or ``--max-trials``."""
        limit = max(1, self.args.long_samples // 2)  # 2 steps of n samples from the long data set
        trials: list[dict[str, Any]] = []
        lo: int | None = None
        hi: int | None = None
        n = min(start, limit)

        def gap_ok() -> bool:
            return lo is not None and hi is not None and hi - lo <= max(1, math.floor(self.args.tolerance * lo))

        step = max(1, math.ceil(self.args.tolerance * n))
        while len(trials) < self.args.max_trials and not gap_ok():
            trials.append(self.fits(tag, method, ac, n, budget))
            lo, hi = (n, hi) if trials[-1]["fits"] else (lo, n)
            if hi is None:  # gallop up
                if n >= limit:
                    break
                n, step = min(limit, n + step), step * 2
            elif lo is None:  # halve down
                if n == 1:
                    break
                n = max(1, n // 2)
            else:
                n = (lo + hi) // 2
                if n in (lo, hi):
                    break
        return {
            "largest_fit": lo,
            "smallest_fail": hi,
            "limit": limit,
            "trials": trials,
            "resolved": gap_ok() or (lo is not None and hi == lo + 1),
        }

    def phase_estimate(self) -> None:
        """``adaptive-batching estimate`` at each profile's budget, for the settings with the fresh-process truth."""
        for key, entry in sorted(self.results["settings"].items()):
            if key not in self.args.truth or "profile" not in entry or "estimate" in entry:
                continue
            method, ac, tag = entry["method"], entry["activation_checkpointing"], f"{key.replace('/', '-')}-estimate"
            out = self.work / "runs" / tag
            out.mkdir(parents=True, exist_ok=True)
            argv = [
                "estimate",
                "--config",
                self.config(method),
                "--device-memory",
                str(entry["profile"]["budget_bytes"]),
                "--fraction",
                "1.0",
                "--json",
                str(out / "estimate.json"),
                *self.overrides(method, ac, out),
            ]
            record = self.launch(tag, {"kind": "cli", "argv": argv})
            if record["exit_code"] == 0 and (out / "estimate.json").exists():
                est = json.loads((out / "estimate.json").read_text())
                entry["estimate"] = {
                    k: est[k] for k in ("max_micro_batch", "budget_bytes", "fit_micro_batch", "method", "seconds")
                }
                entry["estimate"]["wall_seconds"] = round(record["wall_seconds"], 2)
            else:
                entry["estimate"] = {"error": f"{record.get('error')} (log {record['log']})"}
            self.save()

    def shared_profile(self, name: str) -> Path:
        """A cache folder with the full/ac_off profile (same model, length and budget): the run skips profiling."""
        cache = self.work / "runs" / f"{name}-cache"
        shutil.rmtree(cache, ignore_errors=True)
        profiled = self.work / "runs" / "full-ac_off-profile" / "cache"
        if not profiled.is_dir():  # that row did not run here: a profile of its own, shared by the next phases
            profiled = self.work / "runs" / "shared-profile" / "cache"
            if not profiled.is_dir():
                self.recipe("shared-profile", "full", False, ["use_maximum_batch_size=True", "max_steps_per_epoch=1"])
        if profiled.is_dir():
            shutil.copytree(profiled, cache)
        return cache

    def phase_tokens(self) -> None:
        """Fixed micro batches (profiled) against a token budget (auto, similar lengths), one epoch each."""
        a = self.args
        shared = [
            f"dataset.split=train[:{a.token_samples}]",
            "max_steps_per_epoch=null",
            "use_maximum_batch_size=True",
            f"adaptive_batching.cache_dir={self.shared_profile('tokens')}",
        ]
        modes = {
            "fixed": [],
            "token budget": ["adaptive_batching.max_tokens=auto", "adaptive_batching.picking_order=seqlen"],
        }
        runs: dict[str, Any] = {}
        for mode, extra in modes.items():
            tag = "tokens-" + mode.replace(" ", "-")
            record, out = self.recipe(tag, "full", False, [*shared, *extra], long_data=False)
            text = Path(record["log"]).read_text(errors="replace")
            seconds, tokens = sum(record["epoch_seconds"]), sum(s["tokens"] for s in record["steps"])
            chosen = re.search(r"chosen micro batch (\d+);", text)
            budget = re.search(r"Token budget: (\d+) padded tokens", text)
            runs[mode] = {
                "exit_code": record["exit_code"],
                "steps": len(record["steps"]),
                "epoch_seconds": seconds,
                "tokens": tokens,
                "oom_errors": record["oom_errors"],
                "tokens_per_second": tokens / seconds if seconds > 0 else None,
                "micro_batch": int(chosen.group(1)) if chosen else None,
                "profile_from_cache": "Profiler: using the cached profile" in text,
                "max_tokens": int(budget.group(1)) if budget else None,
            }
        cfg_overrides = self.overrides("full", False, self.work / "runs" / "tokens-padding", long_data=False)
        micro, max_tokens = runs["fixed"]["micro_batch"], runs["token budget"]["max_tokens"]
        waste = (
            self.function(
                "tokens-padding", "padding", self.config("full"), [*cfg_overrides, shared[0]], micro or 1, max_tokens
            )
            if micro
            else {}
        )
        for mode in modes:
            if mode in waste:
                runs[mode].update(waste[mode])
        self.results["token_budget"] = {
            "samples": a.token_samples,
            "real_tokens": waste.get("real_tokens"),
            "runs": runs,
        }

    def phase_oom(self) -> None:
        """An out-of-memory error planted in optimizer step 2 (CUDA: the allocator filled before its forward) is
        recovered in place: the same samples again in smaller micro batches, and every step trains once."""
        n, at = 4, 2
        record, _ = self.recipe(
            "oom",
            "full",
            False,
            [
                "use_maximum_batch_size=True",
                f"max_steps_per_epoch={n}",
                f"adaptive_batching.cache_dir={self.shared_profile('oom')}",
            ],
            fault={"oom_at": at},
            record_samples=True,
        )
        steps, failed = record["steps"], record["oom_steps"]
        keys = [k for s in steps for k in s["sample_keys"]]
        retried = next((s for s in steps if s["step"] == at), None)
        entry = dict(
            summarise_steps(record, n, 0, WARMUP),
            planted=record.get("planted"),
            planted_at=at,
            failed_attempts=[{k: f[k] for k in ("step", "micro_batches")} for f in failed],
            retried_micro_batches=retried["micro_batches"] if retried else None,
            steps_trained=[s["step"] for s in steps],
            same_samples_again=bool(
                failed and retried and sorted(retried["sample_keys"]) == sorted(failed[0]["samples"])
            ),
            every_sample_once=len(keys) == len(set(keys)) > 0,
        )
        entry["micro_batch"] = steps[0]["samples"] if steps else None
        entry["ok"] = (
            record["exit_code"] == 0
            and entry["steps_trained"] == list(range(1, n + 1))
            and len(failed) == 1
            and failed[0]["step"] == at
            and entry["same_samples_again"]
            and entry["every_sample_once"]
            and retried is not None
            and len(retried["micro_batches"]) > 1
        )
        self.results["checks"]["oom"] = entry

    def phase_preempt(self) -> None:
        """SIGUSR1 after optimizer step 2 saves and exits 75; the resumed run's steps 3-4 have the losses of a run
        that was never stopped, bit for bit."""
        n, at = 4, 2
        shared = [
            "use_maximum_batch_size=True",
            f"max_steps_per_epoch={n}",
            f"adaptive_batching.cache_dir={self.shared_profile('preempt')}",
        ]
        whole, _ = self.recipe("preempt-whole", "full", False, shared)
        stopped, out = self.recipe(
            "preempt-stopped", "full", False, shared, fault={"signal_at": at, "signal": "SIGUSR1"}, keep_saves=True
        )
        resumed, _ = self.recipe(
            "preempt-stopped-resumed", "full", False, [*shared, "resume_from_checkpoint=True"], fresh=False
        )
        text = Path(stopped["log"]).read_text(errors="replace")
        losses = {
            name: {s["step"]: s["loss"] for s in run["steps"]}
            for name, run in (("whole", whole), ("stopped", stopped), ("resumed", resumed))
        }
        joined = {**losses["stopped"], **losses["resumed"]}
        diffs = [abs(joined[k] - v) for k, v in losses["whole"].items() if k in joined]
        entry = {
            "signal_at": at,
            "requested": n,
            "micro_batch": whole["steps"][0]["samples"] if whole["steps"] else None,
            "exit_codes": {
                "whole": whole["exit_code"],
                "stopped": stopped["exit_code"],
                "resumed": resumed["exit_code"],
            },
            "stop_line": next((line.strip()[:300] for line in text.splitlines() if "stopped: SIGUSR1" in line), None),
            "steps": {name: sorted(v) for name, v in losses.items()},
            "bit_for_bit": sorted(joined) == sorted(losses["whole"]) == list(range(1, n + 1))
            and all(joined[k] == v for k, v in losses["whole"].items()),
            "max_loss_difference": max(diffs, default=None),
            "oom_errors": sum(r["oom_errors"] for r in (whole, stopped, resumed)),
            "alloc_retries": sum(s["alloc_retries"] for r in (whole, stopped, resumed) for s in r["steps"]),
            "max_peak_bytes": max(
                (s["peak_bytes"] or 0 for r in (whole, stopped, resumed) for s in r["steps"]), default=None
            ),
        }
        entry["ok"] = (
            entry["exit_codes"] == {"whole": 0, "stopped": 75, "resumed": 0}
            and entry["bit_for_bit"]
            and sorted(losses["stopped"]) == list(range(1, at + 1))
            and entry["stop_line"] is not None
        )
        self.results["checks"]["preempt"] = entry

    def phase_nccl(self) -> None:
        """The recipe as ``tune run --nproc_per_node 1`` starts it: one torchrun worker, a process group (NCCL on
        CUDA), the model sharded by FSDP2; profiled, then --steps steps at the chosen micro batch."""
        if self.skipped_off_cuda("nccl", "nccl") and not os.environ.get("VALIDATE_CUDA_ONLY_ON_CPU"):
            return
        record, out = self.recipe(
            "nccl",
            "full",
            False,
            ["use_maximum_batch_size=True", f"max_steps_per_epoch={self.args.steps}"],
            torchrun=True,
        )
        profile_path = out / "profile" / "profile.json"
        profile = json.loads(profile_path.read_text()) if profile_path.exists() else {}
        entry = dict(
            summarise_steps(record, self.args.steps, int(profile.get("budget_bytes") or 0), WARMUP),
            parallel=record.get("parallel"),
            profile={k: profile.get(k) for k in ("micro_batch", "max_micro_batch")},
        )
        parallel = record.get("parallel") or {}
        entry["ok"] = bool(
            record["exit_code"] == 0
            and entry["ran"] == self.args.steps
            and not entry["oom_errors"]
            and parallel.get("fsdp")
            and parallel.get("world_size") == 1
            and parallel.get("backend") == ("nccl" if self.device["type"] == "cuda" else "gloo")
        )
        self.results["checks"]["nccl"] = entry

    def stock_argv(self, objective: str, recipe: str, config: str, out: Path, compiled: bool) -> list[str]:
        """``tune run`` arguments of stock torchtune's ``recipe`` at its config's batch, on these assets and data."""
        a = self.args
        common = [
            f"max_steps_per_epoch={a.steps}",
            "gradient_accumulation_steps=1",
            "epochs=1",
            "seed=0",
            f"compile={compiled}",
            f"output_dir={out}",
            "enable_activation_checkpointing=False",
            "log_every_n_steps=1",
            f"metric_logger.log_dir={out / 'logs'}",
        ]
        data = self.long_pairs if objective == "dpo" else self.long_data
        if a.model == "tiny":  # our tiny config less the keys stock does not read, at torchtune's 1B batch
            from omegaconf import OmegaConf
            from recipe_vs_torchtune import stock_config

            from adaptive_batching.config.loading import load_config

            method = "lora_dpo" if objective == "dpo" else "full"
            shared = [x for x in self.overrides(method, False, out) if x != "lr_scheduler=null"]  # stock needs one
            ours = OmegaConf.to_container(
                load_config(self.config(method), [*shared, f"batch_size={STOCK_BATCH}", *common]), resolve=True
            )
            cfg, _ = stock_config(ours, recipe)
            (path := out / "stock.yaml").parent.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(OmegaConf.create(cfg), path)
            return ["run", recipe, "--config", str(path)]
        from adaptive_batching.assets.models import ModelAssetPaths, recipe_overrides

        paths = ModelAssetPaths.from_root(self.assets, a.model)
        files = recipe_overrides(paths, a.seq_len)
        if objective == "dpo":
            files = [x for x in files if not x.startswith("dataset.")] + [
                "dataset._component_=torchtune.datasets.preference_dataset",
                "dataset.source=json",
                "dataset.split=train",
                *STOCK_1B_DPO,
            ]
        return ["run", recipe, "--config", config, *files, f"dataset.data_files={data}", *common]

    def phase_stock(self) -> None:
        """Stock torchtune's recipe at its config's batch, compile off and on, beside ours at the profiled micro
        batch (the rows of the same objective): tokens per second as each recipe logs them, after the first step."""
        table: dict[str, Any] = {}
        for objective, (recipe, config, ours) in STOCK[self.args.model].items():
            runs: dict[str, Any] = {}
            for compiled in (False, True)[: 2 if self.args.stock_compile else 1]:
                tag = f"stock-{objective}" + ("-compile" if compiled else "")
                out = self.work / "runs" / tag
                shutil.rmtree(out, ignore_errors=True)
                record = self.launch(
                    tag,
                    {"kind": "tune", "stock": True, "argv": self.stock_argv(objective, recipe, config, out, compiled)},
                )
                runs["stock" + (" compile" if compiled else "")] = summarise_logged(record, self.args.steps)
            table[objective] = {"recipe": recipe, "config": config, "ours": ours, "runs": runs}
        self.results["stock"] = table

    def phase(self, name: str) -> None:
        print(f"phase {name}", flush=True)
        started = time.perf_counter()
        if name in SETTINGS:
            for setting in SETTINGS[name]:
                if setting_key(*setting) in self.args.settings:
                    self.phase_setting(*setting)
        else:
            getattr(self, f"phase_{name}")()
        self.results.setdefault("phases", {})[name] = {
            "seconds": round(time.perf_counter() - started, 1),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        self.save()


def summarise_logged(record: dict[str, Any], requested: int) -> dict[str, Any]:
    """A stock run from what it logged: steps, micro batch, median tokens/s after the first step, peaks (CUDA)."""
    logged = record.get("logged") or []
    timed = [s["tokens_per_second_per_gpu"] for s in logged[WARMUP:] if "tokens_per_second_per_gpu" in s]
    peaks = [s["peak_memory_active"] for s in logged if "peak_memory_active" in s]
    return {
        "requested": requested,
        "ran": len(logged),
        "exit_code": record["exit_code"],
        "error": record.get("error"),
        "micro_batch": STOCK_BATCH,  # the stock configs' batch_size (1B: both 4; tiny: set to it)
        "tokens_per_second": statistics.median(timed) if timed else None,
        "max_peak_bytes": max(peaks) * GIB if peaks else None,
        "wall_seconds": round(record["wall_seconds"], 2),
    }


def summarise_steps(record: dict[str, Any], requested: int, budget: int, warmup: int) -> dict[str, Any]:
    """What a run's steps did: count, OOMs, allocator retries, peaks, tokens/s after the first ``warmup``."""
    steps = record["steps"]
    timed = steps[warmup:] if len(steps) > warmup else steps
    seconds = sum(s["seconds"] for s in timed)
    peaks = [s["peak_bytes"] for s in steps if s["peak_bytes"] is not None]
    reserved = [s["reserved_peak_bytes"] for s in steps if s["reserved_peak_bytes"] is not None]
    logged = [
        s["tokens_per_second_per_gpu"]
        for s in (record.get("logged") or [])[warmup:]
        if "tokens_per_second_per_gpu" in s
    ]
    return {
        "requested": requested,
        "ran": len(steps),
        "exit_code": record["exit_code"],
        "error": record.get("error"),
        "oom_errors": record["oom_errors"],
        "alloc_retries": sum(s["alloc_retries"] for s in steps),
        "max_peak_bytes": max(peaks, default=None),
        "max_reserved_bytes": max(reserved, default=None),
        "budget_bytes": budget,
        "micro_batch": steps[0]["samples"] if steps else None,
        "tokens_per_second": sum(s["tokens"] for s in timed) / seconds if seconds > 0 else None,
        "logged_tokens_per_second": statistics.median(logged) if logged else None,
        "wall_seconds": round(record["wall_seconds"], 2),
    }


def _last_line(log: Path) -> str:
    """A failed run's last line of output (a config error is one line, no traceback)."""
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return lines[-1][-300:] if lines else ""


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.3f}"


def _true_max(entry: dict[str, Any]) -> str:
    true = entry.get("true_max")
    if not true:
        return "-"
    lo, hi = true["largest_fit"], true["smallest_fail"]
    bracket = f"{'-' if lo is None else lo} / {'-' if hi is None else hi}"
    if hi is None and lo is not None and lo >= true["limit"]:
        bracket += " (data limit)"
    return f"{bracket} ({len(true['trials'])})"


def _holds(entry: dict[str, Any]) -> str:
    """Is the chosen micro batch at most the largest that fitted a fresh process?"""
    true, profile = entry.get("true_max"), entry.get("profile")
    if not true or not profile or true["largest_fit"] is None:
        return "-"
    return "yes" if profile["micro_batch"] <= true["largest_fit"] else "NO"


def _steps(steps: dict[str, Any] | None) -> str:
    if not steps:
        return "-"
    ok = steps["exit_code"] == 0 and steps["oom_errors"] == 0 and steps["ran"] == steps["requested"]
    limit = " (all the data)" if steps.get("data_limited") else ""
    return (
        f"{steps['ran']}/{steps['requested']}{limit} {'ok' if ok else 'FAILED'}, {steps['oom_errors']} OOM, "
        f"{steps['alloc_retries']} retries, peak {_gib(steps['max_peak_bytes'])}"
    )


def _estimate(entry: dict[str, Any]) -> str:
    est, profile = entry.get("estimate"), entry.get("profile")
    if not est or "error" in est:
        return "error" if est else "-"
    ratio = est["max_micro_batch"] / profile["max_micro_batch"] if profile and profile["max_micro_batch"] else None
    return f"{est['max_micro_batch']} (x{fmt(ratio, '.2f')})"


def _render_checks(checks: dict[str, Any]) -> list[str]:
    """The out-of-memory, preemption and torchrun checks, one line each."""
    if not checks:
        return []
    lines = ["", "| check | result | micro batch | what it says |", "| --- | --- | ---: | --- |"]
    for name in ("oom", "preempt", "nccl"):
        c = checks.get(name)
        if c is None:
            continue
        if "skipped" in c:
            lines.append(f"| {name} | skipped | - | {c['skipped']} |")
            continue
        if name == "oom":
            said = (
                f"planted in step {c['planted_at']} ({c.get('planted')}): attempts {c['failed_attempts']}, "
                f"served again as {c['retried_micro_batches']}; steps {c['steps_trained']}, same samples again "
                f"{c['same_samples_again']}, every sample once {c['every_sample_once']}; "
                f"{c['ran']}/{c['requested']} steps, {c['alloc_retries']} retries, "
                f"peak {_gib(c['max_peak_bytes'])}"
            )
        elif name == "preempt":
            said = (
                f"SIGUSR1 after step {c['signal_at']}: exit codes {c['exit_codes']}; losses bit for bit "
                f"{c['bit_for_bit']} (largest difference {c['max_loss_difference']}); {c['oom_errors']} OOM, "
                f"{c['alloc_retries']} retries, peak {_gib(c['max_peak_bytes'])}"
            )
        else:
            said = f"{c.get('parallel')}; {_steps(c)}"
        lines.append(f"| {name} | {'ok' if c.get('ok') else 'FAILED'} | {fmt(c.get('micro_batch'))} | {said} |")
    return lines


def ours_beside_stock(results: dict[str, Any], objective: str) -> dict[str, Any]:
    """Our rows of a stock objective (eager and compiled), from whichever run or part measured them."""
    runs = {}
    ours = results["stock"][objective]["ours"]
    for suffix, name in (("", "ours"), ("/compile", "ours compile")):
        steps = results.get("settings", {}).get(ours + suffix, {}).get("steps")
        if steps:
            runs[name] = {
                "setting": ours + suffix,
                "micro_batch": steps["micro_batch"],
                "ran": steps["ran"],
                "requested": steps["requested"],
                "exit_code": steps["exit_code"],
                "error": steps["error"],
                "tokens_per_second": steps.get("logged_tokens_per_second"),
                "max_peak_bytes": steps["max_peak_bytes"],
            }
    return runs


def _render_stock(results: dict[str, Any]) -> list[str]:
    """Stock torchtune at its config's batch beside ours at the profiled micro batch, compile off and on."""
    stock = results.get("stock", {})
    if not stock:
        return []
    lines = [
        "",
        "Stock torchtune beside ours (tokens/s as each recipe logs them, median after the first step):",
        "",
        "| objective | run | micro batch | tokens/s | peak GiB | steps |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for objective, entry in stock.items():
        for name, run in {**entry["runs"], **ours_beside_stock(results, objective)}.items():
            what = entry["recipe"] if name.startswith("stock") else run.get("setting")
            steps = (
                (
                    f"{run['ran']}/{run['requested']}"
                    + ("" if run["exit_code"] == 0 else f" FAILED ({str(run.get('error'))[:120]})")
                )
                if "ran" in run
                else "-"
            )
            lines.append(
                f"| {objective} | {name}: {what} | {fmt(run.get('micro_batch'))} "
                f"| {fmt(run.get('tokens_per_second'), '.0f')} | {_gib(run.get('max_peak_bytes'))} "
                f"| {steps} |"
            )
    return lines


def merge_results(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Results of runs side by side (gpu_check.sh's lanes) as one: each row and check with every field any part
    gave it, the later part's on a clash; phases and commands kept by part."""
    merged: dict[str, Any] = {"settings": {}, "checks": {}, "phases": {}, "parts": []}
    for part in parts:
        for section in ("settings", "checks"):
            for key, entry in part.get(section, {}).items():
                merged[section].setdefault(key, {}).update(entry)
        merged["phases"].update(part.get("phases", {}))
        merged["parts"].append({"command": part.get("meta", {}).get("command"), "phases": part.get("phases", {})})
        for key in ("device", "meta"):  # the first part's: the header
            if key in part:
                merged.setdefault(key, dict(part[key]))
        for key in ("stock", "token_budget", "long_data", "long_pairs", "assets"):
            if key in part:
                merged[key] = part[key]
    if len({str(part.get("meta", {}).get("budget")) for part in parts}) > 1:  # lanes at their own budget
        merged["meta"]["budget"] = "each row's (the budget column)"
    return merged


def render(results: dict[str, Any]) -> str:
    """The settings table, then the token-budget table, with the device and the command."""
    device, meta = results.get("device", {}), results.get("meta", {})
    lines = [
        f"Device: {device.get('name', '?')} ({device.get('type', '?')}, "
        f"{_gib(device.get('memory_bytes'))} GiB), torch {device.get('torch', '?')}; model "
        f"{meta.get('model', '?')}, {meta.get('seq_len', '?')}-token samples, bf16, "
        f"budget {meta.get('budget') or 'the profiler' + chr(39) + 's own'}; command: `{meta.get('command', '?')}`",
        "",
        "| setting | budget GiB | chosen / largest ran (profile trials, s) | fresh-process fits / fails (runs) "
        "| chosen <= true max | steps at chosen | estimate (x largest ran) | tokens/s chosen | tokens/s stock 4x1 "
        "| speed-up |",
        "| --- | ---: | --- | --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for key, entry in sorted(results.get("settings", {}).items()):
        profile = entry.get("profile")
        if profile is None:
            why = entry.get("skipped") or entry.get("error", "no profile")
            lines.append(f"| {key} | - | {str(why)[:160]} | | | | | | | |")
            continue
        chosen = entry.get("steps", {}).get("tokens_per_second")
        stock = (entry.get("stock") or {}).get("tokens_per_second")
        lines.append(
            f"| {key} | {_gib(profile['budget_bytes'])} | {profile['micro_batch']} / {profile['max_micro_batch']} "
            f"({profile['trial_steps']}, {profile['seconds']:.1f}) | {_true_max(entry)} | {_holds(entry)} "
            f"| {_steps(entry.get('steps'))} | {_estimate(entry)} | {fmt(chosen, '.0f')} | {fmt(stock, '.0f')} "
            f"| {'-' if not chosen or not stock else f'x{chosen / stock:.2f}'} |"
        )
    lines += _render_checks(results.get("checks", {})) + _render_stock(results)
    tokens = results.get("token_budget")
    if tokens:
        lines += [
            "",
            f"Token budget against fixed micro batches: {tokens['samples']} samples of the long-tailed "
            f"data, one epoch each, full fine-tuning, checkpointing off",
            "",
            "| mode | micro batch | micro batches | padding waste | steps | tokens/s (training loop) |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for mode, run in tokens["runs"].items():
            size = f"{run['max_tokens']} tokens" if mode == "token budget" else f"{run['micro_batch']} samples"
            waste = run.get("waste")
            lines.append(
                f"| {mode} | {size} | {run.get('micro_batches', '-')} "
                f"| {'-' if waste is None else f'{100 * waste:.1f}%'} | {run['steps']} "
                f"| {fmt(run['tokens_per_second'], '.0f')} |"
            )
    for part in results.get("parts", []):
        lines += ["", f"Part: `{part['command']}`"]
    phases = results.get("phases", {})
    if phases:
        names = sorted(phases, key=lambda k: (PHASES.index(k) if k in PHASES else len(PHASES), k))
        lines += ["", "Phases (s): " + ", ".join(f"{k} {phases[k]['seconds']:.0f}" for k in names)]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", default="all", help=f"all (default), or comma-separated of: {', '.join(PHASES)}")
    p.add_argument("--settings", default=",".join(ALL_SETTINGS), help="comma-separated subset (default: all)")
    p.add_argument(
        "--truth",
        default=",".join(TRUTH),
        help=f"settings that also get the fresh-process truth and estimate (default {','.join(TRUTH)})",
    )
    p.add_argument(
        "--stock-compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the stock phase runs stock torchtune with compile=True too (default)",
    )
    p.add_argument("--table", action="store_true", help="only print the Markdown table of the JSON")
    p.add_argument("--merge", type=Path, nargs="+", help="merge these results files (runs side by side) into --json")
    p.add_argument("--json", type=Path, help="results file (default benchmarks/results/validation-<device>.json)")
    p.add_argument("--model", choices=("tiny", "llama3_2_1b"), help="default: llama3_2_1b on CUDA, tiny on CPU")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: 2048 on CUDA, 128 on CPU)")
    p.add_argument(
        "--budget", help="adaptive_batching.memory_budget (default: the profiler's own on CUDA, 48MiB on CPU)"
    )
    p.add_argument("--compile-budget", help="the compile phase's (default: --budget on CUDA; 128MiB on CPU)")
    p.add_argument("--steps", type=int, help="training steps at the chosen micro batch (default: 50 on CUDA, 5 on CPU)")
    p.add_argument("--long-samples", type=int, help="samples in the long data set (default: 4096 CUDA, 1000 CPU)")
    p.add_argument("--token-samples", type=int, help="samples of the token-budget phase (default: 2000 CUDA, 240 CPU)")
    p.add_argument("--tolerance", type=float, default=0.03, help="bisection stops at this gap (default 0.03)")
    p.add_argument("--max-trials", type=int, default=6, help="fresh processes per bisection (default 6)")
    p.add_argument("--threads", type=int, help="intra-op threads of every run (default 1 on CPU; 0: torch's choice)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/adaptive-batching/validate"))
    p.add_argument("--assets", type=Path, help="existing assets folder (default: written to WORKDIR/assets)")
    p.add_argument("--data-dir", type=Path, help="the long data sets, written by --phase assets (default WORKDIR/data)")
    args = p.parse_args(argv)
    args.phases = PHASES if args.phase == "all" else tuple(x for x in args.phase.split(",") if x)
    unknown = [x for x in args.phases if x not in PHASES]
    if unknown or not args.phases:
        p.error(f"--phase: unknown {unknown or args.phase!r}; use all or some of {', '.join(PHASES)}")
    args.settings = tuple(x for x in args.settings.split(",") if x)
    wrong = [x for x in args.settings if x not in ALL_SETTINGS]
    if wrong or not args.settings:
        p.error(f"--settings: unknown {wrong or args.settings!r}; use some of {', '.join(ALL_SETTINGS)}")
    args.truth = tuple(x for x in args.truth.split(",") if x)
    if wrong := [x for x in args.truth if x not in ALL_SETTINGS]:
        p.error(f"--truth: unknown {wrong!r}; use some of {', '.join(ALL_SETTINGS)}")
    if args.threads is not None and args.threads < 0:
        p.error(f"--threads must be >= 0, got {args.threads}")
    for name in ("seq_len", "steps", "long_samples", "token_samples", "max_trials"):
        if (value := getattr(args, name)) is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if not 0 <= args.tolerance < 1:
        p.error(f"--tolerance must be in [0, 1), got {args.tolerance}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # a spawned run (see launch)
        preload()  # the imports the run makes anyway, frozen, as in a forked child
        return run_in_child(json.loads(Path(argv[1]).read_text()))
    args = parse_args(argv)
    import torch

    kind = "cuda" if torch.cuda.is_available() else "cpu"
    for name, value in DEFAULTS[kind].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    device = device_info(kind)
    slug = re.sub(r"[^a-z0-9]+", "-", f"{kind} {device['name'] if kind == 'cuda' else ''}".lower()).strip("-")
    args.json = args.json or HERE.parent / "results" / f"validation-{slug}.json"
    args.markdown = args.json.with_suffix(".md")
    if args.merge:
        merged = merge_results([json.loads(path.read_text()) for path in args.merge if path.exists()])
        args.json.write_text(json.dumps(merged, indent=2, sort_keys=True, default=str) + "\n")
        args.markdown.write_text(render(merged))
    if args.table or args.merge:
        print(render(json.loads(args.json.read_text())))
        return 0
    args.workdir = args.workdir.resolve()
    args.assets = args.assets.resolve() if args.assets else None
    args.data_dir = args.data_dir.resolve() if args.data_dir else None
    if args.launcher == "fork":
        preload()
    validation = Validation(args, device)
    validation.results["meta"] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("table", "phases")},
    }
    started = time.perf_counter()
    for name in args.phases:
        validation.phase(name)
    validation.results["meta"]["seconds"] = round(time.perf_counter() - started, 1)
    validation.save()
    table = render(validation.results)
    args.markdown.write_text(table)
    print("\n" + table)
    print(f"written: {args.json}, {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
