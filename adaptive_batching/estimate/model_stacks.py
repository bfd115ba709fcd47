"""The stacks of repeated layers a model runs, which a layer extrapolation traces three units of and extends.

A text decoder (torchtune's ``TransformerDecoder``) is one stack: its ``layers``, each one unit. A Llama 3.2 Vision
model (torchtune's ``DeepFusionModel``) runs three, in this order: the vision encoder's CLIP layers on the image
tiles, its projection head's layers, then the text decoder's layers, where every ``fusion_interval``-th layer is a
``FusionLayer`` (a cross-attention layer to the image's tokens before a self-attention layer). The decoder's unit is
one period of its layers (``fusion_interval`` layers, the last with cross-attention), so that its units are
identical as the extrapolation needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from adaptive_batching.estimate.layer_timeline import (
    TRACED_LAYERS,
    LayerTimeline,
    PassStretch,
    decoder_layers,
    layer_signature,
)

DECODER = ""  # the text decoder's stack: its segments keep the labels of a text model's ("forward i", "backward i")
CLIP = "vision encoder"
PROJECTION = "vision projection"


def text_decoder(model: nn.Module) -> nn.Module:
    """The text decoder: the model itself, or a vision model's (``DeepFusionModel.decoder``)."""
    return getattr(model, "decoder", model)


def is_fusion(model: nn.Module) -> bool:
    """Whether ``model`` is an encoder joined to a text decoder (torchtune's ``DeepFusionModel``: Llama 3.2 Vision)."""
    return isinstance(getattr(model, "encoder", None), nn.Module) and isinstance(
        getattr(model, "decoder", None), nn.Module
    )


def text_vocab_size(model: nn.Module) -> int:
    """The ids of the text vocabulary the output projection predicts (a vision decoder's ``FusionEmbedding`` adds a
    few of its own after them, which no label is)."""
    embeddings: Any = text_decoder(model).tok_embeddings
    inner = getattr(embeddings, "embedding", None)  # FusionEmbedding: the text vocabulary's own table
    return int((inner if isinstance(inner, nn.Embedding) else embeddings).num_embeddings)


@dataclass(frozen=True)
class Stack:
    """``owner.layers``: identical units of ``period`` layers, run in order; ``total`` units in the whole model
    (``units``: those it holds now, fewer once cut to the traced ones).

    ``name`` labels its segments in a layer timeline (``""``: the text decoder's)."""

    name: str
    owner: nn.Module
    period: int
    total: int

    @property
    def layers(self) -> nn.ModuleList:
        layers = self.owner.layers
        assert isinstance(layers, nn.ModuleList)
        return layers

    @property
    def units(self) -> int:
        return len(self.layers) // self.period

    def traced_units(self) -> int:
        """Units a layer extrapolation traces: three (a bottom, a middle and a top one), or all when there are no
        more."""
        return min(self.total, TRACED_LAYERS)

    def unit_bounds(self) -> list[tuple[nn.Module, nn.Module]]:
        """Each unit's first and last layer (the forward of a unit starts at its first, its backward at the
        gradient of its last one's output)."""
        layers = list(self.layers)
        return [(layers[i * self.period], layers[(i + 1) * self.period - 1]) for i in range(self.units)]

    def repeats(self, index: int) -> int:
        """How often unit ``index`` of a traced stack runs in the whole one: the middle one for every unit not
        traced."""
        return self.total - self.units + 1 if index == 1 and self.total > self.units else 1


def _period(layers: nn.ModuleList) -> int:
    """The shortest run of layers that repeats to make the whole stack (1 for identical layers)."""
    signatures = [layer_signature(layer) for layer in layers]
    for period in range(1, len(layers) + 1):
        if len(layers) % period == 0 and all(s == signatures[i % period] for i, s in enumerate(signatures)):
            return period
    raise AssertionError("unreachable: the whole stack is its own period")


