"""Start-up profiler: the largest micro batch whose training step fits the memory budget.

Two stages, both on the real training set-up with worst-case inputs:

1. Estimate. After a warm-up step at micro batch 1 (it pays one-time costs such as creating the
   optimizer state; when it does not fit, a second step at 1 decides), probe steps at micro batch
   2, 4, ... measure the forward/backward peak above the memory the step starts from. That part
   grows with the micro batch (activations); the optimizer step's peak does not and is checked on
   its own, so batch-independent peaks never distort the slope. A linear fit predicts the largest micro batch under the
   budget; one more probe, at an eighth of that prediction, measures the slope over many samples and refits.
2. Verify. Real steps from the estimate (gallop, then bisect) find the largest micro batch
   that ran without an out-of-memory error and under the budget.

The micro batch used for training is that size after ``safety_margin`` and ``round_to``.
Weights, optimizer state and RNG state are restored afterwards, so profiling leaves no trace.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from adaptive_batching.core.steps import StepMemory
from adaptive_batching.errors import ProfileError
from adaptive_batching.faults.oom import is_out_of_memory
from adaptive_batching.profiling.budget import Budget
from adaptive_batching.profiling.memory_fit import (
    LinearFit,
    MemoryPoint,
    fit_memory,
    max_micro_batch_under,
    needs_more_points,
)
from adaptive_batching.profiling.search import Trial, choose_micro_batch, search_max_micro_batch

FAR_PROBE_DIVISOR = 8

TrialStep = Callable[[int], StepMemory]
"""Runs one full training step (forward, backward, optimizer step) at a micro batch; raises on OOM."""

Agree = Callable[[bool, Sequence[float]], tuple[bool, list[float]]]
"""Makes every rank see the same trial outcome: ok on all ranks, and the largest of each value."""


def agree_locally(ok: bool, values: Sequence[float]) -> tuple[bool, list[float]]:
    return ok, list(values)


@dataclass
class ProfileResult:
    """What the profiler found; ``max_micro_batch`` is before margin and rounding."""

    max_micro_batch: int
    micro_batch: int
    estimate: int
    trial_steps: int
    seconds: float
    budget_bytes: int
    budget_source: str
    seq_len: int
    seq_len_source: str = ""  # where the worst-case length came from (the data, a pack)
    fixed_bytes: float | None = None
    bytes_per_sample: float | None = None
    optimizer_peak_bytes: int | None = None
    trials: list[dict[str, Any]] = field(default_factory=list)
    from_cache: bool = False
    compile_seconds: float | None = None  # compile: one step before the trials, not measured
    # Set when training later ran out of memory: the micro batch it fell back to.
    oom_cap: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProfileResult:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


class TrialLog:
    """The trial steps of one search: runs each size (once, unless asked again), agrees on its outcome over the
    ranks and keeps what it measured. ``recover`` frees memory after an out-of-memory error, once the error and
    the tensors its traceback holds are gone; ``before_trial`` runs before every step (a stop signal ends the
    search there)."""

    def __init__(
        self,
        step: TrialStep,
        budget: Budget,
        agree: Agree,
        recover: Callable[[], None],
        before_trial: Callable[[], None],
    ) -> None:
        self.step, self.budget, self.agree, self.recover, self.before_trial = step, budget, agree, recover, before_trial
        self.trials: list[Trial] = []
        self.ran: dict[int, Trial] = {}  # each size's latest trial
        self.memory: dict[int, StepMemory] = {}

    def attempt(self, micro_batch: int, phase: str, again: bool = False) -> Trial:
        if micro_batch in self.ran and not again:
            return self.ran[micro_batch]
        self.before_trial()
        t0 = time.perf_counter()
        used: StepMemory | None = None
        try:
            used = self.step(micro_batch)
        except Exception as error:  # noqa: BLE001 - only out-of-memory errors are expected
            if not is_out_of_memory(error):
                raise
        if used is None:
            self.recover()
        ok = used is not None and used.fits(self.budget.bytes)
        values = (
            [
                float(used.peak_bytes),
                float(used.activation_bytes),
                float(used.steady_bytes),
                float(used.reserved_peak if used.reserved_peak is not None else -1),
                float(used.alloc_retries),
            ]
            if used
            else [0.0, 0.0, 0.0, -1.0, 0.0]
        )
        ok, values = self.agree(ok, values)
        if used is not None:
            self.memory[micro_batch] = StepMemory(
                int(values[1]), used.forward_backward_peak, used.optimizer_peak, int(values[2])
            )
        trial = Trial(
            micro_batch,
            ok,
            values[0] if used is not None else None,
            time.perf_counter() - t0,
            phase,
            reserved_bytes=values[3] if values[3] >= 0 else None,
            alloc_retries=int(values[4]),
        )
        self.trials.append(trial)
        self.ran[micro_batch] = trial
        return trial

    def largest_fit(self, fallback: int) -> int:
        """The largest size that ran within the budget below every size that did not (a size's latest step: a
        warm-up retried counts once); ``fallback`` when none did."""
        failed = [t.micro_batch for t in self.ran.values() if not t.ok]
        return max([b for b, t in self.ran.items() if t.ok and all(b < f for f in failed)], default=fallback)


def _warm_up(log: TrialLog, seq_len: int) -> None:
    """Micro batch 1 (one-time costs: optimizer state, lazy initialisation); it fails only if a second step fails
    too, since the first one's peak holds the one-time costs."""
    if log.attempt(1, "warmup").ok or log.attempt(1, "warmup", again=True).ok:
        return
    budget, used = log.budget, log.trials[-1].peak_bytes
    measured = f" (its step used {used / 2**30:.3f} GiB)" if used is not None else " (out of memory)"
    raise ProfileError(
        f"micro batch 1 does not fit the memory budget of {budget.bytes / 2**30:.2f} GiB ({budget.source}) "
        f"with {seq_len}-token samples{measured}: lower tokenizer.max_seq_len, enable activation checkpointing, "
        f"or raise adaptive_batching.memory_budget / memory_fraction"
    )


