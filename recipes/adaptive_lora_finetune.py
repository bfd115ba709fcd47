"""LoRA fine-tuning with automatic and adaptive batch sizes.

    tune run adaptive_lora_finetune --config tiny_lora
    tune run --nproc_per_node 2 adaptive_lora_finetune --config llama3_2_1b_lora

Only adapter parameters train; the batch machinery is shared with ``adaptive_full_finetune``.
``save_adapter_weights_only: True`` saves the adapter alone, else the merged model as well.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

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

from adaptive_batching.config import parse
from adaptive_batching.settings import validate_config
from adaptive_batching.trainer import Trainer


class LoRAFinetune:
    """Train the adapters only; the base weights come from the checkpoint and stay frozen."""

    name = "lora"

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
        for module in model.modules():
            if hasattr(module, "initialize_parameters") and hasattr(module, "lora_a"):
                module.initialize_parameters()

    def weights(self, checkpoint: dict[str, Any]) -> Sequence[dict[str, torch.Tensor]]:
        adapter = checkpoint.get(training.ADAPTER_KEY)
        return [checkpoint[training.MODEL_KEY]] + ([adapter] if adapter else [])

    def after_load(self, model: nn.Module, missing: Sequence[str], unexpected: Sequence[str]) -> None:
        not_adapter = [k for k in missing if k not in self._adapter_names]
        if not_adapter or unexpected:
            raise RuntimeError(
                f"Checkpoint does not match the LoRA model: missing {not_adapter}, unexpected {list(unexpected)}"
            )
        for module in model.modules():
            if hasattr(module, "initialize_dora_magnitude"):
                module.initialize_dora_magnitude()

    def checkpoint_entries(self, full_state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
        entries: dict[str, Any] = {
            training.ADAPTER_CONFIG: {
                "r": self.rank,
                "lora_alpha": self.alpha,
                "target_modules": get_lora_module_names(
                    self.attn_modules, self.apply_to_mlp, self.apply_to_output
                ),
                "peft_type": "LORA",
            }
        }
        if self.adapter_only:
            entries[training.ADAPTER_KEY] = full_state_dict
            return entries
        entries[training.ADAPTER_KEY] = get_adapter_state_dict(full_state_dict)
        entries[training.MODEL_KEY] = get_merged_lora_ckpt(dict(full_state_dict), rank=self.rank, alpha=self.alpha)
        return entries


@parse
def recipe_main(cfg: DictConfig) -> None:
    """Validate; set up; profile the largest micro batch that fits; plan every epoch's batch and LR; train; close."""
    settings = validate_config(cfg)
    method = LoRAFinetune(cfg.model, cfg.get("save_adapter_weights_only", False))
    trainer = Trainer(cfg, settings, method)
    trainer.setup()
    trainer.profile()
    trainer.make_plan()
    trainer.train()
    trainer.close()


if __name__ == "__main__":
    sys.exit(recipe_main())
