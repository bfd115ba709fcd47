"""Run a KD recipe for the parity test (test_kd.py): ours, torchtune's ``knowledge_distillation_single_device``, or
that recipe with its gradient normalised as the fine-tuning recipes normalise it (``stock_fixed``).

    python tests/kd_parity_run.py RECIPE --config CONFIG KEY=VALUE...
    python benchmarks/faulty_run.py FAULT_JSON PREFIX kd_parity_run --config CONFIG KEY=VALUE...  (ours, its faults)

As tests/dpo_parity_run.py (whose LoRA A generator and exact logger it uses). torchtune 0.6.1's KD recipes
backpropagate each micro batch's *mean* loss and then divide the step's gradients by its tokens again (counted
before the label shift), so a micro batch with fewer tokens weighs more and the step's gradient depends on how it
is cut; ours sums each micro batch's loss over its tokens and divides by the step's (shifted) tokens once, as
torchtune's fine-tuning recipes do. ``stock_fixed`` runs torchtune's recipe unchanged but for that: each micro
batch's CE and KD losses send back their gradient times the micro batch's shifted tokens (a hook on each loss),
and ``scale_grads`` divides by the step's shifted tokens.
"""

from __future__ import annotations

import sys
from typing import Any

import dpo_parity_run
import torch

STOCK = "knowledge_distillation_single_device"


def fix_stock_normalisation() -> None:
    """Patch torchtune's chunked CE and forward-KL losses and ``scale_grads`` in this process (see above)."""
    from torchtune import training
    from torchtune.modules import loss as losses

    step_tokens: list[torch.Tensor] = []

    def weighted(forward: Any, count: bool) -> Any:
        def forward_times_tokens(self: Any, *args: Any) -> torch.Tensor:
            out = forward(self, *args)
            tokens = (args[-1] != self.ignore_index).sum()
            if count:
                step_tokens.append(tokens)
            if out.requires_grad:
                out.register_hook(lambda grad: grad * tokens)
            return out

        return forward_times_tokens

    losses.CEWithChunkedOutputLoss.forward = weighted(losses.CEWithChunkedOutputLoss.forward, True)
    losses.ForwardKLWithChunkedOutputLoss.forward = weighted(losses.ForwardKLWithChunkedOutputLoss.forward, False)
    scale_grads = training.scale_grads

    def scale_by_shifted_tokens(model: torch.nn.Module, scaler: torch.Tensor) -> None:
        tokens = torch.stack(step_tokens).sum()
        step_tokens.clear()
        scale_grads(model, 1 / tokens)

    training.scale_grads = scale_by_shifted_tokens


def same_adapters() -> None:
    """Every LoRA A matrix drawn from one generator of its own (as dpo_parity_run.main draws them)."""
    import math

    import torchtune.modules.peft.lora as lora
    from torch import nn

    generator = torch.Generator().manual_seed(0)
    lora._lora_a_init_params = lambda x: nn.init.kaiming_uniform_(x.weight, a=math.sqrt(5), generator=generator)


def recipe_main() -> Any:
    """``adaptive_knowledge_distillation`` with the LoRA A matrices of :func:`same_adapters`, for the harnesses
    that import a recipe module and call its ``recipe_main`` (benchmarks/faulty_run.py, crashing_run.py)."""
    same_adapters()
    import adaptive_knowledge_distillation

    return adaptive_knowledge_distillation.recipe_main()


if __name__ == "__main__":
    if sys.argv[1] == "stock_fixed":
        fix_stock_normalisation()
        sys.argv[1] = STOCK
    dpo_parity_run.main()
