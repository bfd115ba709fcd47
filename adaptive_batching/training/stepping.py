"""One optimizer step, for training and for the profiler's trial steps.

:class:`StepRunner` owns the model, the optimizer, the loss and the step guard: forward and backward
of each micro batch (loss summed over tokens), the gradients normalised by the step's tokens on all
ranks, clipping, and the optimizer step (retried once after a clean OOM). The profiler reaches the
model only through :meth:`StepRunner.trial_step`, one measured worst-case step. Before each step it asks the
fine-tuning method whether the step trains with fake quantization (QAT), which a trial step always does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchtune import training, utils

from adaptive_batching.core import logs
from adaptive_batching.core.method import FinetuneMethod
from adaptive_batching.core.objective import TrainingObjective
from adaptive_batching.core.steps import StepMemory
from adaptive_batching.errors import OutOfMemoryStop, PeerOutOfMemory, StepNotRetried, UnguardedOutOfMemory
from adaptive_batching.faults.guard import OK, StepGuard, optimizer_step_counts
from adaptive_batching.faults.oom import is_out_of_memory
from adaptive_batching.growth.gradient_noise import NoiseScaleEstimator, squared_grad_norm
from adaptive_batching.runtime import memory
from adaptive_batching.runtime.distributed import ParallelInfo, all_reduce_sum
from adaptive_batching.training.hooks import TrainerHooks
from adaptive_batching.training.methods import FullFinetune
from adaptive_batching.training.objectives import SupervisedFinetune
from adaptive_batching.training.optimizers import Gradients, gradients_for
from adaptive_batching.training.quantization import switch_fake_quant


def _host_norm(norm: torch.Tensor | None) -> float | None:
    return None if norm is None else float(norm)


@dataclass
class StepStats:
    """What one optimizer step produced, summed over micro batches and ranks."""

    loss: float
    tokens: int
    seconds: float
    grad_norm: float | None = None
    samples: int = 0
    noise_scale: float | None = None  # the smoothed gradient noise scale after this step, in samples
    padded_tokens: int = 0  # token positions the step's forwards ran on, padding included (this rank)


def step_metrics(
    stats: StepStats,
    *,
    lr: float,
    accumulation: int,
    ranks: int,
    device: torch.device,
    batching: dict[str, float],
    peak_memory_stats: bool = False,
) -> dict[str, float]:
    """One optimizer step's metrics as logged: what ran (micro batch and accumulation after any cut);
    ``peak_memory_stats`` (``log_peak_memory_stats``) adds torchtune's CUDA memory statistics, as its recipes do."""
    metrics: dict[str, float] = {
        "loss": stats.loss,
        "lr": lr,
        "gradient_accumulation_steps": accumulation,
        "global_batch_size": stats.samples,
        "tokens_per_second_per_gpu": stats.tokens / (stats.seconds * ranks),
        **batching,
    }
    peak = memory.peak_memory_gb(device)
    if peak is not None:
        metrics["peak_memory_gb"] = peak
    if peak_memory_stats and device.type == "cuda":
        metrics.update(training.get_memory_stats(device=device))
    if stats.grad_norm is not None:
        metrics["grad_norm"] = stats.grad_norm
    if stats.noise_scale is not None:
        metrics["gradient_noise_scale"] = stats.noise_scale
    return metrics


