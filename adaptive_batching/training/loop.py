"""An epoch's optimizer steps: serve each step's micro batches, run it, count it, log it, save or stop between
steps, and answer an out-of-memory error (:class:`~adaptive_batching.training.oom_response.OomResponse`)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig
from torchtune import config, training
from tqdm import tqdm

from adaptive_batching.batching.lr_scaling import SampleDrivenLR
from adaptive_batching.core.nodes import building
from adaptive_batching.errors import StepNotRetried, UnguardedOutOfMemory
from adaptive_batching.growth.growing import Growth
from adaptive_batching.training.oom_response import OomResponse
from adaptive_batching.training.parts import Parts
from adaptive_batching.training.state import Checkpoints
from adaptive_batching.training.stepping import StepStats, step_metrics


class StepLog:
    """The metric logger of the config's ``metric_logger``, on rank zero, opened when training starts (set-up, the
    profile and the plan log nothing, so ``adaptive-batching profile`` and ``plan`` leave no log)."""

    def __init__(self, node: DictConfig, *, is_rank_zero: bool, peak_memory_stats: bool) -> None:
        self.node, self.is_rank_zero, self.peak_memory_stats = node, is_rank_zero, peak_memory_stats
        self.logger: Any = None

    def open(self, cfg: DictConfig) -> None:
        if self.is_rank_zero:
            with building("metric_logger"):
                self.logger = config.instantiate(self.node)
            self.logger.log_config(cfg)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logger.log_dict(metrics, step=step)

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()


class EpochLoop:
    """Trains an epoch's steps (see the module docstring); ``log_every`` and ``save_every`` as the config's
    ``log_every_n_steps`` and ``save_every_n_steps``."""

    def __init__(
        self,
        parts: Parts,
        lr: SampleDrivenLR,
        growth: Growth,
        checkpoints: Checkpoints,
        oom: OomResponse,
        step_log: StepLog,
        *,
        log_every: int,
        save_every: int | None,
    ) -> None:
        self.parts, self.lr, self.growth, self.checkpoints, self.oom = parts, lr, growth, checkpoints, oom
        self.step_log, self.log_every, self.save_every = step_log, log_every, save_every

    def run(self, epoch: int) -> StepStats | None:
        """Train one epoch (from ``step_in_epoch`` when resumed inside it); return the last step's statistics."""
        parts = self.parts
        parts.model.train()
        feed, progress = parts.feed, parts.progress
        bar = tqdm(
            total=feed.epoch_steps,
            initial=progress.step_in_epoch,
            disable=not parts.is_rank_zero,
            desc=f"epoch {epoch + 1}/{parts.plan.epochs}",
        )
        last = None
        while progress.step_in_epoch < feed.epoch_steps:
            index = progress.step_in_epoch
            stats, stop = self.train_step(epoch, index)
            if stats is None:
                self.oom.after_out_of_memory(epoch, index)
                if stop:
                    self.stop_inside_epoch(epoch)
                continue
            last = stats
            self.count_step(epoch, index, stats, bar)
            if progress.step_in_epoch < feed.epoch_steps:
                self.save_or_stop(epoch, stop)
            self.oom.maybe_grow_back(epoch)
        bar.close()
        return last

    def train_step(self, epoch: int, index: int) -> tuple[StepStats | None, bool]:
        """The epoch's step ``index``: its statistics (None after an OOM recovered in place) and if a signal came."""
        parts = self.parts
        parts.preemption.begin_step()
        try:
            micro_batches = parts.feed.next_step(index)
            parts.hooks.before_step(parts, micro_batches)
            stats = parts.runner.train_step(micro_batches, parts.progress.global_step)
        except (StepNotRetried, UnguardedOutOfMemory) as error:
            self.oom.stop(error, epoch, index, retries=parts.runner.gradients.retries_out_of_memory)
        if stats is not None:
            parts.feed.recovery.step_done()
        parts.hooks.after_step(parts, stats)
        return stats, parts.preemption.end_step(parts.progress.global_step + 1)

    def count_step(self, epoch: int, index: int, stats: StepStats, bar: tqdm) -> None:
        """After a finished step: advance the LR and the progress, log, and grow at a growth period's end."""
        parts = self.parts
        feed, progress = parts.feed, parts.progress
        parts.guard.step_done()
        stats.samples = feed.samples_in_step(index)
        self.lr.advance(stats.samples)
        feed.set_step_lr(index + 1)
        progress.global_step += 1
        progress.step_in_epoch = index + 1
        bar.update(1)
        bar.set_postfix_str(
            f"global batch {stats.samples} lr {training.get_lr(parts.optimizer):.2e} loss {stats.loss:.4f}"
        )
        if progress.global_step % self.log_every == 0:  # read once: a cfg.get costs 5-150 us
            self.log_step(stats)
        period = parts.plan.period_after_step(progress.global_step, self.lr.consumed_samples, stats.samples)
        if period is not None:
            self.growth.in_period(epoch, period)
            bar.total = feed.epoch_steps

    def save_or_stop(self, epoch: int, stop: bool) -> None:
        """Inside an epoch, after a step: save every ``save_every_n_steps``; after a stop signal, save and end."""
        if self.save_every and self.parts.progress.global_step % self.save_every == 0:
            self.checkpoints.save(epoch)
        if stop:
            self.stop_inside_epoch(epoch)

    def stop_inside_epoch(self, epoch: int) -> None:
        """After a stop signal: save where the run stands inside the epoch (unless just saved) and end the run."""
        progress = self.parts.progress
        if progress.saved_step != progress.global_step:
            self.checkpoints.save(epoch)
        self.parts.preemption.stop(
            f"after optimizer step {progress.global_step} ({progress.where()})",
            f"saved the checkpoint of optimizer step {progress.global_step} in {self.parts.output_dir}",
        )

    def log_step(self, stats: StepStats) -> None:
        parts = self.parts
        if parts.is_rank_zero:
            feed = parts.feed
            metrics = step_metrics(
                stats,
                lr=training.get_lr(parts.optimizer),
                ranks=parts.parallel.world_size,
                accumulation=feed.batch.accumulation * feed.split,
                device=parts.device,
                batching=feed.metrics(parts.progress.epochs_run),
                peak_memory_stats=self.step_log.peak_memory_stats,
            )
            objective = parts.runner.objective.step_metrics(stats.seconds, stats.padded_tokens)
            self.step_log.log(metrics | objective, step=parts.progress.global_step)