def _estimate(log: TrialLog, upper_limit: int) -> tuple[int, LinearFit | None]:
    """Probes until the memory shows a slope, one far probe to measure it over many samples, and the largest micro
    batch the fitted line puts under the budget (at least the largest probe, at most ``upper_limit``)."""
    probed = probe_until_slope(
        lambda b: log.memory.get(b) if log.attempt(b, "probe").ok else None, upper_limit, first=2
    )
    fit = fit_probes(probed)
    if fit is not None:
        far = max_micro_batch_under(fit, log.budget.bytes) // FAR_PROBE_DIVISOR
        if 2 * max(probed) <= far <= upper_limit and log.attempt(far, "probe").ok:
            probed[far] = log.memory[far]
            fit = fit_probes(probed) or fit
    largest_probe = max(probed, default=1)
    estimate = max_micro_batch_under(fit, log.budget.bytes) if fit is not None else largest_probe
    return max(min(estimate, upper_limit), largest_probe), fit


def find_max_micro_batch(
    step: TrialStep,
    budget: Budget,
    *,
    seq_len: int,
    safety_margin: float,
    round_to: str,
    upper_limit: int,
    agree: Agree = agree_locally,
    recover: Callable[[], None] = lambda: None,
    tolerance: float = 0.01,
    max_verify_steps: int = 16,
    before_trial: Callable[[], None] = lambda: None,
) -> ProfileResult:
    """Warm up, probe and fit, verify with real steps from the estimate, choose (see the module docstring and
    :class:`TrialLog`)."""
    started = time.perf_counter()
    log = TrialLog(step, budget, agree, recover, before_trial)
    _warm_up(log, seq_len)
    estimate, fit = _estimate(log, upper_limit)
    search = search_max_micro_batch(
        lambda b: log.attempt(b, "verify"),
        estimate,
        tolerance=tolerance,
        upper_limit=upper_limit,
        max_steps=max_verify_steps,
    )
    max_ok = log.largest_fit(search.max_ok)
    return ProfileResult(
        max_micro_batch=max_ok,
        micro_batch=choose_micro_batch(max_ok, safety_margin, round_to),
        estimate=estimate,
        trial_steps=len(log.trials),
        seconds=time.perf_counter() - started,
        budget_bytes=budget.bytes,
        budget_source=budget.source,
        seq_len=seq_len,
        fixed_bytes=fit.fixed_bytes if fit else None,
        bytes_per_sample=fit.bytes_per_sample if fit else None,
        optimizer_peak_bytes=max((m.optimizer_peak for m in log.memory.values()), default=None),
        trials=[asdict(t) for t in log.trials],
    )


def steady_points(probed: dict[int, StepMemory]) -> list[MemoryPoint]:
    """Each probe's forward/backward peak as it is once the optimizer state exists."""
    steady = probed[max(probed)].steady_bytes
    return [MemoryPoint(b, steady + m.activation_bytes) for b, m in sorted(probed.items())]


def probe_until_slope(
    run: Callable[[int], StepMemory | None], upper_limit: int, first: int = 1
) -> dict[int, StepMemory]:
    """Run micro batches ``first``, 2 x ``first``, ... until the peaks grow linearly
    (``run`` gives None when one does not fit)."""
    probed: dict[int, StepMemory] = {}
    micro_batch = first
    while micro_batch <= upper_limit:
        used = run(micro_batch)
        if used is None:
            break
        probed[micro_batch] = used
        if len(probed) >= 2 and not needs_more_points(steady_points(probed)):
            break
        micro_batch *= 2
    return probed


def fit_probes(probed: dict[int, StepMemory]) -> LinearFit | None:
    """The linear fit of the probes, or None while they show no slope."""
    points = steady_points(probed) if probed else []
    return fit_memory(points) if len(points) >= 2 and not needs_more_points(points) else None


@contextmanager
def preserved_training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Restore trainable weights, optimizer state and every RNG afterwards, exactly.

    The copies live in host memory (pinned for an accelerator's weights): a copy on the device
    would sit inside every trial's measured peak, and a full fine-tune would be profiled one copy
    of its weights short of the memory training has.
    """
    weights = {n: host_copy(p) for n, p in model.named_parameters() if p.requires_grad}
    optimizer_state = _to_cpu(optimizer.state_dict())
    rng = (
        torch.get_rng_state(),
        np.random.get_state(),
        random.getstate(),
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    )
    try:
        yield
    finally:
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in weights:
                    _local(param).copy_(weights[name])
        optimizer.load_state_dict(optimizer_state)
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])
        if rng[3] is not None:
            torch.cuda.set_rng_state_all(rng[3])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameter), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``'s local values in host memory, pinned when they come from an accelerator
    (so the copy back is a fast DMA and no device memory is spent on it)."""
    local = _local(tensor.detach())
    copy = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=local.device.type == "cuda")
    copy.copy_(local)
    return copy


def _to_cpu(state: Any) -> Any:
    """A copy of a (nested) state dict, plain tensors moved to host memory."""
    if isinstance(state, DTensor):
        return state.detach().clone()
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_cpu(v) for v in state)
    return state
