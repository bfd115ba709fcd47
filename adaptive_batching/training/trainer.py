"""The trainer every recipe shares: ``Trainer.build(...)`` sets up, profiles and plans; ``train()`` trains and saves.

The trainer composes parts that own their state (:class:`~adaptive_batching.training.parts.Parts`: the data, the
model and optimizer, the step runner, the feed, the batch plan, the profiler, preemption), the LR schedule and
growth the plan fixes, the checkpoints, the OOM response and the epoch loop. What differs between full and LoRA
fine-tuning (QAT around either) is a :class:`~adaptive_batching.core.method.FinetuneMethod`; what differs between
objectives (fine-tuning, DPO, knowledge distillation) a :class:`~adaptive_batching.core.objective.TrainingObjective`;
both are given by the recipe. Harnesses see inside a run through its hooks (``training.hooks``).
"""

from __future__ import annotations

import time

from omegaconf import DictConfig

from adaptive_batching.batching.lr_scaling import SampleDrivenLR, reference_steps
from adaptive_batching.config.settings import AdaptiveSettings
from adaptive_batching.core import logs
from adaptive_batching.core.method import FinetuneMethod
from adaptive_batching.core.nodes import optional_component
from adaptive_batching.core.objective import TrainingObjective
from adaptive_batching.errors import Preempted
from adaptive_batching.growth.growing import Growth
from adaptive_batching.growth.plan import starting_batch
from adaptive_batching.profiling.max_micro_batch import ProfileResult
from adaptive_batching.runtime import memory
from adaptive_batching.training.hooks import TrainerHooks
from adaptive_batching.training.loop import EpochLoop, StepLog
from adaptive_batching.training.oom_response import OomResponse
from adaptive_batching.training.parts import Parts, set_up
from adaptive_batching.training.state import Checkpoints, RunShape
from adaptive_batching.training.stepping import StepStats


class Trainer:
    """Fine-tunes a torchtune model; one per run, made by :meth:`build`, used as a context manager around
    :meth:`train` (it leaves the process group on the way out)."""

    @classmethod
    def build(
        cls,
        cfg: DictConfig,
        settings: AdaptiveSettings,
        method: FinetuneMethod,
        objective: TrainingObjective,
        hooks: TrainerHooks | None = None,
    ) -> Trainer:
        """Set up every part, profile the largest micro batch that fits (or take the resumed checkpoint's) when
        the run asks for it, and plan every epoch's batch and the LR schedule, in that order."""
        parts = set_up(cfg, settings, method, objective, hooks)
        try:
            profile = parts.profiler.find(parts.trial_step) if settings.needs_profile else None
            lr, growth = plan_training(cfg, settings, parts, profile)
            return cls(cfg, parts, lr=lr, growth=growth)
        except BaseException as error:
            parts.close(together=isinstance(error, Preempted))
            raise

    def __init__(self, cfg: DictConfig, parts: Parts, *, lr: SampleDrivenLR, growth: Growth) -> None:
        self.cfg = cfg
        self.parts = parts
        self.lr = lr
        self.growth = growth
        self.checkpoints = Checkpoints(
            parts.checkpointer,
            parts.method,
            {
                "progress": parts.progress,
                "feed": parts.feed,
                "plan": parts.plan,
                "lr": lr,
                "noise_scale": parts.runner.noise,
                "profile": parts.profiler,
            },
            model=parts.model,
            optimizer=parts.optimizer,
            seed=parts.seed,
            progress=parts.progress,
            shape=RunShape(cfg.epochs, cfg.get("max_steps_per_epoch", None)),
            parallel=parts.parallel,
            device=parts.device,
            preemption=parts.preemption,
        )
        self.oom = OomResponse(
            parts.feed,
            parts.progress,
            parallel=parts.parallel,
            device=parts.device,
            guard=parts.guard,
            output_dir=parts.output_dir,
            checkpoints=self.checkpoints,
            profiler=parts.profiler,
        )
        self.step_log = StepLog(
            cfg.metric_logger,
            is_rank_zero=parts.is_rank_zero,
            peak_memory_stats=cfg.get("log_peak_memory_stats", False),
        )
        self.loop = EpochLoop(
            parts,
            lr,
            growth,
            self.checkpoints,
            self.oom,
            self.step_log,
            log_every=cfg.get("log_every_n_steps", 1),
            save_every=cfg.get("save_every_n_steps", None),
        )

    def train(self) -> None:
        """Train the remaining epochs at the plan's batches (it grows as it says), saving a checkpoint at the end of
        each epoch and every ``save_every_n_steps``."""
        parts = self.parts
        parts.hooks.before_train(parts)
        self.step_log.open(self.cfg)
        memory.release_memory(parts.device)
        parts.optimizer.zero_grad(set_to_none=True)
        last: StepStats | None = None
        progress = parts.progress
        first = progress.epochs_run
        for epoch in range(first, parts.plan.epochs):
            self.start_epoch(epoch, switch=epoch > first)
            parts.hooks.before_epoch(parts, epoch)
            last = self.loop.run(epoch) or last
            parts.hooks.after_epoch(parts, epoch)
            self.end_epoch(epoch)
        if last is not None:
            logs.log.info(
                f"Rank {parts.parallel.rank}: finished at optimizer step {progress.global_step}, "
                f"{parts.feed.final_batch(progress.epochs_run)}, last loss {last.loss:.6f}"
            )
        parts.hooks.after_train(parts)

    def start_epoch(self, epoch: int, switch: bool) -> None:
        """Serve this epoch's planned batch from the same dataset (a new sampler) and rescale the LR."""
        start, feed, lr, plan = time.perf_counter(), self.parts.feed, self.lr, self.parts.plan
        if switch:
            self.growth.at_epoch_start(epoch)
        previous, lr_before = feed.batch, lr.lrs()[0]
        feed.start_epoch(epoch, plan.entries[epoch].shape)
        took_ms = (time.perf_counter() - start) * 1e3
        if not switch:
            logs.info(
                f"Epoch {epoch + 1}/{plan.epochs}: {feed.describe_epoch(epoch)}, "
                f"LR {lr.lrs()[0]:.3e} (x{lr.factor:.3f} for the global batch)"
            )
            return
        logs.info(
            f"Epoch switch {epoch} -> {epoch + 1}: {self.parts.batching.describe_change(epoch, previous, feed.batch)}, "
            f"LR {lr_before:.3e} -> {lr.lrs()[0]:.3e} ({plan.switch_reason(epoch)}){feed.split_note()} "
            f"(took {took_ms:.1f} ms)"
        )

    def end_epoch(self, epoch: int) -> None:
        """Count the epoch done, save it, and end the run here if a stop signal came."""
        parts = self.parts
        parts.progress.epochs_run, parts.progress.step_in_epoch = epoch + 1, 0
        parts.feed.end_epoch()
        self.checkpoints.save(epoch)
        if parts.preemption.stopping:
            parts.preemption.stop(f"at the end of epoch {epoch + 1}", f"saved epoch {epoch + 1} in {parts.output_dir}")

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        self.close(together=kind is None or issubclass(kind, Preempted))

    def close(self, together: bool = False) -> None:
        """Close the metric logger and end the parts' hold on the process (see :meth:`Parts.close`); runs after any
        error."""
        self.step_log.close()
        self.parts.close(together=together, broken=self.oom.process_group_broken)


