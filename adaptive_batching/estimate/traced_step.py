"""The step an estimate traces: the micro batch's forward and loss of the training objective its recipe trains with.

The objective (a :class:`~adaptive_batching.core.objective.TrainingObjective`, handed in by the caller: the one the
trainer composes, so the estimate traces the code that trains) runs its own ``micro_loss`` on its own worst-case
micro batch, collated as training collates it: for fine-tuning the summed-token loss; for DPO the reference's forward
without autograd, then the policy's on the chosen and rejected sequences of each pair, and the preference loss; for
knowledge distillation the teacher's forward without autograd, then the student's on the same micro batch, and both
losses (cross-entropy and KD) on the two sets of logits. The frozen model it holds besides the policy (full DPO's
reference, KD's teacher: the objective's ``frozen``) is a fake, frozen
model handed to it here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses import fake_impls
from torch.utils import _pytree as pytree

from adaptive_batching.core.objective import FrozenModel, TrainingObjective


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
class TracedStep:
    """The step a trace runs: ``objective``'s ``micro_loss`` on its worst-case micro batch, collated by
    ``collate_path`` (the config's ``collate_fn``) as training collates it. ``resident``: the models the objective
    holds besides the policy (their weights count with the policy's)."""

    objective: TrainingObjective
    collate_path: str
    resident: tuple[nn.Module, ...] = ()
    images: int = 0  # a vision sample's images (the most a sample of the data holds; 0: not read, one)

    def batch(self, loss_fn: Any, micro_batch: int, seq_len: int, vocab_size: int) -> dict[str, Any]:
        """The objective's worst-case micro batch, real (its collate reads the values), made before a trace."""
        collate = self.objective.collate(self.collate_path, False, 0, loss_fn)
        return self.objective.worst_case_batch(
            collate, micro_batch=micro_batch, seq_len=seq_len, vocab_size=vocab_size, packed=False, images=self.images
        )

    def loss(self, model: nn.Module, loss_fn: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The micro batch's summed loss, traced: its inputs are copied inside the trace, so they count as a real
        step's do."""
        self.objective.start_step()
        inputs = pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, batch)  # a vision batch nests its images
        with values_of_a_full_batch():
            return self.objective.micro_loss(model, loss_fn, inputs, contextlib.nullcontext())[0]

    def describe(self, seq_len: int, frozen_bytes: int, frozen_layers: tuple[int, int]) -> str:
        """The objective's step in words ("" for fine-tuning's; see ``TrainingObjective.describe_step``)."""
        return self.objective.describe_step(seq_len, frozen_bytes, frozen_layers)


def traced_step(
    objective: TrainingObjective,
    collate_path: str,
    frozen_copy: Callable[[FrozenModel], nn.Module],
    images: int = 0,
) -> TracedStep:
    """The step of ``objective``, the frozen model it holds (if any) built by ``frozen_copy`` (a fake, frozen model
    of the builder it names; whichever checkpointer's weights it asks for, they are fake); ``images``: a vision
    sample's (0: one)."""
    if objective.frozen is not None:
        objective.hold(frozen_copy(objective.frozen))
    return TracedStep(objective, collate_path, tuple(objective.resident), images)
