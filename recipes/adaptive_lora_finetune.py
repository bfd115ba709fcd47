"""LoRA fine-tuning with automatic and adaptive batch sizes.

    tune run adaptive_lora_finetune --config tiny_lora
    tune run --nproc_per_node 2 adaptive_lora_finetune --config llama3_2_1b_lora
    tune run adaptive_lora_finetune --config tiny_qat_lora    # with quantization-aware training (a quantizer)

Only adapter parameters train; the batch machinery is shared with ``adaptive_full_finetune``.
``save_adapter_weights_only: True`` saves the adapter alone, else the merged model as well. With a ``quantizer``
the base weights are fake-quantized (docs/qat.md).
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
    saving as it goes. Only the adapters train."""
    settings = validate_config(cfg, "adaptive_lora_finetune")
    method, objective = method_and_objective(cfg, "adaptive_lora_finetune", profiled=settings.needs_profile)
    with Trainer.build(cfg, settings, method, objective) as trainer:
        trainer.train()


if __name__ == "__main__":
    sys.exit(recipe_main())
