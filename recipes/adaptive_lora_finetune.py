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
from adaptive_batching.training.methods import LoRAFinetune
from adaptive_batching.training.quantization import step_hooks, with_quantizer
from adaptive_batching.training.trainer import Trainer


@parse
def recipe_main(cfg: DictConfig) -> None:
    """Validate; set up; profile the largest micro batch that fits; plan every epoch's batch and LR; train,
    saving as it goes. Only the adapters train."""
    settings = validate_config(cfg, "adaptive_lora_finetune")
    adapters = LoRAFinetune(cfg.model, save_adapter_weights_only=cfg.get("save_adapter_weights_only", False))
    method = with_quantizer(cfg, adapters)  # the base weights fake-quantized when the config has a quantizer (QAT)
    with Trainer(cfg, settings, method, hooks=step_hooks(method)) as trainer:
        trainer.setup()
        profile = trainer.profile()
        trainer.train(trainer.make_plan(profile))


if __name__ == "__main__":
    sys.exit(recipe_main())
