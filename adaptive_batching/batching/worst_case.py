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
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from adaptive_batching.batching.data import data_files
from adaptive_batching.batching.sequence_lengths import data_files_digest, sequence_lengths
from adaptive_batching.errors import ConfigError


@dataclass(frozen=True)
class WorstCase:
    """Tokens in the longest sample (or pack) a micro batch can hold, and where that number came from."""

    tokens: int
    source: str

    def describe(self) -> str:
        return f"{self.tokens} tokens, {self.source}"


def pack_size(dataset: Any, cfg: DictConfig) -> int:
    """Tokens in every pack of a packed data set (torchtune packs to ``tokenizer.max_seq_len``)."""
    parts = getattr(dataset, "datasets", None) or getattr(dataset, "_datasets", None) or [dataset]
    sizes = {getattr(part, "max_seq_len", None) for part in parts} - {None}
    if len(sizes) == 1:
        return int(sizes.pop())
    return int(cfg.tokenizer.max_seq_len)


def sample_lengths(dataset: Any, cfg: DictConfig, cache_dir: Optional[Path]) -> list[int]:
    """Every sample's token count after truncation, cached by a fingerprint of the data files, the dataset
    config and the tokenizer config (``cache_dir=None``: measured, not stored)."""
    key_parts = {
        "dataset": OmegaConf.to_container(cfg.dataset, resolve=True),
        "tokenizer": OmegaConf.to_container(cfg.tokenizer, resolve=True),
        "data_files": data_files_digest(data_files(cfg.dataset)),
    }
    return sequence_lengths(dataset, cache_dir=cache_dir, key_parts=key_parts)


def truncation(cfg: DictConfig) -> str:
    value = cfg.tokenizer.get("max_seq_len", None)
    return f"tokenizer.max_seq_len={'null: no truncation' if value is None else value}"


def from_lengths(lengths: list[int], cfg: DictConfig) -> WorstCase:
    if not lengths:
        raise ValueError("the data set has no samples")
    return WorstCase(max(lengths), f"the longest of {len(lengths)} samples after {truncation(cfg)}")


def measure(dataset: Any, cfg: DictConfig, *, packed: bool, cache_dir: Optional[Path],
            info: Callable[[str], None]) -> tuple[WorstCase, Optional[list[int]]]:
    """The data set's worst case, and every sample's length (None when packed: all are one pack)."""
    if packed:
        size = pack_size(dataset, cfg)
        return WorstCase(size, f"the pack size ({truncation(cfg)})"), None
    start = time.perf_counter()
    lengths = sample_lengths(dataset, cfg, cache_dir)
    worst = from_lengths(lengths, cfg)
    info(f"Worst-case sample: {worst.describe()} (token counts of the data set in {time.perf_counter() - start:.1f} s"
         f"{'' if cache_dir is None else f', cached in {cache_dir}'})")
    return worst, lengths


def check_fits(worst: Optional[WorstCase], model_max_seq_len: int) -> None:
    """Refuse a worst case the model cannot take (its rotary cache ends at ``max_seq_len``)."""
    if worst is not None and worst.tokens > model_max_seq_len:
        raise ConfigError(f"the data's worst case is {worst.describe()}, above the model's max_seq_len "
                          f"{model_max_seq_len}: set tokenizer.max_seq_len to at most {model_max_seq_len}")


def from_config(cfg: DictConfig, cache_dir: Path, info: Callable[[str], None] = lambda message: None) -> WorstCase:
    """The worst case of a config's data, building its tokenizer and data set here (``estimate``, which has
    no run). A data set or tokenizer that cannot be read here (a hub data set offline, a tokenizer file
    not downloaded) is one error that says to give the length instead."""
    from torchtune import config

    from adaptive_batching.batching.data import build_dataset
    from adaptive_batching.core.nodes import one_line

    try:
        tokenizer = config.instantiate(cfg.tokenizer)
        dataset, packed = build_dataset(cfg.dataset, tokenizer)
    except Exception as error:  # noqa: BLE001 - whatever stops the data being read, the way out is the same
        raise ConfigError(f"the worst-case sample length comes from the data of config keys 'tokenizer' and "
                          f"'dataset', which could not be read here ({one_line(error)[:300]}); give it with "
                          f"--seq-len N (tokens in the longest sample after truncation)") from None
    return measure(dataset, cfg, packed=packed, info=info, cache_dir=cache_dir)[0]
