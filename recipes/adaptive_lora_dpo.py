"""Direct preference optimisation (DPO) of LoRA adapters with automatic and adaptive batch sizes.

    tune run adaptive_lora_dpo --config tiny_lora_dpo
    tune run adaptive_lora_dpo --config llama3_1/8B_lora_dpo_single_device use_maximum_batch_size=True

The step is torchtune's ``lora_dpo_single_device``'s: the policy's forward on each micro batch's chosen and
rejected answers at once, the reference's (the same model with its adapters off) without gradients, and the
preference loss (``DPOLoss``); the batch machinery is the fine-tuning recipes'. A sample is a pair.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from adaptive_batching.config.loading import parse
from adaptive_batching.config.settings import validate_config
from adaptive_batching.training.recipe_table import method_and_objective
from adaptive_batching.training.trainer import Trainer


@parse
def recipe_main(cfg: DictConfig) -> None:
    """Validate; set up; profile the largest micro batch of pairs that fits; plan every epoch's batch and LR;
    train the adapters, saving as it goes."""
    settings = validate_config(cfg, "adaptive_lora_dpo")
    method, objective = method_and_objective(cfg, "adaptive_lora_dpo", profiled=settings.needs_profile)
    with Trainer.build(cfg, settings, method, objective) as trainer:
        trainer.train()


if __name__ == "__main__":
    sys.exit(recipe_main())
