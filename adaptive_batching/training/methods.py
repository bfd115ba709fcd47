"""The fine-tuning methods: what is trained and what is saved (``training.recipe_table`` picks each recipe's).

A method is a :class:`~adaptive_batching.core.method.FinetuneMethod`: the trainer asks it which parameters
train, which weights a checkpoint holds and what a save writes; everything about the batch is shared. Neither
method here fake-quantizes (``training.quantization`` wraps either for QAT).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import training
from torchtune.modules.peft import (
    get_adapter_params,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
    set_trainable_params,
)

from adaptive_batching.core.method import FakeQuantization
from adaptive_batching.errors import ConfigError

_CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."  # torch's checkpoint_wrapper's submodule name


def checkpoint_mismatch(what: str, missing: Sequence[str], unexpected: Sequence[str]) -> ConfigError:
    """The checkpoint's weights do not fit the configured model: a wrong ``model`` or ``checkpointer``."""

    def names(keys: Sequence[str]) -> str:
        keys = list(keys)
        return f"{keys[:4]}{f' and {len(keys) - 4} more' if len(keys) > 4 else ''}"

    return ConfigError(
        f"the checkpoint in 'checkpointer.checkpoint_dir' does not match {what} of config key 'model': "
        f"missing {names(missing)}, unexpected {names(unexpected)}"
    )


class FullFinetune:
    """Train every weight; save the whole model."""

    name = "full"
    adapter_only = False
    fake_quantization: FakeQuantization | None = None

    def configure(self, model: nn.Module) -> None:
        pass

    def initialize(self, model: nn.Module) -> None:
        pass

    def weights(self, checkpoint: dict[str, Any]) -> Sequence[dict[str, torch.Tensor]]:
        return [checkpoint[training.MODEL_KEY]]

    def after_load(self, model: nn.Module, missing: Sequence[str], unexpected: Sequence[str]) -> None:
        if missing or unexpected:
            raise checkpoint_mismatch("the model", missing, unexpected)

    def checkpoint_entries(self, full_state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {training.MODEL_KEY: full_state_dict}

    def quantized(self) -> str:
        return ""


class LoRAFinetune:
    """Train the adapters only; the base weights come from the checkpoint and stay frozen."""

    name = "lora"
    fake_quantization: FakeQuantization | None = None

    def __init__(self, cfg_model: DictConfig, save_adapter_weights_only: bool) -> None:
        self.rank = cfg_model.lora_rank
        self.alpha = cfg_model.lora_alpha
        self.attn_modules = list(cfg_model.lora_attn_modules)
        self.apply_to_mlp = cfg_model.get("apply_lora_to_mlp", False)
        self.apply_to_output = cfg_model.get("apply_lora_to_output", False)
        self.adapter_only = save_adapter_weights_only
        self._adapter_names: set[str] = set()

    def configure(self, model: nn.Module) -> None:
        adapter = get_adapter_params(model)
        self._adapter_names = set(adapter)
        set_trainable_params(model, adapter)

    def initialize(self, model: nn.Module) -> None:
        with warnings.catch_warnings():
            # Under FSDP2 on CPU the adapters are DTensors on a CPU mesh, which has no RNG tracker (CUDA's): torch
            # warns at each random draw that its DTensor random ops "may not have complete support", and each rank
            # draws its shard of ``lora_a`` from its own generator (seeded seed + rank). For the adapters' random
            # start that is what is wanted, any draw of the same distribution; nothing a user can act on.
            warnings.filterwarnings(
                "ignore", message="DTensor random operators may not have complete support on cpu", category=UserWarning
            )
            for module in model.modules():
                initialize = getattr(module, "initialize_parameters", None)
                if initialize is not None and hasattr(module, "lora_a"):
                    initialize()

    def weights(self, checkpoint: dict[str, Any]) -> Sequence[dict[str, torch.Tensor]]:
        adapter = checkpoint.get(training.ADAPTER_KEY)
        return [checkpoint[training.MODEL_KEY]] + ([adapter] if adapter else [])

    def after_load(self, model: nn.Module, missing: Sequence[str], unexpected: Sequence[str]) -> None:
        # Activation checkpointing wraps each layer after the adapter was found: its keys gain the wrapper's name.
        not_adapter = [k for k in missing if k.replace(_CHECKPOINT_WRAPPER, "") not in self._adapter_names]
        if not_adapter or unexpected:
            raise checkpoint_mismatch("the LoRA model", not_adapter, unexpected)
        for module in model.modules():
            initialize = getattr(module, "initialize_dora_magnitude", None)
            if initialize is not None:
                initialize()

    def checkpoint_entries(self, full_state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
        entries: dict[str, Any] = {
            training.ADAPTER_CONFIG: {
                "r": self.rank,
                "lora_alpha": self.alpha,
                "target_modules": get_lora_module_names(self.attn_modules, self.apply_to_mlp, self.apply_to_output),
                "peft_type": "LORA",
            }
        }
        if self.adapter_only:
            entries[training.ADAPTER_KEY] = full_state_dict
            return entries
        entries[training.ADAPTER_KEY] = get_adapter_state_dict(full_state_dict)
        entries[training.MODEL_KEY] = get_merged_lora_ckpt(dict(full_state_dict), rank=self.rank, alpha=self.alpha)
        return entries

    def quantized(self) -> str:
        return ""
