"""The step an estimate traces: fine-tuning's, or that of the training objective a DPO recipe trains with.

Fine-tuning's step is the summed-token loss on fake tokens (``fake_steps`` has always traced it so). Another
objective (a :class:`~adaptive_batching.core.objective.TrainingObjective`, handed in by the caller: the one the
trainer composes, so the estimate traces the code that trains) runs its own ``micro_loss`` on its own worst-case
micro batch, collated as training collates it; for DPO that is the policy's forward on the chosen and rejected
sequences of each pair, the reference's forward without autograd, and the preference loss. What the objective holds
besides the policy (full DPO's frozen reference) it builds through ``build``, from fake frozen copies of the model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig
from torch import nn

from adaptive_batching.core.loss import summed_token_loss
from adaptive_batching.core.objective import TrainingObjective
from adaptive_batching.errors import ConfigError


def _tokens(micro_batch: int, seq_len: int, vocab_size: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, vocab_size, (micro_batch, seq_len))
    return {"tokens": tokens, "labels": tokens}


@dataclass(frozen=True)
class Step:
    """The step a trace runs: fine-tuning's summed-token loss (``objective`` None), or an objective's
    ``micro_loss`` on its worst-case micro batch (DPO). ``resident``: the models the objective holds besides the
    policy (their weights count with the policy's)."""

    objective: Optional[TrainingObjective] = None
    resident: tuple[nn.Module, ...] = ()

    def batch(self, loss_fn: Any, micro_batch: int, seq_len: int, vocab_size: int) -> Optional[dict[str, Any]]:
        """The objective's worst-case micro batch, real (its collate reads the values), made before a trace; None
        for fine-tuning, whose fake tokens the trace makes."""
        if self.objective is None:
            return None
        collate = self.objective.collate("", False, 0, loss_fn)
        return self.objective.worst_case_batch(collate, micro_batch=micro_batch, seq_len=seq_len,
                                               vocab_size=vocab_size, packed=False)

    def loss(self, model: nn.Module, loss_fn: Any, batch: Optional[dict[str, Any]], micro_batch: int, seq_len: int,
             vocab_size: int) -> torch.Tensor:
        """The micro batch's summed loss, traced: its inputs are made inside the trace (an objective's batch is
        copied there), so they count as a real step's do."""
        if self.objective is None:
            return summed_token_loss(model, loss_fn, _tokens(micro_batch, seq_len, vocab_size))[0]
        assert batch is not None
        inputs = {key: value.clone() for key, value in batch.items()}
        return self.objective.micro_loss(model, loss_fn, inputs, contextlib.nullcontext())[0]


def step_of(cfg: DictConfig, objective: Optional[TrainingObjective], frozen_copy: Callable[[], nn.Module]) -> Step:
    """The step of ``objective`` (None: fine-tuning), what it holds besides the policy built from ``frozen_copy``
    (a fake, frozen copy of the config's model, whichever checkpointer's weights it asks for: they are fake)."""
    if objective is None:
        return Step()
    if objective.name == "kd":
        raise ConfigError("config key 'teacher_model': estimate does not model knowledge distillation yet (the "
                          "teacher's weights, forward and logits); measure it with adaptive-batching profile")
    objective.build(cfg, lambda key: frozen_copy())
    return Step(objective, tuple(objective.resident))
