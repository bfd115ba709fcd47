"""The training machinery both recipes share: set-up, the step loop, metrics and checkpoints.

What differs between full and LoRA fine-tuning is a :class:`~adaptive_batching.model.FinetuneMethod`
given by the recipe; how big a batch is comes from :class:`~adaptive_batching.batch.BatchShape`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor
from torchtune import config, training, utils
from tqdm import tqdm

from adaptive_batching import checkpointing, memory, restart
from adaptive_batching.batch import BatchShape, shape_keeping_global_batch
from adaptive_batching.config import optional_component
from adaptive_batching.data import (
    DEFAULT_COLLATE,
    build_collate,
    build_dataloader,
    build_dataset,
    build_token_dataloader,
    data_files,
    worst_case_batch,
)
from adaptive_batching.elastic import shape_at
from adaptive_batching.errors import ConfigError
from adaptive_batching.distributed import all_reduce_sum, barrier, init_parallel, shutdown
from adaptive_batching.loss import summed_token_loss
from adaptive_batching.lr_scaling import SampleDrivenLR, lr_factor, reference_steps
from adaptive_batching.oom import PeerOutOfMemory, is_out_of_memory
from adaptive_batching.oom_recovery import OK, OutOfMemoryStop, StepGuard, optimizer_step_counts, piece_size
from adaptive_batching.model import (
    FinetuneMethod,
    ModelOptions,
    build_model,
    full_optimizer_state_dict,
    full_state_dict,
    load_optimizer_state_dict,
)
from adaptive_batching.plan_checks import check_plan_against_data, lr_factor_warnings
from adaptive_batching.profile_cache import default_cache_dir
from adaptive_batching.recovery import OomRecovery, SampleCuts, TokenCuts
from adaptive_batching.profile_run import remember_out_of_memory, run_profile
from adaptive_batching.profiler import ProfileResult, StepMemory, preserved_training_state
from adaptive_batching.sampler import epoch_extent
from adaptive_batching.schedule import EpochBatch, describe_plan, epoch_switch_reason, plan_batches
from adaptive_batching.sequence_lengths import data_files_digest, sequence_lengths
from adaptive_batching.token_batching import padding_waste
from adaptive_batching.settings import AdaptiveSettings

log = utils.get_logger("INFO")


@dataclass
class StepStats:
    """What one optimizer step produced, summed over micro batches and ranks."""

    loss: float
    tokens: int
    seconds: float
    grad_norm: Optional[float] = None
    samples: int = 0


class UnguardedOutOfMemory(RuntimeError):
    """An OOM in a step outside a guard window (several ranks): the others cannot be told in place."""


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
        # Token-budget batching: padded tokens per micro batch, per epoch, and every sample's length.
        self.token_mode = settings.knobs["max_tokens"] is not None
        self.token_budgets: list[int] = []
        self.lengths: list[int] = []
        self.total_epochs: int = cfg.epochs
        self.max_steps_per_epoch: Optional[int] = cfg.get("max_steps_per_epoch", None)
        self.save_every_n_steps: Optional[int] = cfg.get("save_every_n_steps", None)
        self.clip_grad_norm: Optional[float] = cfg.get("clip_grad_norm", None)
        self.log_every_n_steps: int = cfg.get("log_every_n_steps", 1)
        self.resume: bool = cfg.get("resume_from_checkpoint", False)
        if not self.resume:
            self.resume, why = restart.resume_after_restart(Path(cfg.checkpointer.output_dir))
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
        self.resumed: dict[str, Any] = {}
        # After an OOM in training: the most samples one forward may see, and each micro batch's pieces.
        self.oom_recovery: bool = settings.knobs["oom_recovery"]
        self.recovery = OomRecovery(TokenCuts() if self.token_mode else SampleCuts(),
                                    settings.knobs["oom_grow_back_after"])
        self.saved_step: Optional[int] = None
        self.guard = StepGuard(self.parallel, self.device)

    @property
    def is_rank_zero(self) -> bool:
        return self.parallel.is_rank_zero

    def info(self, message: str) -> None:
        utils.log_rank_zero(log, message)

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
        self.checkpointer, checkpoint = checkpointing.load_checkpoint(cfg.checkpointer, self.resume)
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

        self.dataset, self.packed = build_dataset(cfg.dataset, self.tokenizer)
        self.collate = build_collate(
            cfg.get("collate_fn", DEFAULT_COLLATE), self.packed, self.tokenizer.pad_id, self.loss_fn.ignore_index
        )
        if self.token_mode:
            self.lengths = self.measure_lengths()

    def measure_lengths(self) -> list[int]:
        """Every sample's token count, cached by a fingerprint of the data, the dataset and the tokenizer config."""
        cache_dir = self.settings.knobs["cache_dir"]
        key_parts = {
            "dataset": OmegaConf.to_container(self.cfg.dataset, resolve=True),
            "tokenizer": OmegaConf.to_container(self.cfg.tokenizer, resolve=True),
            "data_files": data_files_digest(data_files(self.cfg.dataset)),
        }
        lengths = sequence_lengths(self.dataset, cache_dir=default_cache_dir() if cache_dir is None else cache_dir,
                                   key_parts=key_parts)
        ordered = sorted(lengths)
        self.info(f"Token budget batching: {len(lengths)} samples of {ordered[0]} to {ordered[-1]} tokens "
                  f"(median {ordered[len(ordered) // 2]})")
        return lengths

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
        if self.lengths:
            return max(self.lengths)
        return int(self.cfg.tokenizer.get("max_seq_len", None) or self.model.max_seq_len)

    def samples_per_rank(self) -> int:
        return len(self.dataset) // self.parallel.world_size

    def trial_step(self, micro_batch: int, seq_len: Optional[int] = None) -> StepMemory:
        """One full training step on a worst-case batch, measured; the LR schedule does not move.

        An OOM on any rank is an OOM on every rank (see :class:`StepGuard`), so no rank waits for another.
        """
        meters = (self.model, self.optimizer)
        measured: list[StepMemory] = []
        self.guard.attach()  # profiling is always guarded; training opens its own windows

        def step() -> None:
            if self.batch.accumulation > 1:
                # As in every micro batch after the first: the gradients already exist.
                for param in self.model.parameters():
                    if param.requires_grad:
                        param.grad = torch.zeros_like(param)
            with memory.PeakMeter(self.device, *meters) as forward_backward:
                batch = worst_case_batch(self.collate, micro_batch=micro_batch, seq_len=seq_len or self.seq_len,
                                         vocab_size=self.tokenizer.vocab_size, packed=self.packed)
                _, tokens = self._forward_backward(batch)
                del batch
            with memory.PeakMeter(self.device, *meters) as optimizer_step:
                self._apply_gradients(tokens)
            measured.append(StepMemory(
                activation_bytes=forward_backward.peak_bytes - forward_backward.start_bytes,
                forward_backward_peak=forward_backward.peak_bytes,
                optimizer_peak=optimizer_step.peak_bytes,
                steady_bytes=memory.current_bytes(self.device, *meters),
                reserved_peak=max((m.reserved_peak_bytes for m in (forward_backward, optimizer_step)
                                   if m.reserved_peak_bytes is not None), default=None),
                alloc_retries=forward_backward.alloc_retries + optimizer_step.alloc_retries,
            ))

        try:
            if self.guard.run(step) != OK:
                self.guard.abandon(self.model, self.optimizer)
                raise PeerOutOfMemory(f"micro batch {micro_batch} ran out of memory on at least one rank")
            return measured[0]
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            memory.release_memory(self.device)

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
        self.epoch_plan = plan_batches(
            epochs=self.total_epochs, start=start, accumulation=accumulation,
            ranks=self.parallel.world_size, increase=self.settings.batch_increase_function,
            memory_cap=cap, grow_past_memory=self.settings.knobs["grow_past_memory"],
        )
        if not self.token_mode:
            check_plan_against_data(
                self.epoch_plan, dataset_size=len(self.dataset),
                profiled=self.settings.use_maximum_batch_size and self.elastic is None,
                allow_above_data=self.settings.knobs["allow_global_batch_above_data"],
                reference_global_batch=self.reference.global_batch, rule=self.settings.lr_scaling,
            )
            warnings = lr_factor_warnings(self.epoch_plan, reference_global_batch=self.reference.global_batch,
                                          rule=self.settings.lr_scaling)
            if warnings and self.is_rank_zero:
                log.warning("\n".join(warnings))
        if self.token_mode:
            base = self.resumed.get("token_budget") or self.token_budget_base(start)
            # Growth scales the budget as it would scale a micro batch of samples.
            self.token_budgets = [base * entry.shape.micro_batch // start for entry in self.epoch_plan]
        extents = [self.epoch_extent(epoch) for epoch in range(self.total_epochs)]
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
        if self.token_mode:
            rows = [f"{row} | token budget {budget} | {steps} steps, {samples} samples, LR x per step by its samples"
                    for row, budget, (steps, samples) in zip(rows, self.token_budgets, extents)]
        else:
            rows = [f"{row} | {steps} steps, {samples} samples, LR x"
                    f"{lr_factor(entry.shape.global_batch, self.reference.global_batch, self.lr.rule):.3f}"
                    for row, entry, (steps, samples) in zip(rows, self.epoch_plan, extents)]
        self.info(
            "Batch plan (micro batch = samples per forward per rank; global batch = micro x accumulation x ranks; "
            f"reference global batch {self.reference.global_batch} from the config; LR scaling '{self.lr.rule}'; "
            f"LR schedule over {total_steps} reference steps):\n"
            + "\n".join([header, *rows])
        )
        return self.epoch_plan

    def token_budget_base(self, start: int) -> int:
        """The first epoch's padded tokens per micro batch: the config's, the profiler's, or the smaller of both."""
        value = self.settings.knobs["max_tokens"]
        profile = self.profile_result
        if profile is None or not self.settings.use_maximum_batch_size:
            return int(value)
        profiled = start * self.seq_len
        budget = profiled if value == "auto" else min(int(value), profiled)
        self.info(f"Token budget: {budget} padded tokens per micro batch (the profiler's micro batch {start} x "
                  f"the longest sample's {self.seq_len} tokens"
                  f"{'' if value == 'auto' else f', at most adaptive_batching.max_tokens={value}'})")
        return self.verify_short_samples(budget)

    def verify_short_samples(self, budget: int) -> int:
        """Check the budget where it packs the most samples (the shortest ones): memory depends on the
        tokens and on their length. Halve it until a real step fits."""
        shortest = min(self.lengths)
        with preserved_training_state(self.model, self.optimizer):
            while budget >= self.seq_len:
                samples = budget // shortest
                try:
                    used = self.trial_step(samples, seq_len=shortest)
                except Exception as error:  # noqa: BLE001 - only an OOM lowers the budget
                    if not is_out_of_memory(error):
                        raise
                    self.info(f"Token budget {budget}: {samples} samples of {shortest} tokens ran out of memory; "
                              f"trying {budget // 2}")
                    budget //= 2
                    continue
                peak = max(used.forward_backward_peak, used.optimizer_peak)
                self.info(f"Token budget {budget} verified with {samples} samples of the shortest length, "
                          f"{shortest} tokens: peak {peak / 2**30:.3f} GiB")
                return budget
        raise OutOfMemoryStop(f"no token budget of at least one longest sample ({self.seq_len} tokens) fits "
                              f"{budget // shortest} samples of {shortest} tokens")

    def epoch_extent(self, epoch: int) -> tuple[int, int]:
        """Optimizer steps and samples (all ranks) of ``epoch`` as planned."""
        shape = self.epoch_plan[epoch].shape
        if not self.token_mode:
            return epoch_extent(len(self.dataset), shape.global_batch, self.max_steps_per_epoch)
        sampler = self.loader(epoch, split=1, start_step=0).batch_sampler
        return sampler.steps, sum(sampler.samples_in_step(i) for i in range(sampler.steps))

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
            self.epochs_run, self.step_in_epoch = epoch + 1, 0
            self.save(epoch)
        if last is not None:
            log.info(f"Rank {self.parallel.rank}: finished at optimizer step {self.global_step}, "
                     f"{self.final_batch()}, last loss {last.loss:.6f}")

    def final_batch(self) -> str:
        if self.token_mode:
            return f"token budget {self.token_budgets[-1]} in {self.split} piece(s)"
        return f"micro batch {self.micro_piece}"

    def start_epoch(self, epoch: int, switch: bool) -> None:
        """Serve this epoch's planned batch from the same dataset (a new sampler) and rescale the LR."""
        start = time.perf_counter()
        entry, previous, lr_before = self.epoch_plan[epoch], self.batch, self.lr.lrs()[0]
        self.batch = entry.shape
        self.recovery.plan(self.batch.micro_batch)
        self.serve(epoch, start_step=self.step_in_epoch, state=self.resumed.get("dataloader"))
        self.set_step_lr(self.step_in_epoch)
        took_ms = (time.perf_counter() - start) * 1e3
        what = self.describe_batch(epoch)
        if not switch:
            self.info(f"Epoch {epoch + 1}/{self.total_epochs}: {what}, "
                      f"LR {self.lr.lrs()[0]:.3e} (x{self.lr.factor:.3f} for the global batch)")
            return
        if self.token_mode:
            change = (f"token budget {self.token_budgets[epoch - 1]} -> {self.token_budgets[epoch]} padded tokens "
                      f"per micro batch, accumulation {previous.accumulation} -> {self.batch.accumulation}")
        else:
            change = (f"micro batch {previous.micro_batch} -> {self.batch.micro_batch}, accumulation "
                      f"{previous.accumulation} -> {self.batch.accumulation}, global batch "
                      f"{previous.global_batch} -> {self.batch.global_batch}")
        self.info(
            f"Epoch switch {epoch} -> {epoch + 1}: {change}, LR {lr_before:.3e} -> {self.lr.lrs()[0]:.3e} "
            f"({epoch_switch_reason(self.epoch_plan[epoch - 1], entry)}){self.split_note()} (took {took_ms:.1f} ms)"
        )

    def describe_batch(self, epoch: int) -> str:
        if not self.token_mode:
            return f"{self.batch.describe()}{self.split_note()}"
        sampler = self.dataloader.batch_sampler
        waste = padding_waste(self.lengths, [mb for step in sampler.plan() for rank in step for mb in rank])
        return (f"token budget {self.token_budgets[epoch]} padded tokens per micro batch x accumulation "
                f"{self.batch.accumulation} x {self.parallel.world_size} rank(s): {sampler.steps} steps of "
                f"{min(sampler.samples_in_step(i) for i in range(sampler.steps))}-"
                f"{max(sampler.samples_in_step(i) for i in range(sampler.steps))} samples, "
                f"padding {100 * waste:.1f}%{self.split_note()}")

    def set_step_lr(self, index: int) -> None:
        """The LR of step ``index``: for the planned global batch, or for the samples this step holds."""
        sampler = self.dataloader.batch_sampler
        if not self.token_mode:
            self.lr.set_global_batch(self.batch.global_batch)
        elif index < sampler.steps:
            self.lr.set_global_batch(sampler.samples_in_step(index))

    def loader(self, epoch: int, split: int, start_step: int) -> Any:
        """A dataloader over ``epoch``'s planned batch, each micro batch cut into ``split`` pieces, from ``start_step``."""
        common = dict(collate_fn=self.collate, parallel=self.parallel, shuffle=self.cfg.get("shuffle", True),
                      seed=self.seed, epoch=epoch, max_steps=self.max_steps_per_epoch, split=split,
                      start_step=start_step)
        if self.token_mode:
            knobs = self.settings.knobs
            return build_token_dataloader(
                self.dataset, self.lengths, max_tokens=self.token_budgets[epoch],
                picking_order=knobs["picking_order"], min_batch_size=knobs["min_batch_size"],
                max_batch_size=knobs["max_batch_size"], accumulation=self.epoch_plan[epoch].shape.accumulation,
                **common,
            )
        shape = self.epoch_plan[epoch].shape
        return build_dataloader(self.dataset, micro_batch=shape.micro_batch, accumulation=shape.accumulation,
                                **common)

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
        self.dataloader = self.loader(epoch, self.split, 0 if state else start_step)
        served = (self.batch.micro_batch, self.split, self.token_budgets[epoch] if self.token_mode else 0)
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
        if not self.token_mode:
            return self.micro_piece
        step = self.dataloader.batch_sampler.plan()[index]
        return piece_size(max(len(micro) for rank in step for micro in rank), self.split)

    def split_note(self) -> str:
        if self.split == 1:
            return ""
        if self.token_mode:
            return f"; after an OOM each micro batch runs as {self.split} pieces"
        return (f"; after an OOM each micro batch runs as {self.split} pieces of <= {self.micro_piece} "
                f"(micro batch {self.micro_piece} x accumulation {self.batch.accumulation * self.split})")

    def train_epoch(self, epoch: int) -> Optional[StepStats]:
        """Train one epoch (from ``step_in_epoch`` when resumed inside it); return the last step's statistics."""
        self.model.train()
        sampler = self.dataloader.batch_sampler
        steps = sampler.steps
        progress = tqdm(total=steps, initial=self.step_in_epoch, disable=not self.is_rank_zero,
                        desc=f"epoch {epoch + 1}/{self.total_epochs}")
        stats = None
        while self.step_in_epoch < steps:
            index = self.step_in_epoch
            layout = self.dataloader.batch_sampler.step_layout()
            try:
                step_stats = self.train_step([next(self.batches) for _ in range(layout[index])])
            except UnguardedOutOfMemory as error:
                self.stop_for_restart(epoch, index, str(error))
            if step_stats is None:
                self.after_out_of_memory(epoch, index)
                continue
            self.guard.step_done()
            stats = step_stats
            stats.samples = sampler.samples_in_step(index)
            self.lr.advance(stats.samples)
            self.set_step_lr(index + 1)
            self.global_step += 1
            self.step_in_epoch = index + 1
            progress.update(1)
            progress.set_postfix_str(f"global batch {stats.samples} lr {self.current_lr():.2e} loss {stats.loss:.4f}")
            if self.global_step % self.log_every_n_steps == 0:
                self.log_step(stats)
            if self.save_every_n_steps and self.global_step % self.save_every_n_steps == 0 \
                    and self.step_in_epoch < steps:
                self.save(epoch)
            self.maybe_grow_back(epoch)
        progress.close()
        return stats

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> Optional[StepStats]:
        """One optimizer step over ``micro_batches``: loss normalised by the tokens of the whole step.

        Returns None, with nothing changed, when the forward or backward ran out of memory on any rank.
        """
        start = time.perf_counter()
        memory.reset_peak_memory(self.device)
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device, dtype=torch.long)

        def forward_backward() -> None:
            for batch in micro_batches:
                micro_loss, micro_tokens = self._forward_backward(batch)
                loss_sum.add_(micro_loss)
                tokens.add_(micro_tokens)

        if not (self.oom_recovery and self.guard.protecting):
            try:
                forward_backward()
            except Exception as error:
                if self.oom_recovery and is_out_of_memory(error):
                    raise UnguardedOutOfMemory(str(error).strip().splitlines()[0][:200]) from error
                raise
        elif self.guard.run(forward_backward) != OK:
            micro_batches.clear()
            self.guard.abandon(self.model, self.optimizer)
            memory.release_memory(self.device)
            return None
        all_reduce_sum(loss_sum, self.parallel)
        grad_norm = self._apply_gradients(tokens)
        n_tokens = int(tokens.item())
        self.recovery.step_done()
        return StepStats(loss=loss_sum.item() / max(n_tokens, 1), tokens=n_tokens,
                         seconds=time.perf_counter() - start, grad_norm=grad_norm)

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
        samples = self.dataloader.batch_sampler.samples_in_step(index)
        if self.token_mode:
            self.info(f"Out of memory at a micro batch of {failed} samples in {where} ({self.guard.last_error}): "
                      f"running the same {samples} samples again with each micro batch cut into {self.split} "
                      "pieces; global batch and LR unchanged, for the rest of the run")
        else:
            self.info(
                f"Out of memory at micro batch {failed} in {where} ({self.guard.last_error}): running the same "
                f"{samples} samples again as micro batch {self.micro_piece} x accumulation "
                f"{self.batch.accumulation * self.split} x {self.parallel.world_size} rank(s); global batch "
                f"{self.batch.global_batch} and LR unchanged; micro batch capped at {cap} for the rest of the run"
            )
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
        if self.step_in_epoch < self.dataloader.batch_sampler.steps:
            self.serve(epoch, start_step=self.step_in_epoch)
        if self.token_mode:
            self.info(f"Growing back after {waited} clean steps: micro batches cut into {self.split} piece(s)")
        else:
            self.info(f"Growing back after {waited} clean steps: micro batch {before} -> "
                      f"{self.micro_piece} (cap {self.oom_cap if self.oom_cap is not None else 'lifted'})")

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
        cut = f"micro batch {self.micro_piece}" if not self.token_mode else f"{self.split} piece(s) per micro batch"
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

    def _apply_gradients(self, tokens: torch.Tensor) -> Optional[float]:
        """Normalise the summed gradients by the step's tokens on all ranks, clip, step; return the norm."""
        self.guard.sync_point()
        all_reduce_sum(tokens, self.parallel)
        # FSDP averages gradients over ranks; undo that and divide by the step's tokens.
        training.scale_grads(self.model, self.parallel.world_size / tokens.clamp(min=1))
        grad_norm = None
        if self.clip_grad_norm is not None:
            self.guard.sync_point()
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=float(self.clip_grad_norm))
            grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        self._optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _optimizer_step(self) -> None:
        """``optimizer.step()``; after an OOM that changed nothing yet, free memory and try once more.

        The gradients are whole and the step is local to each rank, so it is retried alone.
        """
        counts = optimizer_step_counts(self.optimizer) if self.oom_recovery and not self.guard.armed else None
        try:
            self.optimizer.step()
            return
        except Exception as error:  # noqa: BLE001 - only a clean OOM is retried
            if counts is None or not is_out_of_memory(error) or optimizer_step_counts(self.optimizer) != counts:
                raise
        memory.release_memory(self.device)
        self.info(f"Out of memory in the optimizer step of optimizer step {self.global_step + 1}: "
                  "memory released, the optimizer step retried with the same gradients")
        try:
            self.optimizer.step()
        except Exception as error:  # noqa: BLE001
            if not is_out_of_memory(error):
                raise
            raise OutOfMemoryStop(
                f"the optimizer step of optimizer step {self.global_step + 1} runs out of memory even after "
                f"freeing memory (its state does not depend on the batch); the last complete checkpoint "
                f"(optimizer step {self.saved_step}) is in {self.cfg.checkpointer.output_dir}"
            ) from None

    def _forward_backward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro batch; returns its summed loss and token count."""
        utils.batch_to_device(batch, self.device)
        loss, tokens = summed_token_loss(self.model, self.loss_fn, batch)
        loss.backward()
        return loss.detach(), tokens

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
        if self.token_mode:
            metrics["max_tokens"] = self.token_budgets[self.epochs_run] // self.split
        else:
            metrics["micro_batch_size"] = self.micro_piece
        peak = memory.peak_memory_gb(self.device)
        if peak is not None:
            metrics["peak_memory_gb"] = peak
        if stats.grad_norm is not None:
            metrics["grad_norm"] = stats.grad_norm
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
            "token_budget": self.token_budgets[0] if self.token_mode else None,
        }

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
