"""The training machinery both recipes share: set-up, the step loop, metrics and checkpoints.

What differs between full and LoRA fine-tuning is a :class:`~adaptive_batching.training.model.FinetuneMethod`
given by the recipe; how big a batch is comes from :class:`~adaptive_batching.batching.shape.BatchShape`.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from omegaconf import DictConfig
from torchtune import config, training, utils
from tqdm import tqdm

from adaptive_batching.batching.elastic import shape_at
from adaptive_batching.batching.plan import BatchPlan, starting_batch
from adaptive_batching.batching.policy import DataContext, batching_for
from adaptive_batching.batching.schedule import describe_plan
from adaptive_batching.batching.shape import BatchShape
from adaptive_batching.config.loading import given_argv, optional_component
from adaptive_batching.config.settings import AdaptiveSettings
from adaptive_batching.errors import ConfigError, UnguardedOutOfMemory
from adaptive_batching.faults import checkpoints as checkpointing
from adaptive_batching.faults import restart
from adaptive_batching.faults.guard import StepGuard
from adaptive_batching.faults.recovery import OomRecovery
from adaptive_batching.growth.interval import Segment
from adaptive_batching.growth.lr_scaling import SampleDrivenLR, reference_steps
from adaptive_batching.profiling.profiler import ProfileResult, StepMemory, preserved_training_state
from adaptive_batching.profiling.run import ProfileContext, run_profile, saved_profile
from adaptive_batching.runtime import memory
from adaptive_batching.runtime.distributed import init_parallel, shutdown
from adaptive_batching.training.components import build_components
from adaptive_batching.training.growing import Growing
from adaptive_batching.training.model import FinetuneMethod
from adaptive_batching.training.oom_handling import OomHandling
from adaptive_batching.training.state import RunState
from adaptive_batching.training.stepping import StepRunner, StepStats, step_metrics

log = utils.get_logger("INFO")


class Trainer(Growing, OomHandling, RunState):
    """Fine-tunes a torchtune model; one instance per run."""

    def __init__(self, cfg: DictConfig, settings: AdaptiveSettings, method: FinetuneMethod) -> None:
        self.cfg = cfg
        self.settings = settings
        self.method = method
        if cfg.get("device", "cpu") == "cpu" and self.needs_profile:
            # Before any rank joins the process group: a restart replaces this process.
            memory.restart_with_glibc_pinned(given_argv(), self.info)
        self.device, self.parallel = init_parallel(cfg.get("device", "cpu"))
        self.dtype = training.get_dtype(cfg.get("dtype", "fp32"), device=self.device)
        self.seed = training.set_seed(cfg.get("seed", None), debug_mode=cfg.get("cudnn_deterministic_mode", None))
        # The batch as written in the config: the reference for LR scaling and the LR schedule.
        self.reference = BatchShape(
            micro_batch=cfg.batch_size,
            accumulation=cfg.get("gradient_accumulation_steps", 1),
            ranks=self.parallel.world_size,
        )
        self.elastic = settings.knobs["elastic"]
        if self.elastic is not None:
            # The elastic global batch replaces batch_size x accumulation; checked here, before any model loads.
            try:
                self.elastic_choice, self.reference = shape_at(self.elastic, self.parallel.world_size)
            except ValueError as error:
                raise ConfigError(f"config key 'adaptive_batching.elastic': {error}") from None
        self.batch = self.reference
        self.batching = batching_for(settings.knobs)
        self.total_epochs: int = cfg.epochs
        self.max_steps_per_epoch: Optional[int] = cfg.get("max_steps_per_epoch", None)
        self.save_every_n_steps: Optional[int] = cfg.get("save_every_n_steps", None)
        self.clip_grad_norm: Optional[float] = cfg.get("clip_grad_norm", None)
        self.log_every_n_steps: int = cfg.get("log_every_n_steps", 1)
        self.resume: bool = cfg.get("resume_from_checkpoint", False)
        self.resume_job: Optional[str] = None  # a torchrun restart resumes only its own job's checkpoints
        if not self.resume:
            self.resume, why = restart.resume_after_restart(Path(cfg.checkpointer.output_dir))
            self.resume_job = restart.job_id() if self.resume else None
            if why:
                self.info(why)
        self.guard_steps: int = settings.knobs["guard_steps"]
        self.process_group_broken = False
        self._served: Optional[tuple[int, int, int]] = None  # (micro batch, split, token budget) last served
        self.epochs_run = self.step_in_epoch = self.global_step = 0
        self.metric_logger: Any = None
        self.profile_result: Optional[ProfileResult] = None
        self.plan = BatchPlan(settings, self.total_epochs, self.parallel.world_size)
        self.segment = Segment()  # the part of the current epoch the current sampler serves
        self.resumed: dict[str, Any] = {}
        # After an OOM in training: the most samples one forward may see, and each micro batch's pieces.
        self.oom_recovery: bool = settings.knobs["oom_recovery"]
        self.recovery = OomRecovery(self.batching.cuts(), settings.knobs["oom_grow_back_after"])
        self.saved_step: Optional[int] = None
        self.guard = StepGuard(self.parallel, self.device)

    @property
    def is_rank_zero(self) -> bool:
        return self.parallel.is_rank_zero

    def info(self, message: str) -> None:
        utils.log_rank_zero(log, message)

    def warn(self, message: str) -> None:
        if self.is_rank_zero:
            log.warning(message)

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        """Load the checkpoint and build model, tokenizer, optimizer, loss and dataset."""
        cfg = self.cfg
        if self.device.type == "cpu" and self.needs_profile:
            self._pin_glibc()
        if self.is_rank_zero:
            self.metric_logger = config.instantiate(cfg.metric_logger)
            self.metric_logger.log_config(cfg)
        self.checkpointer, checkpoint = checkpointing.load_checkpoint(cfg.checkpointer, self.resume, self.resume_job)
        parts = build_components(cfg, self.method, checkpoint, device=self.device, dtype=self.dtype,
                                 parallel=self.parallel, is_rank_zero=self.is_rank_zero)
        self.model, self.tokenizer, self.optimizer, self.loss_fn = parts.model, parts.tokenizer, parts.optimizer, \
            parts.loss_fn
        self.dataset, self.packed, self.collate = parts.dataset, parts.packed, parts.collate
        self.guard.install(self.model)
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        if self.resume:
            self._restore(checkpoint)
        self.steps = StepRunner(self.model, self.optimizer, self.loss_fn, self.guard, self.parallel, self.device,
                                clip_grad_norm=self.clip_grad_norm, oom_recovery=self.oom_recovery, info=self.info,
                                where=lambda: (self.global_step + 1, self.saved_step, cfg.checkpointer.output_dir))
        if self.resumed.get("noise_scale"):
            self.steps.noise.load_state_dict(self.resumed["noise_scale"])
        self.batching.prepare(DataContext(self.dataset, self.collate, self.parallel, shuffle=cfg.get("shuffle", True),
                                          seed=self.seed, max_steps=self.max_steps_per_epoch), cfg, self.info)
        memory.freeze_long_lived_objects()

    # ------------------------------------------------------------------ profiling
    def _pin_glibc(self) -> None:
        """Before set-up, so the heap it leaves behind is already under the rule the profile runs by."""
        if memory.pinned_from_start(os.environ):
            self.info("Profiler: glibc pinned from process start by GLIBC_TUNABLES "
                      f"({os.environ['GLIBC_TUNABLES']}), so the address space follows the tensors")
        elif memory.pin_cpu_allocator():
            self.info("Profiler: glibc set to return freed tensors' memory at once and to use one arena, "
                      "so the address space follows the tensors and the chosen micro batch keeps fitting")

    @property
    def needs_profile(self) -> bool:
        """The profile gives the starting micro batch (``use_maximum_batch_size``) and the cap on growth."""
        return self.settings.use_maximum_batch_size or self.settings.batch_increase_function is not None

    def profile(self) -> Optional[ProfileResult]:
        """Find the largest micro batch that fits (see profiler), or take it from the resumed checkpoint."""
        if not self.needs_profile:
            return None
        self.profile_result = saved_profile(self.resumed, self.parallel.world_size, self.info) \
            or run_profile(self.profile_context(), self.trial_step)
        return self.profile_result

    def profile_context(self) -> ProfileContext:
        """All the profiler sees of this run, besides :meth:`trial_step`."""
        return ProfileContext(
            cfg=self.cfg, knobs=self.settings.knobs, device=self.device, parallel=self.parallel,
            seq_len=self.seq_len, samples_per_rank=len(self.dataset) // self.parallel.world_size,
            preserved=lambda: preserved_training_state(self.model, self.optimizer),
            live_bytes=lambda: memory.current_bytes(self.device, self.model, self.optimizer), info=self.info)

    @property
    def seq_len(self) -> int:
        """Tokens in a worst-case sample or pack: the longest sample with a token budget, else the maximum."""
        return self.batching.worst_case_seq_len(int(self.cfg.tokenizer.get("max_seq_len", None)
                                                    or self.model.max_seq_len))

    def trial_step(self, micro_batch: int, seq_len: Optional[int] = None) -> StepMemory:
        """One measured worst-case training step (the profiler's trial step)."""
        return self.steps.trial_step(micro_batch, seq_len=seq_len or self.seq_len, accumulation=self.batch.accumulation,
                                     collate=self.collate, vocab_size=self.tokenizer.vocab_size, packed=self.packed)

    # ------------------------------------------------------------------ planning
    def make_plan(self) -> BatchPlan:
        """Fix every epoch's batch (growth function, memory cap) and the sample-driven LR schedule; log both."""
        profile = self.profile_result
        start = starting_batch(self.settings, self.reference, self.parallel.world_size,
                               profile.micro_batch if profile is not None else None, self.info)
        self.reference = start.reference
        self.plan.make(start=start.micro_batch, accumulation=start.accumulation, memory_cap=start.memory_cap,
                       resumed=self.resumed, epochs_run=self.epochs_run)
        self.segment = Segment.from_state(self.resumed.get("segment"))
        profiled = start.micro_batch if profile is not None and self.settings.use_maximum_batch_size else None
        self.batching.plan(self.plan.entries, start=start.micro_batch, resumed=self.resumed, profiled=profiled,
                           verify=self._verifying, info=self.info)
        self.batching.check(profiled=self.settings.use_maximum_batch_size and self.elastic is None,
                            reference_global_batch=self.reference.global_batch, rule=self.settings.lr_scaling,
                            warn=self.warn)
        extents = [self.batching.extent(epoch) for epoch in range(self.total_epochs)]
        total_steps = reference_steps(sum(samples for _, samples in extents), self.reference.global_batch)
        self.lr = SampleDrivenLR.from_config(optional_component(self.cfg.get("lr_scheduler", None)), self.optimizer, self.base_lrs,
                                             total_steps=total_steps, reference_global_batch=self.reference.global_batch,
                                             rule=self.settings.lr_scaling, state=self.resumed.get("lr"))
        header, *rows = describe_plan(self.plan.entries)
        rows = self.batching.plan_rows(rows, extents, self.reference.global_batch, self.lr.rule)
        grows = f"; the batch grows {self.plan.interval.describe()}, so the rows show where it starts" \
            if self.plan.grows_inside_epochs else ""
        self.info(
            "Batch plan (micro batch = samples per forward per rank; global batch = micro x accumulation x ranks; "
            f"reference global batch {self.reference.global_batch} from the config; LR scaling '{self.lr.rule}'; "
            f"LR schedule over {total_steps} reference steps{grows}):\n"
            + "\n".join([header, *rows])
        )
        return self.plan

    @contextmanager
    def _verifying(self) -> Iterator[Callable[[int, int], StepMemory]]:
        """Trial steps at given samples and lengths, the training state restored afterwards."""
        with preserved_training_state(self.model, self.optimizer):
            yield lambda samples, seq_len: self.trial_step(samples, seq_len=seq_len)

    # ------------------------------------------------------------------ training
    def train(self, plan: BatchPlan) -> None:
        """Train the remaining epochs at ``plan``'s batches (it grows as it says), saving a checkpoint at the
        end of each epoch and every ``save_every_n_steps``."""
        self.plan = plan
        memory.release_memory(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        last: Optional[StepStats] = None
        first = self.epochs_run
        for epoch in range(first, self.total_epochs):
            self.start_epoch(epoch, switch=epoch > first)
            last = self.train_epoch(epoch) or last
            self.epochs_run, self.step_in_epoch, self.segment = epoch + 1, 0, Segment()
            self.save(epoch)
        if last is not None:
            log.info(f"Rank {self.parallel.rank}: finished at optimizer step {self.global_step}, "
                     f"{self.batching.final_batch(self.epochs_run, self.split, self.micro_piece)}, "
                     f"last loss {last.loss:.6f}")

    def start_epoch(self, epoch: int, switch: bool) -> None:
        """Serve this epoch's planned batch from the same dataset (a new sampler) and rescale the LR."""
        start = time.perf_counter()
        if switch:
            self.grow_from_statistics(epoch)
        entry, previous, lr_before = self.plan.entries[epoch], self.batch, self.lr.lrs()[0]
        self.batch = entry.shape
        self.recovery.plan(self.batch.micro_batch)
        if switch:
            self.segment = Segment()
        self.serve(epoch, start_step=self.step_in_epoch, state=self.resumed.get("dataloader"))
        self.set_step_lr(self.step_in_epoch)
        took_ms = (time.perf_counter() - start) * 1e3
        what = self.batching.describe_epoch(epoch, self.batch, self.dataloader.batch_sampler, self.split_note())
        if not switch:
            self.info(f"Epoch {epoch + 1}/{self.total_epochs}: {what}, "
                      f"LR {self.lr.lrs()[0]:.3e} (x{self.lr.factor:.3f} for the global batch)")
            return
        change = self.batching.describe_change(epoch, previous, self.batch)
        self.info(
            f"Epoch switch {epoch} -> {epoch + 1}: {change}, LR {lr_before:.3e} -> {self.lr.lrs()[0]:.3e} "
            f"({self.plan.switch_reason(epoch)}){self.split_note()} (took {took_ms:.1f} ms)"
        )

    def set_step_lr(self, index: int) -> None:
        """The LR of step ``index``: for the planned global batch, or for the samples this step holds."""
        global_batch = self.batching.lr_global_batch(self.batch, self.dataloader.batch_sampler,
                                                     self.segment.local(index))
        if global_batch is not None:
            self.lr.set_global_batch(global_batch)

    def serve(self, epoch: int, start_step: int, state: Optional[dict[str, Any]] = None) -> None:
        """Serve ``epoch`` from ``start_step`` on, each micro batch cut into ``self.split`` pieces.

        ``state`` (a saved dataloader state) is checked against the new loader, so a resume with another
        dataset, seed or ranks fails instead of silently training on other samples. An elastic run resumed
        on another number of ranks has the same global batch, so the same samples per step: it starts at
        ``start_step`` instead.
        """
        if state and self.elastic is not None and self.resumed.get("ranks") != self.parallel.world_size:
            self.info(f"Resuming on {self.parallel.world_size} rank(s) instead of {self.resumed['ranks']}: "
                      f"the same global batch {self.reference.global_batch}, as {self.reference.describe()}")
            state = None
        self.dataloader = self.batching.loader(epoch, self.split, 0 if state else self.segment.local(start_step),
                                               self.segment)
        served = (self.batch.micro_batch, self.split, self.batching.served(epoch))
        if served != self._served:
            self._served = served
            self.guard.open_window(self.guard_steps)
        if start_step and state:
            self.dataloader.load_state_dict(state)
        self.resumed.pop("dataloader", None)
        self.batches = iter(self.dataloader)

    def train_epoch(self, epoch: int) -> Optional[StepStats]:
        """Train one epoch (from ``step_in_epoch`` when resumed inside it); return the last step's statistics."""
        self.model.train()
        progress = tqdm(total=self.epoch_steps, initial=self.step_in_epoch, disable=not self.is_rank_zero,
                        desc=f"epoch {epoch + 1}/{self.total_epochs}")
        stats = None
        while self.step_in_epoch < self.epoch_steps:
            index = self.step_in_epoch
            layout = self.dataloader.batch_sampler.step_layout()
            try:
                step_stats = self.train_step([next(self.batches) for _ in range(layout[self.segment.local(index)])])
            except UnguardedOutOfMemory as error:
                self.stop_for_restart(epoch, index, str(error))
            if step_stats is None:
                self.after_out_of_memory(epoch, index)
                continue
            self.guard.step_done()
            stats = step_stats
            stats.samples = self.dataloader.batch_sampler.samples_in_step(self.segment.local(index))
            self.lr.advance(stats.samples)
            self.set_step_lr(index + 1)
            self.global_step += 1
            self.step_in_epoch = index + 1
            progress.update(1)
            progress.set_postfix_str(f"global batch {stats.samples} lr {self.current_lr():.2e} loss {stats.loss:.4f}")
            if self.global_step % self.log_every_n_steps == 0:
                self.log_step(stats)
            period = self.plan.period_after_step(self.global_step, self.lr.consumed_samples, stats.samples)
            if period is not None:
                self.grow_inside_epoch(epoch, period)
                progress.total = self.epoch_steps
            if self.save_every_n_steps and self.global_step % self.save_every_n_steps == 0 \
                    and self.step_in_epoch < self.epoch_steps:
                self.save(epoch)
            self.maybe_grow_back(epoch)
        progress.close()
        return stats

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> Optional[StepStats]:
        """One optimizer step (see :meth:`StepRunner.train_step`); None after an OOM recovered in place."""
        stats = self.steps.train_step(micro_batches)
        if stats is not None:
            self.recovery.step_done()
        return stats

    def current_lr(self) -> float:
        return training.get_lr(self.optimizer)

    def log_step(self, stats: StepStats) -> None:
        if not self.is_rank_zero:
            return
        metrics = step_metrics(stats, lr=self.current_lr(), accumulation=self.batch.accumulation * self.split,
                               ranks=self.parallel.world_size, device=self.device,
                               batching=self.batching.metrics(self.epochs_run, self.split, self.micro_piece))
        self.metric_logger.log_dict(metrics, step=self.global_step)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the metric logger and leave the process group (unless a rank broke it); runs after any error."""
        if self.metric_logger is not None:
            self.metric_logger.close()
        if not self.process_group_broken:
            shutdown(self.parallel)
