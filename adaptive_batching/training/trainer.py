"""The training machinery every recipe shares: set-up, the step loop, metrics and checkpoints.

The trainer composes objects that own their state: the feed (what each step trains on), the batch plan,
growth, the OOM response, the step runner and the checkpoints. What differs between full and LoRA
fine-tuning is a :class:`~adaptive_batching.core.method.FinetuneMethod` given by the recipe; what differs between
objectives (fine-tuning, DPO) a :class:`~adaptive_batching.core.objective.TrainingObjective`. A recipe calls, in
order: ``setup``, ``profile``, ``make_plan`` and ``train``. Harnesses see inside a run through its ``hooks``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch.distributed.checkpoint.stateful import Stateful
from torchtune import config, training
from tqdm import tqdm

from adaptive_batching.batching import worst_case
from adaptive_batching.batching.lr_scaling import reference_steps
from adaptive_batching.batching.policy import DataContext, batching_for
from adaptive_batching.config.inputs import length_source, profiled_setup
from adaptive_batching.config.loading import given_argv
from adaptive_batching.config.settings import AdaptiveSettings
from adaptive_batching.core import logs
from adaptive_batching.core.method import FinetuneMethod
from adaptive_batching.core.nodes import building
from adaptive_batching.core.objective import TrainingObjective
from adaptive_batching.core.steps import StepMemory
from adaptive_batching.errors import Preempted, StepNotRetried, UnguardedOutOfMemory
from adaptive_batching.faults import restart
from adaptive_batching.faults.guard import StepGuard
from adaptive_batching.faults.preemption import Preemption
from adaptive_batching.faults.recovery import OomRecovery
from adaptive_batching.growth.plan import BatchPlan, reference_batch, starting_batch
from adaptive_batching.profiling.max_micro_batch import ProfileResult, preserved_training_state
from adaptive_batching.profiling.profiler import ProfilerContext, StartupProfiler
from adaptive_batching.runtime import memory
from adaptive_batching.runtime.distributed import init_parallel, shutdown
from adaptive_batching.training.feed import Feed
from adaptive_batching.training.hooks import TrainerHooks, installed
from adaptive_batching.training.objectives import SupervisedFinetune
from adaptive_batching.training.oom_response import OomResponse
from adaptive_batching.training.parts import Parts, Schedule, build_parts, build_schedule
from adaptive_batching.training.state import STATE_VERSION, PendingState, Progress
from adaptive_batching.training.stepping import StepStats, step_metrics


class Trainer:
    """Fine-tunes a torchtune model; one instance per run (``hooks``: see ``training.hooks``)."""

    def __init__(
        self,
        cfg: DictConfig,
        settings: AdaptiveSettings,
        method: FinetuneMethod,
        objective: TrainingObjective | None = None,
        hooks: TrainerHooks | None = None,
    ) -> None:
        self.cfg, self.settings, self.method = cfg, settings, method
        self.objective, self.hooks = objective or SupervisedFinetune(), hooks or installed()
        if cfg.get("device", "cpu") == "cpu" and settings.needs_profile:
            # Before any rank joins the process group: a restart replaces this process.
            memory.restart_with_glibc_pinned(given_argv())
        self.device, self.parallel = init_parallel(cfg.get("device", "cpu"))
        self.seed = training.set_seed(cfg.get("seed", None), debug_mode=cfg.get("cudnn_deterministic_mode", None))
        self.output_dir = Path(cfg.checkpointer.output_dir)
        self.total_epochs: int = cfg.epochs
        self.reference = reference_batch(cfg, settings.elastic, self.parallel.world_size)
        # A torchrun restart resumes by itself, and only its own job's checkpoints (``resume_job``).
        self.resume, self.resume_job = restart.resume_decision(
            cfg.get("resume_from_checkpoint", False), self.output_dir
        )
        progress = self.progress = Progress()
        self.metric_logger: Any = None
        self.log_every, self.peak_memory_stats = (
            cfg.get("log_every_n_steps", 1),
            cfg.get("log_peak_memory_stats", False),
        )
        self.save_every: int | None = cfg.get("save_every_n_steps", None)
        self.profiler = StartupProfiler(self.profiler_context, self.parallel.world_size)
        self.plan = BatchPlan(
            settings.growth, self.total_epochs, self.parallel.world_size, epochs_run=lambda: progress.epochs_run
        )
        self.guard = StepGuard(self.parallel, self.device)
        self.batching, faults = batching_for(settings.batching), settings.faults
        self.feed = Feed(
            self.batching,
            OomRecovery(self.batching.cuts(), faults.oom_grow_back_after),
            self.guard,
            faults.guard_steps,
            self.reference,
            step_in_epoch=lambda: progress.step_in_epoch,
            elastic=settings.elastic is not None,
        )
        self.built: Parts | None = None  # by setup()
        self.schedule: Schedule | None = None  # by make_plan()
        self.saved_lr: dict[str, Any] | None = None  # a resumed run's LR schedule, which the plan builds
        self.oom = OomResponse(
            self.feed,
            self.progress,
            parallel=self.parallel,
            device=self.device,
            guard=self.guard,
            output_dir=self.output_dir,
            save=self.save,
            profiler=self.profiler,
        )
        self.preemption = Preemption(
            faults.stop_signals, self.parallel, self.device, output_dir=None if self.resume else self.output_dir
        )
        self.preemption.install()  # from here on a stop signal stops the run where it can (see faults.preemption)

    @property
    def is_rank_zero(self) -> bool:
        return self.parallel.is_rank_zero

    @property
    def global_step(self) -> int:
        return self.progress.global_step

    @property
    def parts(self) -> Parts:
        assert self.built is not None, "Trainer.setup() builds the parts"
        return self.built

    @property
    def scheduled(self) -> Schedule:
        assert self.schedule is not None, "Trainer.make_plan() fixes the schedule"
        return self.schedule

    def setup(self) -> Parts:
        """Load the checkpoint and build every part: data, model, optimizer, loss, collate, step runner, checkpoints."""
        cfg = self.cfg
        self.hooks.before_setup(self)
        if self.device.type == "cpu":
            memory.set_cpu_allocator(profiles=self.settings.needs_profile)
        with building("metric_logger"):  # built when training starts (``profile`` and ``plan`` log nothing)
            config._utils._get_component_from_path(cfg.metric_logger._component_)
        self.built, checkpoint = build_parts(
            cfg,
            self.method,
            self.objective,
            self.hooks,
            resume=(self.resume, self.resume_job),
            elastic=self.settings.elastic is not None,
            guard=self.guard,
            parallel=self.parallel,
            device=self.device,
            oom_recovery=self.settings.faults.oom_recovery,
            where=lambda: (self.progress.global_step + 1, self.progress.saved_step, str(self.output_dir)),
        )
        data, model, optimizer = self.built.data, self.built.model, self.built.optimizer
        if self.resume:
            self.seed = self.built.checkpoints.restore(
                checkpoint,
                seed=self.seed,
                parts=self.resumable(),
                model=model,
                optimizer=optimizer,
                output_dir=self.output_dir,
            )
        self.batching.prepare(
            DataContext(
                data.dataset,
                self.built.collate,
                self.parallel,
                shuffle=cfg.get("shuffle", True),
                seed=self.seed,
                max_steps=cfg.get("max_steps_per_epoch", None),
                packed=data.packed,
                sequences_per_sample=self.objective.sequences_per_sample,
            ),
            length_source(cfg, self.settings.profiler.cache_dir),
            profiles=self.settings.needs_profile,
        )
        worst_case.check_fits(self.batching.worst, model.max_seq_len)
        self.preemption.before_training("during set-up (data, model, token counts)")
        self.hooks.after_setup(self)
        return self.built

    def profile(self) -> ProfileResult | None:
        """The largest micro batch that fits (see profiler), or the resumed checkpoint's; None if the run needs none."""
        return self.profiler.find(self.trial_step) if self.settings.needs_profile else None

    def profiler_context(self) -> ProfilerContext:
        """All the profiler sees of this run, besides :meth:`trial_step`."""
        parts = self.parts  # built by now: the profiler asks for its context after set-up
        return ProfilerContext(
            setup=profiled_setup(self.cfg),
            settings=self.settings.profiler,
            device=self.device,
            parallel=self.parallel,
            seq_len=self.seq_len,
            seq_len_source=self.batching.worst.source,
            samples_per_rank=len(parts.data.dataset) // self.parallel.world_size,
            preserved=lambda: preserved_training_state(parts.model, parts.optimizer),
            live_bytes=lambda: memory.current_bytes(self.device, *parts.runner.tracked),
            before_trial=self.preemption.between_trials,
        )

    @property
    def seq_len(self) -> int:
        """Tokens in the data's worst-case sample or pack (measured when the run profiles)."""
        assert self.batching.worst is not None, "the worst case is measured only for a run that profiles"
        return self.batching.worst.tokens

    def trial_step(self, micro_batch: int, seq_len: int | None = None) -> StepMemory:
        """One measured worst-case training step (the profiler's trial step)."""
        self.hooks.before_trial(micro_batch)
        parts = self.parts
        return parts.runner.trial_step(
            micro_batch,
            seq_len=seq_len or self.seq_len,
            accumulation=self.feed.batch.accumulation,
            collate=parts.collate,
            vocab_size=parts.model.tok_embeddings.num_embeddings,
            packed=parts.data.packed,
        )

    def make_plan(self, profile: ProfileResult | None) -> Schedule:
        """Fix every epoch's batch from ``profile`` (:meth:`profile`'s answer: growth function, memory cap) and the
        sample-driven LR schedule; log both."""
        settings = self.settings
        start = starting_batch(
            settings.growth,
            settings.elastic,
            self.reference,
            self.parallel.world_size,
            profile.micro_batch if profile is not None else None,
            use_maximum_batch_size=settings.use_maximum_batch_size,
            optimizer_in_bwd=settings.optimizer_in_bwd,
        )
        self.reference = start.reference
        self.plan.make(start=start.micro_batch, accumulation=start.accumulation, memory_cap=start.memory_cap)
        profiled = start.micro_batch if profile is not None and settings.use_maximum_batch_size else None
        self.batching.use_plan(self.plan.entries, start=start.micro_batch, profiled=profiled, verify=self._verifying)
        self.batching.check(
            profiled=settings.use_maximum_batch_size and settings.elastic is None,
            reference_global_batch=self.reference.global_batch,
            rule=settings.lr_scaling,
        )
        extents = [self.batching.extent(epoch) for epoch in range(self.total_epochs)]
        total_steps = reference_steps(sum(samples for _, samples in extents), self.reference.global_batch)
        self.schedule = build_schedule(
            self.cfg,
            self.parts,
            self.plan,
            self.feed,
            self.progress,
            verify=self._verifying,
            total_steps=total_steps,
            reference_global_batch=self.reference.global_batch,
            rule=settings.lr_scaling,
            saved_lr=self.saved_lr,
        )
        logs.info(
            self.plan.describe(
                self.batching.plan_rows,
                extents,
                self.reference.global_batch,
                self.schedule.lr.rule,
                total_steps,
                self.batching.worst.describe() if profile else "",
            )
        )
        return self.schedule

    @contextmanager
    def _verifying(self) -> Iterator[Callable[[int, int], StepMemory]]:
        """Trial steps at given samples and lengths, the training state restored afterwards."""
        with preserved_training_state(self.parts.model, self.parts.optimizer):
            yield lambda samples, seq_len: self.trial_step(samples, seq_len=seq_len)

    def train(self, schedule: Schedule) -> None:
        """Train the remaining epochs at ``schedule``'s batches (it grows as it says), saving a checkpoint at the
        end of each epoch and every ``save_every_n_steps``."""
        self.schedule = schedule
        self.hooks.before_train(self)
        if self.is_rank_zero:
            with building("metric_logger"):
                self.metric_logger = config.instantiate(self.cfg.metric_logger)
            self.metric_logger.log_config(self.cfg)
        memory.release_memory(self.device)
        self.parts.optimizer.zero_grad(set_to_none=True)
        last: StepStats | None = None
        first, progress = self.progress.epochs_run, self.progress
        for epoch in range(first, self.total_epochs):
            self.start_epoch(epoch, switch=epoch > first)
            self.hooks.before_epoch(self, epoch)
            last = self.train_epoch(epoch) or last
            self.hooks.after_epoch(self, epoch)
            self.end_epoch(epoch)
        if last is not None:
            logs.log.info(
                f"Rank {self.parallel.rank}: finished at optimizer step {progress.global_step}, "
                f"{self.feed.final_batch(progress.epochs_run)}, last loss {last.loss:.6f}"
            )
        self.hooks.after_train(self)

    def start_epoch(self, epoch: int, switch: bool) -> None:
        """Serve this epoch's planned batch from the same dataset (a new sampler) and rescale the LR."""
        start, feed, lr = time.perf_counter(), self.feed, self.scheduled.lr
        if switch:
            self.scheduled.growth.at_epoch_start(epoch)
        previous, lr_before = feed.batch, lr.lrs()[0]
        feed.start_epoch(epoch, self.plan.entries[epoch].shape)
        took_ms = (time.perf_counter() - start) * 1e3
        if not switch:
            logs.info(
                f"Epoch {epoch + 1}/{self.total_epochs}: {feed.describe_epoch(epoch)}, "
                f"LR {lr.lrs()[0]:.3e} (x{lr.factor:.3f} for the global batch)"
            )
            return
        logs.info(
            f"Epoch switch {epoch} -> {epoch + 1}: {self.batching.describe_change(epoch, previous, feed.batch)}, "
            f"LR {lr_before:.3e} -> {lr.lrs()[0]:.3e} ({self.plan.switch_reason(epoch)}){feed.split_note()} "
            f"(took {took_ms:.1f} ms)"
        )

    def end_epoch(self, epoch: int) -> None:
        """Count the epoch done, save it, and end the run here if a stop signal came."""
        self.progress.epochs_run, self.progress.step_in_epoch = epoch + 1, 0
        self.feed.end_epoch()
        self.save(epoch)
        if self.preemption.stopping:
            self.preemption.stop(f"at the end of epoch {epoch + 1}", f"saved epoch {epoch + 1} in {self.output_dir}")

    def train_epoch(self, epoch: int) -> StepStats | None:
        """Train one epoch (from ``step_in_epoch`` when resumed inside it); return the last step's statistics."""
        self.parts.model.train()
        feed, progress = self.feed, self.progress
        bar = tqdm(
            total=feed.epoch_steps,
            initial=progress.step_in_epoch,
            disable=not self.is_rank_zero,
            desc=f"epoch {epoch + 1}/{self.total_epochs}",
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

    def count_step(self, epoch: int, index: int, stats: StepStats, bar: tqdm) -> None:
        """After a finished step: advance the LR and the progress, log, and grow at a growth period's end."""
        feed, progress, schedule = self.feed, self.progress, self.scheduled
        self.guard.step_done()
        stats.samples = feed.samples_in_step(index)
        schedule.lr.advance(stats.samples)
        feed.set_step_lr(index + 1)
        progress.global_step += 1
        progress.step_in_epoch = index + 1
        bar.update(1)
        bar.set_postfix_str(
            f"global batch {stats.samples} lr {training.get_lr(self.parts.optimizer):.2e} loss {stats.loss:.4f}"
        )
        if progress.global_step % self.log_every == 0:  # read once: a cfg.get costs 5-150 us
            self.log_step(stats)
        period = self.plan.period_after_step(progress.global_step, schedule.lr.consumed_samples, stats.samples)
        if period is not None:
            schedule.growth.in_period(epoch, period)
            bar.total = feed.epoch_steps

    def save_or_stop(self, epoch: int, stop: bool) -> None:
        """Inside an epoch, after a step: save every ``save_every_n_steps``; after a stop signal, save and end."""
        if self.save_every and self.progress.global_step % self.save_every == 0:
            self.save(epoch)
        if stop:
            self.stop_inside_epoch(epoch)

    def stop_inside_epoch(self, epoch: int) -> None:
        """After a stop signal: save where the run stands inside the epoch (unless just saved) and end the run."""
        if self.progress.saved_step != self.progress.global_step:
            self.save(epoch)
        self.preemption.stop(
            f"after optimizer step {self.progress.global_step} ({self.progress.where()})",
            f"saved the checkpoint of optimizer step {self.progress.global_step} in {self.output_dir}",
        )

    def train_step(self, epoch: int, index: int) -> tuple[StepStats | None, bool]:
        """The epoch's step ``index``: its statistics (None after an OOM recovered in place) and if a signal came."""
        self.preemption.begin_step()
        try:
            micro_batches = self.feed.next_step(index)
            self.hooks.before_step(self, micro_batches)
            stats = self.parts.runner.train_step(micro_batches)
        except (StepNotRetried, UnguardedOutOfMemory) as error:
            self.oom.stop(error, epoch, index, retries=self.parts.runner.gradients.retries_out_of_memory)
        if stats is not None:
            self.feed.recovery.step_done()
        self.hooks.after_step(self, stats)
        return stats, self.preemption.end_step(self.progress.global_step + 1)

    def log_step(self, stats: StepStats) -> None:
        if self.is_rank_zero:
            feed = self.feed
            metrics = step_metrics(
                stats,
                lr=training.get_lr(self.parts.optimizer),
                ranks=self.parallel.world_size,
                accumulation=feed.batch.accumulation * feed.split,
                device=self.device,
                batching=feed.metrics(self.progress.epochs_run),
                peak_memory_stats=self.peak_memory_stats,
            )
            self.metric_logger.log_dict(
                metrics | self.objective.step_metrics(stats.seconds, stats.padded_tokens),
                step=self.progress.global_step,
            )

    def save(self, epoch: int) -> None:
        """Write the weights and everything an exact resume needs (see :class:`Checkpoints`)."""
        self.parts.checkpoints.save(
            epoch,
            model=self.parts.model,
            optimizer=self.parts.optimizer,
            seed=self.seed,
            progress=self.progress,
            adaptive_state=self.adaptive_state,
        )
        self.preemption.saved()

    def resumable(self) -> dict[str, Stateful]:
        """The parts that resume, by their key in the checkpoint (the LR schedule's state waits in :attr:`saved_lr`)."""
        return {
            "progress": self.progress,
            "feed": self.feed,
            "plan": self.plan,
            "lr": self.schedule.lr if self.schedule else PendingState(self, "saved_lr"),
            "noise_scale": self.parts.runner.noise,
            "profile": self.profiler,
        }

    def adaptive_state(self) -> dict[str, Any]:
        """The adaptive part of the recipe state: each part's own state under its key."""
        return {"version": STATE_VERSION, **{key: part.state_dict() for key, part in self.resumable().items()}}

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        self.close(together=kind is None or issubclass(kind, Preempted))

    def close(self, together: bool = False) -> None:
        """Drop the last loss (its autograd nodes hold FSDP's groups), close the metric logger and leave the process
        group (unless a rank broke it); runs after any error. ``together``: every rank leaves here (a finished run,
        an agreed stop), so none tears the group down while another still uses it or has a line to say."""
        if self.built is not None:
            self.built.runner.last_loss = None
        self.preemption.uninstall()
        if self.metric_logger is not None:
            self.metric_logger.close()
        if not self.oom.process_group_broken:
            shutdown(self.parallel, together=together)
