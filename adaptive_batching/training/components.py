"""The torchtune components of a run, built from its config: the data first (tokenizer and dataset, so a wrong
path fails before any weights load), then the model, optimizer, loss and collate. An error that is the
config's names its key (see ``adaptive_batching.core.nodes.building``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import config
from torchtune.modules import TransformerDecoder, common_utils

from adaptive_batching.batching.data import DEFAULT_COLLATE, build_dataset
from adaptive_batching.core import logs
from adaptive_batching.core.defaults import DEFAULT_COMPILE
from adaptive_batching.core.method import FinetuneMethod
from adaptive_batching.core.nodes import building
from adaptive_batching.core.objective import TrainingObjective
from adaptive_batching.runtime.distributed import ParallelInfo
from adaptive_batching.training import compiling
from adaptive_batching.training.model import FrozenWeights, ModelOptions, build_model
from adaptive_batching.training.optimizers import build_optimizer


@dataclass
class Data:
    tokenizer: Any
    dataset: Any
    packed: bool


@dataclass
class Components:
    model: TransformerDecoder
    optimizer: torch.optim.Optimizer
    loss_fn: Any
    collate: Callable


def build_data(cfg: DictConfig) -> Data:
    """The tokenizer and the dataset (several, concatenated, when ``dataset`` is a list)."""
    with building("tokenizer"):
        tokenizer = config.instantiate(cfg.tokenizer)
    with building("dataset"):
        dataset, packed = build_dataset(cfg.dataset, tokenizer)
    return Data(tokenizer, dataset, packed)


def build_components(
    cfg: DictConfig,
    method: FinetuneMethod,
    objective: TrainingObjective,
    checkpoint: dict[str, Any],
    data: Data,
    *,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelInfo,
    is_rank_zero: bool,
) -> Components:
    """The model (sharded over ``parallel``, weights from ``checkpoint``), what ``objective`` builds besides
    (full DPO's reference model), the optimizer over the trainable parameters (one per parameter, stepped in the
    backward, with ``optimizer_in_bwd``), the loss (compiled with ``compile``) and the collate of ``data`` as
    ``objective`` collates it."""
    common_utils._use_low_cpu_ram = cfg.get("low_cpu_ram", False)  # as torchtune's LoRA recipe sets it (QLoRA saves)
    options = ModelOptions(
        activation_checkpointing=cfg.get("enable_activation_checkpointing", False),
        compile=cfg.get("compile", DEFAULT_COMPILE),
        custom_sharded_layers=cfg.get("custom_sharded_layers", None),
        reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True),
        fsdp_cpu_offload=cfg.get("fsdp_cpu_offload", False),
    )
    place: dict[str, Any] = dict(device=device, dtype=dtype, parallel=parallel, is_rank_zero=is_rank_zero)
    with building("model"):
        model = build_model(cfg.model, method, checkpoint, options=options, **place)
    if objective.frozen is not None:  # full DPO's reference, KD's teacher
        objective.hold(build_frozen_copy(cfg, objective.frozen.weights, options, node=objective.frozen.model, **place))
    optimizer = build_optimizer(cfg, model)
    with building("loss"):
        loss_fn = config.instantiate(cfg.loss)
    if cfg.get("compile", DEFAULT_COMPILE):
        loss_fn = compiling.compile_loss(loss_fn, verbose=is_rank_zero)
    if loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    with building("collate_fn"):
        collate = objective.collate(cfg.get("collate_fn", DEFAULT_COLLATE), data.packed, data.tokenizer.pad_id, loss_fn)
    return Components(model, optimizer, loss_fn, collate)


def build_frozen_copy(
    cfg: DictConfig,
    key: str,
    options: ModelOptions,
    *,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelInfo,
    is_rank_zero: bool,
    node: str = "model",
) -> nn.Module:
    """A frozen model built from config key ``node`` (``model``: a second copy of the policy; ``teacher_model``:
    distillation's teacher, another architecture) with the weights of the checkpointer at config key ``key``,
    built, compiled and sharded as the policy is (FSDP2 under torchrun), frozen: no gradients, eval mode, dropout
    off, in no optimizer and no checkpoint. Full DPO's reference model, as torchtune's ``full_dpo_distributed``
    builds it, or the KD teacher (both without activation checkpointing: nothing is saved for a backward)."""
    with building(key):
        weights = config.instantiate(cfg[key], should_load_recipe_state=False).load_checkpoint()
    with building(node):
        model = build_model(
            cfg[node],
            FrozenWeights(key, node),
            weights,
            device=device,
            dtype=dtype,
            parallel=parallel,
            options=replace(options, activation_checkpointing=False),
            is_rank_zero=is_rank_zero,
        )
    logs.info(describe_frozen_copy(model, key, parallel.world_size, node))
    return model


def describe_frozen_copy(model: nn.Module, key: str, ranks: int, node: str = "model") -> str:
    """One line: what the frozen model costs, all its weights and those this rank holds (a shard under FSDP2)."""
    whole = sum(param.numel() * param.element_size() for param in model.parameters())
    here = sum(_local(param).numel() * param.element_size() for param in model.parameters())
    trained = "policy" if node == "model" else "student"
    where = f", {here / 2**20:.3f} MiB on this rank (sharded over {ranks} ranks as the {trained})" if ranks > 1 else ""
    what = (
        f"Reference model ({key}): a frozen copy of the model"
        if node == "model"
        else f"Teacher model ({node}, weights from {key}): frozen"
    )
    return f"{what}, {whole / 2**20:.3f} MiB of weights{where}; no gradients, eval mode, in no optimizer or checkpoint"


def _local(param: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard (a DTensor's), else itself."""
    return param.to_local() if hasattr(param, "to_local") else param
