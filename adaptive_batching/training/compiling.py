"""``compile: True`` as torchtune compiles (each decoder layer, and the loss's cross-entropy), with the batch's
sizes marked dynamic, so that one graph serves every micro batch and sample length.

torchtune 0.6.1 marks nothing: Dynamo compiles a graph for micro batch 1, another for 2, then a dynamic one, and
again when inductor's code adds a range guard (``2 <= x.size(0) <= 16``). The profiler's trials and later growth
change the micro batch all the time, so each of those recompiles would fall inside a measured step. Here the
hidden state that enters the first layer is marked before the layers see it: the micro batch dimension *unbacked*
(no guard on its value, size 1 included, so nothing specialises on it) and the sequence dimension dynamic; the
loss's logits and labels likewise. The decoder layers share one compiled function, so one graph serves all of
them.

The unbacked dimension gets the size traced as its hint (``hint_override``), the hint a backed one would have:
without one inductor cannot weigh the dimension and fuses less (on CPU the SiLU's recompute and its backward
became two kernels, where the graph specialised on micro batch 8, and the hinted one, have one).

The marks are needed only while Dynamo traces: a graph whose micro batch dimension is unbacked guards nothing on
it, so later inputs reuse it unmarked. Marked on every call (each of the chunked loss's 8 chunks, twice), the loss
cost 157 us a micro batch more than torchtune's on the 2-core machine (a benchmark since removed, commit 89c5ee5), so the
marks step aside after the first call that ran with gradients.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torchtune import training


def _unbacked(tensor: torch.Tensor) -> None:
    torch._dynamo.decorators.mark_unbacked(tensor, 0, hint_override=tensor.size(0))


def _mark(tensor: torch.Tensor) -> torch.Tensor:
    _unbacked(tensor)
    if tensor.dim() > 2:
        torch._dynamo.maybe_mark_dynamic(tensor, 1)
    return tensor


def compile_model(model: nn.Module, verbose: bool) -> None:
    """torchtune's per-layer compile, with the embedding's output (the first layer's input) marked dynamic until the
    first forward with gradients has compiled the layers."""
    training.compile_model(model, verbose=verbose)
    hooks = [model.tok_embeddings.register_forward_hook(lambda module, args, output: _mark(output))]

    def compiled(module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for hook in hooks:
                hook.remove()

    hooks.append(model.register_forward_hook(compiled))


def compile_loss(loss_fn: Any, verbose: bool) -> Any:
    """torchtune's compiled loss; for the chunked cross-entropy, each chunk's logits and labels marked dynamic until
    the first call with gradients has compiled it."""
    compiled = training.compile_loss(loss_fn, verbose=verbose)
    inner: Callable[..., torch.Tensor] = getattr(compiled, "compute_cross_entropy", None)  # type: ignore[assignment]
    if inner is not None and not isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule):

        def compute_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            _unbacked(logits)
            _unbacked(labels)
            result = inner(logits, labels, *args, **kwargs)
            if torch.is_grad_enabled():
                compiled.compute_cross_entropy = inner
            return result

        compiled.compute_cross_entropy = compute_cross_entropy
    return compiled
