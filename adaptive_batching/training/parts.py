"""Set-up: every part of a run, built once, in the order set-up needs them (:func:`build_parts`).

The data comes first, so a wrong path fails before any weights load; then the checkpoint, the model and what
trains it, the step runner, where the run stands, the batches and the profiler. A resumed run's parts take their
saved state as each is built (:class:`~adaptive_batching.training.state.SavedState`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torchtune import config, training
from torchtune.modules import TransformerDecoder

from adaptive_batching.batching import worst_case
from adaptive_batching.batching.policy import DataContext, SampleBatching, batching_for
from adaptive_batching.batching.shape import BatchShape
from adaptive_batching.config.inputs import check_inputs, length_source, profiled_setup
from adaptive_batching.config.loading import given_argv
from adaptive_batching.config.settings import AdaptiveSettings
from adaptive_batching.core.defaults import DEFAULT_DEVICE, DEFAULT_DTYPE
from adaptive_batching.core.method import FinetuneMethod
from adaptive_batching.core.nodes import building
from adaptive_batching.core.objective import TrainingObjective
from adaptive_batching.core.steps import StepMemory
from adaptive_batching.errors import Preempted
from adaptive_batching.faults import checkpoints as checkpointing
from adaptive_batching.faults import restart
from adaptive_batching.faults.guard import StepGuard
from adaptive_batching.faults.preemption import Preemption
from adaptive_batching.faults.recovery import OomRecovery
from adaptive_batching.growth.plan import BatchPlan, reference_batch
from adaptive_batching.profiling.max_micro_batch import preserved_training_state
from adaptive_batching.profiling.profiler import ProfilerContext, StartupProfiler
from adaptive_batching.runtime import memory
from adaptive_batching.runtime.distributed import ParallelInfo, shutdown
from adaptive_batching.runtime.launch import start_process
from adaptive_batching.training.components import Data, build_components, build_data
from adaptive_batching.training.feed import Feed
from adaptive_batching.training.hooks import TrainerHooks, installed
from adaptive_batching.training.model import decoder_of, text_vocab_size
from adaptive_batching.training.optimizers import offloading
from adaptive_batching.training.state import Progress, SavedState, check_resumable_on, resume_training
from adaptive_batching.training.stepping import StepRunner


@dataclass(frozen=True)
class Parts:
    """Every part of a run (see the module docstring); each owns its state, and none is replaced."""

    device: torch.device
    parallel: ParallelInfo
    seed: int
    output_dir: Path
    hooks: TrainerHooks
    method: FinetuneMethod
    data: Data
    model: TransformerDecoder
    optimizer: torch.optim.Optimizer
    loss_fn: Any
    collate: Callable
    runner: StepRunner
    base_lrs: list[float]
    """The optimizer's LRs as configured (the LR schedule scales them)."""
    checkpointer: Any
    """torchtune's checkpointer, which wrote the weights the model loaded and writes the run's checkpoints."""
    saved: SavedState
    progress: Progress
    guard: StepGuard
    batching: SampleBatching
    reference: BatchShape
    """The batch as the config writes it: the reference for LR scaling (the plan may change it: an elastic one)."""
    feed: Feed
    plan: BatchPlan
    preemption: Preemption
    profiler: StartupProfiler

    @property
    def is_rank_zero(self) -> bool:
        return self.parallel.is_rank_zero

    @property
    def seq_len(self) -> int:
        """Tokens in the data's worst-case sample or pack (measured when the run profiles)."""
        assert self.batching.worst is not None, "the worst case is measured only for a run that profiles"
        return self.batching.worst.tokens

    def trial_step(self, micro_batch: int, seq_len: int | None = None) -> StepMemory:
        """One measured worst-case training step (the profiler's trial step, and growth's check of a batch)."""
        self.hooks.before_trial(micro_batch)
        return self.runner.trial_step(
            micro_batch,
            seq_len=seq_len or self.seq_len,
            accumulation=self.feed.batch.accumulation,
            collate=self.collate,
            vocab_size=text_vocab_size(self.model),
            packed=self.data.packed,
            images=self.batching.worst.images if self.batching.worst is not None else 0,
        )

    def __enter__(self) -> Parts:
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        self.close(together=kind is None or issubclass(kind, Preempted))

    def close(self, *, together: bool, broken: bool = False) -> None:
        """End the run's hold on the process: drop the last loss (its autograd nodes hold FSDP's groups), stop
        handling stop signals and leave the process group, unless a rank broke it (``broken``). ``together``: every
        rank leaves here (a finished run, an agreed stop), so none tears the group down while another still uses it
        or has a line to say."""
        self.runner.last_loss = None
        close_process(self.parallel, self.preemption, together=together, broken=broken)

    @contextmanager
    def verifying(self) -> Iterator[Callable[[int, int], StepMemory]]:
        """Trial steps at given samples and lengths, the training state restored afterwards."""
        with preserved_training_state(self.model, self.optimizer):
            yield lambda samples, seq_len: self.trial_step(samples, seq_len=seq_len)


