"""Full fine-tuning with automatic and adaptive batch sizes.

    tune run adaptive_full_finetune --config tiny_full
    tune run --nproc_per_node 2 adaptive_full_finetune --config llama3_2_1b

Every parameter trains and the whole model is saved; the batch machinery is shared with
``adaptive_lora_finetune``. With a ``quantizer`` the linear layers are fake-quantized (docs/qat.md).
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
    """Validate; set up; profile the largest micro batch that fits; plan every epoch's batch and LR; train,
    saving as it goes. Every weight trains."""
    settings = validate_config(cfg, "adaptive_full_finetune")
    method, objective = method_and_objective(cfg, "adaptive_full_finetune", profiled=settings.needs_profile)
    with Trainer.build(cfg, settings, method, objective) as trainer:
        trainer.train()


if __name__ == "__main__":
    sys.exit(recipe_main())
