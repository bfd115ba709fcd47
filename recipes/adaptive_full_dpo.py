"""Direct preference optimisation (DPO) of the whole model with automatic and adaptive batch sizes.

    tune run adaptive_full_dpo --config tiny_full_dpo
    tune run --nproc_per_node 8 adaptive_full_dpo --config llama3_1/8B_full_dpo use_maximum_batch_size=True

The step is torchtune's ``full_dpo_distributed``'s: the policy's forward on each micro batch's chosen and rejected
answers at once, the reference's (a second, frozen copy of the model loaded from ``ref_checkpointer``, sharded as
the policy is) without gradients, and the preference loss (``DPOLoss``); every weight of the policy trains. The
batch machinery is the fine-tuning recipes'. A sample is a pair.
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
    """Validate; set up (the policy and its frozen reference); profile the largest micro batch of pairs that fits,
    the reference's weights resident; plan every epoch's batch and LR; train every weight, saving as it goes."""
    settings = validate_config(cfg, "adaptive_full_dpo")
    method, objective = method_and_objective(cfg, "adaptive_full_dpo", profiled=settings.needs_profile)
    with Trainer.build(cfg, settings, method, objective) as trainer:
        trainer.train()


if __name__ == "__main__":
    sys.exit(recipe_main())