@dataclass
class StepRunner:
    """Runs optimizer steps on ``model``, each micro batch's forward and loss from ``objective``, with fake
    quantization as ``method`` says; ``where`` names the next optimizer step and the last save for messages."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Any
    guard: StepGuard
    parallel: ParallelInfo
    device: torch.device
    clip_grad_norm: float | None
    oom_recovery: bool
    where: Callable[[], tuple[int, int | None, str]]  # (next optimizer step, last saved step, output dir)
    activations: Any = field(default_factory=contextlib.nullcontext)  # around each forward (activation offloading)
    noise: NoiseScaleEstimator = field(default_factory=lambda: NoiseScaleEstimator(decay=0.99))
    objective: TrainingObjective = field(default_factory=SupervisedFinetune)  # a micro batch's forward and loss
    method: FinetuneMethod = field(default_factory=FullFinetune)  # asked before each step: fake quantization (QAT)
    hooks: TrainerHooks = field(default_factory=TrainerHooks)  # before each forward, with each loss
    gradients: Gradients = field(init=False)  # after the backward, or inside it (optimizer_in_bwd)
    last_loss: torch.Tensor | None = field(default=None, init=False, repr=False)
    fake_quant: bool | None = field(default=None, init=False)  # whether the model's fake quantizers are on (QAT)

    def __post_init__(self) -> None:
        self.gradients = gradients_for(self.optimizer, self.guard, self.parallel)

    @property
    def tracked(self) -> tuple[Any, ...]:
        """What holds a step's long-lived tensors (the meters count them on CPU): the model, the optimizer and the
        models the objective keeps resident (full DPO's reference)."""
        return (self.model, self.optimizer, *self.objective.resident)

    def _fake_quantize(self, global_step: int | None) -> None:
        """Fake quantization as the method says for the optimizer step after ``global_step`` finished ones, or on
        for a trial step (None): the profile fits the steps after it turns on (nothing for a method without it)."""
        when = self.method.fake_quantization
        if when is not None:
            self.fake_quant = switch_fake_quant(self.model, when, self.fake_quant, global_step)

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], global_step: int) -> StepStats | None:
        """One optimizer step over ``micro_batches``, after ``global_step`` finished ones: loss normalised by the
        tokens of the whole step.

        Returns None, with nothing changed, when the forward or backward ran out of memory on any rank
        inside a guard window; raises :class:`UnguardedOutOfMemory` for one outside it, and
        :class:`StepNotRetried` for one the gradients cannot recover from in place (optimizer_in_bwd).
        """
        self._fake_quantize(global_step)
        start = time.perf_counter()
        memory.reset_peak_memory(self.device)
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device, dtype=torch.long)
        # The first micro batch's gradient against the whole step's (see noise_scale.py): needs >= 2.
        first: list[torch.Tensor] = []
        samples = [float(len(b["tokens"])) for b in micro_batches]
        padded = sum(b["tokens"].numel() for b in micro_batches)

        def forward_backward() -> None:
            self.objective.start_step()
            for index, batch in enumerate(micro_batches):
                micro_loss, micro_tokens = self.forward_backward(batch)
                loss_sum.add_(micro_loss)
                tokens.add_(micro_tokens)
                if index == 0 and len(micro_batches) > 1:
                    first[:] = [squared_grad_norm(self.model.parameters(), self.device), micro_tokens.float()]

        if not (self.oom_recovery and self.guard.protecting):
            try:
                forward_backward()
            except Exception as error:
                if self.oom_recovery and is_out_of_memory(error):
                    raise UnguardedOutOfMemory(str(error).strip().splitlines()[0][:200]) from error
                raise
        elif self.guard.run(forward_backward) != OK:
            micro_batches.clear()
            self.guard.abandon(self.model, self.optimizer)
            memory.release_memory(self.device)
            if not self.gradients.retries_out_of_memory:
                raise StepNotRetried(self.guard.last_error)
            return None
        all_reduce_sum(loss_sum, self.parallel)
        noise: list[torch.Tensor] = []
        measure = (lambda big: noise.append(self._noise_sample(first, big, samples))) if first else None
        norm = self.apply_gradients(tokens, measure)
        # Every read of a device value waits here, after the optimizer step was queued: none waits inside the step.
        if noise:
            self._update_noise(noise[0])
        n_tokens = int(tokens.item())
        return StepStats(
            loss=loss_sum.item() / max(n_tokens, 1),
            tokens=n_tokens,
            seconds=time.perf_counter() - start,
            grad_norm=_host_norm(norm),
            noise_scale=self.noise.value,
            padded_tokens=padded,
        )

    def _noise_sample(self, first: list[torch.Tensor], big: torch.Tensor, samples: list[float]) -> torch.Tensor:
        """One step's measurement for the noise scale, summed over ranks in one all-reduce and left on the device:
        the first micro batch's and the whole step's squared gradient norms, the first micro batch's tokens and
        both sizes in samples (read by :meth:`_update_noise` once the optimizer step is queued)."""
        small, first_tokens = first
        # The sizes go to the device without waiting (``torch.tensor(x, device=cuda)`` would wait for the stream).
        sizes = torch.tensor([samples[0], sum(samples)], dtype=torch.float32).to(small.device, non_blocking=True)
        packed = torch.cat(
            [torch.stack([small.float(), big.float(), first_tokens.to(small.device, torch.float32)]), sizes]
        )
        all_reduce_sum(packed, self.parallel)
        return packed

    def _update_noise(self, packed: torch.Tensor) -> None:
        """One update of the noise scale from :meth:`_noise_sample`'s measurement."""
        small_sq, big_sq, first_total, small_size, big_size = packed.tolist()
        if first_total > 0 and 0 < small_size < big_size:
            # The first micro batch's gradient is a sum over its tokens, averaged over ranks by FSDP.
            self.noise.update(small_sq * (self.parallel.world_size / first_total) ** 2, small_size, big_sq, big_size)

    def trial_step(
        self,
        micro_batch: int,
        *,
        seq_len: int,
        accumulation: int,
        collate: Callable,
        vocab_size: int,
        packed: bool,
        images: int = 0,
    ) -> StepMemory:
        """One full training step on a worst-case batch, measured; the LR schedule does not move.

        An OOM on any rank is an OOM on every rank (see :class:`StepGuard`), so no rank waits for another.
        """
        self._fake_quantize(None)
        meters = self.tracked
        measured: list[StepMemory] = []
        self.guard.attach()  # profiling is always guarded; training opens its own windows

        def step() -> None:
            if accumulation > 1:
                # As in every micro batch after the first: the gradients already exist.
                for param in self.model.parameters():
                    if param.requires_grad:
                        param.grad = torch.zeros_like(param)
            with memory.PeakMeter(self.device, *meters) as forward_backward:
                batch = self.objective.worst_case_batch(
                    collate,
                    micro_batch=micro_batch,
                    seq_len=seq_len,
                    vocab_size=vocab_size,
                    packed=packed,
                    images=images,
                )
                _, tokens = self.forward_backward(batch)
                del batch
            with memory.PeakMeter(self.device, *meters) as optimizer_step:
                self.apply_gradients(tokens)
            measured.append(
                StepMemory(
                    activation_bytes=forward_backward.peak_bytes - forward_backward.start_bytes,
                    forward_backward_peak=forward_backward.peak_bytes,
                    optimizer_peak=optimizer_step.peak_bytes,
                    steady_bytes=memory.current_bytes(self.device, *meters),
                    reserved_peak=max(
                        (
                            m.reserved_peak_bytes
                            for m in (forward_backward, optimizer_step)
                            if m.reserved_peak_bytes is not None
                        ),
                        default=None,
                    ),
                    alloc_retries=forward_backward.alloc_retries + optimizer_step.alloc_retries,
                )
            )

        try:
            if self.guard.run(step) != OK:
                self.guard.abandon(self.model, self.optimizer)
                raise PeerOutOfMemory(f"micro batch {micro_batch} ran out of memory on at least one rank")
            return measured[0]
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            memory.release_memory(self.device)

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro batch; returns its summed loss and token count.

        The loss stays in :attr:`last_loss` until the next micro batch's backward is done, as ``current_loss`` stays
        in torchtune's loop: its autograd nodes (the backward freed their saved tensors, so they hold no device
        memory) then lie among the next step's blocks on glibc's heap and keep its top from being given back to the
        kernel between steps. Freed at once, they cost ours about 40% more page faults per step than stock's on CPU,
        and 1-3% of its speed (docs/benchmarks.md)."""
        utils.batch_to_device(batch, self.device)
        self.hooks.before_forward(batch)
        loss, tokens = self.objective.micro_loss(self.model, self.loss_fn, batch, self.activations)
        self.hooks.after_loss(loss)
        self.gradients.backward(loss, tokens)
        self.last_loss = loss
        return loss.detach(), tokens

    def apply_gradients(
        self, tokens: torch.Tensor, measure: Callable[[torch.Tensor], None] | None = None
    ) -> torch.Tensor | None:
        """Normalise the summed gradients by the step's tokens on all ranks, clip, step; return the norm before
        clipping (None without ``clip_grad_norm``), a tensor not read here, so nothing waits for the device
        before the optimizer step (as torchtune's recipes, which read it when they log).

        ``measure`` receives the step's squared gradient norm (this rank's part) before clipping."""
        self.gradients.normalise(self.model, tokens)
        if measure is not None:
            measure(squared_grad_norm(self.model.parameters(), self.device))
        norm = None
        if self.clip_grad_norm is not None:
            self.guard.sync_point()
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=float(self.clip_grad_norm))
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
        self.optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def optimizer_step(self) -> None:
        """``optimizer.step()``; after an OOM that changed nothing yet, free memory and try once more.

        The gradients are whole and the step is local to each rank, so it is retried alone.
        """
        counts = optimizer_step_counts(self.optimizer) if self.oom_recovery and not self.guard.armed else None
        try:
            self.optimizer.step()
            return
        except Exception as error:  # noqa: BLE001 - only a clean OOM is retried
            if (
                counts is None
                or not is_out_of_memory(error)
                or not optimizer_step_counts(self.optimizer).same_as(counts)
            ):
                raise
        memory.release_memory(self.device)
        step, saved, output_dir = self.where()
        logs.info(
            f"Out of memory in the optimizer step of optimizer step {step}: "
            "memory released, the optimizer step retried with the same gradients"
        )
        try:
            self.optimizer.step()
        except Exception as error:  # noqa: BLE001
            if not is_out_of_memory(error):
                raise
            raise OutOfMemoryStop(
                f"the optimizer step of optimizer step {step} runs out of memory even after "
                f"freeing memory (its state does not depend on the batch); the last complete checkpoint "
                f"(optimizer step {saved}) is in {output_dir}"
            ) from None
