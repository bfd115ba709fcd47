"""Predict the largest micro batch for a device you do not have, allocating no real memory.

The model, optimizer and inputs are built under ``FakeTensorMode`` (shapes and dtypes, no storage);
torch's ``MemTracker`` counts the bytes a training step would hold. The same probe-and-fit as the
real profiler then predicts the largest micro batch under ``device memory x fraction``, and fake
steps from that prediction verify it, as the real profiler's real steps do. Allocator overheads
the real profiler would meet are not seen here.

Two ways to count a step, with the same answer (tested to 2% and the same micro batch):

* layer extrapolation (default): the forward/backward of a 3-layer copy of the model is traced
  and extended to all its layers (``layer_timeline``); the optimizer step runs on the whole fake
  model with fake gradients, which is cheap. Seconds for Llama 3 8B at 8192 tokens.
* full trace (``exact=True``, ``--full-trace``): every layer is traced, which is minutes for an
  8B model because the tracker's cost per op grows with the number of modules.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torchtune import config, modules, training

from adaptive_batching.config.loading import building
from adaptive_batching.profiling.layer_timeline import (
    LayerTimeline,
    decoder_layers,
    extrapolate_peak,
    layers_to_trace,
    repeats,
)
from adaptive_batching.profiling.memory_fit import max_micro_batch_under
from adaptive_batching.profiling.profiler import StepMemory, fit_probes, probe_until_slope
from adaptive_batching.profiling.search import Trial, search_max_micro_batch
from adaptive_batching.runtime.memory import PeakMeter, current_bytes
from adaptive_batching.training.loss import summed_token_loss
from adaptive_batching.training.model import FinetuneMethod

CPU = torch.device("cpu")
EXTRAPOLATED = "layer extrapolation"
FULL_TRACE = "full trace"


@dataclass(frozen=True)
class Estimate:
    """A prediction for ``device_memory_bytes``; ``max_micro_batch`` is before margin and rounding.

    ``method`` says how steps were counted (``layer extrapolation`` or ``full trace``) and
    ``traced_layers`` how many of the model's ``num_layers`` were traced. ``fit_micro_batch`` is
    the linear fit's answer; ``verify_steps`` fake steps from it found ``max_micro_batch``.
    """

    max_micro_batch: int
    device_memory_bytes: int
    budget_bytes: int
    seq_len: int
    seq_len_source: str
    model_state_bytes: int
    fixed_bytes: float
    bytes_per_sample: float
    optimizer_peak_bytes: int
    world_size: int
    seconds: float
    method: str
    num_layers: int
    traced_layers: int
    fit_micro_batch: int
    verify_steps: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        gib = 2**30
        if self.method == FULL_TRACE:
            how = f"full trace of all {self.num_layers} layers"
        elif self.traced_layers < self.num_layers:
            how = (f"layer extrapolation (traced {self.traced_layers} of {self.num_layers} layers; "
                   f"--full-trace traces all)")
        else:
            how = f"layer extrapolation (all {self.num_layers} layers traced, nothing to extrapolate)"
        verified = (f"the fit predicted {self.fit_micro_batch}; {self.verify_steps} fake steps from there found "
                    f"{self.max_micro_batch}" if self.verify_steps else "the fit's prediction, not verified")
        return (
            f"predicted largest micro batch: {self.max_micro_batch} ({self.seq_len}-token samples, "
            f"{self.world_size} rank(s))\n"
            f"worst-case sample: {self.seq_len} tokens, {self.seq_len_source or 'as given'}\n"
            f"budget {self.budget_bytes / gib:.2f} GiB of {self.device_memory_bytes / gib:.2f} GiB; "
            f"weights + optimizer state {self.model_state_bytes / gib:.2f} GiB per rank; "
            f"step peak = {self.fixed_bytes / gib:.2f} GiB + {self.bytes_per_sample / 2**20:.1f} MiB x micro batch; "
            f"optimizer step peak {self.optimizer_peak_bytes / gib:.2f} GiB; computed in {self.seconds:.1f} s\n"
            f"{verified}\n"
            f"method: {how}"
        )


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


def _build(cfg: DictConfig, method: FinetuneMethod, dtype: torch.dtype, fake: FakeTensorMode, *,
           uniform: bool = False, keep_layers: Optional[int] = None) -> tuple[nn.Module, Any, int]:
    """The model with fake storage, its loss and its number of layers (before ``keep_layers`` cuts them).

    Built on the meta device and then given fake storage, as the recipes build it (Llama 3.1+'s
    scaled RoPE reads its frequencies, which fake tensors do not have). ``uniform`` checks that
    the layers are identical, which extrapolating over them assumes.
    """
    with building("model"), training.set_default_dtype(dtype), torch.device("meta"):
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


Measure = Callable[[int], StepMemory]
"""One more fake training step at a micro batch, on the model a trace built."""


def _full_trace(cfg: DictConfig, method: FinetuneMethod, dtype: torch.dtype, fake: FakeTensorMode,
                seq_len: int) -> tuple[Measure, int]:
    """Steps that trace every layer of the whole model: exact, and slow for deep models."""
    model, loss_fn, num_layers = _build(cfg, method, dtype, fake)
    vocab_size = model.tok_embeddings.num_embeddings
    with fake:
        optimizer = _optimizer(cfg, model)

    def step(micro_batch: int) -> StepMemory:
        # The first step also creates the optimizer state; activations do not depend on it.
        with fake:
            return _fake_step(model, optimizer, loss_fn, micro_batch, seq_len, vocab_size)

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


def _extrapolated(cfg: DictConfig, method: FinetuneMethod, dtype: torch.dtype, fake: FakeTensorMode,
                  seq_len: int) -> tuple[Measure, int, int]:
    """Steps whose forward/backward is traced on 3 layers and extended to all; exact optimizer steps."""
    model, _, num_layers = _build(cfg, method, dtype, fake, uniform=True)
    vocab_size = model.tok_embeddings.num_embeddings
    with fake:
        initial, steady, optimizer_peaks = _optimizer_steps(model, _optimizer(cfg, model))
    traced = layers_to_trace(num_layers)
    small, loss_fn, _ = _build(cfg, method, dtype, fake, keep_layers=traced)
    counts = repeats(traced, num_layers)
    steps = 0

    def step(micro_batch: int) -> StepMemory:
        nonlocal steps
        with fake, LayerTimeline(small.layers, small) as timeline:
            loss, _ = summed_token_loss(small, loss_fn, _tokens(micro_batch, seq_len, vocab_size))
            loss.backward()
        small.zero_grad(set_to_none=True)
        activation = extrapolate_peak(timeline.segments(), counts)
        start = initial if steps == 0 else steady
        memory = StepMemory(activation, start + activation, optimizer_peaks[min(steps, 1)], steady)
        steps += 1
        return memory

    return step, num_layers, traced


@dataclass(frozen=True)
class StepTrace:
    """The probe steps of one trace, for any device: :func:`predict` turns them into an :class:`Estimate`.

    ``measure`` runs more fake steps on the same model (to verify a prediction); ``measured``
    keeps every step it ran, so predictions for several devices share them.
    """

    probes: dict[int, StepMemory]
    seq_len: int
    seq_len_source: str
    num_layers: int
    traced_layers: int
    method: str
    seconds: float
    measure: Optional[Measure] = field(default=None, repr=False, compare=False)
    measured: dict[int, StepMemory] = field(default_factory=dict, repr=False, compare=False)


def trace_steps(cfg: DictConfig, method: FinetuneMethod, *, seq_len: int, seq_len_source: str = "",
                exact: bool = False, max_probe: int = 1024) -> StepTrace:
    """Count the memory of fake training steps at micro batch 1, 2, 4, ... of ``seq_len``-token samples (the
    worst case, see ``batching.worst_case``; ``seq_len_source`` says where it came from) until the peaks grow
    linearly.

    ``exact`` traces every layer (slow for deep models); by default 3 layers are traced and
    extended to the model's depth (see the module docstring).
    """
    if not isinstance(max_probe, int) or isinstance(max_probe, bool) or max_probe < 2:
        raise ValueError(f"max_probe must be an integer >= 2, got {max_probe!r}")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len (--seq-len) must be an integer >= 1, got {seq_len!r}")
    started = time.perf_counter()
    dtype = training.get_dtype(cfg.get("dtype", "fp32"), device=CPU)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    if exact:
        measure, num_layers = _full_trace(cfg, method, dtype, fake, seq_len)
        traced = num_layers
    else:
        measure, num_layers, traced = _extrapolated(cfg, method, dtype, fake, seq_len)
    probed = probe_until_slope(measure, max_probe)
    if fit_probes(probed) is None:
        raise ValueError(f"peak memory did not grow with the micro batch up to {max_probe}; nothing to fit")
    return StepTrace(probed, seq_len, seq_len_source, num_layers, traced, FULL_TRACE if exact else EXTRAPOLATED,
                     time.perf_counter() - started, measure, dict(probed))


def _check_device(device_memory_bytes: Any, fraction: Any, world_size: Any) -> None:
    def integer(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not integer(device_memory_bytes) or device_memory_bytes < 1:
        raise ValueError(f"device_memory_bytes (--device-memory) must be a positive number of bytes, "
                         f"got {device_memory_bytes!r}")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"fraction (--fraction) must be a number in (0, 1], got {fraction!r}")
    if not integer(world_size) or world_size < 1:
        raise ValueError(f"world_size (--world-size) must be an integer >= 1, got {world_size!r}")


def predict(trace: StepTrace, *, device_memory_bytes: int, fraction: float = 0.9, world_size: int = 1,
            verify: bool = True) -> Estimate:
    """The largest micro batch under ``device_memory_bytes x fraction`` for the traced steps.

    The linear fit of the probes predicts it; with ``verify`` (and a trace that can measure),
    fake steps from there (gallop, then bisect, as the real profiler's verification) find the
    largest micro batch whose step fits. The fit alone can be far off: a step's peak is the
    highest of several phases, and which one sets it changes with the micro batch (Llama 3 8B
    at 8192 tokens: the gradients at 1-2 samples, the logits from 3 on), so a line through the
    smallest probes can underestimate larger batches. With ``world_size`` > 1, weights,
    gradients and optimizer state are divided over the ranks as FSDP shards them; activations are not.
    """
    _check_device(device_memory_bytes, fraction, world_size)
    started = time.perf_counter()
    probed = trace.probes
    fit = fit_probes(probed)
    if fit is None:
        raise ValueError(f"the probes at micro batches {sorted(probed)} show no growth with the micro batch")
    steady = probed[max(probed)].steady_bytes
    model_state = steady // world_size
    fit = replace(fit, fixed_bytes=fit.fixed_bytes - (steady - model_state),
                  plateau_bytes=max(0.0, fit.plateau_bytes - (steady - model_state)))
    optimizer_peak = max(m.optimizer_peak for m in probed.values()) // world_size
    budget = int(device_memory_bytes * fraction)
    fit_batch = max_micro_batch_under(fit, budget) if optimizer_peak <= budget else 0
    largest, steps = fit_batch, 0
    if verify and trace.measure is not None and fit_batch >= 1:
        largest, steps = _verify(trace, fit_batch, budget, model_state, world_size)
    return Estimate(
        max_micro_batch=largest,
        device_memory_bytes=device_memory_bytes,
        budget_bytes=budget,
        seq_len=trace.seq_len,
        seq_len_source=trace.seq_len_source,
        model_state_bytes=model_state,
        fixed_bytes=fit.fixed_bytes,
        bytes_per_sample=fit.bytes_per_sample,
        optimizer_peak_bytes=optimizer_peak,
        world_size=world_size,
        seconds=trace.seconds + time.perf_counter() - started,
        method=trace.method,
        num_layers=trace.num_layers,
        traced_layers=trace.traced_layers,
        fit_micro_batch=fit_batch,
        verify_steps=steps,
    )


def _verify(trace: StepTrace, start: int, budget: int, model_state: int, world_size: int) -> tuple[int, int]:
    """The largest micro batch whose fake step fits ``budget`` per rank, searched from ``start``;
    and the number of steps the search looked at (steps already measured cost nothing)."""
    assert trace.measure is not None

    def run(micro_batch: int) -> Trial:
        if micro_batch not in trace.measured:
            trace.measured[micro_batch] = trace.measure(micro_batch)
        memory = trace.measured[micro_batch]
        peak = max(model_state + memory.activation_bytes, memory.optimizer_peak // world_size)
        return Trial(micro_batch, peak <= budget, float(peak), 0.0, "verify")

    result = search_max_micro_batch(run, start, tolerance=0.0, max_steps=16)
    return result.max_ok, len(result.trials)


def estimate_max_micro_batch(cfg: DictConfig, method: FinetuneMethod, *, device_memory_bytes: int, seq_len: int,
                             seq_len_source: str = "", fraction: float = 0.9, world_size: int = 1,
                             max_probe: int = 1024, exact: bool = False) -> Estimate:
    """Predict the largest micro batch for ``cfg`` on a device with ``device_memory_bytes``, for
    ``seq_len``-token worst-case samples: :func:`trace_steps`, then :func:`predict` (arguments are checked
    before any tracing)."""
    _check_device(device_memory_bytes, fraction, world_size)
    trace = trace_steps(cfg, method, seq_len=seq_len, seq_len_source=seq_len_source, exact=exact,
                        max_probe=max_probe)
    return predict(trace, device_memory_bytes=device_memory_bytes, fraction=fraction, world_size=world_size)
