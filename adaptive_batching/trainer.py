"""The training machinery both recipes share: set-up, the step loop, metrics and checkpoints.

What differs between full and LoRA fine-tuning is a :class:`~adaptive_batching.model.FinetuneMethod`
given by the recipe; how big a batch is comes from :class:`~adaptive_batching.batch.BatchShape`.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor
from torchtune import config, training, utils
from tqdm import tqdm

from adaptive_batching import checkpointing, memory
from adaptive_batching.batch import BatchShape
from adaptive_batching.config import optional_component
from adaptive_batching.data import DEFAULT_COLLATE, build_collate, build_dataloader, build_dataset, worst_case_batch
from adaptive_batching.distributed import ParallelInfo, all_reduce_sum, barrier, init_parallel, shutdown
from adaptive_batching.loss import summed_token_loss
from adaptive_batching.model import (
    FinetuneMethod,
    ModelOptions,
    build_model,
    full_optimizer_state_dict,
    full_state_dict,
    load_optimizer_state_dict,
)
from adaptive_batching.profile_run import run_profile
from adaptive_batching.profiler import ProfileResult, StepMemory
from adaptive_batching.settings import AdaptiveSettings

log = utils.get_logger("INFO")


@dataclass
class StepStats:
    """What one optimizer step produced, summed over micro batches and ranks."""

    loss: float
    tokens: int
    seconds: float
    grad_norm: Optional[float] = None


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive groups of ``size`` items; a shorter trailing group is dropped."""
    iterator = iter(items)
    while len(group := list(itertools.islice(iterator, size))) == size:
        yield group


