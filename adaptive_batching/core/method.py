"""The fine-tuning method's protocol: what differs between full and LoRA fine-tuning, with or without fake
quantization (see ``training.methods`` and ``training.quantization``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class FakeQuantization:
    """When a quantization-aware method trains with fake quantization: off for the first ``after_n_steps`` optimizer
    steps, then on (None: on from the first). A trial step of the profiler always runs with it on."""

    after_n_steps: int | None = None

    def enabled_at(self, global_step: int) -> bool:
        """Whether the optimizer step after ``global_step`` finished ones trains with fake quantization."""
        return self.after_n_steps is None or global_step >= self.after_n_steps


class FinetuneMethod(Protocol):
    """What differs between full and LoRA fine-tuning; everything else is shared."""

    # Read-only members (a property or a frozen dataclass's field implements each).
    @property
    def name(self) -> str: ...

    @property
    def fake_quantization(self) -> FakeQuantization | None:
        """When its linear layers are fake-quantized (QAT); None: never."""

    def configure(self, model: nn.Module) -> None:
        """Choose the trainable parameters (called on the meta-device model)."""

    def initialize(self, model: nn.Module) -> None:
        """Initialise parameters that no checkpoint provides (called on the materialised model)."""

    def weights(self, checkpoint: dict[str, Any]) -> Sequence[dict[str, torch.Tensor]]:
        """The state dicts to load into the model, in order."""

    def after_load(self, model: nn.Module, missing: Sequence[str], unexpected: Sequence[str]) -> None:
        """Raise if loading left the model incomplete; finish what depends on the loaded weights."""

    def checkpoint_entries(self, full_state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
        """What to hand to the torchtune checkpointer for the model (model and/or adapter keys)."""

    def quantized(self) -> str:
        """What it fake-quantizes once ``configure`` ran, in words ("" for a method without fake quantization)."""

    @property
    def adapter_only(self) -> bool:
        """True when only adapter weights are saved."""
