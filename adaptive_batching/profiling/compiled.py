"""``compile: True`` for fake steps: the two places where compiling changes what a step holds most.

The layers are traced eager otherwise (what a compiled layer keeps for the backward is not modelled), so a
compiled step is counted from above.

**The loss.** torchtune's recipes compile the loss (``training.compile_loss``): for ``CEWithChunkedOutputLoss``
the upcast and cross-entropy of each chunk, for other losses the whole module. What a compiled function keeps for
the backward is chosen by AOTAutograd's min-cut partitioner on the joint graph, after inductor's decompositions.
Traced that way, ``F.cross_entropy(logits.float(), labels, reduction="sum")`` keeps its bf16 input, the labels
and two float32 values per token (the running max and log-sum-exp), where eager keeps a float32 copy of the
logits (4 bytes a logit; checked with ``aot_function(..., partition_fn=min_cut_rematerialization_partition,
decompositions=select_decomp_table())`` in torch 2.13). Inductor fuses the pointwise work and reductions of
each side into kernels that read the bf16 logits, so it is assumed (not measured here) that neither side holds a
float32 copy at any time: the backward writes the gradient of the logits and nothing else.
:class:`FusedCrossEntropy` is that, for shapes and bytes only: on fake tensors it allocates what the compiled
loss allocates, and its values are meaningless (it is never used on real tensors).

**NF4 weights (QLoRA).** Eager, torchao's ``NF4Tensor.get_original_weight`` builds the bf16 weight through
int64 indices and bf16 intermediates: 14 bytes a weight at its peak (MemTracker, a 1024 x 4096 weight). A
compiled layer fuses it into one kernel that writes the bf16 weight (2 bytes a weight);
:func:`fused_nf4_dequantization` makes the fake step allocate only that.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch
from torch import nn


class FusedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``logits`` (N x V) against ``labels`` (N), as the compiled kernels hold memory."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        tokens = logits.shape[:-1]
        running_max = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        log_sum_exp = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        ctx.save_for_backward(logits, labels, running_max, log_sum_exp)
        return torch.empty((), dtype=torch.float32, device=logits.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, _, _, _ = ctx.saved_tensors
        return torch.empty_like(logits), None


def _chunk_cross_entropy(self: Any, logits: torch.Tensor, labels: torch.Tensor, normalize: bool = True) -> Any:
    return FusedCrossEntropy.apply(logits, labels)


def _module_cross_entropy(self: nn.CrossEntropyLoss, logits: torch.Tensor, labels: torch.Tensor) -> Any:
    return FusedCrossEntropy.apply(logits, labels)


def as_compiled(loss_fn: Any) -> bool:
    """Make ``loss_fn`` hold memory as torchtune's compiled loss does, where this module models it
    (``CEWithChunkedOutputLoss``: each chunk's cross-entropy; ``torch.nn.CrossEntropyLoss``: the whole loss);
    True if it did, False for a loss it leaves eager."""
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    if isinstance(loss_fn, CEWithChunkedOutputLoss):
        loss_fn.compute_cross_entropy = types.MethodType(_chunk_cross_entropy, loss_fn)
        return True
    if type(loss_fn) is nn.CrossEntropyLoss:
        loss_fn.forward = types.MethodType(_module_cross_entropy, loss_fn)
        return True
    return False


@contextlib.contextmanager
def fused_nf4_dequantization() -> Iterator[None]:
    """While a fake step runs: dequantizing an NF4 weight allocates the bf16 weight only, as a compiled layer's
    fused kernel does (see the module docstring)."""
    from torchao.dtypes.nf4tensor import NF4Tensor

    def fused(self: NF4Tensor) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    original = NF4Tensor.get_original_weight
    NF4Tensor.get_original_weight = fused
    try:
        yield
    finally:
        NF4Tensor.get_original_weight = original
