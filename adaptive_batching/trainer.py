"""The training machinery both recipes share: set-up, the step loop, metrics and checkpoints.

What differs between full and LoRA fine-tuning is a :class:`~adaptive_batching.model.FinetuneMethod`
given by the recipe; how big a batch is comes from :class:`~adaptive_batching.batch.BatchShape`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from omegaconf import DictConfig
from torchtune import config, training, utils
from tqdm import tqdm

from adaptive_batching import checkpointing, memory, restart
from adaptive_batching.batch import BatchShape, shape_keeping_global_batch
from adaptive_batching.batching import DataContext, batching_for
from adaptive_batching.config import optional_component
from adaptive_batching.data import DEFAULT_COLLATE, build_collate, build_dataset
from adaptive_batching.distributed import barrier, init_parallel, shutdown
from adaptive_batching.elastic import shape_at
from adaptive_batching.errors import ConfigError
from adaptive_batching.growth_interval import Segment, parse_growth_interval
from adaptive_batching.growth_stats import accepts_stats, call_increase
from adaptive_batching.lr_scaling import SampleDrivenLR, reference_steps
from adaptive_batching.model import (
    FinetuneMethod,
    ModelOptions,
    build_model,
    full_optimizer_state_dict,
    full_state_dict,
    load_optimizer_state_dict,
)
from adaptive_batching.oom import is_out_of_memory
from adaptive_batching.oom_recovery import OutOfMemoryStop, StepGuard, piece_size
from adaptive_batching.profile_run import remember_out_of_memory, run_profile
from adaptive_batching.profiler import ProfileResult, StepMemory, preserved_training_state
from adaptive_batching.recovery import OomRecovery
from adaptive_batching.schedule import (
    EpochBatch,
    checked_increment,
    describe_plan,
    epoch_switch_reason,
    grow_entry,
    plan_batches,
    seen_size,
)
from adaptive_batching.settings import AdaptiveSettings
from adaptive_batching.stepping import StepRunner, StepStats, UnguardedOutOfMemory

log = utils.get_logger("INFO")


class Trainer:
    """Fine-tunes a torchtune model; one instance per run."""

    def __init__(self, cfg: DictConfig, settings: AdaptiveSettings, method: FinetuneMethod) -> None:
        self.cfg = cfg
        self.settings = settings
        self.method = method
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
        self.epochs_run = 0
        self.step_in_epoch = 0
        self.global_step = 0
        self.metric_logger: Any = None
        self.profile_result: Optional[ProfileResult] = None
        self.epoch_plan: list[EpochBatch] = []
        self.measured_increments: dict[int, int] = {}  # epoch -> what a statistics-reading growth function returned
        self.growth_interval = parse_growth_interval(settings.knobs["growth_interval"])
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
        if self.device.type == "cpu" and self.needs_profile and memory.pin_cpu_allocator():
            # Before set-up, so the heap it leaves behind is already under the rule the profile runs by.
            self.info("Profiler: glibc set to return freed tensors' memory at once and to use one arena, "
                      "so the address space follows the tensors and the chosen micro batch keeps fitting")
        if self.is_rank_zero:
            self.metric_logger = config.instantiate(cfg.metric_logger)
            self.metric_logger.log_config(cfg)
        self.checkpointer, checkpoint = checkpointing.load_checkpoint(cfg.checkpointer, self.resume, self.resume_job)
        self.model = build_model(
            cfg.model, self.method, checkpoint,
            device=self.device, dtype=self.dtype, parallel=self.parallel,
            options=ModelOptions(
                activation_checkpointing=cfg.get("enable_activation_checkpointing", False),
                compile=cfg.get("compile", False),
                custom_sharded_layers=cfg.get("custom_sharded_layers", None),
                reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True),
                fsdp_cpu_offload=cfg.get("fsdp_cpu_offload", False),
            ),
            is_rank_zero=self.is_rank_zero,
        )
        self.guard.install(self.model)
        self.tokenizer = config.instantiate(cfg.tokenizer)
        self.optimizer = config.instantiate(
            cfg.optimizer, [p for p in self.model.parameters() if p.requires_grad]
        )
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        if self.resume:
            self._restore(checkpoint)
        self.loss_fn = config.instantiate(cfg.loss)
        if cfg.get("compile", False):
            training.compile_loss(self.loss_fn, verbose=self.is_rank_zero)
        if self.loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self.model.set_num_output_chunks(self.loss_fn.num_output_chunks)
        self.steps = StepRunner(self.model, self.optimizer, self.loss_fn, self.guard, self.parallel, self.device,
                                clip_grad_norm=self.clip_grad_norm, oom_recovery=self.oom_recovery, info=self.info,
                                where=lambda: (self.global_step + 1, self.saved_step, cfg.checkpointer.output_dir))
        if self.resumed.get("noise_scale"):
            self.steps.noise.load_state_dict(self.resumed["noise_scale"])

        self.dataset, self.packed = build_dataset(cfg.dataset, self.tokenizer)
        self.collate = build_collate(
            cfg.get("collate_fn", DEFAULT_COLLATE), self.packed, self.tokenizer.pad_id, self.loss_fn.ignore_index
        )
        self.batching.prepare(DataContext(self.dataset, self.collate, self.parallel, shuffle=cfg.get("shuffle", True),
                                          seed=self.seed, max_steps=self.max_steps_per_epoch), cfg, self.info)

    # ------------------------------------------------------------------ profiling
    @property
    def needs_profile(self) -> bool:
        """The profile gives the starting micro batch (``use_maximum_batch_size``) and the cap on growth."""
        return self.settings.use_maximum_batch_size or self.settings.batch_increase_function is not None

    def profile(self) -> Optional[ProfileResult]:
        """Find the largest micro batch that fits (see profiler), or take it from the resumed checkpoint."""
        if not self.needs_profile:
            return None
        saved = self.resumed.get("profile")
        saved_ranks = self.resumed.get("ranks", self.parallel.world_size)
        if saved is not None and saved_ranks != self.parallel.world_size:
            self.info(f"Profiler: the checkpoint's profile was measured on {saved_ranks} rank(s); "
                      f"profiling for {self.parallel.world_size}")
            saved = None
        if saved is not None:
            self.profile_result = ProfileResult.from_dict(saved)
            self.info(f"Profiler: using the profile saved in the checkpoint "
                      f"(micro batch {self.profile_result.micro_batch})")
            return self.profile_result
        self.profile_result = run_profile(self)
        return self.profile_result

    @property
    def seq_len(self) -> int:
        """Tokens in a worst-case sample or pack: the longest sample with a token budget, else the maximum."""
        return self.batching.worst_case_seq_len(int(self.cfg.tokenizer.get("max_seq_len", None)
                                                    or self.model.max_seq_len))

    def samples_per_rank(self) -> int:
        return len(self.dataset) // self.parallel.world_size

    def trial_step(self, micro_batch: int, seq_len: Optional[int] = None) -> StepMemory:
        """One measured worst-case training step (the profiler's trial step)."""
        return self.steps.trial_step(micro_batch, seq_len=seq_len or self.seq_len, accumulation=self.batch.accumulation,
                                     collate=self.collate, vocab_size=self.tokenizer.vocab_size, packed=self.packed)

    # ------------------------------------------------------------------ planning
    def make_plan(self) -> list[EpochBatch]:
        """Fix every epoch's batch (growth function, memory cap) and the sample-driven LR schedule; log both."""
        profile = self.profile_result
        cap = profile.micro_batch if profile is not None else None
        accumulation = self.reference.accumulation
        if self.elastic is not None:
            try:
                self.elastic_choice, self.reference = shape_at(self.elastic, self.parallel.world_size,
                                                               memory_cap=cap)
            except ValueError as error:
                raise ConfigError(f"config key 'adaptive_batching.elastic' with the profiled micro batch "
                                  f"{cap}: {error}") from None
            self.info(f"{self.elastic_choice.describe()}; this run: {self.reference.describe()} "
                      "(batch_size and gradient_accumulation_steps in the config are not used)")
            start, accumulation, cap = self.reference.micro_batch, self.reference.accumulation, None
        elif self.settings.knobs["keep_global_batch"]:
            shape, why = shape_keeping_global_batch(self.reference.global_batch, self.parallel.world_size, cap)
            self.info(f"Keeping the config's global batch {self.reference.global_batch}: {shape.describe()} ({why}); "
                      "LR unchanged")
            start, accumulation, cap = shape.micro_batch, shape.accumulation, None
        else:
            start = cap if cap is not None and self.settings.use_maximum_batch_size else self.reference.micro_batch
        self.measured_increments = {int(k): v for k, v in (self.resumed.get("measured_increments") or {}).items()}
        per_epoch = self.settings.batch_increase_function is not None and self.growth_interval.per_epoch
        self._plan_args = dict(epochs=self.total_epochs, start=start, accumulation=accumulation,
                               ranks=self.parallel.world_size, memory_cap=cap,
                               increase=self._increase if per_epoch else None,
                               grow_past_memory=self.settings.knobs["grow_past_memory"])
        self.epoch_plan = plan_batches(**self._plan_args)
        self.start_global_batch = self.epoch_plan[0].shape.global_batch  # before any growth inside an epoch
        grown = self.resumed.get("grown")
        if grown is not None:  # the batch as grown inside epochs before the checkpoint
            shape = BatchShape(grown["micro_batch"], grown["accumulation"], self.parallel.world_size)
            self._continue_with(EpochBatch(self.epochs_run, grown["requested"], grown["increment"], shape,
                                           grown["reason"], cap), self.epochs_run)
            self.segment = Segment.from_state(self.resumed.get("segment"))
        profiled = start if profile is not None and self.settings.use_maximum_batch_size else None
        self.batching.plan(self.epoch_plan, start=start, resumed=self.resumed, profiled=profiled,
                           verify=self._verifying, info=self.info)
        self.batching.check(profiled=self.settings.use_maximum_batch_size and self.elastic is None,
                            reference_global_batch=self.reference.global_batch, rule=self.settings.lr_scaling,
                            warn=self.warn)
        extents = [self.batching.extent(epoch) for epoch in range(self.total_epochs)]
        total_steps = reference_steps(sum(samples for _, samples in extents), self.reference.global_batch)
        scheduler_cfg = optional_component(self.cfg.get("lr_scheduler", None))
        scheduler = None if scheduler_cfg is None else config.instantiate(
            scheduler_cfg, self.optimizer, num_training_steps=total_steps,
        )
        self.lr = SampleDrivenLR(self.optimizer, self.base_lrs, scheduler,
                                 reference_global_batch=self.reference.global_batch, rule=self.settings.lr_scaling)
        if "lr" in self.resumed:
            self.lr.load_state_dict(self.resumed["lr"])
        header, *rows = describe_plan(self.epoch_plan)
        rows = self.batching.plan_rows(rows, extents, self.reference.global_batch, self.lr.rule)
        grows = "" if per_epoch or self.settings.batch_increase_function is None else \
            f"; the batch grows {self.growth_interval.describe()}, so the rows show where it starts"
        self.info(
            "Batch plan (micro batch = samples per forward per rank; global batch = micro x accumulation x ranks; "
            f"reference global batch {self.reference.global_batch} from the config; LR scaling '{self.lr.rule}'; "
            f"LR schedule over {total_steps} reference steps{grows}):\n"
            + "\n".join([header, *rows])
        )
        return self.epoch_plan

    def _continue_with(self, entry: EpochBatch, epoch: int) -> None:
        """``entry`` is the batch from ``epoch`` on (growth inside epochs); the plan list is changed in place."""
        self.epoch_plan[epoch:] = [EpochBatch(e, entry.requested, entry.increment, entry.shape, entry.reason,
                                              entry.memory_cap) for e in range(epoch, self.total_epochs)]

    @contextmanager
    def _verifying(self) -> Iterator[Callable[[int, int], StepMemory]]:
        """Trial steps at given samples and lengths, the training state restored afterwards."""
        with preserved_training_state(self.model, self.optimizer):
            yield lambda samples, seq_len: self.trial_step(samples, seq_len=seq_len)

    def _restore(self, checkpoint: dict[str, Any]) -> None:
        """Continue from the saved recipe state: the end of an epoch, or a step inside one."""
        if checkpoint.get(training.SEED_KEY, self.seed) != self.seed:
            self.info(f"Using the checkpoint's seed {checkpoint[training.SEED_KEY]} instead of {self.seed}")
            self.seed = checkpoint[training.SEED_KEY]
        self.resumed = dict(checkpoint[checkpointing.ADAPTIVE_KEY])
        if "data_parallel" in self.resumed:  # saved before "ranks" was the one word for it
            self.resumed["ranks"] = self.resumed.pop("data_parallel")
        self.epochs_run = checkpoint[training.EPOCHS_KEY]
        self.global_step = self.resumed["global_step"]
        self.saved_step = self.global_step
        self.step_in_epoch = self.resumed.get("step_in_epoch", 0)
        self.recovery.load_state_dict(self.resumed)
        recorded = restart.recorded_cut(Path(self.cfg.checkpointer.output_dir))
        if recorded is not None and self.recovery.adopt(recorded["recovery"]):
            # The saved loader position was for the old cut; the same samples come from the step index.
            self.resumed.pop("dataloader", None)
            self.info(f"Resuming under the cut recorded after an out-of-memory error at optimizer step "
                      f"{recorded.get('step')}: micro batches run as {self.split} piece(s)"
                      + (f", micro batch capped at {self.oom_cap}" if self.oom_cap is not None else ""))
        load_optimizer_state_dict(self.model, self.optimizer, checkpoint[training.OPT_KEY],
                                  self.parallel, self.device)
        where = f"step {self.step_in_epoch} of epoch {self.epochs_run + 1}" if self.step_in_epoch \
            else f"the end of epoch {self.epochs_run}"
        cap = "" if self.oom_cap is None else f"; micro batch capped at {self.oom_cap} after an earlier OOM"
        self.info(f"Resuming at {where} (optimizer step {self.global_step}){cap}")

    # ------------------------------------------------------------------ training
    def train(self) -> None:
        """Train the remaining epochs at the planned batches, saving a checkpoint at the end of each."""
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
                     f"{self.final_batch()}, last loss {last.loss:.6f}")

    def final_batch(self) -> str:
        return self.batching.final_batch(self.epochs_run, self.split, self.micro_piece)

    def _increase(self, epoch: int, current: int) -> int:
        """The growth function as the plan calls it: an increment measured at an epoch start, where one was."""
        if epoch in self.measured_increments:
            return self.measured_increments[epoch]
        return self.settings.batch_increase_function(epoch, current)  # type: ignore[misc]

    def grow_from_statistics(self, epoch: int) -> None:
        """A growth function that reads training statistics decides ``epoch``'s batch now, from what the
        run measured (gradient noise scale, LR decay); the rest of the plan follows from it."""
        fn = self.settings.batch_increase_function
        if fn is None or epoch == 0 or epoch in self.measured_increments or not accepts_stats(fn) \
                or not self.growth_interval.per_epoch:
            return
        previous = self.epoch_plan[epoch - 1]
        stats = self.growth_statistics(previous)
        self.measured_increments[epoch] = int(call_increase(fn, epoch, previous.requested, stats))
        self.epoch_plan = plan_batches(**self._plan_args)
        self.batching.plan(self.epoch_plan, start=self._plan_args["start"],
                           resumed={**self.resumed, **self.batching.state_dict()}, profiled=None,
                           verify=self._verifying, info=self.info)
        noise = stats["noise_scale"]
        self.info(f"Growth from statistics at epoch {epoch + 1}: gradient noise scale "
                  f"{'not measured yet' if noise is None else f'{noise:.1f}'}, global batch {previous.shape.global_batch}"
                  f": the function returned {self.measured_increments[epoch]:+d}")

    def growth_statistics(self, previous: EpochBatch) -> dict[str, Any]:
        """What a statistics-reading growth function is given (see ``growth_stats``)."""
        # Seesaw's lr_decay (growth_stats.seesaw): shape now / peak shape so far x the batch's growth since the
        # start. Not epoch_plan[0]: growth inside the first epoch overwrites it with the grown batch.
        shape, peak = self.lr.schedule_shape(), self.lr.peak_shape
        return {"noise_scale": self.steps.noise.value, "global_batch": previous.shape.global_batch,
                "micro_batch": previous.shape.micro_batch, "accumulation": previous.shape.accumulation,
                "ranks": previous.shape.ranks, "epoch": self.epochs_run,
                "lr_decay": None if shape is None else
                (shape / peak if peak else 1.0) * previous.shape.global_batch / self.start_global_batch}

    def grow_inside_epoch(self, epoch: int, period: int) -> None:
        """Growth period ``period`` starts after this step: ask the growth function, and serve the rest of the
        epoch at the new batch from the samples not yet served (the epoch's order goes on; the LR follows)."""
        start, fn = time.perf_counter(), self.settings.batch_increase_function
        previous = self.epoch_plan[epoch]
        current = seen_size(previous, self.settings.knobs["grow_past_memory"])
        stats = self.growth_statistics(previous)
        inc = checked_increment(lambda p, c: call_increase(fn, p, c, stats), period, current)
        entry = grow_entry(previous, inc, epoch=epoch, accumulation=self._plan_args["accumulation"],
                           ranks=self.parallel.world_size, memory_cap=self._plan_args["memory_cap"],
                           grow_past_memory=self.settings.knobs["grow_past_memory"])
        self._continue_with(entry, epoch)
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
        self.info(f"Growth period {period} ({self.growth_interval.describe()}) after optimizer step {self.global_step}: "
                  f"{self.batching.describe_change(epoch, before, entry.shape)} for {where}, LR {lr_before:.3e} -> "
                  f"{self.lr.lrs()[0]:.3e} ({epoch_switch_reason(previous, entry)}; gradient noise scale "
                  f"{'not measured' if noise is None else f'{noise:.1f}'}) (took {(time.perf_counter() - start) * 1e3:.1f} ms)")

    def growth_period_after_step(self, samples: int) -> Optional[int]:
        """The growth period that starts after the step just done (``samples`` in it), or None."""
        if self.settings.batch_increase_function is None or self.growth_interval.per_epoch:
            return None
        now = self.growth_interval.period(self.global_step, self.lr.consumed_samples)
        before = self.growth_interval.period(self.global_step - 1, self.lr.consumed_samples - samples)
        return now if now > before else None

    @property
    def epoch_steps(self) -> int:
        """Optimizer steps in the current epoch (all its segments)."""
        return self.segment.start_step + self.dataloader.batch_sampler.steps

    def start_epoch(self, epoch: int, switch: bool) -> None:
        """Serve this epoch's planned batch from the same dataset (a new sampler) and rescale the LR."""
        start = time.perf_counter()
        if switch:
            self.grow_from_statistics(epoch)
        entry, previous, lr_before = self.epoch_plan[epoch], self.batch, self.lr.lrs()[0]
        self.batch = entry.shape
        self.recovery.plan(self.batch.micro_batch)
        if switch:
            self.segment = Segment()
        self.serve(epoch, start_step=self.step_in_epoch, state=self.resumed.get("dataloader"))
        self.set_step_lr(self.step_in_epoch)
        took_ms = (time.perf_counter() - start) * 1e3
        what = self.describe_batch(epoch)
        if not switch:
            self.info(f"Epoch {epoch + 1}/{self.total_epochs}: {what}, "
                      f"LR {self.lr.lrs()[0]:.3e} (x{self.lr.factor:.3f} for the global batch)")
            return
        change = self.batching.describe_change(epoch, previous, self.batch)
        self.info(
            f"Epoch switch {epoch} -> {epoch + 1}: {change}, LR {lr_before:.3e} -> {self.lr.lrs()[0]:.3e} "
            f"({epoch_switch_reason(self.epoch_plan[epoch - 1], entry)}){self.split_note()} (took {took_ms:.1f} ms)"
        )

    def describe_batch(self, epoch: int) -> str:
        return self.batching.describe_epoch(epoch, self.batch, self.dataloader.batch_sampler, self.split_note())

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

    @property
    def split(self) -> int:
        """Micro batches each planned one runs as (1 until an OOM)."""
        return self.recovery.split

    @property
    def oom_cap(self) -> Optional[int]:
        """The most samples one forward may see after an OOM (sample-count batching), or None."""
        return self.recovery.oom_cap

    @property
    def micro_piece(self) -> int:
        """The most samples one forward sees now: the micro batch, or its largest piece after an OOM."""
        return piece_size(self.batch.micro_batch, self.split)

    def largest_piece(self, index: int) -> int:
        """The most samples a forward of step ``index`` sees, on any rank."""
        return self.batching.largest_piece(self.dataloader.batch_sampler, self.segment.local(index),
                                           self.micro_piece, self.split)

    def split_note(self) -> str:
        return self.batching.split_note(self.split, self.micro_piece, self.batch)

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
            period = self.growth_period_after_step(stats.samples)
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

    def after_out_of_memory(self, epoch: int, index: int) -> None:
        """Serve the same step again in smaller micro batches, for the rest of the run; stop if 1 sample is too many."""
        failed = self.largest_piece(index)
        where = f"step {index + 1} of epoch {epoch + 1} (optimizer step {self.global_step + 1})"
        first = self.oom_cap is None and self.split == 1
        cap = self.recovery.out_of_memory(failed, self.batch.micro_batch)
        if cap is None:
            self.stop_out_of_memory(epoch, where)
        if self.device.type == "cpu" and first and memory.pin_cpu_allocator():
            self.info("glibc set to return freed tensors' memory at once, so the smaller micro batch keeps fitting")
            memory.release_memory(self.device)
        self.serve(epoch, start_step=index)
        samples = self.dataloader.batch_sampler.samples_in_step(self.segment.local(index))
        self.info(self.batching.oom_line(failed=failed, where=where, error=self.guard.last_error, samples=samples,
                                         split=self.split, micro_piece=self.micro_piece, batch=self.batch,
                                         ranks=self.parallel.world_size, cap=cap))
        if self.profile_result is not None:
            limit = self.recovery.cache_cap(self.profile_result.micro_batch)
            self.profile_result.oom_cap = limit
            if self.is_rank_zero:
                path = remember_out_of_memory(self, limit)
                self.info(f"Profile cache {path}: later runs start at micro batch <= {limit}")

    def maybe_grow_back(self, epoch: int) -> None:
        """After ``oom_grow_back_after`` clean steps under a cut, undo one level of it (at a step boundary)."""
        if not self.recovery.grow_back_due():
            return
        waited, before = self.recovery.state.wait, self.micro_piece
        self.recovery.grow_back(self.batch.micro_batch)
        if self.step_in_epoch < self.epoch_steps:
            self.serve(epoch, start_step=self.step_in_epoch)
        self.info(self.batching.grow_back_line(waited=waited, before=before, micro_piece=self.micro_piece,
                                               split=self.split, cap=self.oom_cap))

    def stop_for_restart(self, epoch: int, index: int, error: str) -> None:
        """An OOM outside a guard window: the other ranks cannot be told, so record the cut the rest of the
        run needs (output folder and profile cache) and exit; torchrun's agent stops the other ranks and,
        with ``--max-restarts``, restarts the job, which resumes under the cut."""
        failed = self.largest_piece(index)
        self.recovery.out_of_memory(failed, self.batch.micro_batch)
        output_dir = Path(self.cfg.checkpointer.output_dir)
        path = restart.record_cut(output_dir, self.recovery.state_dict(), step=self.global_step + 1,
                                  failed_micro_batch=failed, rank=self.parallel.rank, job_id=restart.job_id())
        if self.profile_result is not None:
            remember_out_of_memory(self, self.recovery.cache_cap(self.profile_result.micro_batch))
        self.process_group_broken = True  # the other ranks wait in a collective this rank never joins
        where = f"step {index + 1} of epoch {epoch + 1} (optimizer step {self.global_step + 1})"
        cut = self.batching.cut_description(self.split, self.micro_piece)
        raise OutOfMemoryStop(
            f"rank {self.parallel.rank}: out of memory at micro batch {failed} in {where}, outside the guard window "
            f"({error}). Recorded the cut ({cut}) in {path}. Under torchrun with --max-restarts the job restarts and "
            f"resumes by itself from the last complete checkpoint (optimizer step {self.saved_step}); otherwise "
            f"continue with resume_from_checkpoint=True, which resumes under the same cut."
        )

    def stop_out_of_memory(self, epoch: int, where: str) -> None:
        """Save what is done (the state before this step is whole) and stop with what to change."""
        output_dir = self.cfg.checkpointer.output_dir
        # Every size down to 1 failed in this step, so no cap is known to be safe: a resume starts from the plan.
        self.recovery.give_up()
        if self.global_step == 0:
            saved = "nothing was trained yet, so no checkpoint was written"
        elif self.saved_step != self.global_step:
            self.serve(epoch, start_step=self.step_in_epoch)  # the loader's position: before this step
            try:
                self.save(epoch)
                saved = f"saved the checkpoint of optimizer step {self.global_step} in {output_dir}"
            except Exception as error:  # noqa: BLE001 - the previous checkpoint is still whole
                if not is_out_of_memory(error):
                    raise
                saved = (f"saving ran out of memory too; the last complete checkpoint (optimizer step "
                         f"{self.saved_step}) is in {output_dir}")
        else:
            saved = f"the checkpoint of optimizer step {self.global_step} in {output_dir} is up to date"
        raise OutOfMemoryStop(
            f"a micro batch of 1 sample does not fit in memory in {where} ({self.guard.last_error}); {saved}. "
            "Free memory (a shorter tokenizer.max_seq_len, enable_activation_checkpointing=True, more ranks, "
            "a smaller model) and continue with resume_from_checkpoint=True."
        )

    def current_lr(self) -> float:
        return training.get_lr(self.optimizer)

    def log_step(self, stats: StepStats) -> None:
        if not self.is_rank_zero:
            return
        metrics: dict[str, float] = {
            "loss": stats.loss,
            "lr": self.current_lr(),
            "gradient_accumulation_steps": self.batch.accumulation * self.split,
            "global_batch_size": stats.samples,
            "tokens_per_second_per_gpu": stats.tokens / (stats.seconds * self.parallel.world_size),
        }
        metrics.update(self.batching.metrics(self.epochs_run, self.split, self.micro_piece))
        peak = memory.peak_memory_gb(self.device)
        if peak is not None:
            metrics["peak_memory_gb"] = peak
        if stats.grad_norm is not None:
            metrics["grad_norm"] = stats.grad_norm
        if stats.noise_scale is not None:
            metrics["gradient_noise_scale"] = stats.noise_scale
        self.metric_logger.log_dict(metrics, step=self.global_step)

    # ------------------------------------------------------------------ saving
    def adaptive_state(self) -> dict[str, Any]:
        """The adaptive part of the recipe state: enough to continue exactly where the run stands."""
        return {
            "global_step": self.global_step,
            "epoch": self.epochs_run,
            "step_in_epoch": self.step_in_epoch,
            # What ran (after an OOM, the planned micro batch cut into ``split``), as the metrics log it.
            "micro_batch": self.micro_piece,
            "accumulation": self.batch.accumulation * self.split,
            "planned_micro_batch": self.batch.micro_batch,
            "planned_accumulation": self.batch.accumulation,
            "ranks": self.batch.ranks,
            "lr": self.lr.state_dict(),
            "profile": self.profile_result.to_dict() if self.profile_result else None,
            "dataloader": self.dataloader.state_dict() if self.step_in_epoch else None,
            **self.recovery.state_dict(),
            **self.batching.state_dict(),
            "measured_increments": {str(k): v for k, v in self.measured_increments.items()},
            "grown": None if self.growth_interval.per_epoch else self._grown_entry(),
            "segment": self.segment.state_dict(),
            "noise_scale": self.steps.noise.state_dict(),
        }

    def _grown_entry(self) -> Optional[dict[str, Any]]:
        """The batch in force from the epoch the run stands in (grown inside epochs), as saved."""
        if self.epochs_run >= len(self.epoch_plan):
            return None
        entry = self.epoch_plan[self.epochs_run]
        return {"requested": entry.requested, "increment": entry.increment, "reason": entry.reason,
                "micro_batch": entry.shape.micro_batch, "accumulation": entry.shape.accumulation}

    def save(self, epoch: int) -> None:
        """Write the weights and the full recipe state, at the end of an epoch or inside one.

        Both go to ``epoch_{epoch}``, swapped in whole (see checkpointing): a kill at any moment leaves
        the previous checkpoint or the new one, complete. A save inside an epoch is replaced by the one at its end.
        """
        start = time.perf_counter()
        weights = full_state_dict(self.model, self.parallel, self.device, trainable_only=self.method.adapter_only)
        optimizer_state = full_optimizer_state_dict(self.model, self.optimizer, self.parallel, self.device)
        if self.is_rank_zero:
            state = self.method.checkpoint_entries(weights)
            state.update(checkpointing.recipe_state(
                seed=self.seed, epochs_run=self.epochs_run, total_epochs=self.total_epochs,
                max_steps_per_epoch=self.max_steps_per_epoch, optimizer_state=optimizer_state,
                adaptive_state=self.adaptive_state(),
            ))
            folder = checkpointing.save_checkpoint_atomically(
                self.checkpointer, state, epoch=epoch, adapter_only=self.method.adapter_only,
                record={"global_step": self.global_step, "epoch": epoch, "step_in_epoch": self.step_in_epoch,
                        "epochs_run": self.epochs_run, "job_id": restart.job_id()},
            )
            what = f"step {self.step_in_epoch} of epoch {epoch + 1}" if self.step_in_epoch else f"epoch {epoch + 1}"
            self.info(f"Saved the checkpoint of {what} (optimizer step {self.global_step}) to {folder} "
                      f"in {time.perf_counter() - start:.1f} s")
        barrier(self.parallel)
        self.saved_step = self.global_step

    def close(self) -> None:
        if self.metric_logger is not None:
            self.metric_logger.close()
        if not self.process_group_broken:
            shutdown(self.parallel)
