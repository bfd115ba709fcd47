"""The memory of a forward/backward pass over N identical layers, from a trace of three of them.

Tracing a fake training step costs time for every op, and torch's ``MemTracker`` also updates
every module it has seen after every op, so a full trace of a 32-layer model is slow (minutes).
Its peak is not simply ``fixed + per_layer x N`` either: the step's peak moves between phases as
N grows (with few layers it is the logits after the forward, with many the gradients of every
layer at the end of the backward), so two whole-step peaks at 1 and 2 layers can miss the phase
that sets the peak at N layers.

So the pass is cut at layer boundaries into segments, and each segment's start, peak and end are
recorded (bytes, as ``MemTracker`` counts them): before layer 0 (embedding), the forward of each
layer, the top layer's forward with the head, loss and the head's backward, the backward of each
layer, and the bottom layer's backward with what follows. With three traced layers there is a
bottom, a middle and a top one; an N-layer pass is the same segments with the middle layer's
forward and backward repeated N - 2 times. Memory moves by the same amount in every repeat, so
the highest point of a run of repeats is at its first or its last one, and the peak at N layers
is computed exactly, at no extra cost, for any N.

A DPO or KD step has a second forward: the reference's (the policy with its adapters off, a frozen copy, or KD's
teacher, another architecture traced on three of its own layers), under ``no_grad``, before the policy's forward
(as DPO and KD run it) or between the policy's forward and backward. Its layers are segments of their own
("reference forward i"), whose middle one repeats as the others do; it saves nothing, so a repeat moves no memory,
and its transient peak is counted where it happens: before the policy's activations exist, or on top of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from adaptive_batching.runtime.mem_tracker import FrozenAwareMemTracker

TRACED_LAYERS = 3  # a bottom, a middle and a top layer


@dataclass
class PassStretch:
    """Tensor bytes at the start and end of one stretch of the pass, and its highest point after an op."""

    label: str
    start: int
    end: int = 0
    peak: int | None = None  # None: no op ran in it
    grads_start: int = 0  # bytes of parameter gradients that exist at the start, and that appeared in it
    grads_added: int = 0


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of transformer layers (``model.layers``), checked to be identical in shape."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{type(model).__name__} has no non-empty `layers` ModuleList to extrapolate over; "
            f"estimate it with --full-trace (exact=True)"
        )
    first = layer_signature(layers[0])
    for i, layer in enumerate(layers):
        if layer_signature(layer) != first:
            raise ValueError(
                f"layer {i} of {type(model).__name__} differs from layer 0 (modules or parameter "
                f"shapes), so layers cannot be extrapolated; estimate it with --full-trace (exact=True)"
            )
    return layers


def layer_signature(layer: nn.Module) -> tuple:
    modules = tuple((name, type(m).__name__) for name, m in layer.named_modules())
    params = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in layer.named_parameters())
    return modules, params


def repeats(
    traced: int,
    total: int,
    forwards: int = 1,
    reference: tuple[int, int] | None = None,
    reference_first: bool = False,
) -> list[int]:
    """How often each segment of a ``traced``-layer pass occurs in a ``total``-layer pass.

    Segments: before the layers, the forward of layers 0 .. traced-2, the top layer and head,
    the backward of layers traced-1 .. 1, then the bottom layer's backward and the rest. With ``forwards`` 2
    (DPO, KD), the reference's forward of its layers comes between the two (its top layer's segment holds its
    head, the loss and the head's backward), or before the policy's forward with ``reference_first`` (DPO, KD):
    ``reference`` is its (traced, total) layers when they differ from the policy's (KD's teacher, another
    architecture), else the policy's.
    """

    def middle(traced: int, total: int) -> list[int]:
        if traced < 1 or total < traced:
            raise ValueError(f"cannot extrapolate {traced} traced layers to {total}")
        counts = [1] * traced
        if total > traced:
            if traced != TRACED_LAYERS:
                raise ValueError(
                    f"extrapolation needs {TRACED_LAYERS} traced layers (bottom, middle, top), got {traced}"
                )
            counts[1] = total - traced + 1
        return counts

    policy = middle(traced, total)
    other = middle(*(reference or (traced, total))) if forwards == 2 else []
    return [1, *other, *policy, *policy] if reference_first else [1, *policy, *other, *policy]


def extrapolate_peak(segments: Sequence[PassStretch], counts: Sequence[int], kept_grads: float = 1.0) -> int:
    """The pass's highest point above its start when each segment runs ``counts[i]`` times in a row.

    ``kept_grads``: the share of each segment's new gradients that stays on this rank once the segment ends
    (FSDP reduce-scatters a layer's gradients after its backward: 1/ranks; in host memory with CPU offload: 0);
    inside the segment they are whole.
    """
    if len(segments) != len(counts):
        raise ValueError(f"{len(segments)} segments but {len(counts)} repeat counts")
    level, highest = 0, 0
    for segment, count in zip(segments, counts):
        moved = segment.end - segment.start - round((1 - kept_grads) * segment.grads_added)
        if segment.peak is not None:
            rise = segment.peak - segment.start
            highest = max(highest, level + rise + max(0, (count - 1) * moved))
        level += count * moved
    return highest


class LayerTimeline(FrozenAwareMemTracker):
    """``MemTracker`` that also cuts the pass into segments at the layers' boundaries.

    A segment starts at a layer's forward (pre-hook on ``layers[i]``; activation checkpointing
    recomputes the wrapped module inside, which has no such hook) and when the gradient of a
    layer's output arrives (the start of its backward). A layer's forward without autograd, or one of
    ``reference_layers`` (a separate reference model's), is the reference's ("reference forward i").
    Highest points are sampled where ``MemTracker`` samples its own peak, after every op, so the segments'
    highest point is the tracker's peak.
    """

    def __init__(
        self, layers: nn.ModuleList, model: nn.Module, *tracked: Any, reference_layers: Sequence[nn.ModuleList] = ()
    ) -> None:
        super().__init__()
        self.track_external(model, *tracked)
        self._layers = layers
        self._reference_layers = [stack for stack in reference_layers if stack is not layers]
        self._model = model
        self._segments: list[PassStretch] = []
        self._handles: list[Any] = []

    def _total(self) -> int:
        return int(sum(snap.get("Total", 0) for snap in self._curr_mem_snap.values()))

    def current_segment(self) -> int:
        """The index of the segment under way (for a record kept per segment, such as saved tensors)."""
        return len(self._segments) - 1

    def _grads(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self._model.parameters() if p.grad is not None)

    def _end_segment(self) -> None:
        segment = self._segments[-1]
        segment.end = self._total()
        segment.grads_added = self._grads() - segment.grads_start

    def _mark(self, label: str) -> None:
        if self._segments:
            self._end_segment()
        self._segments.append(PassStretch(label, start=self._total(), grads_start=self._grads()))

    def _update_peak_stats(self, peak_state: Any) -> None:
        """Called by ``MemTracker`` after every op, where it samples its peaks.

        This replaces its per-module peaks (unused here, and a cost per op that grows with the
        number of modules) with the current segment's highest point.
        """
        segment = self._segments[-1]
        now = self._total()
        segment.peak = now if segment.peak is None else max(segment.peak, now)

    def __enter__(self) -> LayerTimeline:
        self._segments = []
        for i, layer in enumerate(self._layers):
            self._handles.append(layer.register_forward_pre_hook(self._forward_hook(i)))
            self._handles.append(layer.register_forward_hook(self._output_hook(i)))
        for stack in self._reference_layers:
            for i, layer in enumerate(stack):
                self._handles.append(layer.register_forward_pre_hook(self._forward_hook(i, reference=True)))
        self._mark("before the layers")
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._segments:
            self._end_segment()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        super().__exit__(*exc)

    def _forward_hook(self, i: int, reference: bool = False) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._mark(f"reference forward {i}" if reference or not torch.is_grad_enabled() else f"forward {i}")

        return hook

    def _output_hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self._mark(f"backward {i}"))

        return hook

    def forwards(self) -> int:
        """The forwards the pass ran: 1, or 2 with a reference's (DPO, KD)."""
        return 2 if any(s.label.startswith("reference") for s in self._segments) else 1

    def reference_first(self) -> bool:
        """Whether the reference's forward ran before the policy's (DPO and KD run it so), not after it."""
        return len(self._segments) > 1 and self._segments[1].label.startswith("reference")

    def segments(self) -> list[PassStretch]:
        """The segments, checked to be in layer order (bottom to top, the reference's bottom to top if it ran, before
        or after the policy's, then back) and to have seen ops."""
        n = len(self._layers)
        depth = len(self._reference_layers[0]) if self._reference_layers else n
        reference = [f"reference forward {i}" for i in range(depth)] if self.forwards() == 2 else []
        forward = [f"forward {i}" for i in range(n)]
        forwards = reference + forward if self.reference_first() else forward + reference
        expected = ["before the layers"] + forwards + [f"backward {i}" for i in reversed(range(n))]
        labels = [s.label for s in self._segments]
        if labels != expected:
            raise RuntimeError(
                f"the pass did not run its layers in order (bottom to top, then back): {labels}; "
                f"estimate this model with --full-trace (exact=True)"
            )
        if all(s.peak is None for s in self._segments):
            raise RuntimeError(
                "MemTracker reported no op to the layer timeline (an unsupported torch version?); "
                "estimate with --full-trace (exact=True)"
            )
        return list(self._segments)


def layers_to_trace(total: int) -> int:
    """Layers traced for a ``total``-layer model: three, or all of them when there are no more."""
    return min(total, TRACED_LAYERS)
