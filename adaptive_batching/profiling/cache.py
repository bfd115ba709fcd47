"""The profiler's result on disk, so a restart or a resume skips the search.

A profile is valid only for the setup it was measured on, so it is stored under a fingerprint
of everything that changes a step's memory. Files are JSON (never pickle: a cache directory
may be shared), written atomically so that concurrent ranks or a crash never leave half a file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from adaptive_batching.core import paths
from adaptive_batching.profiling.settings import ProfilerSettings
from adaptive_batching.runtime.files import read_json_cache, write_atomically
from adaptive_batching.units import parse_bytes

log = logging.getLogger(__name__)

CACHE_SCHEMA = 1


def cache_file(cache_dir: Path | str | None, key: str) -> Path:
    """The file for ``key``: ``<dir>/<key[:16]>.json`` (the full key is checked inside the file)."""
    return paths.cache_dir(cache_dir) / f"{key[:16]}.json"


def load_profile(path: Path, key: str) -> dict | None:
    """The cached result for ``key``, or None when absent, corrupt or stale (the latter two logged).

    Bad content is never an error: the profiler simply runs again and overwrites the file.
    """
    path = Path(path)
    record = read_json_cache(path, "profile cache")
    if record is None:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("result"), dict):
        log.warning("ignoring corrupt profile cache %s: not a profile record", path)
        return None
    if record.get("schema") != CACHE_SCHEMA:
        log.warning("ignoring stale profile cache %s: schema %r, expected %r", path, record.get("schema"), CACHE_SCHEMA)
        return None
    if record.get("key") != key:
        log.warning("ignoring stale profile cache %s: it was measured for a different setup", path)
        return None
    return record["result"]


def save_profile(path: Path, key: str, result: Mapping[str, Any]) -> None:
    """Store ``result`` for ``key`` at ``path``; readers see the old file or the new one, never a mix."""
    path = Path(path)
    record = {
        "schema": CACHE_SCHEMA,
        "key": key,
        "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "result": dict(result),
    }
    write_atomically(path, json.dumps(record, indent=2, sort_keys=True, allow_nan=False) + "\n")


def _budget_setting(value: Any) -> Any:
    """``'1GiB'`` and ``1073741824`` ask for the same budget, so they fingerprint alike."""
    try:
        return None if value is None else parse_bytes(value)
    except ValueError:
        return value


def _fraction_setting(value: Any) -> Any:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if is_number else value


def memory_fingerprint_parts(
    setup: Mapping[str, Any],
    settings: ProfilerSettings,
    *,
    world_size: int,
    device: torch.device,
    device_name: str,
    device_memory_bytes: int,
    torch_version: str,
    seq_len: int,
) -> dict[str, Any]:
    """Everything in a run that changes the largest micro batch that fits, or how closely the search
    found it, as plain JSON-able values: ``setup``, the config's part (read by ``config``), and the machine's.

    Left out on purpose: the learning rate and other optimizer scalars, and the profiler knobs
    applied after the search (safety_margin, round_to, reprofile, cache_dir).
    """
    return {
        **setup,
        "worst_case_seq_len": int(seq_len),
        "world_size": int(world_size),
        "device_type": torch.device(device).type,
        "device_name": device_name,
        "device_memory_bytes": int(device_memory_bytes),
        "torch_version": torch_version,
        "adaptive_batching.memory_budget": _budget_setting(settings.memory_budget),
        "adaptive_batching.memory_fraction": _fraction_setting(settings.memory_fraction),
        # Not memory, but how close to the largest that fits the search went.
        "adaptive_batching.search_tolerance": float(settings.search_tolerance),
    }
