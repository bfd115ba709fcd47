"""``compile: True`` for fake steps: a step holds memory as torchtune's compiled layers and loss hold it.

torchtune compiles each decoder layer (``training.compile_model``) and the loss (``training.compile_loss``). What
a compiled function keeps for the backward is decided before inductor writes any kernel: AOTAutograd traces the
joint forward/backward graph, after inductor's decompositions, and its min-cut partitioner chooses which values
the forward saves and which the backward computes again. That does not depend on the device, so it is traced
here on fake tensors, the same way; inductor then only fuses ops inside each side.

**Layers.** :class:`PartitionedLayer` runs each decoder layer through that partition (``aot_function`` with
``min_cut_rematerialization_partition`` and ``select_decomp_table()``) and runs both sides op by op, each value
freed after its last use, as inductor's code frees its buffers; what the forward saves is then what inductor's
forward saves (checked against ``torch.compile`` on the CPU, ``tests/test_compiled_fake.py``). Values inside a
side that inductor would fuse away are counted while they live, so the highest point within a layer is counted
from above. Layers given a mask or positions (packed samples) run eager.

**The loss.** For ``CEWithChunkedOutputLoss`` torchtune compiles each chunk's upcast and cross-entropy, for other
losses the whole module. Compiled, ``F.cross_entropy(logits.float(), labels, reduction="sum")`` keeps its bf16
input, the labels and two float32 values a token for the backward, where eager keeps a float32 copy of the logits
(4 bytes a logit). Inductor fuses each side into kernels that read the bf16 logits, so it is assumed that neither
side holds a float32 copy at any time. :class:`FusedCrossEntropy` saves exactly what inductor saves (the same
test), allocates nothing else, and its values are meaningless (never used on real tensors).

**NF4 weights (QLoRA).** Eager, torchao's ``NF4Tensor.get_original_weight`` builds the bf16 weight through
int64 indices and bf16 intermediates: 14 bytes a weight at its peak (MemTracker, a 1024 x 4096 weight). A
compiled layer fuses it into one kernel that writes the bf16 weight (2 bytes a weight);
:func:`fused_nf4_dequantization` makes it one opaque op that allocates only that. The partitioner then keeps each
dequantized weight for the backward, as it does for the real dequantization: a compiled QLoRA layer without
activation checkpointing holds its bf16 weights until its backward.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

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
        loss_fn.forward = types.MethodType(_module_cross_entropy, loss_fn)  # type: ignore[method-assign]  # traceable
        return True
    return False


def _dequantized_weight(quantized_data: torch.Tensor, size: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The bf16 weight of an NF4 tensor as one fused kernel writes it; shapes and bytes only (its values are not
    computed). One opaque op, real and fake alike, so the partitioner weighs saving its output against running it
    again."""
    return torch.empty(size, dtype=dtype, device=quantized_data.device)


_fused_nf4_dequantization = torch.library.custom_op("adaptive_batching::fused_nf4_dequantization", mutates_args=())(
    _dequantized_weight
)
_fused_nf4_dequantization.register_fake(_dequantized_weight)


@contextlib.contextmanager
def fused_nf4_dequantization() -> Iterator[None]:
    """While a fake step runs: dequantizing an NF4 weight is one op that allocates the bf16 weight only, as a
    compiled layer's fused kernel does (see the module docstring)."""
    from torchao.dtypes.nf4tensor import NF4Tensor

    def fused(self: NF4Tensor) -> torch.Tensor:
        return _fused_nf4_dequantization(self.quantized_data, list(self.shape), self.dtype)

    original = NF4Tensor.get_original_weight
    NF4Tensor.get_original_weight = fused
    try:
        yield
    finally:
        NF4Tensor.get_original_weight = original


@contextlib.contextmanager
def _no_global_module_hooks() -> Iterator[None]:
    """Trackers' global module hooks (MemTracker's ModTracker) left out while a layer is traced."""
    from torch.nn.modules import module

    names = [n for n in dir(module) if n.startswith("_global_") and n.endswith("hooks")]
    saved = {n: getattr(module, n).copy() for n in names}
    try:
        for n in names:
            getattr(module, n).clear()
        yield
    finally:
        for n, hooks in saved.items():
            getattr(module, n).update(hooks)


class _Own(nn.Module):
    """A layer's own forward (the one it had before :class:`PartitionedLayer` took its place, no hooks)."""

    def __init__(self, layer: nn.Module, forward: Any) -> None:
        super().__init__()
        self.layer = layer
        self.run = forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


