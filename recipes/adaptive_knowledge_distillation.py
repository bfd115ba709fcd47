"""Knowledge distillation (KD) of a student model from a frozen teacher, with automatic and adaptive batch sizes.

  tune run adaptive_knowledge_distillation --config tiny_kd
  tune run adaptive_knowledge_distillation --config qwen2/1.5_to_0.5B_KD_lora_single_device use_maximum_batch_size=True
  tune run --nproc_per_node 2 adaptive_knowledge_distillation --config llama3_2/8B_to_1B_KD_lora_distributed

The step is torchtune's ``knowledge_distillation_single_device``'s (and ``_distributed``'s): the student's forward,
the teacher's (``teacher_model`` with the weights of ``teacher_checkpointer``, frozen, sharded as the student is)
without gradients, and ``(1 - kd_ratio) x`` the cross-entropy ``+ kd_ratio x`` the ``kd_loss``. The student is
LoRA (as in torchtune's KD configs) or, with a model builder without adapters, every weight trains. The batch
machinery is the fine-tuning recipes'; the profiler's trials hold the teacher's weights and run its forward.
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
    """Validate; set up (the student and its frozen teacher); profile the largest micro batch that fits, the
    teacher's weights resident; plan every epoch's batch and LR; train the student, saving as it goes."""
    settings = validate_config(cfg, "adaptive_knowledge_distillation")
    method, objective = method_and_objective(cfg, "adaptive_knowledge_distillation", profiled=settings.needs_profile)
    with Trainer.build(cfg, settings, method, objective) as trainer:
        trainer.train()


if __name__ == "__main__":
    sys.exit(recipe_main())
