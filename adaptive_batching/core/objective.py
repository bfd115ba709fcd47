"""The training objective's protocol: what differs between supervised fine-tuning, preference tuning (DPO) and
knowledge distillation (KD).

The trainer composes one objective (see ``training.objectives``) as it composes a
:class:`~adaptive_batching.core.method.FinetuneMethod`: the objective says how samples are collated, what one
micro batch's forward and loss are, how a sample's padded length is measured and what a step logs besides its loss.
It describes its own step, so the profiler, ``estimate`` and the CLI ask it rather than its name: the sequences of
a sample, the frozen model it holds besides the policy (:class:`FrozenModel`: built with the other parts, then
handed to it) and the step in words. Everything about the batch (its size, growth, the OOM response, checkpoints)
is shared.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

PAIR_KEYS = ("chosen_input_ids", "rejected_input_ids")  # a preference sample's two token lists (torchtune's names)


def sample_length(sample: Mapping[str, Any]) -> int:
    """A sample's padded length: its tokens, or for a preference pair the longer of its two sequences (the
    collate pads both to it)."""
    if "tokens" in sample:
        return len(sample["tokens"])
    return max(len(sample[key]) for key in PAIR_KEYS)


@dataclass(frozen=True)
class FrozenModel:
    """A frozen model an objective holds besides the policy (full DPO's reference, KD's teacher): built from config
    key ``model`` (``model``: a second copy of the policy) with the weights of the checkpointer at config key
    ``weights``, sharded as the policy is; its forward runs without autograd at every micro batch."""

    model: str
    weights: str


class TrainingObjective(Protocol):
    """What one micro batch trains on and how its loss is made; everything else is the trainer's."""

    # Read-only members (a property or a frozen dataclass's field implements each).
    @property
    def name(self) -> str: ...

    @property
    def trained_by(self) -> str:
        """What trains with it, as messages name it: its recipe, or "fine-tuning"."""

    @property
    def sequences_per_sample(self) -> int:
        """Sequences the policy's forward sees per sample (a preference pair: 2)."""

    @property
    def frozen(self) -> FrozenModel | None:
        """The frozen model to build for it with the other parts (:meth:`hold`); None: none."""

    @property
    def resident(self) -> tuple[nn.Module, ...]:
        """Models it holds besides the policy (a reference, a teacher): memory a step counts."""

    def hold(self, model: nn.Module) -> None:
        """Keep the frozen model built as :attr:`frozen` says (called once, with the other parts)."""

    def describe_step(self, seq_len: int, frozen_bytes: int, frozen_layers: tuple[int, int]) -> str:
        """The step in words, for ``adaptive-batching estimate`` ("" for fine-tuning's, which needs none): with
        ``seq_len``-token sequences, a rank's ``frozen_bytes`` of the frozen model's weights and, of its layers,
        ``frozen_layers`` (traced, total)."""

    def start_step(self) -> None:
        """A training step's micro batches begin (again, after an out-of-memory retry): forget what
        :meth:`step_metrics` would have read from an unfinished one."""

    def collate(self, collate_path: str, packed: bool, pad_id: int, loss_fn: Any) -> Callable:
        """The collate of the data set's samples into a micro batch: a dict whose ``tokens`` has one row per
        sample (``len(batch["tokens"])`` is the micro batch's samples) and which an empty list also gives."""

    def micro_loss(
        self, model: nn.Module, loss_fn: Any, batch: dict[str, torch.Tensor], activations: AbstractContextManager
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward one micro batch; its loss summed over what counts (tokens, pairs) and how many counted.
        The step divides the gradients by the count of all its micro batches and ranks."""

    def worst_case_batch(
        self, collate: Callable, *, micro_batch: int, seq_len: int, vocab_size: int, packed: bool, images: int = 0
    ) -> dict[str, torch.Tensor]:
        """``micro_batch`` samples of ``seq_len`` tokens each, collated as training collates them; ``images``: the
        most images a sample of the data holds (a vision objective's; the others have none)."""

    def step_metrics(self, seconds: float, padded_tokens: int) -> dict[str, float]:
        """What a logged step adds to (or changes in) the loss and the batch's metrics, from its last micro batch;
        ``seconds`` and ``padded_tokens``: the step's time and the token positions its forwards ran on."""
