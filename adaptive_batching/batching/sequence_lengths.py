"""Every sample's token count, computed once per dataset and tokenizer and cached on disk.

Token-budget batching plans an epoch from the lengths alone, but getting them means tokenising
the whole dataset. The cache is keyed by what decides the lengths (dataset and tokenizer configs,
a content hash of the data files, the dataset size), stored as JSON (never pickle) and written
atomically, so concurrent ranks or a crash never leave half a file; a bad file is recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptive_batching.core.objective import sample_length
from adaptive_batching.runtime.files import fingerprint, read_json_cache, write_atomically

log = logging.getLogger(__name__)

LENGTHS_SCHEMA = 1
_CHUNK = 1 << 20


def data_files_digest(paths: Sequence[str | Path]) -> str:
    """sha256 (hex) of the files' bytes, in the given order; names do not count, sizes separate the files."""
    digest = hashlib.sha256()
    for path in paths:
        path = Path(path)
        digest.update(path.stat().st_size.to_bytes(8, "little"))
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def lengths_cache_file(cache_dir: Path | str, key: str) -> Path:
    """``<dir>/lengths-<key[:16]>.json`` (the full key is checked inside the file)."""
    return Path(cache_dir).expanduser() / f"lengths-{key[:16]}.json"


def _load(path: Path, key: str, size: int) -> Measured | None:
    """The cached lengths, or None when absent, unreadable, corrupt or stale (all but absent logged)."""
    record = read_json_cache(path, "sequence-length cache")
    if record is None:  # absent (or unreadable, logged): measured anew
        return None
    lengths = record.get("lengths") if isinstance(record, dict) else None
    if not isinstance(lengths, list) or not all(type(n) is int and n >= 0 for n in lengths):
        log.warning("ignoring corrupt sequence-length cache %s: not a list of lengths", path)
        return None
    if record.get("schema") != LENGTHS_SCHEMA or record.get("key") != key:
        log.warning("ignoring stale sequence-length cache %s: it was made for another dataset or tokenizer", path)
        return None
    if len(lengths) != size:
        log.warning("ignoring corrupt sequence-length cache %s: %d lengths for %d samples", path, len(lengths), size)
        return None
    most_images = record.get("most_images", 0)
    if type(most_images) is not int or most_images < 0:
        log.warning("ignoring corrupt sequence-length cache %s: most_images is not a count", path)
        return None
    return Measured(lengths, most_images)


def _save(path: Path, key: str, measured: Measured) -> None:
    """Write atomically: readers see the old file or the new one, never a mix."""
    record = {"schema": LENGTHS_SCHEMA, "key": key, "lengths": measured.lengths, "most_images": measured.most_images}
    write_atomically(path, json.dumps(record, separators=(",", ":")) + "\n")


@dataclass(frozen=True)
class Measured:
    """Every sample's padded length, and the most images one sample holds (0: a text data set)."""

    lengths: list[int]
    most_images: int = 0


def sample_images(sample: Mapping[str, Any]) -> int:
    """The images of a vision sample (torchtune's multimodal transforms put them under ``encoder_input``)."""
    encoder_input = sample.get("encoder_input", None)
    return len(encoder_input.get("images", ())) if isinstance(encoder_input, Mapping) else 0


def sequence_lengths(dataset: Any, *, cache_dir: Path | None, key_parts: Mapping[str, Any]) -> list[int]:
    """The padded length of every sample (see :func:`measure_samples`)."""
    return measure_samples(dataset, cache_dir=cache_dir, key_parts=key_parts).lengths


def measure_samples(dataset: Any, *, cache_dir: Path | None, key_parts: Mapping[str, Any]) -> Measured:
    """The padded length of every sample (``len(dataset[i]["tokens"])``, a pair's longer sequence) and the most
    images a sample holds, measured in one pass (a vision sample's images are tiled as it is read), from the cache
    under ``cache_dir`` when it has them.

    The key is ``fingerprint`` of ``key_parts`` (the caller's dataset config, tokenizer config and
    data files digest) and the dataset size. ``cache_dir=None``: computed every time, nothing stored.
    """
    size = len(dataset)
    key = fingerprint({"key_parts": dict(key_parts), "dataset_size": size})
    path = None if cache_dir is None else lengths_cache_file(cache_dir, key)
    if path is not None:
        cached = _load(path, key, size)
        if cached is not None:
            return cached
    start = time.perf_counter()
    lengths, most_images = [], 0
    for index in range(size):
        sample = dataset[index]
        lengths.append(sample_length(sample))
        most_images = max(most_images, sample_images(sample))
    measured = Measured(lengths, most_images)
    log.info("measured the token count of %d samples in %.1f s", size, time.perf_counter() - start)
    if path is not None:
        try:
            _save(path, key, measured)
        except OSError as error:
            log.warning("could not write the sequence-length cache %s: %s", path, error)
    return measured
