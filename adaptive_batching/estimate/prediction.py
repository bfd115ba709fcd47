"""Predict the largest micro batch for a device you do not have, allocating no real memory.

The model, optimizer and inputs are built under ``FakeTensorMode`` (shapes and dtypes, no storage);
torch's ``MemTracker`` counts the bytes a training step would hold. The same probe-and-fit as the
real profiler then predicts the largest micro batch under ``device memory x fraction``, and fake
steps from that prediction verify it, as the real profiler's real steps do. Allocator overheads
the real profiler would meet are not seen here.

Two ways to count a step (``fake_steps``), with the same answer on one rank (tested to 2% and the same
micro batch): layer extrapolation (default; seconds for Llama 3 8B at 8192 tokens), and a full trace
(``exact=True``, ``--full-trace``; minutes for an 8B model). At more than one rank the extrapolation
follows FSDP: weights, gradients and optimizer state sharded, each layer gathered while it runs.

Both follow the config's memory savers (see ``fake_steps``): ``optimizer_in_bwd`` (no full set of gradients,
no optimizer step after the backward), activation offloading (the device figures are what stays on the
device; the host memory the offloaded activations need is reported beside them), and bitsandbytes optimizers,
counted at their real state size without bitsandbytes (paged state is counted as device memory).

The step traced is the training objective's (``objective``, the one the config's recipe trains with; see
``fake_steps``), which also says it in words. A DPO config's sample is a pair, chosen and rejected each ``seq_len``
tokens, so the policy's forward and backward run on twice the sequences of the micro batch, and the reference's
forward, which keeps nothing for the backward, adds its transient peak; full DPO's reference weights are counted
with the policy's, sharded as they are. A KD config's step is distillation's: the student's forward and backward,
the teacher's forward on the same micro batch without autograd (it keeps nothing for the backward; its logits live
until both losses are done), the teacher's weights counted with the student's, sharded as they are. A QAT config (a
``quantizer``) is traced with the model its recipe prepares, fake quantization on: what torchao's fake quantizers
keep for the backward is counted as traced.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode
from torchtune import training

from adaptive_batching.core.method import FinetuneMethod
from adaptive_batching.core.objective import TrainingObjective
from adaptive_batching.core.steps import StepMemory
from adaptive_batching.estimate.fake_steps import CPU, Measure, Savers, TraceInputs, extrapolated, full_trace
from adaptive_batching.estimate.traced_step import TracedStep
from adaptive_batching.profiling.max_micro_batch import fit_probes, probe_until_slope
from adaptive_batching.profiling.memory_fit import LinearFit, max_micro_batch_under
from adaptive_batching.profiling.search import Trial, search_max_micro_batch

EXTRAPOLATED = "layer extrapolation"
FULL_TRACE = "full trace"


@dataclass(frozen=True)
class Estimate:
    """A prediction for ``device_memory_bytes``; ``max_micro_batch`` is before margin and rounding.

    ``method`` says how steps were counted (``layer extrapolation`` or ``full trace``) and
    ``traced_layers`` how many of the model's ``num_layers`` were traced. ``fit_micro_batch`` is
    the linear fit's answer; ``verify_steps`` fake steps from it found ``max_micro_batch``.

    ``optimizer`` is the config's ``optimizer._component_``. With ``activation_offloading``, ``host_bytes`` is the
    host (pinned) memory a rank's offloaded activations take at ``max_micro_batch`` (``host_bytes_per_sample``
    per sample); the device figures are what stays on the device. ``paged_state_bytes``: a rank's optimizer
    state in CUDA unified memory (paged bitsandbytes optimizers), counted in the device figures; the driver
    moves it to host memory when the GPU runs short (and torch's allocator statistics never count it), so
    ``max_micro_batch_paged_out`` is the answer with all of it off the device. ``paged_state_evicted``: the device
    cannot hold that state beside one sample, so ``max_micro_batch`` is what the hardware does, the driver
    evicting the state's pages to host memory (the paged-out answer).

    ``objective``: the name of the training objective whose step was traced (``finetune``, ``lora_dpo``,
    ``full_dpo``, ``kd``); ``sequences_per_sample`` its sequences per sample (a DPO pair: 2, each of ``seq_len``
    tokens) and ``step`` its step in words ("" for fine-tuning's). ``reference_bytes``: a rank's share of the
    weights of the frozen model it holds (full DPO's reference, KD's teacher; weights and buffers), counted in
    ``model_state_bytes``. ``sequences_per_sample`` and ``step`` are words for :meth:`describe`, not in
    :meth:`to_dict`.
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
    optimizer: str = ""
    optimizer_in_bwd: bool = False
    activation_offloading: bool = False
    host_bytes: int = 0
    host_bytes_per_sample: float = 0.0
    paged_state_bytes: int = 0
    max_micro_batch_paged_out: int | None = None
    paged_state_evicted: bool = False
    compile: bool = False
    objective: str = ""  # the objective's name
    reference_bytes: int = 0
    quantization: str = ""  # QAT: what is fake-quantized ("" without a quantizer)
    reference_layers: tuple[int, int] = (0, 0)  # a separate frozen model's layers (KD's teacher): traced, total
    sequences_per_sample: int = 1
    step: str = ""
    vision: str = ""  # a vision model's stacks and images, in words

    def to_dict(self) -> dict[str, Any]:
        words = ("sequences_per_sample", "step", "vision")
        return {key: value for key, value in asdict(self).items() if key not in words}

    def _samples(self) -> str:
        if self.sequences_per_sample == 2:
            return f"pairs of {self.seq_len}-token sequences"
        return f"{self.seq_len}-token samples"

    def describe(self) -> str:
        gib = 2**30
        if self.method == FULL_TRACE:
            how = f"full trace of all {self.num_layers} layers"
        elif self.traced_layers < self.num_layers:
            how = (
                f"layer extrapolation (traced {self.traced_layers} of {self.num_layers} layers; "
                f"--full-trace traces all)"
            )
        else:
            how = f"layer extrapolation (all {self.num_layers} layers traced, nothing to extrapolate)"
        verified = (
            f"the fit predicted {self.fit_micro_batch}; {self.verify_steps} fake steps from there found "
            f"{self.max_micro_batch}"
            if self.verify_steps
            else "the fit's prediction, not verified"
        )
        savers = []
        if self.optimizer_in_bwd:
            savers.append(
                "optimizer_in_bwd: each parameter's optimizer steps in its gradient hook, which frees the "
                "gradient; no full set of gradients, no optimizer step after the backward"
            )
        if self.paged_state_evicted:
            savers.append(
                f"paged optimizer state ({self.optimizer}): {self.paged_state_bytes / gib:.2f} GiB per rank "
                f"in CUDA unified memory, more than the device holds beside one sample: the driver evicts "
                f"its pages to host memory (each optimizer step pages them back, slower); micro batch "
                f"{self.max_micro_batch} is with it evicted, 0 with it all on the device"
            )
        elif self.paged_state_bytes:
            savers.append(
                f"paged optimizer state ({self.optimizer}): {self.paged_state_bytes / gib:.2f} GiB per rank "
                f"in CUDA unified memory, counted as device memory (it stays on the GPU unless evicted); "
                f"with all of it evicted to host memory: micro batch {self.max_micro_batch_paged_out}"
            )
        if self.compile:
            savers.append(
                "compile: a compiled step: each decoder layer keeps for the backward what AOTAutograd's "
                "min-cut partition keeps (as inductor), the cross-entropy no float32 copy of the logits, "
                "NF4 weights dequantized in one fused op"
            )
        else:
            savers.append("compile: off (an eager step)")
        if self.activation_offloading:
            savers.append(
                f"activation offloading: {self.host_bytes / gib:.2f} GiB of host (pinned) memory per rank "
                f"at micro batch {self.max_micro_batch} ({self.host_bytes_per_sample / 2**20:.1f} MiB a "
                f"sample); device figures are what stays on the GPU"
            )
        return "\n".join(
            [
                (
                    f"predicted largest micro batch: {self.max_micro_batch} ({self._samples()}, "
                    f"{self.world_size} rank(s)"
                    f"{', the paged optimizer state evicted' if self.paged_state_evicted else ''})\n"
                    f"worst-case sample: {self.seq_len} tokens, {self.seq_len_source or 'as given'}\n"
                    f"budget {self.budget_bytes / gib:.2f} GiB of {self.device_memory_bytes / gib:.2f} GiB; "
                    f"weights + optimizer state {self.model_state_bytes / gib:.2f} GiB per rank; "
                    f"step peak = {self.fixed_bytes / gib:.2f} GiB + "
                    f"{self.bytes_per_sample / 2**20:.1f} MiB x micro batch; "
                    f"optimizer step peak {self.optimizer_peak_bytes / gib:.2f} GiB; computed in {self.seconds:.1f} s\n"
                    f"{verified}\n"
                    f"method: {how}"
                ),
                *([self.vision] if self.vision else []),
                *self._objective_lines(),
                *savers,
            ]
        )

    def _objective_lines(self) -> list[str]:
        """What the traced step trains besides fine-tuning: QAT, then the objective's step in its own words."""
        lines = [self.step] if self.step else []
        if self.quantization:
            lines.insert(
                0,
                f"QAT: {self.quantization}; traced with fake quantization on (torchao's fake quantizers "
                f"on fake tensors), so what they keep for the backward is counted, as in the steps after "
                f"fake_quant_after_n_steps turns it on",
            )
        return lines


MAX_PROBE = 1024  # the largest micro batch a trace probes for a slope


@dataclass(frozen=True)
class StepTrace:
    """The probe steps of one trace, for any device: :func:`predict` turns them into an :class:`Estimate`.

    ``measure`` runs more fake steps on the same model (to verify a prediction), and gives a rank's share of
    any step it ran at another number of ranks; it keeps every step it traced, so predictions for several
    devices and numbers of ranks share them.
    """

    probes: dict[int, StepMemory]
    seq_len: int
    seq_len_source: str
    cpu_offload: bool
    num_layers: int
    traced_layers: int
    method: str
    seconds: float
    measure: Measure | None = field(default=None, repr=False, compare=False)
    max_probe: int = MAX_PROBE  # the largest micro batch probed for a slope, here and at other ranks
    savers: Savers = Savers()
    optimizer: str = ""
    host_bytes: dict[int, int] = field(default_factory=dict)  # offloaded activations' host memory per probe
    paged_bytes: int = 0  # optimizer state in CUDA unified memory, whole model
    objective: str = ""  # the name of the training objective whose step was traced
    resident_bytes: int = 0  # models held besides the policy (full DPO's reference): weights and buffers, whole
    quantization: str = ""  # QAT: what is fake-quantized ("" without a quantizer)
    reference_layers: tuple[int, int] = (0, 0)  # a separate frozen model's layers (KD's teacher): traced, total
    step: TracedStep | None = field(default=None, repr=False, compare=False)  # what was traced, to say it in words
    vision: str = ""  # a vision model's stacks and images, in words


def trace_steps(
    inputs: TraceInputs,
    method: FinetuneMethod,
    objective: TrainingObjective,
    *,
    seq_len: int,
    seq_len_source: str = "",
    exact: bool = False,
    max_probe: int = MAX_PROBE,
) -> StepTrace:
    """Count the memory of fake training steps at micro batch 1, 2, 4, ... of ``seq_len``-token samples (the
    worst case, see ``batching.worst_case``; ``seq_len_source`` says where it came from) until the peaks grow
    linearly.

    ``exact`` traces every layer (slow for deep models); by default 3 layers are traced and
    extended to the model's depth (see the module docstring). ``objective``: the training objective whose step is
    traced (DPO: its pairs of ``seq_len``-token sequences), as its recipe's trainer runs it.
    """
    if not isinstance(max_probe, int) or isinstance(max_probe, bool) or max_probe < 2:
        raise ValueError(f"max_probe must be an integer >= 2, got {max_probe!r}")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len (--seq-len) must be an integer >= 1, got {seq_len!r}")
    started = time.perf_counter()
    dtype = training.get_dtype(inputs.dtype, device=CPU)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    steps = (full_trace if exact else extrapolated)(inputs, method, dtype, fake, seq_len, objective)
    measure = steps.measure
    probed = probe_until_slope(lambda micro_batch: measure(micro_batch, 1), max_probe)
    if fit_probes(probed) is None:
        raise ValueError(f"peak memory did not grow with the micro batch up to {max_probe}; nothing to fit")
    host = {m: steps.host_bytes(m) for m in probed} if steps.savers.activation_offloading else {}
    return StepTrace(
        probed,
        seq_len,
        seq_len_source,
        steps.savers.fsdp_cpu_offload,
        steps.num_layers,
        steps.traced_layers,
        FULL_TRACE if exact else EXTRAPOLATED,
        time.perf_counter() - started,
        measure,
        max_probe,
        steps.savers,
        str(inputs.optimizer.get("_component_", "")),
        host,
        steps.paged_bytes,
        objective.name,
        steps.resident_bytes,
        method.quantized(),
        steps.resident_layers,
        steps.step,
        steps.vision,
    )


def _check_device(device_memory_bytes: Any, fraction: Any, world_size: Any) -> None:
    def integer(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not integer(device_memory_bytes) or device_memory_bytes < 1:
        raise ValueError(
            f"device_memory_bytes (--device-memory) must be a positive number of bytes, got {device_memory_bytes!r}"
        )
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"fraction (--fraction) must be a number in (0, 1], got {fraction!r}")
    if not integer(world_size) or world_size < 1:
        raise ValueError(f"world_size (--world-size) must be an integer >= 1, got {world_size!r}")


def _rank_fit(trace: StepTrace, world_size: int, offload: bool) -> tuple[LinearFit, int, int]:
    """One rank's fit of peak bytes against the micro batch, its model state and its optimizer step's peak.

    Weights, gradients and optimizer state are a rank's FSDP shard (none of them with ``offload``).
    """
    probed = trace.probes
    measure = trace.measure
    if measure is not None:  # a rank's share: sharded state can hide the slope longer, so probe again
        probed = probe_until_slope(lambda micro_batch: measure(micro_batch, world_size), trace.max_probe)
    fit = fit_probes(probed)
    if fit is None:
        raise ValueError(f"the probes at micro batches {sorted(probed)} show no growth with the micro batch")
    steady = probed[max(probed)].steady_bytes
    model_state = 0 if offload else steady // world_size
    fit = replace(
        fit,
        fixed_bytes=fit.fixed_bytes - (steady - model_state),
        plateau_bytes=max(0.0, fit.plateau_bytes - (steady - model_state)),
    )
    optimizer_peak = 0 if offload else max(m.optimizer_peak for m in probed.values()) // world_size
    return fit, model_state, optimizer_peak


def predict(
    trace: StepTrace, *, device_memory_bytes: int, fraction: float = 0.9, world_size: int = 1, verify: bool = True
) -> Estimate:
    """The largest micro batch under ``device_memory_bytes x fraction`` for the traced steps.

    The linear fit of the probes predicts it; with ``verify`` (and a trace that can measure),
    fake steps from there (gallop, then bisect, as the real profiler's verification) find the
    largest micro batch whose step fits. The fit alone can be far off: a step's peak is the
    highest of several phases, and which one sets it changes with the micro batch (Llama 3 8B
    at 8192 tokens: the gradients at 1-2 samples, the logits from 3 on), so a line through the
    smallest probes can underestimate larger batches. With ``world_size`` > 1, weights,
    gradients and optimizer state are divided over the ranks as FSDP shards them; activations are not.
    With ``fsdp_cpu_offload`` (and more than one rank: one process has no FSDP) they stay in host memory, and
    the optimizer steps there; the layer FSDP gathers for its forward or backward is not counted.
    """
    _check_device(device_memory_bytes, fraction, world_size)
    started = time.perf_counter()
    offload = trace.cpu_offload and world_size > 1
    fit, model_state, optimizer_peak = _rank_fit(trace, world_size, offload)
    budget = int(device_memory_bytes * fraction)

    def search(room: int) -> tuple[int, int, int]:
        fit_batch = max_micro_batch_under(fit, room) if optimizer_peak <= room else 0
        if verify and trace.measure is not None and fit_batch >= 1:
            return fit_batch, *_verify(trace, fit_batch, room, model_state, 0 if offload else world_size, world_size)
        return fit_batch, fit_batch, 0

    fit_batch, largest, steps = search(budget)
    paged = 0 if offload else trace.paged_bytes // world_size
    evicted = search(budget + paged) if paged else None  # the paged state off the device: as if more room
    paged_out = largest == 0 and evicted is not None and evicted[1] >= 1  # the driver evicts it, as the GPU would
    if paged_out and evicted is not None:
        fit_batch, largest, steps = evicted
    host_at = _host_line(trace.host_bytes)
    reference_bytes = 0 if offload else trace.resident_bytes // world_size
    step = trace.step.describe(trace.seq_len, reference_bytes, trace.reference_layers) if trace.step else ""
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
        optimizer=trace.optimizer,
        optimizer_in_bwd=trace.savers.optimizer_in_bwd,
        activation_offloading=trace.savers.activation_offloading,
        host_bytes=round(host_at(largest)),
        host_bytes_per_sample=host_at(1) - host_at(0),
        paged_state_bytes=paged,
        max_micro_batch_paged_out=evicted[1] if evicted else None,
        paged_state_evicted=paged_out,
        compile=trace.savers.compile,
        objective=trace.objective,
        reference_bytes=reference_bytes,
        quantization=trace.quantization,
        reference_layers=trace.reference_layers,
        sequences_per_sample=trace.step.objective.sequences_per_sample if trace.step else 1,
        step=step,
        vision=trace.vision,
    )


def peak_at(trace: StepTrace, micro_batch: int, world_size: int = 1, *, paged_out: bool = False) -> int:
    """A rank's predicted peak in bytes for a step at ``micro_batch`` over ``world_size`` ranks: the larger of
    the weights and optimizer state with the forward/backward's peak on top, and the optimizer step's peak (what
    :func:`predict` holds against the budget). ``paged_out``: without the paged optimizer state, which torch's
    allocator statistics do not count (it is CUDA unified memory)."""
    if trace.measure is None:
        raise ValueError("this trace cannot measure more steps")
    offload = trace.cpu_offload and world_size > 1
    memory = trace.measure(micro_batch, world_size)
    model_state = 0 if offload else memory.steady_bytes // world_size
    peak = max(model_state + memory.activation_bytes, 0 if offload else memory.optimizer_peak // world_size)
    return peak - (trace.paged_bytes // world_size if paged_out and not offload else 0)


def _host_line(host: dict[int, int]) -> Callable[[int], float]:
    """Host memory of offloaded activations at any micro batch: the line through the two largest probes (the
    saved tensors grow linearly with the micro batch); 0 without offloading."""
    if len(host) < 2:
        return lambda micro_batch: 0.0
    low, high = sorted(host)[-2:]
    slope = (host[high] - host[low]) / (high - low)
    return lambda micro_batch: max(0.0, host[low] + slope * (micro_batch - low))


def _verify(
    trace: StepTrace, start: int, budget: int, model_state: int, world_size: int, ranks: int
) -> tuple[int, int]:
    """The largest micro batch whose fake step fits ``budget`` on one of ``ranks``, searched from ``start``;
    and the number of steps the search looked at (steps already measured cost nothing). ``world_size`` 0:
    the optimizer steps off the device."""
    measure = trace.measure
    assert measure is not None

    def run(micro_batch: int) -> Trial:
        memory = measure(micro_batch, max(world_size, ranks))
        peak = max(model_state + memory.activation_bytes, memory.optimizer_peak // world_size if world_size else 0)
        return Trial(micro_batch, peak <= budget, float(peak), 0.0, "verify")

    result = search_max_micro_batch(run, start, tolerance=0.0, max_steps=16)
    return result.max_ok, len(result.trials)


def estimate_max_micro_batch(
    inputs: TraceInputs,
    method: FinetuneMethod,
    objective: TrainingObjective,
    *,
    device_memory_bytes: int,
    seq_len: int,
    seq_len_source: str = "",
    fraction: float = 0.9,
    world_size: int = 1,
    max_probe: int = MAX_PROBE,
    exact: bool = False,
) -> Estimate:
    """Predict the largest micro batch for the config ``inputs`` come from on a device with ``device_memory_bytes``, for
    ``seq_len``-token worst-case samples of ``objective``'s step (see :func:`trace_steps`): :func:`trace_steps`, then
    :func:`predict` (arguments are checked before any tracing)."""
    _check_device(device_memory_bytes, fraction, world_size)
    trace = trace_steps(
        inputs,
        method,
        objective,
        seq_len=seq_len,
        seq_len_source=seq_len_source,
        exact=exact,
        max_probe=max_probe,
    )
    return predict(trace, device_memory_bytes=device_memory_bytes, fraction=fraction, world_size=world_size)