class Trainer:
    """Fine-tunes a torchtune model; one instance per run."""

    def __init__(self, cfg: DictConfig, settings: AdaptiveSettings, method: FinetuneMethod) -> None:
        self.cfg = cfg
        self.settings = settings
        self.method = method
        self.device, self.parallel = init_parallel(cfg.get("device", "cpu"))
        self.dtype = training.get_dtype(cfg.get("dtype", "fp32"), device=self.device)
        if self.dtype == torch.float16:
            raise ValueError("config key 'dtype' = 'fp16' is not supported; use bf16 or fp32")
        self.seed = training.set_seed(cfg.get("seed", None), debug_mode=cfg.get("cudnn_deterministic_mode", None))
        self.batch = BatchShape(
            micro_batch=cfg.batch_size,
            accumulation=cfg.get("gradient_accumulation_steps", 1),
            data_parallel=self.parallel.world_size,
        )
        self.total_epochs: int = cfg.epochs
        self.max_steps_per_epoch: Optional[int] = cfg.get("max_steps_per_epoch", None)
        self.clip_grad_norm: Optional[float] = cfg.get("clip_grad_norm", None)
        self.log_every_n_steps: int = cfg.get("log_every_n_steps", 1)
        self.resume: bool = cfg.get("resume_from_checkpoint", False)
        self.epochs_run = 0
        self.global_step = 0
        self.metric_logger: Any = None
        self.profile_result: Optional[ProfileResult] = None

    @property
    def is_rank_zero(self) -> bool:
        return self.parallel.is_rank_zero

    def info(self, message: str) -> None:
        utils.log_rank_zero(log, message)

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        """Load the checkpoint and build model, tokenizer, optimizer, loss, data and LR schedule."""
        cfg = self.cfg
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
        self.tokenizer = config.instantiate(cfg.tokenizer)
        self.optimizer = config.instantiate(
            cfg.optimizer, [p for p in self.model.parameters() if p.requires_grad]
        )
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
        self.apply_batch(self.batch)

    def apply_batch(self, batch: BatchShape) -> None:
        """Serve ``batch`` from now on: dataloader, steps per epoch and LR schedule follow it."""
        self.batch = batch
        self.dataloader = build_dataloader(
            self.dataset, micro_batch=batch.micro_batch, collate_fn=self.collate,
            parallel=self.parallel, shuffle=self.cfg.get("shuffle", True), seed=self.seed,
        )
        self.steps_per_epoch = self._steps_per_epoch()
        self.lr_scheduler = self._build_lr_scheduler()
        self.info(
            f"Batch: {batch.describe()}; {self.steps_per_epoch} optimizer steps per epoch, "
            f"{self.total_epochs} epoch(s)"
        )

    # ------------------------------------------------------------------ profiling
    def profile(self) -> Optional[ProfileResult]:
        """With ``use_maximum_batch_size``, train at the largest micro batch that fits (see profiler)."""
        if not self.settings.use_maximum_batch_size:
            return None
        if self.device.type == "cpu" and memory.pin_cpu_allocator():
            self.info("Profiler: glibc set to return freed tensors' memory at once and to use one arena, "
                      "so the address space follows the tensors and the chosen micro batch keeps fitting")
        result = run_profile(self)
        self.profile_result = result
        if result.micro_batch != self.batch.micro_batch:
            self.info(f"Profiler: micro batch {self.batch.micro_batch} -> {result.micro_batch} "
                      f"(largest that ran: {result.max_micro_batch})")
            self.apply_batch(BatchShape(result.micro_batch, self.batch.accumulation, self.batch.data_parallel))
        return result

    @property
    def seq_len(self) -> int:
        """Tokens in a worst-case sample or pack."""
        return int(self.cfg.tokenizer.get("max_seq_len", None) or self.model.max_seq_len)

    def samples_per_rank(self) -> int:
        return len(self.dataset) // self.parallel.world_size

    def trial_step(self, micro_batch: int) -> StepMemory:
        """One full training step on a worst-case batch, measured; the LR schedule does not move."""
        meters = (self.model, self.optimizer)
        try:
            if self.batch.accumulation > 1:
                # As in every micro batch after the first: the gradients already exist.
                for param in self.model.parameters():
                    if param.requires_grad:
                        param.grad = torch.zeros_like(param)
            with memory.PeakMeter(self.device, *meters) as forward_backward:
                batch = worst_case_batch(self.collate, micro_batch=micro_batch, seq_len=self.seq_len,
                                         vocab_size=self.tokenizer.vocab_size, packed=self.packed)
                _, tokens = self._forward_backward(batch)
                del batch
            with memory.PeakMeter(self.device, *meters) as optimizer_step:
                self._apply_gradients(tokens)
            return StepMemory(
                activation_bytes=forward_backward.peak_bytes - forward_backward.start_bytes,
                forward_backward_peak=forward_backward.peak_bytes,
                optimizer_peak=optimizer_step.peak_bytes,
                steady_bytes=memory.current_bytes(self.device, *meters),
            )
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            memory.release_memory(self.device)

    def _restore(self, checkpoint: dict[str, Any]) -> None:
        """Continue from the recipe state of the last finished epoch."""
        if checkpoint.get(training.SEED_KEY, self.seed) != self.seed:
            self.info(f"Using the checkpoint's seed {checkpoint[training.SEED_KEY]} instead of {self.seed}")
            self.seed = checkpoint[training.SEED_KEY]
        self.epochs_run = checkpoint[training.EPOCHS_KEY]
        self.global_step = checkpoint[checkpointing.ADAPTIVE_KEY]["global_step"]
        load_optimizer_state_dict(self.model, self.optimizer, checkpoint[training.OPT_KEY],
                                  self.parallel, self.device)
        self.info(f"Resuming after epoch {self.epochs_run} (optimizer step {self.global_step})")

    def _steps_per_epoch(self) -> int:
        steps = len(self.dataloader) // self.batch.accumulation
        if self.max_steps_per_epoch is not None:
            steps = min(steps, self.max_steps_per_epoch)
        if steps < 1:
            raise ValueError(
                f"The dataset gives {len(self.dataloader)} micro batches of {self.batch.micro_batch} per rank, "
                f"fewer than one optimizer step of {self.batch.accumulation}; lower 'batch_size' "
                f"or 'gradient_accumulation_steps'"
            )
        return steps

    def _build_lr_scheduler(self) -> Any:
        cfg_scheduler = optional_component(self.cfg.get("lr_scheduler", None))
        if cfg_scheduler is None:
            return None
        return config.instantiate(
            cfg_scheduler, self.optimizer,
            num_training_steps=self.total_epochs * self.steps_per_epoch,
            last_epoch=self.global_step - 1,
        )

    # ------------------------------------------------------------------ training
    def train(self) -> None:
        """Train the remaining epochs, saving a checkpoint at the end of each."""
        memory.release_memory(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        last: Optional[StepStats] = None
        for epoch in range(self.epochs_run, self.total_epochs):
            last = self.train_epoch(epoch) or last
            self.epochs_run = epoch + 1
            self.save(epoch)
        if last is not None:
            log.info(f"Rank {self.parallel.rank}: finished at optimizer step {self.global_step}, "
                     f"micro batch {self.batch.micro_batch}, last loss {last.loss:.6f}")

    def train_epoch(self, epoch: int) -> Optional[StepStats]:
        """Train one epoch; return the last step's statistics."""
        self.dataloader.sampler.set_epoch(epoch)
        self.model.train()
        progress = tqdm(total=self.steps_per_epoch, disable=not self.is_rank_zero, desc=f"epoch {epoch + 1}")
        steps = itertools.islice(_chunks(self.dataloader, self.batch.accumulation), self.steps_per_epoch)
        stats = None
        for micro_batches in steps:
            stats = self.train_step(micro_batches)
            self.global_step += 1
            progress.update(1)
            progress.set_postfix_str(
                f"loss {stats.loss:.4f} global batch {self.batch.global_batch} lr {self.current_lr():.2e}"
            )
            if self.global_step % self.log_every_n_steps == 0:
                self.log_step(stats)
        progress.close()
        return stats

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepStats:
        """One optimizer step over ``micro_batches``: loss normalised by the tokens of the whole step."""
        start = time.perf_counter()
        memory.reset_peak_memory(self.device)
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device, dtype=torch.long)
        for batch in micro_batches:
            micro_loss, micro_tokens = self._forward_backward(batch)
            loss_sum += micro_loss
            tokens += micro_tokens
        all_reduce_sum(loss_sum, self.parallel)
        grad_norm = self._apply_gradients(tokens)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        n_tokens = int(tokens.item())
        return StepStats(loss=loss_sum.item() / max(n_tokens, 1), tokens=n_tokens,
                         seconds=time.perf_counter() - start, grad_norm=grad_norm)

    def _apply_gradients(self, tokens: torch.Tensor) -> Optional[float]:
        """Normalise the summed gradients by the step's tokens on all ranks, clip, step; return the norm."""
        all_reduce_sum(tokens, self.parallel)
        # FSDP averages gradients over ranks; undo that and divide by the step's tokens.
        training.scale_grads(self.model, self.parallel.world_size / tokens.clamp(min=1))
        grad_norm = None
        if self.clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=float(self.clip_grad_norm))
            grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

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
            "micro_batch_size": self.batch.micro_batch,
            "gradient_accumulation_steps": self.batch.accumulation,
            "global_batch_size": self.batch.global_batch,
            "tokens_per_second_per_gpu": stats.tokens / (stats.seconds * self.parallel.world_size),
        }
        peak = memory.peak_memory_gb(self.device)
        if peak is not None:
            metrics["peak_memory_gb"] = peak
        if stats.grad_norm is not None:
            metrics["grad_norm"] = stats.grad_norm
        self.metric_logger.log_dict(metrics, step=self.global_step)

    # ------------------------------------------------------------------ saving
    def adaptive_state(self) -> dict[str, Any]:
        """The adaptive part of the recipe state."""
        return {
            "global_step": self.global_step,
            "micro_batch": self.batch.micro_batch,
            "accumulation": self.batch.accumulation,
            "data_parallel": self.batch.data_parallel,
            "profile": self.profile_result.to_dict() if self.profile_result else None,
        }

    def save(self, epoch: int) -> None:
        """Write the weights and the full recipe state for the epoch just finished."""
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
            self.checkpointer.save_checkpoint(
                state, epoch=epoch, intermediate_checkpoint=True, adapter_only=self.method.adapter_only
            )
            self.info(f"Saved the epoch {epoch + 1} checkpoint in {time.perf_counter() - start:.1f} s")
        barrier(self.parallel)

    def close(self) -> None:
        if self.metric_logger is not None:
            self.metric_logger.close()
        shutdown(self.parallel)