def close_process(parallel: ParallelInfo, preemption: Preemption, *, together: bool, broken: bool = False) -> None:
    """Stop handling stop signals and leave the process group (see :meth:`Parts.close`)."""
    preemption.uninstall()
    if not broken:
        shutdown(parallel, together=together)


def set_up(
    cfg: DictConfig,
    settings: AdaptiveSettings,
    method: FinetuneMethod,
    objective: TrainingObjective,
    hooks: TrainerHooks | None = None,
) -> Parts:
    """Start the process (:func:`~adaptive_batching.runtime.launch.start_process`), handle stop signals from then on,
    and build every part (``hooks``: those :func:`~adaptive_batching.training.hooks.install` set, if not given).
    A failure leaves the process as it found it, the process group left."""
    hooks = hooks or installed()
    device, parallel = start_process(
        cfg.get("device", DEFAULT_DEVICE), profiles=settings.needs_profile, argv=given_argv()
    )
    output_dir = Path(cfg.checkpointer.output_dir)
    # A torchrun restart resumes by itself, and only its own job's checkpoints (``resume_job``).
    resume = restart.resume_decision(cfg.get("resume_from_checkpoint", False), output_dir)
    preemption = Preemption(
        settings.faults.stop_signals, parallel, device, output_dir=None if resume[0] else output_dir
    )
    preemption.install()  # from here on a stop signal stops the run where it can (see faults.preemption)
    try:
        return build_parts(
            cfg,
            settings,
            method,
            objective,
            hooks,
            device=device,
            parallel=parallel,
            preemption=preemption,
            resume=resume,
        )
    except BaseException as error:
        close_process(parallel, preemption, together=isinstance(error, Preempted))
        raise