def plan_training(
    cfg: DictConfig, settings: AdaptiveSettings, parts: Parts, profile: ProfileResult | None
) -> tuple[SampleDrivenLR, Growth]:
    """Fix every epoch's batch from ``profile`` (the profiler's answer: growth function, memory cap) and the
    sample-driven LR schedule, and log both; the LR schedule (scaled from the plan's reference batch: an elastic one
    changes it) and growth, which the feed and the epoch loop follow."""
    parallel, batching, plan = parts.parallel, parts.batching, parts.plan
    start = starting_batch(
        settings.growth,
        settings.elastic,
        parts.reference,
        parallel.world_size,
        profile.micro_batch if profile is not None else None,
        use_maximum_batch_size=settings.use_maximum_batch_size,
        optimizer_in_bwd=settings.optimizer_in_bwd,
    )
    reference = start.reference
    plan.make(start=start.micro_batch, accumulation=start.accumulation, memory_cap=start.memory_cap)
    profiled = start.micro_batch if profile is not None and settings.use_maximum_batch_size else None
    batching.use_plan(plan.entries, start=start.micro_batch, profiled=profiled, verify=parts.verifying)
    batching.check(
        profiled=settings.use_maximum_batch_size and settings.elastic is None,
        reference_global_batch=reference.global_batch,
        rule=settings.lr_scaling,
    )
    extents = [batching.extent(epoch) for epoch in range(plan.epochs)]
    total_steps = reference_steps(sum(samples for _, samples in extents), reference.global_batch)
    lr = SampleDrivenLR.from_config(
        optional_component(cfg.get("lr_scheduler", None)),
        parts.optimizer,
        parts.base_lrs,
        total_steps=total_steps,
        reference_global_batch=reference.global_batch,
        rule=settings.lr_scaling,
    )
    parts.saved.restore("lr", lr)
    parts.feed.follow(lr)
    growth = Growth(plan, parts.feed, lr, parts.runner.noise, parts.progress, verify=parts.verifying)
    logs.info(
        plan.describe(
            batching.plan_rows,
            extents,
            reference.global_batch,
            lr.rule,
            total_steps,
            batching.worst.describe() if profile and batching.worst is not None else "",
        )
    )
    return lr, growth
