"""StepRunner's micro batch: what it keeps after the backward."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from adaptive_batching.faults.guard import StepGuard
from adaptive_batching.runtime.distributed import ParallelInfo
from adaptive_batching.training.stepping import StepRunner

ONE_RANK = ParallelInfo(world_size=1, rank=0, local_rank=0)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.embed(tokens)))


class Loss(nn.Module):
    ignore_index = -100

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=self.ignore_index
        )


def micro_batch(seed: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(seed))
    return {"tokens": tokens, "labels": tokens.clone()}


def test_the_last_loss_stays_without_its_saved_tensors_until_the_next_micro_batch() -> None:
    model = Model()
    runner = StepRunner(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        Loss(),
        StepGuard(ONE_RANK, torch.device("cpu")),
        ONE_RANK,
        torch.device("cpu"),
        clip_grad_norm=None,
        oom_recovery=True,
        where=lambda: (1, None, "."),
    )
    assert runner.last_loss is None
    loss, _ = runner.forward_backward(micro_batch(0))
    held = runner.last_loss
    assert held is not None and held.grad_fn is not None
    assert torch.equal(held.detach(), loss)
    with pytest.raises(RuntimeError, match="second time"):  # the backward freed what the nodes saved
        held.backward()
    gone = weakref.ref(held)
    del held
    assert gone() is not None
    second, _ = runner.forward_backward(micro_batch(1))
    assert gone() is None
    assert runner.last_loss is not None and torch.equal(runner.last_loss.detach(), second)