def build_parts(
    cfg: DictConfig,
    settings: AdaptiveSettings,
    method: FinetuneMethod,
    objective: TrainingObjective,
    hooks: TrainerHooks,
    *,
    device: torch.device,
    parallel: ParallelInfo,
    preemption: Preemption,
    resume: tuple[bool, str | None],
) -> Parts:
    """Every part of a run (see the module docstring). ``resume``: whether to resume, and the job whose checkpoints
    a torchrun restart may take; ``preemption`` stops the run at the end of set-up if a stop signal came."""
    hooks.before_setup(preemption)
    seed = training.set_seed(cfg.get("seed", None), debug_mode=cfg.get("cudnn_deterministic_mode", None))
    check_inputs(cfg, objective, resume=resume[0])  # files, data columns, weights: one line, before any build
    with building("metric_logger"):  # built when training starts (``profile`` and ``plan`` log nothing)
        config._utils._get_component_from_path(cfg.metric_logger._component_)
    data = build_data(cfg)
    with building("checkpointer"):
        checkpointer, checkpoint = checkpointing.load_checkpoint(cfg.checkpointer, *resume)
    saved = SavedState(checkpoint[checkpointing.ADAPTIVE_KEY] if resume[0] else None)
    if resume[0]:
        check_resumable_on(checkpoint, parallel.world_size, elastic=settings.elastic is not None)
    components = build_components(
        cfg,
        method,
        objective,
        checkpoint,
        data,
        device=device,
        dtype=training.get_dtype(cfg.get("dtype", DEFAULT_DTYPE), device=device),
        parallel=parallel,
        is_rank_zero=parallel.is_rank_zero,
    )
    collate = hooks.collate(components.collate)
    model, optimizer = components.model, components.optimizer
    base_lrs = [group["lr"] for group in optimizer.param_groups]  # as configured: before a resume loads its state
    guard = StepGuard(parallel, device)
    guard.install(model)
    progress = Progress()
    output_dir = Path(cfg.checkpointer.output_dir)
    runner = StepRunner(
        model,
        optimizer,
        components.loss_fn,
        guard,
        parallel,
        device,
        clip_grad_norm=cfg.get("clip_grad_norm", None),
        oom_recovery=settings.faults.oom_recovery,
        where=lambda: (progress.global_step + 1, progress.saved_step, str(output_dir)),
        activations=offloading(model, cfg.get("enable_activation_offloading", None)),
        objective=objective,
        method=method,
        hooks=hooks,
    )
    reference = reference_batch(
        cfg.batch_size, cfg.get("gradient_accumulation_steps", 1), settings.elastic, parallel.world_size
    )
    batching, faults = batching_for(settings.batching), settings.faults
    feed = Feed(
        batching,
        OomRecovery(batching.cuts(), faults.oom_grow_back_after),
        guard,
        faults.guard_steps,
        reference,
        step_in_epoch=lambda: progress.step_in_epoch,
        elastic=settings.elastic is not None,
    )
    plan = BatchPlan(settings.growth, cfg.epochs, parallel.world_size, epochs_run=lambda: progress.epochs_run)
    for key, part in (("progress", progress), ("feed", feed), ("plan", plan), ("noise_scale", runner.noise)):
        saved.restore(key, part)
    if resume[0]:
        seed = resume_training(
            checkpoint,
            seed=seed,
            feed=feed,
            progress=progress,
            model=model,
            optimizer=optimizer,
            parallel=parallel,
            device=device,
            output_dir=output_dir,
        )
    batching.prepare(
        DataContext(
            data.dataset,
            collate,
            parallel,
            shuffle=cfg.get("shuffle", True),
            seed=seed,
            max_steps=cfg.get("max_steps_per_epoch", None),
            packed=data.packed,
            sequences_per_sample=objective.sequences_per_sample,
        ),
        length_source(cfg, settings.profiler.cache_dir),
        profiles=settings.needs_profile,
    )
    worst_case.check_fits(batching.worst, decoder_of(model).max_seq_len)
    profiler = StartupProfiler(
        ProfilerContext(
            setup=profiled_setup(cfg),
            settings=settings.profiler,
            device=device,
            parallel=parallel,
            seq_len=batching.worst.tokens if batching.worst is not None else 0,
            seq_len_source=batching.worst.source if batching.worst is not None else "",
            samples_per_rank=len(data.dataset) // parallel.world_size,
            preserved=lambda: preserved_training_state(model, optimizer),
            live_bytes=lambda: memory.current_bytes(device, *runner.tracked),
            before_trial=preemption.between_trials,
        ),
        parallel.world_size,
    )
    saved.restore("profile", profiler)
    preemption.before_training("during set-up (data, model, token counts)")
    parts = Parts(
        device=device,
        parallel=parallel,
        seed=seed,
        output_dir=output_dir,
        hooks=hooks,
        method=method,
        data=data,
        model=model,
        optimizer=optimizer,
        loss_fn=components.loss_fn,
        collate=collate,
        runner=runner,
        base_lrs=base_lrs,
        checkpointer=checkpointer,
        saved=saved,
        progress=progress,
        guard=guard,
        batching=batching,
        reference=reference,
        feed=feed,
        plan=plan,
        preemption=preemption,
        profiler=profiler,
    )
    hooks.after_setup(parts)
    return parts
