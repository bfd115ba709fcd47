"""Predict the largest micro batch for a device you do not have, allocating no real memory.

The model, optimizer and inputs are built under ``FakeTensorMode`` (shapes and dtypes, no storage);
torch's ``MemTracker`` counts the bytes a training step would hold. The same probe-and-fit as the
real profiler then predicts the largest micro batch under ``device memory x fraction``. There is no
verification step, so allocator overheads the real profiler would meet are not seen here.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from omegaconf import DictConfig
from torch._subclasses.fake_tensor import FakeTensorMode
from torchtune import config, modules, training

from adaptive_batching.loss import summed_token_loss
from adaptive_batching.memory import PeakMeter, current_bytes
from adaptive_batching.memory_fit import max_micro_batch_under
from adaptive_batching.model import FinetuneMethod
from adaptive_batching.profiler import StepMemory, fit_probes, probe_until_slope

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Estimate:
    """A prediction for ``device_memory_bytes``; ``max_micro_batch`` is before margin and rounding."""

    max_micro_batch: int
    device_memory_bytes: int
    budget_bytes: int
    seq_len: int
    model_state_bytes: int
    fixed_bytes: float
    bytes_per_sample: float
    optimizer_peak_bytes: int
    world_size: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        gib = 2**30
        return (
            f"predicted largest micro batch: {self.max_micro_batch} ({self.seq_len}-token samples, "
            f"{self.world_size} rank(s))\n"
            f"budget {self.budget_bytes / gib:.2f} GiB of {self.device_memory_bytes / gib:.2f} GiB; "
            f"weights + optimizer state {self.model_state_bytes / gib:.2f} GiB per rank; "
            f"step peak = {self.fixed_bytes / gib:.2f} GiB + {self.bytes_per_sample / 2**20:.1f} MiB x micro batch; "
            f"optimizer step peak {self.optimizer_peak_bytes / gib:.2f} GiB; computed in {self.seconds:.1f} s"
        )


def _fake_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any, micro_batch: int,
               seq_len: int, vocab_size: int) -> StepMemory:
    """The memory one training step would use; the tensors are fake, nothing is allocated."""
    with PeakMeter(CPU, model, optimizer) as forward_backward:
        tokens = torch.randint(0, vocab_size, (micro_batch, seq_len))
        loss, _ = summed_token_loss(model, loss_fn, {"tokens": tokens, "labels": tokens})
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


def estimate_max_micro_batch(cfg: DictConfig, method: FinetuneMethod, *, device_memory_bytes: int,
                             fraction: float = 0.9, world_size: int = 1,
                             max_probe: int = 1024) -> Estimate:
    """Predict the largest micro batch for ``cfg`` on a device with ``device_memory_bytes``.

    With ``world_size`` > 1, weights, gradients and optimizer state are divided over the ranks
    as FSDP shards them; activations are not.
    """
    started = time.perf_counter()
    dtype = training.get_dtype(cfg.get("dtype", "fp32"), device=CPU)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with training.set_default_dtype(dtype):
            model = config.instantiate(cfg.model)
        method.configure(model)
        if cfg.get("enable_activation_checkpointing", False):
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        loss_fn = config.instantiate(cfg.loss)
        if loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            model.set_num_output_chunks(loss_fn.num_output_chunks)
        optimizer_cfg = {k: v for k, v in cfg.optimizer.items() if k != "fused"}
        optimizer = config.instantiate(DictConfig(optimizer_cfg), [p for p in model.parameters() if p.requires_grad])
        seq_len = int(cfg.tokenizer.get("max_seq_len", None) or model.max_seq_len)
        vocab_size = model.tok_embeddings.num_embeddings
        # The first probe also creates the optimizer state; activations do not depend on it.
        probed = probe_until_slope(lambda b: _fake_step(model, optimizer, loss_fn, b, seq_len, vocab_size), max_probe)

    fit = fit_probes(probed)
    if fit is None:
        raise ValueError(f"peak memory did not grow with the micro batch up to {max_probe}; nothing to fit")
    model_state = probed[max(probed)].steady_bytes // world_size
    sharded = probed[max(probed)].steady_bytes - model_state
    fit = replace(fit, fixed_bytes=fit.fixed_bytes - sharded, plateau_bytes=max(0.0, fit.plateau_bytes - sharded))
    optimizer_peak = max(m.optimizer_peak for m in probed.values()) // world_size
    budget = int(device_memory_bytes * fraction)
    return Estimate(
        max_micro_batch=max_micro_batch_under(fit, budget) if optimizer_peak <= budget else 0,
        device_memory_bytes=device_memory_bytes,
        budget_bytes=budget,
        seq_len=seq_len,
        model_state_bytes=model_state,
        fixed_bytes=fit.fixed_bytes,
        bytes_per_sample=fit.bytes_per_sample,
        optimizer_peak_bytes=optimizer_peak,
        world_size=world_size,
        seconds=time.perf_counter() - started,
    )
