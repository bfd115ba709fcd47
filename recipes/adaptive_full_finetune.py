"""Full fine-tuning with automatic and adaptive batch sizes.

    tune run adaptive_full_finetune --config tiny_full
    tune run --nproc_per_node 2 adaptive_full_finetune --config llama3_2_1b

Every parameter trains; the batch machinery is shared with ``adaptive_lora_finetune``.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import training

from adaptive_batching.config import parse
from adaptive_batching.settings import validate_config
from adaptive_batching.trainer import Trainer


class FullFinetune:
    """Train every weight; save the whole model."""

    name = "full"
    adapter_only = False

    def configure(self, model: nn.Module) -> None:
        pass

    def initialize(self, model: nn.Module) -> None:
        pass

    def weights(self, checkpoint: dict[str, Any]) -> Sequence[dict[str, torch.Tensor]]:
        return [checkpoint[training.MODEL_KEY]]

    def after_load(self, model: nn.Module, missing: Sequence[str], unexpected: Sequence[str]) -> None:
        if missing or unexpected:
            raise RuntimeError(f"Checkpoint does not match the model: missing {missing}, unexpected {unexpected}")

    def checkpoint_entries(self, full_state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {training.MODEL_KEY: full_state_dict}


@parse
def recipe_main(cfg: DictConfig) -> None:
    """Validate; set up; profile the largest micro batch that fits; plan every epoch's batch and LR; train; close."""
    settings = validate_config(cfg)
    trainer = Trainer(cfg, settings, FullFinetune())
    trainer.setup()
    trainer.profile()
    trainer.make_plan()
    trainer.train()
    trainer.close()


if __name__ == "__main__":
    sys.exit(recipe_main())
