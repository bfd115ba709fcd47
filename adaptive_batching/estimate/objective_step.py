"""The step an estimate traces: fine-tuning's, or that of the training objective a DPO or KD recipe trains with.

Fine-tuning's step is the summed-token loss on fake tokens (``fake_steps`` has always traced it so). Another
objective (a :class:`~adaptive_batching.core.objective.TrainingObjective`, handed in by the caller: the one the
trainer composes, so the estimate traces the code that trains) runs its own ``micro_loss`` on its own worst-case
micro batch, collated as training collates it; for DPO that is the reference's forward without autograd, then the
policy's on the chosen and rejected sequences of each pair, and the preference loss; for knowledge distillation the
teacher's forward without autograd, then the student's on the same micro batch, and both losses (cross-entropy and
KD) on the two sets of logits. What the objective holds besides the policy (full DPO's frozen reference, KD's
teacher) it builds through ``build``, from fake frozen models of the config key it names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch._subclasses import fake_impls

from adaptive_batching.batching.data import DEFAULT_COLLATE
from adaptive_batching.core.loss import summed_token_loss
from adaptive_batching.core.objective import TrainingObjective


def _tokens(micro_batch: int, seq_len: int, vocab_size: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, vocab_size, (micro_batch, seq_len))
    return {"tokens": tokens, "labels": tokens}


@contextlib.contextmanager
def values_of_a_full_batch() -> Iterator[None]:
    """Fake tensors read as Python values: a truth value is ``False``, a number 1. A loss that branches on a value
    takes the branch of a batch whose tokens count: torchtune's KD losses return a constant 0, with no graph, when
    none does (``if sum_masks == 0``), which would drop their backward from the trace. A fake tensor has no value;
    read, it raises ``DataDependentOutputException``."""
    op = torch.ops.aten._local_scalar_dense.default
    saved = fake_impls.op_implementations_dict[op]

    def one(fake_mode: Any, func: Any, arg: torch.Tensor) -> Any:
        return False if arg.dtype == torch.bool else 1.0 if arg.dtype.is_floating_point else 1

    fake_impls.op_implementations_dict[op] = one
    try:
        yield
    finally:
        fake_impls.op_implementations_dict[op] = saved


@dataclass(frozen=True)
class Step:
    """The step a trace runs: fine-tuning's summed-token loss (``objective`` None), or an objective's
    ``micro_loss`` on its worst-case micro batch (DPO, KD). ``resident``: the models the objective holds besides the
    policy (their weights count with the policy's)."""

    objective: TrainingObjective | None = None
    resident: tuple[nn.Module, ...] = ()
    collate_path: str = DEFAULT_COLLATE  # the config's collate_fn, as training collates (fine-tuning's, KD's)

    def batch(self, loss_fn: Any, micro_batch: int, seq_len: int, vocab_size: int) -> dict[str, Any] | None:
        """The objective's worst-case micro batch, real (its collate reads the values), made before a trace; None
        for fine-tuning, whose fake tokens the trace makes."""
        if self.objective is None:
            return None
        collate = self.objective.collate(self.collate_path, False, 0, loss_fn)
        return self.objective.worst_case_batch(
            collate, micro_batch=micro_batch, seq_len=seq_len, vocab_size=vocab_size, packed=False
        )

    def loss(
        self,
        model: nn.Module,
        loss_fn: Any,
        batch: dict[str, Any] | None,
        micro_batch: int,
        seq_len: int,
        vocab_size: int,
    ) -> torch.Tensor:
        """The micro batch's summed loss, traced: its inputs are made inside the trace (an objective's batch is
        copied there), so they count as a real step's do."""
        if self.objective is None:
            return summed_token_loss(model, loss_fn, _tokens(micro_batch, seq_len, vocab_size))[0]
        assert batch is not None
        self.objective.start_step()
        inputs = {key: value.clone() for key, value in batch.items()}
        with values_of_a_full_batch():
            return self.objective.micro_loss(model, loss_fn, inputs, contextlib.nullcontext())[0]


def step_of(cfg: DictConfig, objective: TrainingObjective | None, frozen_copy: Callable[[str], nn.Module]) -> Step:
    """The step of ``objective`` (None: fine-tuning), what it holds besides the policy built by ``frozen_copy(node)``
    (a fake, frozen model of config key ``node``: ``model`` for full DPO's reference, ``teacher_model`` for KD's
    teacher; whichever checkpointer's weights it asks for, they are fake)."""
    if objective is None:
        return Step()
    objective.build(cfg, lambda key, node="model": frozen_copy(node))
    return Step(objective, tuple(objective.resident), str(cfg.get("collate_fn", DEFAULT_COLLATE)))
