"""Where a run stands, and its checkpoints: what is saved besides the weights and optimizer, and how a run
continues from it (at the end of an epoch or at a step inside one).

The adaptive state holds one entry per part of the run, each part's own ``state_dict()`` under its key
(``progress``, ``feed``, ``plan``, ``lr``, ``noise_scale``, ``profile``), as torchtitan's ``Stateful`` parts;
it travels inside the checkpoint folder with the weights (see :mod:`~adaptive_batching.faults.checkpoints`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torchtune import training

from adaptive_batching.core import logs
from adaptive_batching.core.method import FinetuneMethod
from adaptive_batching.errors import ConfigError
from adaptive_batching.faults import checkpoints as checkpointing
from adaptive_batching.faults import restart
from adaptive_batching.faults.preemption import Preemption
from adaptive_batching.runtime.distributed import ParallelInfo, barrier
from adaptive_batching.training.feed import Feed
from adaptive_batching.training.model import full_optimizer_state_dict, full_state_dict, load_optimizer_state_dict


@dataclass
class Progress:
    """Epochs done, optimizer steps done in the current epoch and in all, and the optimizer step of the
    last complete checkpoint (None before the first save)."""

    epochs_run: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    saved_step: int | None = None

    def where(self) -> str:
        return (
            f"step {self.step_in_epoch} of epoch {self.epochs_run + 1}"
            if self.step_in_epoch
            else f"the end of epoch {self.epochs_run}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "epoch": self.epochs_run, "step_in_epoch": self.step_in_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Where the saved run stood; it was saved there, so ``saved_step`` too."""
        self.epochs_run = int(state["epoch"])
        self.global_step = self.saved_step = int(state["global_step"])
        self.step_in_epoch = int(state["step_in_epoch"])


STATE_VERSION = 2
"""The adaptive state's format. Until the first release it changes without a migration; from then on see
docs/contributing.md ("Each part owns its state")."""


