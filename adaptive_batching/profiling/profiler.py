"""Running the profiler inside a recipe: budget, cache, cross-rank agreement and the report.

It reaches the run only through a :class:`ProfilerContext` and a trial-step callable (one measured
worst-case step at a given micro batch), so it knows nothing of the trainer.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adaptive_batching.core import logs
from adaptive_batching.faults.oom import is_out_of_memory
from adaptive_batching.profiling.budget import Budget, memory_budget
from adaptive_batching.profiling.cache import cache_file, load_profile, memory_fingerprint_parts, save_profile
from adaptive_batching.profiling.max_micro_batch import ProfileResult, TrialStep, find_max_micro_batch
from adaptive_batching.profiling.report import format_table, write_report
from adaptive_batching.profiling.search import choose_micro_batch
from adaptive_batching.profiling.settings import ProfilerSettings
from adaptive_batching.runtime import memory
from adaptive_batching.runtime.distributed import ParallelInfo, agree_on_trial, barrier, minimum_over_ranks
from adaptive_batching.runtime.files import fingerprint


@dataclass(frozen=True)
class ProfiledSetup:
    """What profiling needs from the config, read where the config is (``config``)."""

    memory: Mapping[str, Any]
    """The config's part of the profile cache's fingerprint: every key that changes a step's memory
    (see :func:`~adaptive_batching.profiling.cache.memory_fingerprint_parts`)."""
    output_dir: Path
    """The run's ``output_dir``: the report goes to its ``profile`` folder."""
    compile: bool
    """``compile``: one compiling step runs before the trials."""


@dataclass
class ProfilerContext:
    """What profiling needs from a run. ``preserved`` opens a context that puts the weights and optimizer
    state back afterwards; ``live_bytes`` is the tensor memory alive before the first trial."""

    setup: ProfiledSetup
    settings: ProfilerSettings
    device: torch.device
    parallel: ParallelInfo
    seq_len: int  # tokens in the worst-case sample the trial steps use
    seq_len_source: str  # where that length came from, for the report
    samples_per_rank: int
    preserved: Callable[[], AbstractContextManager[Any]]
    live_bytes: Callable[[], int]
    before_trial: Callable[[], None] = lambda: None  # e.g. stop on a scheduler's signal


