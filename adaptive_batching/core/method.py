"""The fine-tuning method's protocol: what differs between full and LoRA fine-tuning (see ``training.methods``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn


class FinetuneMethod(Protocol):
    """What differs between full and LoRA fine-tuning; everything else is shared."""

    name: str

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

    @property
    def adapter_only(self) -> bool:
        """True when only adapter weights are saved."""
