"""The parts of a run, built in one place (:func:`build_parts`, at the trainer's set-up), and the schedule its plan
fixes (:func:`build_schedule`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torchtune import training

from adaptive_batching.batching.lr_scaling import SampleDrivenLR
from adaptive_batching.batching.policy import Verifier
from adaptive_batching.config.inputs import check_inputs
from adaptive_batching.core.method import FinetuneMethod
from adaptive_batching.core.nodes import building, optional_component
from adaptive_batching.core.objective import TrainingObjective
from adaptive_batching.faults import checkpoints as checkpointing
from adaptive_batching.faults.guard import StepGuard
from adaptive_batching.growth.growing import Growth
from adaptive_batching.growth.plan import BatchPlan
from adaptive_batching.runtime.distributed import ParallelInfo
from adaptive_batching.training.components import Components, Data, build_components, build_data
from adaptive_batching.training.feed import Feed
from adaptive_batching.training.hooks import TrainerHooks
from adaptive_batching.training.optimizers import offloading
from adaptive_batching.training.state import Checkpoints, Progress, check_resumable_on
from adaptive_batching.training.stepping import StepRunner


@dataclass
class Parts:
    """What :meth:`Trainer.setup` builds, in one place: the data, the torchtune components (model, optimizer,
    loss, collate), the step runner and the checkpoints; ``base_lrs``: the optimizer's LRs as configured."""

    data: Data
    components: Components
    runner: StepRunner
    checkpoints: Checkpoints
    base_lrs: list[float]

    @property
    def model(self) -> Any:
        return self.components.model

    @property
    def optimizer(self) -> Any:
        return self.components.optimizer

    @property
    def collate(self) -> Callable:
        return self.components.collate


@dataclass
class Schedule:
    """What :meth:`Trainer.make_plan` fixes from the profile: every epoch's batch, the sample-driven LR schedule
    and the growth that follows the plan."""

    plan: BatchPlan
    lr: SampleDrivenLR
    growth: Growth


def build_parts(
    cfg: DictConfig,
    method: FinetuneMethod,
    objective: TrainingObjective,
    hooks: TrainerHooks,
    *,
    resume: tuple[bool, str | None],
    elastic: bool,
    guard: StepGuard,
    parallel: ParallelInfo,
    device: torch.device,
    oom_recovery: bool,
    where: Callable[[], tuple[int, int | None, str]],
) -> tuple[Parts, dict[str, Any]]:
    """Every part of a run, and the checkpoint its weights came from (a resumed run restores the rest from it).

    The data comes first, so a wrong path fails before any weights load; then the checkpoint (``resume``: whether
    to resume, and the job whose checkpoints a torchrun restart may take), the components (the collate as
    ``hooks`` wrap it), the step guard on the model, the step runner and the checkpoints."""
    check_inputs(cfg, objective.name, resume=resume[0])  # files, data columns, weights: one line, before any build
    data = build_data(cfg)
    with building("checkpointer"):
        checkpointer, checkpoint = checkpointing.load_checkpoint(cfg.checkpointer, *resume)
    if resume[0]:
        check_resumable_on(checkpoint, parallel.world_size, elastic=elastic)
    dtype = training.get_dtype(cfg.get("dtype", "fp32"), device=device)
    components = build_components(
        cfg,
        method,
        objective,
        checkpoint,
        data,
        device=device,
        dtype=dtype,
        parallel=parallel,
        is_rank_zero=parallel.is_rank_zero,
    )
    components.collate = hooks.collate(components.collate)
    model, optimizer = components.model, components.optimizer
    guard.install(model)
    checkpoints = Checkpoints(
        checkpointer,
        method,
        parallel,
        device,
        total_epochs=cfg.epochs,
        max_steps_per_epoch=cfg.get("max_steps_per_epoch", None),
    )
    runner = StepRunner(
        model,
        optimizer,
        components.loss_fn,
        guard,
        parallel,
        device,
        clip_grad_norm=cfg.get("clip_grad_norm", None),
        oom_recovery=oom_recovery,
        where=where,
        activations=offloading(model, cfg.get("enable_activation_offloading", None)),
        objective=objective,
        hooks=hooks,
    )
    return Parts(data, components, runner, checkpoints, [group["lr"] for group in optimizer.param_groups]), checkpoint


def build_schedule(
    cfg: DictConfig,
    parts: Parts,
    plan: BatchPlan,
    feed: Feed,
    progress: Progress,
    *,
    saved_lr: dict[str, Any] | None,
    total_steps: int,
    reference_global_batch: int,
    rule: str,
    verify: Verifier,
) -> Schedule:
    """The schedule of ``plan`` (made): the config's LR schedule over ``total_steps`` reference steps, scaled by
    ``rule`` for each step's global batch (``saved_lr``: a resumed run's state), which ``feed`` sets at each step;
    and growth, which ``verify`` checks a larger batch with."""
    lr = SampleDrivenLR.from_config(
        optional_component(cfg.get("lr_scheduler", None)),
        parts.optimizer,
        parts.base_lrs,
        total_steps=total_steps,
        reference_global_batch=reference_global_batch,
        rule=rule,
        state=saved_lr,
    )
    feed.follow(lr)
    return Schedule(plan, lr, Growth(plan, feed, lr, parts.runner.noise, progress, verify=verify))
