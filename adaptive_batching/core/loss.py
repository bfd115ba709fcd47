"""The loss of one micro batch, summed over its tokens, as every step of the recipes computes it."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
import torch.nn.functional as F
from torch import nn


def summed_token_loss(
    model: nn.Module,
    loss_fn: Any,
    batch: dict[str, torch.Tensor],
    activations: ContextManager = contextlib.nullcontext(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward one micro batch; return its loss summed over the tokens that count, and their number.

    Labels are shifted by one token (the last position predicts nothing). Summing, not averaging,
    lets a step divide by the tokens of all its micro batches and ranks at once.
    A micro batch with no token that counts (a rank's padding at the end of an epoch) gives 0 and
    zero gradients: one label is un-ignored so the mean inside ``loss_fn`` stays finite, then x 0.
    ``batch`` loses its ``labels``. ``activations`` wraps the model's forward (not the loss), as torchtune's
    recipes wrap it in activation offloading.
    """
    labels = batch.pop("labels")
    ignore = loss_fn.ignore_index
    labels = F.pad(labels[..., 1:], (0, 1), value=ignore)
    tokens = (labels != ignore).sum()
    labels.view(-1)[:1].masked_fill_(tokens == 0, 0)  # on the device: no host sync
    with activations:
        logits = model(**batch)
    if not isinstance(logits, list):
        labels = labels.reshape(-1)
        logits = logits.reshape(-1, logits.size(-1))
    loss = loss_fn(logits, labels) * tokens
    del logits
    return loss, tokens