def _interpreted(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """Run a partitioned graph node by node, freeing each input and value after its last use, as inductor's code
    does: it takes its inputs as a list it empties (AOTAutograd's boxed calling convention), so a backward frees
    each saved tensor once it is used for the last time."""
    nodes = list(gm.graph.nodes)
    done_with: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    seen: set[torch.fx.Node] = set()
    for node in reversed(nodes):
        for used in node.all_input_nodes:
            if used not in seen:
                seen.add(used)
                done_with.setdefault(node, []).append(used)

    def run(args: list[Any]) -> Any:
        args.reverse()
        env: dict[torch.fx.Node, Any] = {}
        for node in nodes:
            if node.op == "placeholder":
                value = args.pop()
                if node in seen:
                    env[node] = value
                del value
                continue
            inputs = torch.fx.node.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
            if node.op == "output":
                return inputs[0]
            if node.op == "get_attr":
                env[node] = getattr(gm, node.target)
            else:
                env[node] = node.target(*inputs, **kwargs)
            del inputs, kwargs
            if node not in seen:
                del env[node]
            for used in done_with.get(node, ()):
                del env[used]
        raise RuntimeError("a graph without an output node")

    run._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd's mark on a boxed function
    return run


def _behaviour(layer: nn.Module) -> tuple:
    """What makes two layers trace to the same graph: their modules, tensors' shapes and plain settings."""
    modules = []
    for name, module in layer.named_modules():
        settings = tuple(
            sorted(
                (k, v)
                for k, v in vars(module).items()
                if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))
            )
        )
        modules.append((name, type(module).__name__, settings))
    tensors = tuple(
        (name, tuple(t.shape), t.dtype, t.requires_grad, type(t).__name__)
        for name, t in [*layer.named_parameters(), *layer.named_buffers()]
    )
    return tuple(modules), tensors


class PartitionedLayer:
    """A decoder layer's forward as the compiled layer holds memory: AOTAutograd's joint graph, after inductor's
    decompositions, split by the min-cut partitioner; the forward keeps for the backward what the partitioner chose.

    One graph per layer behaviour and input shape, shared by identical layers (each runs it on its own parameters
    and buffers); the eager forward for masks and positions (packed samples) and without gradients.
    """

    def __init__(self, layer: nn.Module, graphs: dict[tuple, Any]) -> None:
        self.own = _Own(layer, layer.forward)
        self.names = [name for name, _ in [*self.own.named_parameters(), *self.own.named_buffers()]]
        self.behaviour = _behaviour(layer)
        self.graphs = graphs

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*self.own.parameters(), *self.own.buffers(), x)

    def _trace(self, x: torch.Tensor) -> Any:
        from torch._functorch.aot_autograd import aot_function
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._guards import detect_fake_mode
        from torch._inductor.decomposition import select_decomp_table
        from torch.utils._python_dispatch import _disable_current_modes

        own, names = self.own, self.names

        def forward(*args: torch.Tensor) -> tuple[torch.Tensor]:
            return (torch.func.functional_call(own, dict(zip(names, args[:-1])), (args[-1],), strict=True),)

        graph = aot_function(
            forward,
            fw_compiler=_interpreted,
            bw_compiler=_interpreted,
            partition_fn=min_cut_rematerialization_partition,
            decompositions=select_decomp_table(),
            num_params_buffers=len(names),
        )
        # traced on its first call, on an input of its own: the graph's nodes keep the values they were traced
        # with, and the step's input carries trackers' hooks; no mode counts the trace (the fake one goes on making
        # the tensors no input leads to), and its saved tensors stay out of the step's hooks (activation
        # checkpointing counts what is saved)
        fake = detect_fake_mode((x, *self._inputs(x)))
        with (
            _disable_current_modes(),
            fake if fake is not None else contextlib.nullcontext(),
            _no_global_module_hooks(),
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        ):
            graph(*self._inputs(torch.empty_like(x).requires_grad_(x.requires_grad)))
        return graph

    def __call__(self, x: torch.Tensor, *, mask: Any = None, input_pos: Any = None, **kwargs: Any) -> torch.Tensor:
        if (
            mask is not None
            or input_pos is not None
            or any(v is not None for v in kwargs.values())
            or not torch.is_grad_enabled()
        ):
            return self.own.run(x, mask=mask, input_pos=input_pos, **kwargs)
        key = (self.behaviour, tuple(x.shape), x.dtype, x.requires_grad)
        if key not in self.graphs:
            self.graphs[key] = self._trace(x)
        return self.graphs[key](*self._inputs(x))[0]


def partitioned_layers(model: nn.Module) -> int:
    """Each decoder layer of ``model`` runs as :class:`PartitionedLayer`, identical ones sharing graphs; returns
    how many."""
    from torchtune.modules import TransformerSelfAttentionLayer

    layers = [m for m in model.modules() if isinstance(m, TransformerSelfAttentionLayer)]
    graphs: dict[tuple, Any] = {}
    for layer in layers:
        layer.forward = PartitionedLayer(layer, graphs)
    return len(layers)
