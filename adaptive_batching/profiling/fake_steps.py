"""Training steps on fake tensors: the memory a step would use, counted without allocating it.

The model, optimizer and inputs are built under ``FakeTensorMode`` (shapes and dtypes, no storage) and
torch's ``MemTracker`` counts the bytes a step would hold. Two ways to count a step:

* :func:`extrapolated` (the default): the forward/backward of a 3-layer copy of the model is traced and
  extended to all its layers (see ``layer_timeline``); the optimizer step runs on the whole fake model
  with fake gradients, which is cheap. Because the trace keeps where each layer's gradients appear, the
  same trace also gives a rank's share under FSDP at any number of ranks (see :data:`Measure`).
* :func:`full_trace` (``exact``): every layer is traced, minutes for an 8B model; for more than one rank
  it counts every gradient whole (an upper bound).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from omegaconf import DictConfig
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torchtune import config, modules, training

from adaptive_batching.config.loading import building
from adaptive_batching.profiling.layer_timeline import (
    LayerTimeline,
    Segment,
    decoder_layers,
    extrapolate_peak,
    layers_to_trace,
    repeats,
)
from adaptive_batching.profiling.profiler import StepMemory
from adaptive_batching.runtime import nf4
from adaptive_batching.runtime.memory import PeakMeter, current_bytes
from adaptive_batching.training.loss import summed_token_loss
from adaptive_batching.training.model import FinetuneMethod

CPU = torch.device("cpu")

Measure = Callable[[int, int], StepMemory]
"""``measure(micro_batch, ranks)``: one rank's memory in a fake training step at a micro batch (traced once per
micro batch, on the model the trace built), with weights, gradients and optimizer state as FSDP shards them over
``ranks``; the weights, optimizer state and their peak are reported whole (divided by the caller)."""


def _tokens(micro_batch: int, seq_len: int, vocab_size: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, vocab_size, (micro_batch, seq_len))
    return {"tokens": tokens, "labels": tokens}


def _fake_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any, micro_batch: int,
               seq_len: int, vocab_size: int) -> StepMemory:
    """The memory one training step would use; the tensors are fake, nothing is allocated."""
    with PeakMeter(CPU, model, optimizer) as forward_backward:
        loss, _ = summed_token_loss(model, loss_fn, _tokens(micro_batch, seq_len, vocab_size))
        loss.backward()
    with PeakMeter(CPU, model, optimizer) as optimizer_step:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return StepMemory(
        activation_bytes=forward_backward.peak_bytes - forward_backward.start_bytes,
        forward_backward_peak=forward_backward.peak_bytes,
        optimizer_peak=optimizer_step.peak_bytes,
        steady_bytes=current_bytes(CPU, model, optimizer),
    )


def build_fake(cfg: DictConfig, method: FinetuneMethod, dtype: torch.dtype, fake: FakeTensorMode, *,
               uniform: bool = False, keep_layers: int | None = None) -> tuple[nn.Module, Any, int]:
    """The model with fake storage, its loss and its number of layers (before ``keep_layers`` cuts them).

    Built on the meta device and then given fake storage, as the recipes build it (Llama 3.1+'s
    scaled RoPE reads its frequencies, which fake tensors do not have). ``uniform`` checks that
    the layers are identical, which extrapolating over them assumes.
    """
    with building("model"), training.set_default_dtype(dtype), torch.device("meta"), nf4.fast_on_meta():
        model = config.instantiate(cfg.model)
    num_layers = len(getattr(model, "layers", ()))
    method.configure(model)
    if uniform:
        decoder_layers(model)
    if keep_layers is not None:
        model.layers = nn.ModuleList(list(model.layers)[:keep_layers])
    if cfg.get("enable_activation_checkpointing", False):
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    with fake:
        model.to_empty(device=CPU)
        nf4.quantize_empty(model)  # QLoRA: NF4 base weights at their real layout and bytes
    _init_buffers(model, dtype, fake)
    with building("loss"):
        loss_fn = config.instantiate(cfg.loss)
    if loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    return model, loss_fn, num_layers


def _init_buffers(model: nn.Module, dtype: torch.dtype, fake: FakeTensorMode) -> None:
    """Compute the rotary caches for real (small), then hand them to ``fake`` like every other tensor."""
    for module in model.modules():
        if hasattr(module, "rope_init"):
            with training.set_default_dtype(dtype):
                module.rope_init()
            for name, buffer in module._buffers.items():
                if buffer is not None and not isinstance(buffer, FakeTensor):
                    module._buffers[name] = fake.from_tensor(buffer)


def _optimizer(cfg: DictConfig, model: nn.Module) -> torch.optim.Optimizer:
    optimizer_cfg = {k: v for k, v in cfg.optimizer.items() if k != "fused"}
    with building("optimizer"):
        return config.instantiate(DictConfig(optimizer_cfg), [p for p in model.parameters() if p.requires_grad])


def full_trace(cfg: DictConfig, method: FinetuneMethod, dtype: torch.dtype, fake: FakeTensorMode,
               seq_len: int) -> tuple[Measure, int]:
    """Steps that trace every layer of the whole model: exact on one rank, and slow for deep models."""
    model, loss_fn, num_layers = build_fake(cfg, method, dtype, fake)
    vocab_size = model.tok_embeddings.num_embeddings
    with fake:
        optimizer = _optimizer(cfg, model)
    traced: dict[int, StepMemory] = {}

    def step(micro_batch: int, ranks: int = 1) -> StepMemory:
        # The first step also creates the optimizer state; activations do not depend on it.
        if micro_batch not in traced:
            with fake:
                traced[micro_batch] = _fake_step(model, optimizer, loss_fn, micro_batch, seq_len, vocab_size)
        return traced[micro_batch]

    return step, num_layers


def _optimizer_steps(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int, list[int]]:
    """Bytes before the first step, after the steps, and each step's peak: two fake steps on fake gradients.

    The first step creates the optimizer state, the second runs with it, as the probes' steps do.
    """
    before = current_bytes(CPU, model, optimizer)
    peaks = []
    for _ in range(2):
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.empty_like(param)
        with PeakMeter(CPU, model, optimizer) as meter:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peaks.append(meter.peak_bytes)
    return before, current_bytes(CPU, model, optimizer), peaks


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def gathered_bytes(model: nn.Module) -> int:
    """What FSDP holds unsharded at once while it runs a layer: that layer and the next one, prefetched (the
    largest of the layers, the embedding and the output projection, twice)."""
    units = [*model.layers, getattr(model, "tok_embeddings", None), getattr(model, "output", None)]
    return 2 * max(_bytes(unit) for unit in units if isinstance(unit, nn.Module))


def extrapolated(cfg: DictConfig, method: FinetuneMethod, dtype: torch.dtype, fake: FakeTensorMode,
                 seq_len: int) -> tuple[Measure, int, int]:
    """Steps whose forward/backward is traced on 3 layers and extended to all; exact optimizer steps. At more
    than one rank each layer's gradients shrink to the rank's shard once its backward is done (none with
    ``fsdp_cpu_offload``), and FSDP's gathered layers are added."""
    small, loss_fn, num_layers = build_fake(cfg, method, dtype, fake, uniform=True)
    vocab_size = small.tok_embeddings.num_embeddings
    gathered = gathered_bytes(small)
    offload = bool(cfg.get("fsdp_cpu_offload", False))
    with fake:
        initial, steady, optimizer_peaks = _optimizer_steps(small, _optimizer(cfg, small))
    traced = layers_to_trace(num_layers)
    small.layers = nn.ModuleList(list(small.layers)[:traced])  # the whole model's optimizer state is gone with it
    counts = repeats(traced, num_layers)
    segments: dict[int, list[Segment]] = {}

    def step(micro_batch: int, ranks: int = 1) -> StepMemory:
        if micro_batch not in segments:
            with fake, LayerTimeline(small.layers, small) as timeline:
                loss, _ = summed_token_loss(small, loss_fn, _tokens(micro_batch, seq_len, vocab_size))
                loss.backward()
            small.zero_grad(set_to_none=True)
            segments[micro_batch] = timeline.segments()
        kept = 1.0 if ranks == 1 else 0.0 if offload else 1 / ranks
        in_flight = 0 if ranks == 1 else round(gathered * (1.0 if offload else 1 - 1 / ranks))
        activation = extrapolate_peak(segments[micro_batch], counts, kept) + in_flight
        first = micro_batch == min(segments)  # the first step also creates the optimizer state
        start = initial if first else steady
        return StepMemory(activation, start + activation, optimizer_peaks[0 if first else 1], steady)

    return step, num_layers, traced
