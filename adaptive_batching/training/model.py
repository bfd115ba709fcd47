"""Model construction shared by the recipes: instantiate, apply the fine-tuning method, shard, load.

One path for every set-up: the model is built on the meta device in the training dtype, the
method decides which parameters train, FSDP2 shards it under torchrun, and the weights are
then materialised on the device and loaded (via torchtune's distributed loader when sharded).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import config, modules, training
from torchtune.modules import TransformerDecoder

from adaptive_batching.core.defaults import DEFAULT_COMPILE
from adaptive_batching.core.method import FinetuneMethod
from adaptive_batching.errors import ConfigError
from adaptive_batching.runtime import nf4
from adaptive_batching.runtime.distributed import ParallelInfo, barrier
from adaptive_batching.training import compiling
from adaptive_batching.training.methods import FullFinetune


@dataclass(frozen=True)
class ModelOptions:
    """How the model is built, from the standard torchtune recipe keys."""

    activation_checkpointing: bool = False
    compile: bool = DEFAULT_COMPILE
    custom_sharded_layers: Sequence[str] | None = None
    reshard_after_forward: bool = True
    fsdp_cpu_offload: bool = False


def _init_buffers(model: nn.Module) -> None:
    for module in model.modules():
        rope_init = getattr(module, "rope_init", None)
        if rope_init is not None:
            rope_init()


def build_model(
    cfg_model: DictConfig,
    method: FinetuneMethod,
    checkpoint: dict[str, Any],
    *,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelInfo,
    options: ModelOptions,
    is_rank_zero: bool = True,
) -> TransformerDecoder:
    """Build the model on ``device``, sharded with FSDP2 when running under torchrun."""
    with training.set_default_dtype(dtype), torch.device("meta"), nf4.fast_on_meta():
        model = config.instantiate(cfg_model)
    method.configure(model)
    if options.compile:
        compiling.compile_model(model, verbose=is_rank_zero)
    if options.activation_checkpointing:
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    if parallel.is_distributed:
        training.shard_model(
            model=model,
            shard_conditions=[partial(training.get_shard_conditions, names_to_match=options.custom_sharded_layers)],
            cpu_offload=options.fsdp_cpu_offload,
            reshard_after_forward=options.reshard_after_forward,
        )
    with training.set_default_dtype(dtype), device:
        model.to_empty(device="cpu" if options.fsdp_cpu_offload and parallel.is_distributed else device)
        _init_buffers(model)
        method.initialize(model)

    missing: set[str] = set()
    unexpected: set[str] = set()
    loaded_once = False
    for state_dict in method.weights(checkpoint):
        quantized: set[str] = set()
        if parallel.is_distributed:
            result = training.load_from_full_model_state_dict(
                model, dict(state_dict), device, strict=False, cpu_offload=options.fsdp_cpu_offload
            )
        else:
            state_dict, quantized = nf4.quantize_into(model, state_dict, device)  # QLoRA's frozen base weights
            result = model.load_state_dict(state_dict, strict=False)
        these_missing = set(result.missing_keys) - quantized
        missing = these_missing if not loaded_once else missing & these_missing
        unexpected |= set(result.unexpected_keys)
        loaded_once = True
    method.after_load(model, sorted(missing), sorted(unexpected))
    training.validate_no_params_on_meta_device(model)
    barrier(parallel)
    return model


def decoder_of(model: nn.Module) -> TransformerDecoder:
    """The text decoder: the model itself, or a vision model's (torchtune's ``DeepFusionModel``)."""
    decoder = getattr(model, "decoder", model)
    assert isinstance(decoder, TransformerDecoder), f"{type(model).__name__} has no text decoder"
    return decoder


def text_vocab_size(model: nn.Module) -> int:
    """The ids of the text vocabulary (a vision decoder's ``FusionEmbedding`` adds a few of its own after them)."""
    embeddings = decoder_of(model).tok_embeddings
    return int(
        embeddings.embedding.num_embeddings if hasattr(embeddings, "fusion_embedding") else embeddings.num_embeddings
    )


class FrozenWeights(FullFinetune):
    """The fine-tuning method of a model that never trains (full DPO's reference, a KD teacher): no parameter takes
    a gradient, every weight comes from the checkpoint of config key ``key`` for the model of config key ``node``,
    nothing is saved."""

    name = "frozen"

    def __init__(self, key: str, node: str = "model") -> None:
        self.key, self.node = key, node

    def configure(self, model: nn.Module) -> None:
        for param in model.parameters():
            param.requires_grad_(False)

    def after_load(self, model: nn.Module, missing: Sequence[str], unexpected: Sequence[str]) -> None:
        if missing or unexpected:
            raise ConfigError(
                f"the checkpoint of config key '{self.key}' does not match config key '{self.node}': "
                f"missing {list(missing)[:4]}, unexpected {list(unexpected)[:4]}"
            )
        training.disable_dropout(model)
        model.eval()

    def checkpoint_entries(self, full_state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {}


def full_state_dict(
    model: nn.Module, parallel: ParallelInfo, device: torch.device, trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU (on rank 0; empty on other ranks when sharded)."""
    if parallel.is_distributed:
        return training.gather_cpu_state_dict(
            model, parallel.is_rank_zero, device=device, adapter_weights_only=trainable_only
        )
    # A copy: on CPU ``.cpu()`` would alias the live weights, which merging LoRA edits in place.
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    if trainable_only:
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        state = {k: v for k, v in state.items() if k in trainable}
    return state


def full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, parallel: ParallelInfo, device: torch.device
) -> dict[str, Any]:
    """The optimizer state as a full (unsharded) state dict, on rank 0."""
    if parallel.is_distributed:
        return training.get_full_optimizer_state_dict(model, optimizer, parallel.is_rank_zero, device=device)
    return optimizer.state_dict()


def load_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    parallel: ParallelInfo,
    device: torch.device,
) -> None:
    """Restore the optimizer state saved by :func:`full_optimizer_state_dict`."""
    if parallel.is_distributed:
        training.load_from_full_optimizer_state_dict(model, optimizer, state, device)
    else:
        optimizer.load_state_dict(state)