def stacks(model: nn.Module) -> list[Stack]:
    """The stacks of ``model`` in the order its forward runs them. A text model's layers must be identical (else a
    ``ValueError`` says to trace it whole, as ``decoder_layers``); a vision model's decoder repeats in periods of
    its ``fusion_interval`` layers (the shortest run that repeats; all of them if none does)."""
    if not is_fusion(model):
        return [Stack(DECODER, model, 1, len(decoder_layers(model)))]
    encoder: Any = model.encoder
    decoder: Any = model.decoder
    found = []
    for name, owner in ((CLIP, getattr(encoder, "clip", None)), (PROJECTION, getattr(encoder, "projection", None))):
        if owner is not None and isinstance(getattr(owner, "layers", None), nn.ModuleList) and len(owner.layers):
            found.append(Stack(name, owner, 1, len(owner.layers)))
            decoder_layers(owner)
    period = _period(decoder.layers)
    return [*found, Stack(DECODER, decoder, period, len(decoder.layers) // period)]


def keep_traced_units(model: nn.Module) -> None:
    """Cut every stack of ``model`` to the units a layer extrapolation traces. The CLIP encoder hands the projection
    head the hidden states after some of its layers (``out_indices``), which may be among those cut: the first kept
    layer's stands in for each (the same tensor, which the layers keep anyway), so the head's stack and concatenation
    are of the whole encoder's width."""
    for stack in stacks(model):
        stack.owner.layers = nn.ModuleList(list(stack.layers)[: stack.traced_units() * stack.period])
    clip = getattr(getattr(model, "encoder", None), "clip", None)
    projection = getattr(getattr(model, "encoder", None), "projection", None)
    wanted = len(getattr(clip, "out_indices", ()) or ())
    if clip is None or projection is None or not wanted:
        return
    clip.out_indices = [0]

    def every_hidden_state(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x, hidden = args[0], args[1] if len(args) > 1 else None
        if hidden:
            hidden = list(hidden) + [hidden[0]] * (wanted - len(hidden))
        return (x, hidden, *args[2:])

    projection.register_forward_pre_hook(every_hidden_state)


def layer_count(found: Sequence[Stack]) -> int:
    """The layers of all the stacks."""
    return sum(len(stack.layers) for stack in found)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """What FSDP shards and gathers one at a time: each layer of every stack, the decoder's embedding and output."""
    decoder = text_decoder(model)
    units = [layer for stack in stacks(model) for layer in stack.layers]
    ends = (getattr(decoder, "tok_embeddings", None), getattr(decoder, "output", None))
    return [*units, *(end for end in ends if isinstance(end, nn.Module))]


def _label(stack: Stack, direction: str, index: int) -> str:
    return f"{stack.name} {direction} {index}" if stack.name else f"{direction} {index}"


class StackTimeline(LayerTimeline):
    """A :class:`LayerTimeline` over several stacks of units (a vision model's: its encoder's CLIP and projection
    layers, then its decoder's periods): a segment starts at a unit's forward (pre-hook on its first layer) and when
    the gradient of its last layer's output arrives. The encoder's stacks run their forward before the decoder's
    and their backward after it (only if they train)."""

    def __init__(self, found: Sequence[Stack], model: nn.Module, *tracked: Any) -> None:
        super().__init__(nn.ModuleList(), model, *tracked)
        self._stacks = list(found)

    def __enter__(self) -> StackTimeline:
        super().__enter__()
        for stack in self._stacks:
            for i, (first, last) in enumerate(stack.unit_bounds()):
                self._handles.append(first.register_forward_pre_hook(self._unit_forward(stack, i)))
                self._handles.append(last.register_forward_hook(self._unit_output(stack, i)))
        return self

    def _unit_forward(self, stack: Stack, i: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._mark(_label(stack, "forward", i))

        return hook

    def _unit_output(self, stack: Stack, i: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self._mark(_label(stack, "backward", i)))

        return hook

    def forwards(self) -> int:
        return 1

    def reference_first(self) -> bool:
        return False

    def segments(self) -> list[PassStretch]:
        """The segments, checked to be in order: every stack's forward bottom to top, then the backward top to
        bottom of those that train, the decoder's first."""
        labels = [s.label for s in self._segments]
        forward = [_label(stack, "forward", i) for stack in self._stacks for i in range(stack.units)]
        backward = [
            _label(stack, "backward", i)
            for stack in reversed(self._stacks)
            for i in reversed(range(stack.units))
            if _label(stack, "backward", i) in labels
        ]
        expected = ["before the layers", *forward, *backward]
        if labels != expected or not any(label.startswith("backward") for label in labels):
            raise RuntimeError(
                f"the pass did not run its stacks of layers in order (bottom to top, then back): {labels}; "
                f"estimate this model with --full-trace (exact=True)"
            )
        return list(self._segments)

    def repeats(self) -> list[int]:
        """How often each segment runs in the whole model's pass: a stack's middle unit, forward and backward, for
        every unit not traced; the rest once."""
        counts = []
        for segment in self._segments:
            stack, index = self._owner(segment.label)
            counts.append(stack.repeats(index) if stack is not None else 1)
        return counts

    def _owner(self, label: str) -> tuple[Stack | None, int]:
        for stack in self._stacks:
            for direction in ("forward", "backward"):
                prefix = _label(stack, direction, 0)[:-1]
                if label.startswith(prefix) and label[len(prefix) :].isdigit():
                    return stack, int(label[len(prefix) :])
        return None, 0


def traceable(model: nn.Module) -> None:
    """Let fake tensors and ``MemTracker`` trace a vision model's modules that they cannot as torchtune writes them:
    the tile position embeddings (:func:`_reading_grad_fn`) and the decoder's ``FusionEmbedding``
    (:func:`_fusion_embedding_forward`). Nothing changes for a text model."""
    from torchtune.models.clip._position_embeddings import TiledTokenPositionalEmbedding, TilePositionalEmbedding
    from torchtune.modules.model_fusion import FusionEmbedding

    for module in model.modules():
        if isinstance(module, (TiledTokenPositionalEmbedding, TilePositionalEmbedding)):
            module.forward = _reading_grad_fn(module.forward)
        elif isinstance(module, FusionEmbedding):
            module.forward = _fusion_embedding_forward(module)


def _reading_grad_fn(forward: Any) -> Any:
    """``forward``, reading its output's ``grad_fn`` before handing it back.

    The tile position embeddings add to slices of a view of their input in place and return the view; torch (2.13,
    2.14) crashes the process (a segmentation fault) when a gradient hook is registered on such a view before its
    ``grad_fn`` is read, and ``MemTracker``'s module tracker hooks every module's outputs. Reading it rebuilds it,
    and the hook registers."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        output = forward(*args, **kwargs)
        if isinstance(output, torch.Tensor):
            output.grad_fn  # noqa: B018 (read for its effect)
        return output

    return wrapped


def _fusion_embedding_forward(module: nn.Module) -> Any:
    """``FusionEmbedding``'s forward with the same tensors and none of data-dependent shape.

    torchtune's selects the text and the fusion tokens (``masked_select``: shapes that depend on the values, which
    fake tensors do not have), embeds each set and scatters them into one output. This embeds every position in
    both tables and picks by the same mask: the output, and what is held while it is made (two embeddings and the
    output, each a (batch, length, width) tensor), are those of torchtune's."""
    text: Any = module.embedding
    fusion: Any = module.fusion_embedding
    vocab_size = text.num_embeddings

    def forward(input: torch.Tensor) -> torch.Tensor:
        mask = input < vocab_size
        embeds = text(input.clamp(max=vocab_size - 1))
        fusion_embeds = fusion((input - vocab_size).clamp(min=0, max=fusion.num_embeddings - 1))
        return torch.where(mask.unsqueeze(-1), embeds, fusion_embeds)

    return forward


def describe_vision(found: Sequence[Stack], images: int, *, traced: bool) -> str:
    """A vision model's stacks (with ``traced``: how many units of each a layer extrapolation traced) and the images
    a sample was given, in words."""

    def words(stack: Stack) -> str:
        layers = stack.total * stack.period
        kind = {CLIP: "CLIP", PROJECTION: "projection"}.get(stack.name, "decoder")
        part = f"{layers} {kind} layer{'s' if layers > 1 else ''}"
        if stack.name == DECODER:
            part += f" ({stack.total} with cross-attention)" if stack.period > 1 else " (each with cross-attention)"
        if traced and stack.traced_units() < stack.total:
            unit = "layers" if stack.period == 1 else f"runs of {stack.period} layers"
            part += f", {stack.traced_units()} {unit} traced"
        return part

    given = (
        f"{images} image{'s' if images > 1 else ''} a sample (the most a sample of the data holds)"
        if images
        else "1 image a sample (estimate reads no image counts from the data)"
    )
    return f"vision model: {', '.join(words(stack) for stack in found)}; {given}, each of the transform's most tiles"
