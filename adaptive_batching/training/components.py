"""The torchtune components of a run, built from its config: model, tokenizer, optimizer, loss and data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import config, training

from adaptive_batching.batching.data import DEFAULT_COLLATE, build_collate, build_dataset
from adaptive_batching.runtime.distributed import ParallelInfo
from adaptive_batching.training.model import FinetuneMethod, ModelOptions, build_model


@dataclass
class Components:
    model: nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    loss_fn: Any
    dataset: Any
    packed: bool
    collate: Callable


def build_components(cfg: DictConfig, method: FinetuneMethod, checkpoint: dict[str, Any], *, device: torch.device,
                     dtype: torch.dtype, parallel: ParallelInfo, is_rank_zero: bool) -> Components:
    """Model (sharded over ``parallel``, weights from ``checkpoint``), then tokenizer, optimizer over the
    trainable parameters, loss (compiled with ``compile``) and the dataset with its collate."""
    model = build_model(
        cfg.model, method, checkpoint, device=device, dtype=dtype, parallel=parallel,
        options=ModelOptions(
            activation_checkpointing=cfg.get("enable_activation_checkpointing", False),
            compile=cfg.get("compile", False),
            custom_sharded_layers=cfg.get("custom_sharded_layers", None),
            reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True),
            fsdp_cpu_offload=cfg.get("fsdp_cpu_offload", False),
        ),
        is_rank_zero=is_rank_zero,
    )
    tokenizer = config.instantiate(cfg.tokenizer)
    optimizer = config.instantiate(cfg.optimizer, [p for p in model.parameters() if p.requires_grad])
    loss_fn = config.instantiate(cfg.loss)
    if cfg.get("compile", False):
        training.compile_loss(loss_fn, verbose=is_rank_zero)
    if loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    dataset, packed = build_dataset(cfg.dataset, tokenizer)
    collate = build_collate(cfg.get("collate_fn", DEFAULT_COLLATE), packed, tokenizer.pad_id, loss_fn.ignore_index)
    return Components(model, tokenizer, optimizer, loss_fn, dataset, packed, collate)