def device_identity(device: torch.device) -> tuple[str, int]:
    """The device's name and total memory in bytes, for the cache fingerprint."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.name, int(props.total_memory)
    return f"cpu {platform.machine()} {platform.processor()}".strip(), os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES"
    )


def cache_location(context: ProfilerContext) -> tuple[Path, str]:
    """The profile cache file of this set-up and its fingerprint."""
    name, total = device_identity(context.device)
    key = fingerprint(
        memory_fingerprint_parts(
            context.setup.memory,
            context.settings,
            world_size=context.parallel.world_size,
            device=context.device,
            device_name=name,
            device_memory_bytes=total,
            torch_version=torch.__version__,
            seq_len=context.seq_len,
        )
    )
    return cache_file(context.settings.cache_dir, key), key


def remember_out_of_memory(context: ProfilerContext, profile: ProfileResult, cap: int) -> Path:
    """Write ``cap`` (the micro batch training fell back to after an OOM) into the profile cache.

    The next run on this set-up then starts at most at ``cap`` instead of meeting the same OOM.
    """
    path, key = cache_location(context)
    record = load_profile(path, key) or profile.to_dict()
    previous = record.get("oom_cap")
    record["oom_cap"] = cap if previous is None else min(cap, previous)
    save_profile(path, key, record)
    return path


def saved_profile(state: Mapping[str, Any], ranks: int) -> ProfileResult | None:
    """The profile a resumed checkpoint holds (:meth:`StartupProfiler.state_dict`), if it was measured on as many ranks
    as this run has."""
    saved = state.get("result")
    saved_ranks = state.get("ranks", ranks)
    if saved is not None and saved_ranks != ranks:
        logs.info(f"Profiler: the checkpoint's profile was measured on {saved_ranks} rank(s); profiling for {ranks}")
        return None
    if saved is None:
        return None
    result = ProfileResult.from_dict(saved)
    logs.info(f"Profiler: using the profile saved in the checkpoint (micro batch {result.micro_batch})")
    return result


def measure_profile(context: ProfilerContext, trial_step: TrialStep) -> ProfileResult:
    """The profile for this set-up: from the cache when its fingerprint matches, else measured now."""
    settings = context.settings
    path, key = cache_location(context)
    cached = None if settings.reprofile else load_profile(path, key)
    # Every rank must take the same branch: use the cache only if all ranks have it (caches can be per node).
    everyone_has_it = minimum_over_ranks(int(cached is not None), context.parallel, context.device)
    if everyone_has_it and cached is not None:  # this rank's among them
        result = ProfileResult.from_dict(cached)
        result.max_micro_batch = minimum_over_ranks(result.max_micro_batch, context.parallel, context.device)
        result.micro_batch = choose_micro_batch(result.max_micro_batch, settings.safety_margin, settings.round_to)
        result.from_cache = True
        logs.info(f"Profiler: using the cached profile {path}")
        if result.oom_cap is not None and result.oom_cap < result.micro_batch:
            logs.info(
                f"Profiler: micro batch {result.micro_batch} -> {result.oom_cap}: an earlier run "
                f"ran out of memory in training and fell back to {result.oom_cap}"
            )
            result.micro_batch = result.oom_cap
    else:
        result = _measure(context, trial_step)
        if context.parallel.is_rank_zero:
            save_profile(path, key, result.to_dict())
        barrier(context.parallel)
    if context.parallel.is_rank_zero:
        logs.info("Profiler report (micro batch = samples per forward on one rank):\n" + format_table(result))
        paths = write_report(result, context.setup.output_dir / "profile")
        logs.info(f"Profiler report written to {paths['json']} and {paths['png']}")
    return result


def _measure(context: ProfilerContext, trial_step: TrialStep) -> ProfileResult:
    settings = context.settings
    live = context.live_bytes()
    budget = memory_budget(
        context.device, explicit=settings.memory_budget, fraction=settings.memory_fraction, live_tensor_bytes=live
    )
    if context.parallel.is_distributed:
        budget = Budget(
            minimum_over_ranks(budget.bytes, context.parallel, context.device),
            f"{budget.source}; minimum over {context.parallel.world_size} ranks",
        )
    logs.info(
        f"Profiler: budget {budget.bytes / 2**30:.3f} GiB ({budget.source}); "
        f"worst-case samples of {context.seq_len} tokens, {context.seq_len_source}"
    )
    with context.preserved():
        compile_seconds = _compile_first(context, trial_step) if context.setup.compile else None
        result = find_max_micro_batch(
            trial_step,
            budget,
            seq_len=context.seq_len,
            safety_margin=settings.safety_margin,
            round_to=settings.round_to,
            upper_limit=max(1, context.samples_per_rank),
            tolerance=settings.search_tolerance,
            agree=agree_on_trial(context.parallel, context.device),
            recover=lambda: memory.release_memory(context.device),
            before_trial=context.before_trial,
        )
    result.seq_len_source = context.seq_len_source
    result.compile_seconds = compile_seconds
    memory.release_memory(context.device)
    return result


def _compile_first(context: ProfilerContext, trial_step: TrialStep) -> float:
    """One step at micro batch 1 before the trials (the weights and state are put back with theirs): compile
    time and its one-time memory stay out of the measured steps. Its sizes are marked dynamic (see
    ``training.compiling``), so the trials and training reuse its graphs."""
    started = time.perf_counter()
    try:
        trial_step(1)
    except Exception as error:  # noqa: BLE001 - an OOM here is the profiler's to report, at its own warm-up
        if not is_out_of_memory(error):
            raise
        memory.release_memory(context.device)
    seconds = time.perf_counter() - started
    logs.info(f"Profiler: compiled in {seconds:.1f} s (one step at micro batch 1, before the trials)")
    return seconds


class StartupProfiler:
    """A run's profile: the one its resumed checkpoint holds, the cached one, or one measured now (see
    :func:`measure_profile`); after an out-of-memory error in training, the micro batch the run fell back to is
    written into the cache, so the next run on this set-up starts under it."""

    def __init__(self, context: ProfilerContext, ranks: int) -> None:
        self.context, self.ranks = context, ranks
        self.result: ProfileResult | None = None
        self.saved: Mapping[str, Any] = {}  # a resumed run's

    def find(self, trial_step: TrialStep) -> ProfileResult:
        self.result = saved_profile(self.saved, self.ranks) or measure_profile(self.context, trial_step)
        return self.result

    def state_dict(self) -> dict[str, Any]:
        return {"result": self.result.to_dict() if self.result else None, "ranks": self.ranks}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.saved = state

    def remember_cap(self, cap_for: Callable[[int], int], *, any_rank: bool) -> None:
        """Write ``cap_for(profiled micro batch)`` into the profile cache (from rank 0, or from any rank)."""
        if self.result is None:
            return
        context = self.context
        self.result.oom_cap = limit = cap_for(self.result.micro_batch)
        if any_rank or context.parallel.is_rank_zero:
            path = remember_out_of_memory(context, self.result, limit)
            logs.info(f"Profile cache {path}: later runs start at micro batch <= {limit}")
