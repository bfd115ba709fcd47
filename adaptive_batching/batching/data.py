"""Dataset, sampler and dataloader for the recipes, built from torchtune and torchdata components."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch
from omegaconf import DictConfig, ListConfig
from torch.utils.data import ConcatDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtune import config
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed

from adaptive_batching.batching.sampler import StepBatchSampler, collate_allowing_empty
from adaptive_batching.batching.token_sampler import TokenBudgetBatchSampler
from adaptive_batching.core.nodes import packed
from adaptive_batching.errors import ConfigError
from adaptive_batching.runtime.distributed import ParallelInfo

DEFAULT_COLLATE = "torchtune.data.padded_collate_sft"
# torchdata 0.11 calls a deprecated torch function each time a loader is built: noise in every epoch's log.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


class MapDataset(Protocol):
    """A data set read by index (torchtune's SFT, preference and packed data sets, or a ``ConcatDataset`` of them):
    torch's ``Dataset`` type declares no length."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def build_dataset(cfg_dataset: DictConfig | ListConfig, tokenizer: Any) -> tuple[MapDataset, bool]:
    """Instantiate the configured dataset (or several, concatenated); say whether it is packed."""
    if isinstance(cfg_dataset, ListConfig):
        return ConcatDataset([config.instantiate(c, tokenizer) for c in cfg_dataset]), packed(cfg_dataset)
    return config.instantiate(cfg_dataset, tokenizer), packed(cfg_dataset)


def build_collate(collate_path: str, packed: bool, pad_id: int, ignore_index: int) -> Callable:
    """The collate function: packed samples keep their block-causal mask, others are padded.

    An empty micro batch (a rank with no sample left in an epoch's last step) becomes one
    token whose label is ignored, so every rank runs the same forwards.
    """
    if packed:
        collate = padded_collate_packed
    elif "left_pad_sequence" in collate_path:
        raise ConfigError("config key 'collate_fn': left_pad_sequence is for inference only")
    else:
        collate = partial(_get_component_from_path(collate_path), padding_idx=pad_id, ignore_idx=ignore_index)
    return collate_allowing_empty(collate, pad_id=pad_id, ignore_index=ignore_index, packed=packed)


def build_dataloader(
    dataset: MapDataset,
    *,
    micro_batch: int,
    accumulation: int,
    collate_fn: Callable,
    parallel: ParallelInfo,
    shuffle: bool,
    seed: int,
    epoch: int,
    max_steps: int | None,
    split: int = 1,
    start_step: int = 0,
    first_sample: int = 0,
) -> StatefulDataLoader:
    """A resumable dataloader of this rank's micro batches for one epoch, in optimizer steps.

    Changing the batch builds a new one over the same dataset object: nothing is re-tokenised or re-packed.
    ``split`` and ``start_step`` serve the rest of an epoch in smaller pieces after an out-of-memory error.
    """
    sampler = StepBatchSampler(
        len(dataset),
        micro_batch=micro_batch,
        accumulation=accumulation,
        rank=parallel.rank,
        world_size=parallel.world_size,
        shuffle=shuffle,
        seed=seed,
        epoch=epoch,
        max_steps=max_steps,
        split=split,
        start_step=start_step,
        first_sample=first_sample,
    )
    return StatefulDataLoader(dataset=dataset, batch_sampler=sampler, collate_fn=collate_fn)


def build_token_dataloader(
    dataset: MapDataset, lengths: list[int], *, collate_fn: Callable, parallel: ParallelInfo, **sampler_args: Any
) -> StatefulDataLoader:
    """Like :func:`build_dataloader`, with micro batches cut by a padded-token budget: ``sampler_args`` are
    :class:`~adaptive_batching.batching.token_sampler.TokenBudgetBatchSampler`'s, less the rank and the ranks."""
    sampler = TokenBudgetBatchSampler(lengths, rank=parallel.rank, world_size=parallel.world_size, **sampler_args)
    return StatefulDataLoader(dataset=dataset, batch_sampler=sampler, collate_fn=collate_fn)


def data_files(cfg_dataset: DictConfig | ListConfig) -> list[str]:
    """The local data files a dataset config reads (``data_files``), for the sequence-length cache key."""
    nodes = list(cfg_dataset) if isinstance(cfg_dataset, ListConfig) else [cfg_dataset]
    files: list[str] = []
    for node in nodes:
        value = node.get("data_files", None)
        if value is None:
            continue
        files.extend([str(value)] if isinstance(value, str) else [str(v) for v in value])
    return files


def worst_case_batch(
    collate_fn: Callable, *, micro_batch: int, seq_len: int, vocab_size: int, packed: bool, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A batch of ``micro_batch`` full-length samples (full packs when packed), built by the real collate.

    Every token counts in the loss, so the step does the most work a real batch can ask for.
    The tokens come from a private generator: the global RNG is not touched.
    """
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (micro_batch, seq_len), generator=generator)
    if packed:
        samples = [
            {
                "tokens": row,
                "labels": row.clone(),
                "input_pos": torch.arange(seq_len),
                "seq_lens": torch.tensor([seq_len]),
            }
            for row in tokens
        ]
    else:
        samples = [{"tokens": row.tolist(), "labels": row.tolist()} for row in tokens]
    return collate_fn(samples)
