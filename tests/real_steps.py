"""A real training step's activation bytes on CPU, counted by ``MemTracker`` on real tensors: what the estimate's
fake, extrapolated step is checked against (tests/test_estimate_dpo.py, tests/test_estimate_kd_qat.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torchtune import config, modules, training

from adaptive_batching.runtime.mem_tracker import FrozenAwareMemTracker
from adaptive_batching.training.recipe_table import method_and_objective

FIDELITY = 0.05  # the fine-tuning estimate's tolerance against the profiler's real steps (docs/profiler.md)


class PeakTracker(FrozenAwareMemTracker):
    """``MemTracker``'s count of tensor bytes, its highest point after any op kept (cheaply: no per-module peaks)."""

    highest = 0

    def _update_peak_stats(self, peak_state: Any) -> None:
        self.highest = max(self.highest, self.total())

    def total(self) -> int:
        return int(sum(snap.get("Total", 0) for snap in self._curr_mem_snap.values()))


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops on a shared 2-core machine: threads only wait for each other
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def real_activation_bytes(cfg: Any, micro_batch: int, seq_len: int) -> int:
    """The bytes a real step's forward and backward take above where they start: the model built and prepared as
    the recipes build it (its dtype, activation checkpointing, a quantizer's fake quantization on), the step of
    the objective its recipe trains with (with a real frozen reference or teacher), on its worst-case micro batch."""
    method, objective = method_and_objective(cfg, profiled=False)
    torch.manual_seed(0)
    dtype = training.get_dtype(cfg.get("dtype", "fp32"), device=torch.device("cpu"))
    with training.set_default_dtype(dtype):
        model = config.instantiate(cfg.model)
    method.configure(model)
    if cfg.get("enable_activation_checkpointing", False):
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    loss_fn = config.instantiate(cfg.loss)
    if hasattr(loss_fn, "num_output_chunks"):
        model.set_num_output_chunks(loss_fn.num_output_chunks)

    if objective.frozen is not None:
        with training.set_default_dtype(dtype):
            objective.hold(config.instantiate(cfg[objective.frozen.model]).requires_grad_(False).eval())
    collate = objective.collate("torchtune.data.padded_collate_sft", False, 0, loss_fn)
    batch = objective.worst_case_batch(collate, micro_batch=micro_batch, seq_len=seq_len, vocab_size=1280, packed=False)
    with one_thread():
        tracker = PeakTracker()
        tracker.track_external(model, *objective.resident)
        with tracker:
            start = tracker.total()
            loss, _ = objective.micro_loss(
                model, loss_fn, {k: v.clone() for k, v in batch.items()}, contextlib.nullcontext()
            )
            loss.backward()
    return tracker.highest - start


def assert_matches_real_steps(trace: Any, real_bytes: Callable[[int], int]) -> None:
    """Each probed micro batch's traced activation bytes, and the bytes a sample adds between the smallest and the
    largest, equal the real step's (``real_bytes(micro_batch)``) within :data:`FIDELITY`."""
    real = {m: real_bytes(m) for m in sorted(trace.probes)}
    estimated = {m: trace.probes[m].activation_bytes for m in real}
    for m in real:
        assert estimated[m] == pytest.approx(real[m], rel=FIDELITY), (m, estimated, real)
    low, high = min(real), max(real)
    per_sample = (real[high] - real[low]) / (high - low)
    assert (estimated[high] - estimated[low]) / (high - low) == pytest.approx(per_sample, rel=FIDELITY)
