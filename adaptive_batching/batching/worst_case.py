"""The longest sample a micro batch can hold: the length the profiler and ``estimate`` size a step for.

torchtune pads a batch to its own longest sample (``padded_collate_sft``), so the worst case a batch of
samples can meet is the data set's longest sample after the tokenizer's truncation
(``tokenizer.max_seq_len``), never the model's ``max_seq_len`` (131072 tokens for Llama 3.1 and 3.2, where
a data set's longest sample is often a few thousand). A packed data set's samples are all one pack long.
Measuring the lengths means tokenising every sample once; they are cached on disk
(:mod:`~adaptive_batching.batching.sequence_lengths`), so a second run, a resume or a token-budget run on
the same data pays nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptive_batching.batching.sequence_lengths import Measured, data_files_digest, measure_samples
from adaptive_batching.core import logs
from adaptive_batching.errors import ConfigError


@dataclass(frozen=True)
class WorstCase:
    """Tokens in the longest sample (or pack) a micro batch can hold, and where that number came from."""

    tokens: int
    source: str
    images: int = 0
    """The most images a sample holds (a vision data set's; 0 for text): the profiler gives each sample as many,
    each of the most tiles the transform cuts."""

    def describe(self) -> str:
        images = f" and {self.images} image{'s' if self.images > 1 else ''}" if self.images else ""
        return f"{self.tokens} tokens{images}, {self.source}"


@dataclass(frozen=True)
class LengthSource:
    """What measuring the samples' token counts needs from the config, read where the config is (``config``):
    the data's identity for the sample-length cache, the tokenizer's truncation and the cache's folder."""

    dataset: Any
    """The ``dataset`` config, resolved to plain values."""
    tokenizer: Any
    """The ``tokenizer`` config, resolved to plain values."""
    data_files: tuple[str, ...]
    """The local files the data set reads (their digest is part of the cache key)."""
    max_seq_len: int | None
    """``tokenizer.max_seq_len``: where samples are truncated (None: they are not)."""
    cache_dir: Path | None
    """The sample-length cache's folder (None: measured, not stored)."""

    @property
    def truncation(self) -> str:
        return f"tokenizer.max_seq_len={'null: no truncation' if self.max_seq_len is None else self.max_seq_len}"


def pack_size(dataset: Any, source: LengthSource) -> int:
    """Tokens in every pack of a packed data set (torchtune packs to ``tokenizer.max_seq_len``)."""
    parts = getattr(dataset, "datasets", None) or getattr(dataset, "_datasets", None) or [dataset]
    sizes = {size for part in parts if (size := getattr(part, "max_seq_len", None)) is not None}
    if len(sizes) == 1:
        return int(sizes.pop())
    assert source.max_seq_len is not None, "torchtune packs to tokenizer.max_seq_len, so a packed data set has one"
    return int(source.max_seq_len)


def sample_lengths(dataset: Any, source: LengthSource) -> Measured:
    """Every sample's token count after truncation (and the most images a sample holds), cached by a fingerprint
    of the data files, the dataset config and the tokenizer config (``source.cache_dir=None``: measured, not
    stored)."""
    key_parts = {
        "dataset": source.dataset,
        "tokenizer": source.tokenizer,
        "data_files": data_files_digest(list(source.data_files)),
    }
    return measure_samples(dataset, cache_dir=source.cache_dir, key_parts=key_parts)


def from_lengths(lengths: list[int], source: LengthSource, images: int = 0) -> WorstCase:
    if not lengths:
        raise ValueError("the data set has no samples")
    return WorstCase(max(lengths), f"the longest of {len(lengths)} samples after {source.truncation}", images)


def measure(
    dataset: Any, source: LengthSource, *, packed: bool, quiet: bool = False
) -> tuple[WorstCase, list[int] | None]:
    """The data set's worst case, and every sample's length (None when packed: all are one pack); logged unless
    ``quiet`` (``estimate``, which prints its own report)."""
    if packed:
        size = pack_size(dataset, source)
        return WorstCase(size, f"the pack size ({source.truncation})"), None
    start = time.perf_counter()
    measured = sample_lengths(dataset, source)
    lengths = measured.lengths
    worst = from_lengths(lengths, source, measured.most_images)
    cache_dir = source.cache_dir
    if not quiet:
        seconds = time.perf_counter() - start
        logs.info(
            f"Worst-case sample: {worst.describe()} (token counts of the data set in {seconds:.1f} s"
            f"{'' if cache_dir is None else f', cached in {cache_dir}'})"
        )
    return worst, lengths


def check_fits(worst: WorstCase | None, model_max_seq_len: int) -> None:
    """Refuse a worst case the model cannot take (its rotary cache ends at ``max_seq_len``)."""
    if worst is not None and worst.tokens > model_max_seq_len:
        raise ConfigError(
            f"the data's worst case is {worst.describe()}, above the model's max_seq_len "
            f"{model_max_seq_len}: set tokenizer.max_seq_len to at most {model_max_seq_len}"
        )
