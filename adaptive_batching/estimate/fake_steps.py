"""Training steps on fake tensors: the memory a step would use, counted without allocating it.

The model, optimizer and inputs are built under ``FakeTensorMode`` (shapes and dtypes, no storage) and
torch's ``MemTracker`` counts the bytes a step would hold. Two ways to count a step:

* :func:`extrapolated` (the default): the forward/backward of a 3-layer copy of the model is traced and
  extended to all its layers (see ``layer_timeline``); the optimizer step runs on the whole fake model
  with fake gradients, which is cheap. Because the trace keeps where each layer's gradients appear, the
  same trace also gives a rank's share under FSDP at any number of ranks (see :data:`Measure`).
* :func:`full_trace` (``exact``): every layer is traced, minutes for an 8B model; for more than one rank
  it counts every gradient whole (an upper bound).

Both follow the config's memory savers (:class:`Savers`):

* ``optimizer_in_bwd``: one optimizer per trainable parameter, stepped from the parameter's post-accumulate-grad
  hook, which then frees the gradient (torchtune's ``create_optim_in_bwd_wrapper`` and
  ``register_optim_in_bwd_hooks``). The backward trace sees each gradient appear, its optimizer step and the
  gradient go; the full set of gradients never exists, and there is no optimizer step after the backward. The
  optimizer state is created before the first probe (a step per parameter on a fake gradient), so every probe
  starts from the same memory.
* ``enable_activation_offloading`` (with activation checkpointing): torchtune's ``OffloadActivations``, replayed
  by ``activation_offload.FakeOffload``; the device figures are what stays on the device, and the host memory the
  offloaded tensors take is kept per micro batch (:attr:`Traced.host_bytes`).
* bitsandbytes optimizers: counted by ``optimizer_state.BitsAndBytesStandIn``, never imported.
* ``compile``: the decoder layers, the loss and NF4 dequantization hold memory as compiled: each layer through
  AOTAutograd's min-cut partition, as inductor (``compiled``).

The step traced is the training objective's (a :class:`~adaptive_batching.core.objective.TrainingObjective` the
caller hands in, the one the trainer composes; ``traced_step``): its worst-case micro batch, collated as training
collates it, and its ``micro_loss`` (fine-tuning's summed-token loss; for DPO the policy's forward on the chosen and
rejected sequences of each pair, the reference's forward without autograd, the loss; for KD the student's forward,
the teacher's without autograd, both losses), then the backward. The frozen model it holds besides the policy (full
DPO's reference, KD's teacher: a fake frozen model of the builder it names) counts with the weights, sharded as the
policy is; a teacher of another depth is traced on three of its own layers and extended to its own.

A QAT config's model is the one its ``quantizer`` prepares (the method's ``configure``, as the recipes), traced with
fake quantization on: torchao's fake quantizers are torch ops, so what they keep for the backward is counted.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torchtune import config, modules, training

from adaptive_batching.core.method import FinetuneMethod
from adaptive_batching.core.nodes import building
from adaptive_batching.core.objective import FrozenModel, TrainingObjective
from adaptive_batching.core.steps import StepMemory
from adaptive_batching.estimate.activation_offload import FakeOffload, offloading_forward
from adaptive_batching.estimate.compiled import as_compiled, fused_nf4_dequantization, partitioned_layers
from adaptive_batching.estimate.layer_timeline import (
    LayerTimeline,
    PassStretch,
    decoder_layers,
    extrapolate_peak,
    layers_to_trace,
    repeats,
)
from adaptive_batching.estimate.model_stacks import (
    StackTimeline,
    describe_vision,
    fsdp_units,
    is_fusion,
    keep_traced_units,
    layer_count,
    stacks,
    text_vocab_size,
    traceable,
)
from adaptive_batching.estimate.optimizer_state import fake_optimizer, paged_bytes, step_or_explain
from adaptive_batching.estimate.traced_step import TracedStep, traced_step
from adaptive_batching.runtime import nf4
from adaptive_batching.runtime.memory import PeakMeter, current_bytes

CPU = torch.device("cpu")

Measure = Callable[[int, int], StepMemory]
"""``measure(micro_batch, ranks)``: one rank's memory in a fake training step at a micro batch (traced once per
micro batch, on the model the trace built), with weights, gradients and optimizer state as FSDP shards them over
``ranks``; the weights, optimizer state and their peak are reported whole (divided by the caller)."""


@dataclass(frozen=True)
class Savers:
    """The memory savers of a config that change what a training step holds on the device."""

    optimizer_in_bwd: bool = False
    activation_offloading: bool = False
    activation_checkpointing: bool = False
    fsdp_cpu_offload: bool = False
    compile: bool = False  # layers, loss and NF4 dequantization as compiled (``compiled``)


@dataclass(frozen=True)
class TraceInputs:
    """What a trace builds its steps from: the nodes of the torchtune components it instantiates (their
    ``_component_``: the model, its loss and optimizer, the frozen model the objective names) and the run's settings
    a step follows; ``config.trace_inputs`` reads them from a config, checked as the recipes check them."""

    model: DictConfig  # config key ``model``
    loss: DictConfig  # config key ``loss``
    optimizer: DictConfig  # config key ``optimizer``
    dtype: str | None  # config key ``dtype`` (torchtune's get_dtype reads it)
    collate_path: str  # config key ``collate_fn``
    savers: Savers = Savers()
    frozen_model: DictConfig | None = None  # the builder node of the objective's frozen model (reference, teacher)
    images: int = 0  # a vision sample's images: the most a sample of the data holds (0: the data not read, one)


@dataclass(frozen=True)
class Traced:
    """What :func:`full_trace` and :func:`extrapolated` give: the steps, the model's depth and what was traced of
    it, and what the steps keep off the device.

    ``host_bytes(micro_batch)``: host memory the offloaded activations of one step take (0 without offloading;
    the step at that micro batch is traced if it was not). ``paged_bytes``: optimizer state in CUDA unified
    memory (paged bitsandbytes optimizers), whole model, included in the counted state. ``resident_bytes``: the
    weights and buffers of models the step holds besides the policy (full DPO's reference), whole, included in the
    counted state.
    """

    measure: Measure
    num_layers: int
    traced_layers: int
    host_bytes: Callable[[int], int]
    paged_bytes: int
    savers: Savers
    resident_bytes: int = 0  # models held besides the policy (full DPO's reference): weights and buffers, whole
    resident_layers: tuple[int, int] = (0, 0)  # a separate frozen model's layers (KD's teacher): traced, total
    step: TracedStep | None = None  # the objective's step that was traced
    vision: str = ""  # a vision model's stacks and images, in words ("" for a text model)


def frozen_copy(node: DictConfig, key: str, dtype: torch.dtype, fake: FakeTensorMode) -> nn.Module:
    """The model of ``node`` (config key ``key``) with fake storage, no parameter taking a gradient, in eval mode:
    full DPO's reference (``model``) or KD's teacher (``teacher_model``), in the run's dtype (the recipes build both
    without activation checkpointing; they run without autograd)."""
    with building(key), training.set_default_dtype(dtype), torch.device("meta"), nf4.fast_on_meta():
        model = config.instantiate(node)
    model.requires_grad_(False)
    with fake:
        model.to_empty(device=CPU)
        nf4.quantize_empty(model)
    _init_buffers(model, dtype, fake)
    return model.eval()


class FakeOptimizers:
    """The config's optimizer over a model's trainable parameters, built under fake tensors: one optimizer, or with
    ``optimizer_in_bwd`` one per parameter, stepped from the parameter's post-accumulate-grad hook, which then
    frees its gradient (as torchtune's ``register_optim_in_bwd_hooks``)."""

    def __init__(self, node: DictConfig, model: nn.Module, in_backward: bool) -> None:
        self.component = str(node.get("_component_", ""))
        self.in_backward = in_backward
        self.params = [p for p in model.parameters() if p.requires_grad]
        if in_backward:
            self._of: dict[torch.Tensor, torch.optim.Optimizer] = {p: fake_optimizer(node, [p]) for p in self.params}
            self.all: list[torch.optim.Optimizer] = list(self._of.values())
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._step_one)
        else:
            self.all = [fake_optimizer(node, self.params)]

    def _step_one(self, param: torch.Tensor) -> None:
        optimizer = self._of[param]
        step_or_explain(self.component, optimizer.step)
        optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        """The optimizer step after the backward (nothing to do with ``optimizer_in_bwd``: no gradient is left)."""
        for optimizer in self.all:
            step_or_explain(self.component, optimizer.step)
            optimizer.zero_grad(set_to_none=True)

    def step_on_fake_gradients(self) -> None:
        """A step on fake gradients, without a backward; with ``optimizer_in_bwd`` one parameter at a time, as
        its hook would (this is what creates the optimizer state)."""
        if self.in_backward:
            for p in self.params:
                p.grad = torch.empty_like(p)
                self._step_one(p)
        else:
            for p in self.params:
                p.grad = torch.empty_like(p)
            self.step()

    def paged_bytes(self) -> int:
        return paged_bytes(self.all)


