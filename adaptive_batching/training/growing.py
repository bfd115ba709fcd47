"""Growing the batch while training: at an epoch start from measured statistics, or at a growth period
inside an epoch, where the rest of the epoch is served by a new sampler from the first sample not yet
served. The decisions are :class:`~adaptive_batching.batching.plan.BatchPlan`'s; this part of the trainer gives
them their statistics and serves the result. Mixed into :class:`~adaptive_batching.training.trainer.Trainer`.
"""

from __future__ import annotations

import time
from typing import Any

from adaptive_batching.batching.schedule import EpochBatch, epoch_switch_reason
from adaptive_batching.growth.interval import Segment


class Growing:
    """Growth while training (see the module docstring)."""

    def grow_from_statistics(self, epoch: int) -> None:
        """A growth function that reads training statistics decides ``epoch``'s batch now, from what the
        run measured (gradient noise scale, LR decay); the rest of the plan follows from it."""
        if epoch == 0:
            return
        previous = self.plan.entries[epoch - 1]
        stats = self.growth_statistics(previous)
        increment = self.plan.measure_at_epoch_start(epoch, stats)
        if increment is None:
            return
        self.batching.plan(self.plan.entries, start=self.plan.start,
                           resumed={**self.resumed, **self.batching.state_dict()}, profiled=None,
                           verify=self._verifying, info=self.info)
        noise = stats["noise_scale"]
        self.info(f"Growth from statistics at epoch {epoch + 1}: gradient noise scale "
                  f"{'not measured yet' if noise is None else f'{noise:.1f}'}, global batch {previous.shape.global_batch}"
                  f": the function returned {increment:+d}")

    def growth_statistics(self, previous: EpochBatch) -> dict[str, Any]:
        """What a statistics-reading growth function is given (see ``growth_stats``)."""
        # Seesaw's lr_decay (growth_stats.seesaw): the schedule now over its peak so far, times the batch's growth
        # since the start (not entries[0]: growth inside the first epoch overwrites it with the grown batch).
        shape, peak = self.lr.schedule_shape(), self.lr.peak_shape
        return {"noise_scale": self.steps.noise.value, "global_batch": previous.shape.global_batch,
                "micro_batch": previous.shape.micro_batch, "accumulation": previous.shape.accumulation,
                "ranks": previous.shape.ranks, "epoch": self.epochs_run,
                "lr_decay": None if shape is None else
                (shape / peak if peak else 1.0) * previous.shape.global_batch / self.plan.start_global_batch}

    def grow_inside_epoch(self, epoch: int, period: int) -> None:
        """Growth period ``period`` starts after this step: ask the growth function, and serve the rest of the
        epoch at the new batch from the samples not yet served (the epoch's order goes on; the LR follows)."""
        start = time.perf_counter()
        stats = self.growth_statistics(self.plan.entries[epoch])
        previous, entry = self.plan.grow_in_period(epoch, period, stats)
        before, lr_before = self.batch, self.lr.lrs()[0]
        steps = self.epoch_steps
        if entry.shape != before and self.step_in_epoch < steps:
            sampler = self.dataloader.batch_sampler
            served = sum(sampler.samples_in_step(i) for i in range(self.segment.local(self.step_in_epoch)))
            self.segment = Segment(self.segment.first_sample + served, self.step_in_epoch)
            self.batch = entry.shape
            self.recovery.plan(self.batch.micro_batch)
            self.serve(epoch, start_step=self.step_in_epoch)
            self.set_step_lr(self.step_in_epoch)
        where = "the rest of this epoch" if self.step_in_epoch < steps else "the next epoch"
        noise = stats["noise_scale"]
        self.info(f"Growth period {period} ({self.plan.interval.describe()}) after optimizer step {self.global_step}: "
                  f"{self.batching.describe_change(epoch, before, entry.shape)} for {where}, LR {lr_before:.3e} -> "
                  f"{self.lr.lrs()[0]:.3e} ({epoch_switch_reason(previous, entry)}; gradient noise scale "
                  f"{'not measured' if noise is None else f'{noise:.1f}'}) (took {(time.perf_counter() - start) * 1e3:.1f} ms)")

    @property
    def epoch_steps(self) -> int:
        """Optimizer steps in the current epoch (all its segments)."""
        return self.segment.start_step + self.dataloader.batch_sampler.steps

