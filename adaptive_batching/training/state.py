"""Where a run stands, and its checkpoints: what is saved besides the weights and optimizer, and how a run
continues from it (at the end of an epoch or at a step inside one).

The adaptive state is one flat mapping that each part of the run contributes its own entries to
(:meth:`Progress.state_dict`, the feed's, the plan's, the LR's, ...); it travels inside the checkpoint
folder with the weights (see :mod:`~adaptive_batching.faults.checkpoints`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torchtune import training

from adaptive_batching.batching.shape import BatchShape
from adaptive_batching.errors import ConfigError
from adaptive_batching.faults import checkpoints as checkpointing
from adaptive_batching.faults import restart
from adaptive_batching.faults.recovery import OomRecovery
from adaptive_batching.runtime.distributed import ParallelInfo, barrier
from adaptive_batching.training.model import (
    FinetuneMethod,
    full_optimizer_state_dict,
    full_state_dict,
    load_optimizer_state_dict,
)


@dataclass
class Progress:
    """Epochs done, optimizer steps done in the current epoch and in all, and the optimizer step of the
    last complete checkpoint (None before the first save)."""

    epochs_run: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    saved_step: Optional[int] = None

    def where(self) -> str:
        return (f"step {self.step_in_epoch} of epoch {self.epochs_run + 1}" if self.step_in_epoch
                else f"the end of epoch {self.epochs_run}")

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "epoch": self.epochs_run, "step_in_epoch": self.step_in_epoch}


def loader_state(restored: dict[str, Any], *, elastic: bool, ranks: int, reference: BatchShape,
                 info: Callable[[str], None]) -> Optional[dict[str, Any]]:
    """The resumed run's saved loader position, taken out of ``restored`` (it serves once). An elastic run
    resumed on another number of ranks has the same global batch, so the same samples per step: it starts at
    the saved step instead."""
    state = restored.pop("dataloader", None)
    if state and elastic and restored.get("ranks") != ranks:
        info(f"Resuming on {ranks} rank(s) instead of {restored['ranks']}: the same global batch "
             f"{reference.global_batch}, as {reference.describe()}")
        return None
    return state


def check_resumable_on(checkpoint: dict[str, Any], ranks: int, *, elastic: bool, info: Callable[[str], None]) -> None:
    """A run saved inside an epoch resumes there on its own number of ranks only (each rank's place in the data is
    saved), unless its global batch is elastic; from an epoch's end another number of ranks changes the global
    batch, which is said in one line. Checked before any model is built."""
    saved = checkpoint.get(checkpointing.ADAPTIVE_KEY) or {}
    saved_ranks = saved.get("ranks", saved.get("data_parallel"))
    if saved_ranks is None or saved_ranks == ranks or elastic:
        return
    if saved.get("step_in_epoch"):
        raise ConfigError(
            f"the checkpoint was saved inside epoch {checkpoint.get(training.EPOCHS_KEY, 0) + 1} on {saved_ranks} "
            f"rank(s); resume it on {saved_ranks} rank(s) (tune run --nproc_per_node {saved_ranks} ...), or give a run "
            "that must change ranks an elastic global batch (adaptive_batching.elastic)")
    info(f"Resuming on {ranks} rank(s) instead of {saved_ranks}: the global batch follows the ranks (batch_size x "
         "gradient_accumulation_steps x ranks); adaptive_batching.elastic keeps it across a change of ranks")


class Checkpoints:
    """Saves the weights with everything an exact resume needs, and restores a run from them."""

    def __init__(self, checkpointer: Any, method: FinetuneMethod, parallel: ParallelInfo, device: torch.device,
                 info: Callable[[str], None], *, total_epochs: int, max_steps_per_epoch: Optional[int]) -> None:
        self.checkpointer = checkpointer
        self.method = method
        self.parallel, self.device = parallel, device
        self.info = info
        self.total_epochs, self.max_steps_per_epoch = total_epochs, max_steps_per_epoch

    def restore(self, checkpoint: dict[str, Any], *, seed: int, progress: Progress, recovery: OomRecovery,
                model: torch.nn.Module, optimizer: torch.optim.Optimizer, output_dir: Path) -> tuple[dict[str, Any], int]:
        """Put ``progress``, ``recovery`` and the optimizer where the saved run stood (the end of an epoch, or a
        step inside one); return the saved adaptive state and the run's seed."""
        if checkpoint.get(training.SEED_KEY, seed) != seed:
            self.info(f"Using the checkpoint's seed {checkpoint[training.SEED_KEY]} instead of {seed}")
            seed = checkpoint[training.SEED_KEY]
        resumed = dict(checkpoint[checkpointing.ADAPTIVE_KEY])
        if "data_parallel" in resumed:  # saved before "ranks" was the one word for it
            resumed["ranks"] = resumed.pop("data_parallel")
        progress.epochs_run = checkpoint[training.EPOCHS_KEY]
        progress.global_step = progress.saved_step = resumed["global_step"]
        progress.step_in_epoch = resumed.get("step_in_epoch", 0)
        recovery.load_state_dict(resumed)
        recorded = restart.recorded_cut(output_dir)
        if recorded is not None and recovery.adopt(recorded["recovery"]):
            # The saved loader position was for the old cut; the same samples come from the step index.
            resumed.pop("dataloader", None)
            capped = f", micro batch capped at {recovery.oom_cap}" if recovery.oom_cap is not None else ""
            self.info(f"Resuming under the cut recorded after an out-of-memory error at optimizer step "
                      f"{recorded.get('step')}: micro batches run as {recovery.split} piece(s){capped}")
        load_optimizer_state_dict(model, optimizer, checkpoint[training.OPT_KEY], self.parallel, self.device)
        cap = "" if recovery.oom_cap is None else f"; micro batch capped at {recovery.oom_cap} after an earlier OOM"
        self.info(f"Resuming at {progress.where()} (optimizer step {progress.global_step}){cap}")
        return resumed, seed

    def save(self, epoch: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int,
             progress: Progress, adaptive_state: Callable[[], dict[str, Any]]) -> None:
        """Write the weights and the full recipe state, at the end of an epoch or inside one.

        Both go to ``epoch_{epoch}``, swapped in whole (see checkpoints): a kill at any moment leaves
        the previous checkpoint or the new one, complete. A save inside an epoch is replaced by the one at its end.
        """
        start = time.perf_counter()
        weights = full_state_dict(model, self.parallel, self.device, trainable_only=self.method.adapter_only)
        optimizer_state = full_optimizer_state_dict(model, optimizer, self.parallel, self.device)
        if self.parallel.is_rank_zero:
            state = self.method.checkpoint_entries(weights)
            state.update(checkpointing.recipe_state(
                seed=seed, epochs_run=progress.epochs_run, total_epochs=self.total_epochs,
                max_steps_per_epoch=self.max_steps_per_epoch, optimizer_state=optimizer_state,
                adaptive_state=adaptive_state(),
            ))
            folder = checkpointing.save_checkpoint_atomically(
                self.checkpointer, state, epoch=epoch, adapter_only=self.method.adapter_only,
                record={"global_step": progress.global_step, "epoch": epoch,
                        "step_in_epoch": progress.step_in_epoch, "epochs_run": progress.epochs_run,
                        "total_epochs": self.total_epochs, "job_id": restart.job_id()},
            )
            what = f"step {progress.step_in_epoch} of epoch {epoch + 1}" if progress.step_in_epoch \
                else f"epoch {epoch + 1}"
            self.info(f"Saved the checkpoint of {what} (optimizer step {progress.global_step}) to {folder} "
                      f"in {time.perf_counter() - start:.1f} s")
        barrier(self.parallel)
        progress.saved_step = progress.global_step