def _tracked(model: nn.Module, optimizers: FakeOptimizers, step: TracedStep) -> tuple[Any, ...]:
    return (model, *step.resident, *optimizers.all)


def _forward_backward(
    model: nn.Module,
    loss_fn: Any,
    offload: FakeOffload | None,
    compiled: bool,
    step: TracedStep,
    batch: dict[str, Any],
) -> None:
    handles = offloading_forward(model, offload) if offload is not None else []
    with fused_nf4_dequantization() if compiled else contextlib.nullcontext():
        try:
            loss = step.loss(model, loss_fn, batch)
        finally:
            for handle in handles:
                handle.remove()
        with warnings.catch_warnings():
            # MemTracker's own gradient hook runs after an optimizer_in_bwd hook has freed the gradient, and warns
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
            loss.backward()


def _fake_step(
    model: nn.Module,
    optimizers: FakeOptimizers,
    loss_fn: Any,
    offload: FakeOffload | None,
    compiled: bool,
    step: TracedStep,
    batch: dict[str, Any],
) -> StepMemory:
    """The memory one training step would use; the tensors are fake, nothing is allocated."""
    tracked = _tracked(model, optimizers, step)
    with PeakMeter(CPU, *tracked) as forward_backward:
        _forward_backward(model, loss_fn, offload, compiled, step, batch)
    with PeakMeter(CPU, *tracked) as optimizer_step:
        optimizers.step()
    return StepMemory(
        activation_bytes=forward_backward.peak_bytes - forward_backward.start_bytes,
        forward_backward_peak=forward_backward.peak_bytes,
        optimizer_peak=optimizer_step.peak_bytes,
        steady_bytes=current_bytes(CPU, *tracked),
    )


