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
cost 157 us a micro batch more than torchtune's on the 2-core machine (a benchmark since removed, commit 89c5ee5), so
the marks step aside after the first call that ran with gradients.

On CUDA, torch 2.11's inductor cannot compile the backward with an unbacked micro batch. It fuses the RMSNorm
backward's two reductions (one along the rows, one along the columns) into a "mix-order reduction" whenever its size
checks cannot rule that out (``guard_or_true``), then sizes the kernel's split with ``sizevars.size_hint(numel)``
(``codegen/simd.py``, ``_pick_split_size``). Without a fallback that call substitutes only backed hints, never a
``hint_override``, so the rows (micro batch x length) stay a symbol: ``TypeError: Cannot convert symbols to int``
in the first backward (seen on an H200 with torch 2.11.0+cu130). From 2.12.0 that line reads
``sizevars.optimization_hint(numel)``, which substitutes the ``hint_override`` (read in 2.12.0, 2.12.1, 2.13.0
and 2.14.1); 2.13 and 2.14 also check the fusion's sizes size-obliviously, and skip it where they cannot prove
them. So below 2.12 only, a compiled run turns inductor's mix-order reduction off
(``torch._inductor.config.triton.mix_order_reduction``, env ``TORCHINDUCTOR_MIX_ORDER_REDUCTION``): the two
reductions get a kernel each. The marks do not change with the device or the torch, so the graphs and recompiles
are those tests/test_compile.py counts; CPU kernels never read that setting (Triton's only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.torch_version import TorchVersion
from torchtune import training

# The first torch whose mix-order reduction reads an unbacked size's hint_override (see the module docstring).
MIX_ORDER_REDUCTION_HINTED = "2.12"


def _unbacked(tensor: torch.Tensor) -> None:
    torch._dynamo.decorators.mark_unbacked(tensor, 0, hint_override=tensor.size(0))


def _mark(tensor: torch.Tensor) -> torch.Tensor:
    _unbacked(tensor)
    if tensor.dim() > 2:
        torch._dynamo.maybe_mark_dynamic(tensor, 1)
    return tensor


def inductor_settings(torch_version: str) -> dict[str, Any]:
    """The inductor settings (``torch._inductor.config`` names) a compiled run changes on ``torch_version``: mix-order
    reduction off below 2.12, where it cannot size an unbacked micro batch; none from 2.12 on."""
    if TorchVersion(torch_version) < MIX_ORDER_REDUCTION_HINTED:
        return {"triton.mix_order_reduction": False}
    return {}


def configure_inductor() -> dict[str, Any]:
    """Apply :func:`inductor_settings` for the installed torch to this process's inductor; returns them."""
    import torch._inductor.config as inductor_config

    settings = inductor_settings(str(torch.__version__))
    for name, value in settings.items():
        section, key = name.rsplit(".", 1)
        setattr(getattr(inductor_config, section), key, value)
    return settings


def compile_model(model: nn.Module, verbose: bool) -> None:
    """torchtune's per-layer compile, with the embedding's output (the first layer's input) marked dynamic until the
    first forward with gradients has compiled the layers; inductor set for the installed torch."""
    configure_inductor()
    training.compile_model(model, verbose=verbose)
    hooks = [model.get_submodule("tok_embeddings").register_forward_hook(lambda module, args, output: _mark(output))]

    def compiled(module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for hook in hooks:
                hook.remove()

    hooks.append(model.register_forward_hook(compiled))


def compile_loss(loss_fn: Any, verbose: bool) -> Any:
    """torchtune's compiled loss; for the chunked cross-entropy, each chunk's logits and labels marked dynamic until
    the first call with gradients has compiled it; inductor set for the installed torch."""
    configure_inductor()
    compiled = training.compile_loss(loss_fn, verbose=verbose)
    inner: Callable[..., torch.Tensor] = getattr(compiled, "compute_cross_entropy", None)  # type: ignore[assignment]  # None for a plain loss
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
