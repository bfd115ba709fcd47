"""Running the profiler inside a recipe: budget, cache, cross-rank agreement and the report."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torchtune import utils

from adaptive_batching import memory
from adaptive_batching.budget import Budget, memory_budget
from adaptive_batching.distributed import agree_on_trial, barrier, minimum_over_ranks
from adaptive_batching.profile_cache import (
    cache_file,
    fingerprint,
    load_profile,
    memory_fingerprint_parts,
    save_profile,
)
from adaptive_batching.profile_report import format_table, write_report
from adaptive_batching.profiler import ProfileResult, find_max_micro_batch, preserved_training_state
from adaptive_batching.search import choose_micro_batch

if TYPE_CHECKING:
    from adaptive_batching.trainer import Trainer

log = utils.get_logger("INFO")


def device_identity(device: torch.device) -> tuple[str, int]:
    """The device's name and total memory in bytes, for the cache fingerprint."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.name, int(props.total_memory)
    return f"cpu {platform.machine()} {platform.processor()}".strip(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cache_location(trainer: "Trainer") -> tuple[Path, str]:
    """The profile cache file of this set-up and its fingerprint."""
    name, total = device_identity(trainer.device)
    key = fingerprint(memory_fingerprint_parts(
        trainer.cfg, world_size=trainer.parallel.world_size, device=trainer.device, device_name=name,
        device_memory_bytes=total, torch_version=torch.__version__,
    ))
    return cache_file(trainer.settings.knobs["cache_dir"], key), key


def remember_out_of_memory(trainer: "Trainer", cap: int) -> Path:
    """Write ``cap`` (the micro batch training fell back to after an OOM) into the profile cache.

    The next run on this set-up then starts at most at ``cap`` instead of meeting the same OOM.
    """
    path, key = cache_location(trainer)
    record = load_profile(path, key) or trainer.profile_result.to_dict()
    previous = record.get("oom_cap")
    record["oom_cap"] = cap if previous is None else min(cap, previous)
    save_profile(path, key, record)
    return path


def run_profile(trainer: "Trainer") -> ProfileResult:
    """The profile for this set-up: from the cache when its fingerprint matches, else measured now."""
    knobs = trainer.settings.knobs
    path, key = cache_location(trainer)
    cached = None if knobs["reprofile"] else load_profile(path, key)
    # Every rank must take the same branch: use the cache only if all ranks have it (caches can be per node).
    if minimum_over_ranks(int(cached is not None), trainer.parallel, trainer.device):
        result = ProfileResult.from_dict(cached)
        result.max_micro_batch = minimum_over_ranks(result.max_micro_batch, trainer.parallel, trainer.device)
        result.micro_batch = choose_micro_batch(result.max_micro_batch, knobs["safety_margin"], knobs["round_to"])
        result.from_cache = True
        trainer.info(f"Profiler: using the cached profile {path}")
        if result.oom_cap is not None and result.oom_cap < result.micro_batch:
            trainer.info(f"Profiler: micro batch {result.micro_batch} -> {result.oom_cap}: an earlier run "
                         f"ran out of memory in training and fell back to {result.oom_cap}")
            result.micro_batch = result.oom_cap
    else:
        result = _measure(trainer)
        if trainer.is_rank_zero:
            save_profile(path, key, result.to_dict())
        barrier(trainer.parallel)
    if trainer.is_rank_zero:
        log.info("Profiler report (micro batch = samples per forward on one rank):\n" + format_table(result))
        paths = write_report(result, Path(trainer.cfg.output_dir) / "profile")
        log.info(f"Profiler report written to {paths['json']} and {paths['png']}")
    return result


def _measure(trainer: "Trainer") -> ProfileResult:
    knobs = trainer.settings.knobs
    live = memory.current_bytes(trainer.device, trainer.model, trainer.optimizer)
    budget = memory_budget(trainer.device, explicit=knobs["memory_budget"], fraction=knobs["memory_fraction"],
                           live_tensor_bytes=live)
    if trainer.parallel.is_distributed:
        budget = Budget(minimum_over_ranks(budget.bytes, trainer.parallel, trainer.device),
                        f"{budget.source}; minimum over {trainer.parallel.world_size} ranks")
    trainer.info(f"Profiler: budget {budget.bytes / 2**30:.3f} GiB ({budget.source}); "
                 f"worst-case samples of {trainer.seq_len} tokens")
    with preserved_training_state(trainer.model, trainer.optimizer):
        result = find_max_micro_batch(
            trainer.trial_step, budget, seq_len=trainer.seq_len, safety_margin=knobs["safety_margin"],
            round_to=knobs["round_to"], upper_limit=max(1, trainer.samples_per_rank()),
            agree=agree_on_trial(trainer.parallel, trainer.device),
            recover=lambda: memory.release_memory(trainer.device),
        )
    memory.release_memory(trainer.device)
    return result
