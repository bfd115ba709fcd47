"""The loss of one micro batch, summed over its tokens, as every step of the recipes computes it."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def shifted_labels(labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro batch's labels shifted by one token (the last position predicts nothing) and the number of tokens
    that count. With none counting (a rank's padding at the end of an epoch) one label is un-ignored so that the mean
    inside a loss stays finite; the summed loss is then x 0 and its gradients zero."""
    labels = F.pad(labels[..., 1:], (0, 1), value=ignore_index)
    tokens = (labels != ignore_index).sum()
    labels.view(-1)[:1].masked_fill_(tokens == 0, 0)  # on the device: no host sync
    return labels, tokens


def flat(logits: torch.Tensor | list[torch.Tensor], labels: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """Logits and labels as a token loss takes them: one row per token, or as they are for chunked logits (a list,
    ``CEWithChunkedOutputLoss``'s)."""
    if isinstance(logits, list):
        return logits, labels
    return logits.reshape(-1, logits.size(-1)), labels.reshape(-1)


def summed_token_loss(
    model: nn.Module,
    loss_fn: Any,
    batch: dict[str, torch.Tensor],
    activations: AbstractContextManager = contextlib.nullcontext(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward one micro batch; return its loss summed over the tokens that count, and their number.

    Labels are shifted by one token (:func:`shifted_labels`). Summing, not averaging, lets a step divide by the
    tokens of all its micro batches and ranks at once. ``batch`` loses its ``labels``. ``activations`` wraps the
    model's forward (not the loss), as torchtune's recipes wrap it in activation offloading.
    """
    labels, tokens = shifted_labels(batch.pop("labels"), loss_fn.ignore_index)
    with activations:
        logits = model(**batch)
    logits, labels = flat(logits, labels)
    loss = loss_fn(logits, labels) * tokens
    del logits
    return loss, tokens
