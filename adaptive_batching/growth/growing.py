"""Growing the batch while training: at an epoch start from measured statistics, or at a growth period
inside an epoch, where the rest of the epoch is served by a new sampler from the first sample not yet
served. The decisions are :class:`~adaptive_batching.growth.plan.BatchPlan`'s; :class:`Growth` gives
them their statistics and has the feed serve the result.
"""

from __future__ import annotations

import time
from typing import Any

from adaptive_batching.batching.lr_scaling import SampleDrivenLR
from adaptive_batching.batching.policy import Verifier
from adaptive_batching.batching.shape import EpochBatch
from adaptive_batching.core import logs
from adaptive_batching.growth.gradient_noise import NoiseScaleEstimator
from adaptive_batching.growth.plan import BatchPlan
from adaptive_batching.growth.planning import epoch_switch_reason
from adaptive_batching.growth.statistics import TrainingStatistics


class Growth:
    """Growth while training (see the module docstring)."""

    def __init__(
        self,
        plan: BatchPlan,
        feed: Any,
        lr: SampleDrivenLR,
        noise: NoiseScaleEstimator,
        progress: Any,
        *,
        verify: Verifier,
    ) -> None:
        """``feed``: the trainer's :class:`~adaptive_batching.training.feed.Feed`, which serves what growth decides;
        ``progress``: where the run stands (``epochs_run``, ``step_in_epoch``, ``global_step``)."""
        self.plan, self.feed, self.lr, self.noise, self.progress = plan, feed, lr, noise, progress
        self.verify = verify

    def at_epoch_start(self, epoch: int) -> None:
        """A growth function that reads training statistics decides ``epoch``'s batch now, from what the
        run measured (gradient noise scale, LR decay); the rest of the plan follows from it."""
        if epoch == 0:
            return
        previous = self.plan.entries[epoch - 1]
        stats = self.statistics(previous)
        increment = self.plan.measure_at_epoch_start(epoch, stats)
        if increment is None:
            return
        batching = self.feed.batching
        batching.use_plan(self.plan.entries, start=self.plan.start, profiled=None, verify=self.verify)
        noise = stats.noise_scale
        logs.info(
            f"Growth from statistics at epoch {epoch + 1}: gradient noise scale "
            f"{'not measured yet' if noise is None else f'{noise:.1f}'}, global batch {previous.shape.global_batch}"
            f": the function returned {increment:+d}"
        )

    def statistics(self, previous: EpochBatch) -> TrainingStatistics:
        """What a statistics-reading growth function is given (see ``growth.statistics``)."""
        # Seesaw's lr_decay (growth.statistics.seesaw): the schedule now over its peak so far, times the batch's
        # growth since the start (not entries[0]: growth inside the first epoch overwrites it with the grown batch).
        shape, peak, batch = self.lr.schedule_shape(), self.lr.peak_shape, previous.shape
        return TrainingStatistics(
            noise_scale=self.noise.value,
            global_batch=batch.global_batch,
            micro_batch=batch.micro_batch,
            accumulation=batch.accumulation,
            ranks=batch.ranks,
            epoch=self.progress.epochs_run,
            lr_decay=None
            if shape is None
            else (shape / peak if peak else 1.0) * batch.global_batch / self.plan.start_global_batch,
        )

    def in_period(self, epoch: int, period: int) -> None:
        """Growth period ``period`` starts after this step: ask the growth function, and serve the rest of the
        epoch at the new batch from the samples not yet served (the epoch's order goes on; the LR follows)."""
        start = time.perf_counter()
        feed, step = self.feed, self.progress.step_in_epoch
        stats = self.statistics(self.plan.entries[epoch])
        previous, entry = self.plan.grow_in_period(epoch, period, stats)
        before, lr_before = feed.batch, self.lr.lrs()[0]
        inside = step < feed.epoch_steps
        if entry.shape != before and inside:
            feed.grow_inside_epoch(epoch, step, entry.shape)
        noise = stats.noise_scale
        logs.info(
            f"Growth period {period} ({self.plan.interval.describe()}) after optimizer step "
            f"{self.progress.global_step}: {feed.batching.describe_change(epoch, before, entry.shape)} for "
            f"{'the rest of this epoch' if inside else 'the next epoch'}, LR {lr_before:.3e} -> "
            f"{self.lr.lrs()[0]:.3e} ({epoch_switch_reason(previous, entry)}; gradient noise scale "
            f"{'not measured' if noise is None else f'{noise:.1f}'}) "
            f"(took {(time.perf_counter() - start) * 1e3:.1f} ms)"
        )