def build_fake(
    inputs: TraceInputs,
    method: FinetuneMethod,
    dtype: torch.dtype,
    fake: FakeTensorMode,
    *,
    uniform: bool = False,
    keep_layers: int | None = None,
) -> tuple[nn.Module, Any, int]:
    """The model with fake storage, its loss and its number of layers (before ``keep_layers`` cuts them; a vision
    model's: its encoder's and its decoder's, see ``model_stacks``).

    Built on the meta device and then given fake storage, as the recipes build it (Llama 3.1+'s
    scaled RoPE reads its frequencies, which fake tensors do not have). ``uniform`` checks that
    the layers are identical (a vision decoder's: in periods), which extrapolating over them assumes.
    """
    with building("model"), training.set_default_dtype(dtype), torch.device("meta"), nf4.fast_on_meta():
        model = config.instantiate(inputs.model)
    num_layers = layer_count(stacks(model)) if is_fusion(model) else len(getattr(model, "layers", ()))
    method.configure(model)
    traceable(model)
    if uniform:
        stacks(model)
    if keep_layers is not None:
        model.layers = nn.ModuleList(list(model.layers)[:keep_layers])
    if inputs.savers.activation_checkpointing:
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    with fake:
        model.to_empty(device=CPU)
        nf4.quantize_empty(model)  # QLoRA: NF4 base weights at their real layout and bytes
    _init_buffers(model, dtype, fake)
    with building("loss"):
        loss_fn = config.instantiate(inputs.loss)
    if loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    if inputs.savers.compile:
        as_compiled(loss_fn)
        partitioned_layers(model)
    return model, loss_fn, num_layers


def _init_buffers(model: nn.Module, dtype: torch.dtype, fake: FakeTensorMode) -> None:
    """Compute the rotary caches for real (small), then hand them to ``fake`` like every other tensor."""
    for module in model.modules():
        rope_init = getattr(module, "rope_init", None)
        if rope_init is not None:
            with training.set_default_dtype(dtype):
                rope_init()
            for name, buffer in module._buffers.items():
                if buffer is not None and not isinstance(buffer, FakeTensor):
                    module._buffers[name] = fake.from_tensor(buffer)