def read_state(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's adaptive state, one entry per part, if it is in this version's format; another format
    fails in one line naming both versions, before any model is built (its parts' keys would not be ours)."""
    version = saved.get("version", 1)
    if version != STATE_VERSION:
        raise ConfigError(
            f"the checkpoint to resume holds adaptive state format version {version}, and this adaptive-batching "
            f"reads version {STATE_VERSION} only: start a fresh output_dir, or resume it with the adaptive-batching "
            "version that wrote it"
        )
    return dict(saved)


class SavedState:
    """A resumed checkpoint's adaptive state, each part's under its key: :meth:`restore` puts one into its part as
    the part is built (every part alike; a fresh run's is empty, and restores nothing)."""

    def __init__(self, saved: Mapping[str, Any] | None = None) -> None:
        self.saved = read_state(saved) if saved is not None else {}

    def restore(self, key: str, part: Stateful) -> None:
        if self.saved.get(key) is not None:
            part.load_state_dict(self.saved[key])


def check_resumable_on(checkpoint: dict[str, Any], ranks: int, *, elastic: bool) -> None:
    """A run saved inside an epoch resumes there on its own number of ranks only (each rank's place in the data is
    saved), unless its global batch is elastic; from an epoch's end another number of ranks changes the global
    batch, which is said in one line. Checked before any model is built."""
    saved = read_state(checkpoint.get(checkpointing.ADAPTIVE_KEY) or {})
    saved_ranks = saved["feed"].get("ranks")
    if saved_ranks is None or saved_ranks == ranks or elastic:
        return
    if saved["progress"].get("step_in_epoch"):
        raise ConfigError(
            f"the checkpoint was saved inside epoch {checkpoint.get(training.EPOCHS_KEY, 0) + 1} on {saved_ranks} "
            f"rank(s); resume it on {saved_ranks} rank(s) (tune run --nproc_per_node {saved_ranks} ...), or give a run "
            "that must change ranks an elastic global batch (adaptive_batching.elastic)"
        )
    logs.info(
        f"Resuming on {ranks} rank(s) instead of {saved_ranks}: the global batch follows the ranks (batch_size x "
        "gradient_accumulation_steps x ranks); adaptive_batching.elastic keeps it across a change of ranks"
    )


def resume_training(
    checkpoint: dict[str, Any],
    *,
    seed: int,
    feed: Feed,
    progress: Progress,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    parallel: ParallelInfo,
    device: torch.device,
    output_dir: Path,
) -> int:
    """What a resumed run takes from its checkpoint besides its parts' states (:class:`SavedState`): the OOM cut a
    rank recorded before a restart, the optimizer's state where the saved run stood (the end of an epoch, or a step
    inside one) and the seed, which it returns."""
    if checkpoint.get(training.SEED_KEY, seed) != seed:
        logs.info(f"Using the checkpoint's seed {checkpoint[training.SEED_KEY]} instead of {seed}")
        seed = checkpoint[training.SEED_KEY]
    recovery = feed.recovery
    recorded = restart.recorded_cut(output_dir)
    if recorded is not None and feed.adopt_cut(recorded["recovery"]):
        capped = f", micro batch capped at {recovery.oom_cap}" if recovery.oom_cap is not None else ""
        logs.info(
            f"Resuming under the cut recorded after an out-of-memory error at optimizer step "
            f"{recorded.get('step')}: micro batches run as {recovery.split} piece(s){capped}"
        )
    load_optimizer_state_dict(model, optimizer, checkpoint[training.OPT_KEY], parallel, device)
    cap = "" if recovery.oom_cap is None else f"; micro batch capped at {recovery.oom_cap} after an earlier OOM"
    logs.info(f"Resuming at {progress.where()} (optimizer step {progress.global_step}){cap}")
    return seed


@dataclass(frozen=True)
class RunShape:
    """What a checkpoint records of the run's length: its epochs and ``max_steps_per_epoch``."""

    total_epochs: int
    max_steps_per_epoch: int | None


class Checkpoints:
    """Saves the run, as torchtitan's ``CheckpointManager`` does: the weights, the optimizer state and every part
    in ``states`` alike, each part's ``state_dict()`` under its key, with the format's version."""

    def __init__(
        self,
        checkpointer: Any,
        method: FinetuneMethod,
        states: Mapping[str, Stateful],
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        seed: int,
        progress: Progress,
        shape: RunShape,
        parallel: ParallelInfo,
        device: torch.device,
        preemption: Preemption,
    ) -> None:
        self.checkpointer, self.method, self.states = checkpointer, method, states
        self.model, self.optimizer, self.seed, self.progress = model, optimizer, seed, progress
        self.shape, self.parallel, self.device, self.preemption = shape, parallel, device, preemption

    def adaptive_state(self) -> dict[str, Any]:
        """The adaptive part of the recipe state: each part's own state under its key."""
        return {"version": STATE_VERSION, **{key: part.state_dict() for key, part in self.states.items()}}

    def save(self, epoch: int) -> None:
        """Write the weights and the full recipe state, at the end of an epoch or inside one.

        Both go to ``epoch_{epoch}``, swapped in whole (see checkpoints): a kill at any moment leaves
        the previous checkpoint or the new one, complete. A save inside an epoch is replaced by the one at its end.
        """
        start, progress = time.perf_counter(), self.progress
        weights = full_state_dict(self.model, self.parallel, self.device, trainable_only=self.method.adapter_only)
        optimizer_state = full_optimizer_state_dict(self.model, self.optimizer, self.parallel, self.device)
        if self.parallel.is_rank_zero:
            state = self.method.checkpoint_entries(weights)
            state.update(
                checkpointing.recipe_state(
                    seed=self.seed,
                    epochs_run=progress.epochs_run,
                    total_epochs=self.shape.total_epochs,
                    max_steps_per_epoch=self.shape.max_steps_per_epoch,
                    optimizer_state=optimizer_state,
                    adaptive_state=self.adaptive_state(),
                )
            )
            folder = checkpointing.save_checkpoint_atomically(
                self.checkpointer,
                state,
                epoch=epoch,
                adapter_only=self.method.adapter_only,
                record={
                    "global_step": progress.global_step,
                    "epoch": epoch,
                    "step_in_epoch": progress.step_in_epoch,
                    "epochs_run": progress.epochs_run,
                    "total_epochs": self.shape.total_epochs,
                    "job_id": restart.job_id(),
                },
            )
            what = (
                f"step {progress.step_in_epoch} of epoch {epoch + 1}"
                if progress.step_in_epoch
                else f"epoch {epoch + 1}"
            )
            logs.info(
                f"Saved the checkpoint of {what} (optimizer step {progress.global_step}) to {folder} "
                f"in {time.perf_counter() - start:.1f} s"
            )
        barrier(self.parallel)
        progress.saved_step = progress.global_step
        self.preemption.saved()