def _traced_step(
    inputs: TraceInputs, objective: TrainingObjective, dtype: torch.dtype, fake: FakeTensorMode
) -> TracedStep:
    """``objective``'s step, with the frozen model it holds (if any) built fake from the builder node it names."""

    def frozen(model: FrozenModel) -> nn.Module:
        assert inputs.frozen_model is not None, f"config key {model.model!r}: the trace's inputs lack its node"
        return frozen_copy(inputs.frozen_model, model.model, dtype, fake)

    return traced_step(objective, inputs.collate_path, frozen, inputs.images)


def full_trace(
    inputs: TraceInputs,
    method: FinetuneMethod,
    dtype: torch.dtype,
    fake: FakeTensorMode,
    seq_len: int,
    objective: TrainingObjective,
) -> Traced:
    """Steps that trace every layer of the whole model: exact on one rank, and slow for deep models."""
    savers = inputs.savers
    model, loss_fn, num_layers = build_fake(inputs, method, dtype, fake)
    vocab_size = text_vocab_size(model)
    kind = _traced_step(inputs, objective, dtype, fake)
    with fake:
        optimizers = FakeOptimizers(inputs.optimizer, model, savers.optimizer_in_bwd)
        if savers.optimizer_in_bwd:  # the state exists before the first probe, as extrapolated() has it
            optimizers.step_on_fake_gradients()
    traced: dict[int, StepMemory] = {}
    host: dict[int, int] = {}

    def step(micro_batch: int, ranks: int = 1) -> StepMemory:
        # The first step also creates the optimizer state; activations do not depend on it.
        if micro_batch not in traced:
            offload = FakeOffload() if savers.activation_offloading else None
            batch = kind.batch(loss_fn, micro_batch, seq_len, vocab_size)
            with fake:
                memory = _fake_step(model, optimizers, loss_fn, offload, savers.compile, kind, batch)
            stash = offload.stash_bytes() if offload is not None else 0
            traced[micro_batch] = replace(
                memory,
                activation_bytes=memory.activation_bytes + stash,
                forward_backward_peak=memory.forward_backward_peak + stash,
            )
            host[micro_batch] = offload.host_bytes() if offload is not None else 0
        return traced[micro_batch]

    def host_bytes(micro_batch: int) -> int:
        step(micro_batch)
        return host[micro_batch]

    depth = len(getattr(kind.resident[0], "layers", ())) if kind.resident else 0
    return Traced(
        step,
        num_layers,
        num_layers,
        host_bytes,
        optimizers.paged_bytes(),
        savers,
        _resident_bytes(kind),
        (depth, depth),
        kind,
        describe_vision(stacks(model), inputs.images, traced=False) if is_fusion(model) else "",
    )


def _optimizer_steps(model: nn.Module, optimizers: FakeOptimizers, step: TracedStep) -> tuple[int, int, list[int]]:
    """Bytes before the first step, after the steps, and each step's peak: two fake steps on fake gradients.

    The first step creates the optimizer state, the second runs with it, as the probes' steps do. With
    ``optimizer_in_bwd`` the steps run inside the backward (the trace sees them), so their peaks are the memory
    after them: no step follows the backward.
    """
    tracked = _tracked(model, optimizers, step)
    before = current_bytes(CPU, *tracked)
    peaks = []
    for _ in range(2):
        with PeakMeter(CPU, *tracked) as meter:
            optimizers.step_on_fake_gradients()
        peaks.append(meter.peak_bytes)
    after = current_bytes(CPU, *tracked)
    if optimizers.in_backward:
        return after, after, [after, after]
    return before, after, peaks


def _bytes(module: nn.Module) -> int:
    """The bytes of a module's parameters as FSDP gathers them: NF4 weights (QLoRA) at their quantized size
    (torchtune all-gathers the NF4 tensors; each is dequantized only while its linear runs)."""
    total = 0
    for p in module.parameters():
        quantized = nf4.local_nf4(p)
        total += nf4.nf4_bytes(quantized) if quantized is not None else p.numel() * p.element_size()
    return total


def _resident_bytes(step: TracedStep) -> int:
    """The bytes of the models the step holds besides the policy (full DPO's reference), whole: weights and
    buffers (the rotary caches)."""
    return sum(_bytes(model) + sum(b.numel() * b.element_size() for b in model.buffers()) for model in step.resident)


def gathered_bytes(model: nn.Module) -> int:
    """What FSDP holds unsharded at once while it runs a layer: that layer and the next one, prefetched (the
    largest of the layers, the embedding and the output projection, twice; a vision model's encoder layers too)."""
    return 2 * max(_bytes(unit) for unit in fsdp_units(model))


def extrapolated(
    inputs: TraceInputs,
    method: FinetuneMethod,
    dtype: torch.dtype,
    fake: FakeTensorMode,
    seq_len: int,
    objective: TrainingObjective,
) -> Traced:
    """Steps whose forward/backward is traced on 3 layers and extended to all; exact optimizer steps. At more
    than one rank each layer's gradients shrink to the rank's shard once its backward is done (none with
    ``fsdp_cpu_offload``), and FSDP's gathered layers are added."""
    savers = inputs.savers
    small, loss_fn, num_layers = build_fake(inputs, method, dtype, fake, uniform=True)
    vocab_size = text_vocab_size(small)
    kind = _traced_step(inputs, objective, dtype, fake)
    # FSDP gathers one model's layers at a time: the policy's, or the frozen model's while it runs
    gathered = max(gathered_bytes(model) for model in (small, *kind.resident))
    with fake:
        optimizers = FakeOptimizers(inputs.optimizer, small, savers.optimizer_in_bwd)
        initial, steady, optimizer_peaks = _optimizer_steps(small, optimizers, kind)
    paged = optimizers.paged_bytes()
    resident = _resident_bytes(kind)
    traced = layers_to_trace(num_layers)
    depths = [len(decoder_layers(model)) for model in kind.resident]  # KD's teacher: its own depth
    reference = (layers_to_trace(depths[0]), depths[0]) if depths else None
    vision = stacks(small) if is_fusion(small) else []  # a vision model's stacks, of the whole model's depths
    if vision:
        traced = sum(stack.traced_units() * stack.period for stack in vision)
        keep_traced_units(small)  # the whole model's weights and optimizer state are gone with the rest
    for model in (*([] if vision else [small]), *kind.resident):  # the whole models' weights and optimizer state
        model.layers = nn.ModuleList(list(decoder_layers(model))[: layers_to_trace(len(decoder_layers(model)))])
    counts: dict[int, list[int]] = {}  # how often each segment runs: the forwards the step ran (DPO: two)
    segments: dict[int, list[PassStretch]] = {}
    host: dict[int, int] = {}
    stash: dict[int, int] = {}

    def trace(micro_batch: int) -> None:
        batch = kind.batch(loss_fn, micro_batch, seq_len, vocab_size)
        timeline = (
            StackTimeline(vision, small, *optimizers.all)
            if vision
            else LayerTimeline(
                decoder_layers(small),
                small,
                *kind.resident,
                *optimizers.all,
                reference_layers=[decoder_layers(model) for model in kind.resident],
            )
        )
        with fake, timeline:
            offload = FakeOffload(timeline.current_segment) if savers.activation_offloading else None
            _forward_backward(small, loss_fn, offload, savers.compile, kind, batch)
        small.zero_grad(set_to_none=True)
        segments[micro_batch] = timeline.segments()
        counts[micro_batch] = (
            timeline.repeats()
            if isinstance(timeline, StackTimeline)
            else repeats(traced, num_layers, timeline.forwards(), reference, timeline.reference_first())
        )
        host[micro_batch] = offload.host_bytes(counts[micro_batch]) if offload is not None else 0
        stash[micro_batch] = offload.stash_bytes(counts[micro_batch]) if offload is not None else 0

    def step(micro_batch: int, ranks: int = 1) -> StepMemory:
        if micro_batch not in segments:
            trace(micro_batch)
        kept = 1.0 if ranks == 1 else 0.0 if savers.fsdp_cpu_offload else 1 / ranks
        in_flight = 0 if ranks == 1 else round(gathered * (1.0 if savers.fsdp_cpu_offload else 1 - 1 / ranks))
        activation = extrapolate_peak(segments[micro_batch], counts[micro_batch], kept) + in_flight + stash[micro_batch]
        first = micro_batch == min(segments)  # the first step also creates the optimizer state
        start = initial if first else steady
        return StepMemory(activation, start + activation, optimizer_peaks[0 if first else 1], steady)

    def host_bytes(micro_batch: int) -> int:
        if micro_batch not in segments:
            trace(micro_batch)
        return host[micro_batch]

    words = describe_vision(vision, inputs.images, traced=True) if vision else ""
    return Traced(step, num_layers, traced, host_bytes, paged, savers, resident, reference or (0, 0), kind, words)
