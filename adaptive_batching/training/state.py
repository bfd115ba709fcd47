"""The run's state in a checkpoint: what is saved besides the weights and optimizer, and how a run
continues from it (at the end of an epoch or at a step inside one). Mixed into
:class:`~adaptive_batching.training.trainer.Trainer`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from torchtune import training

from adaptive_batching.faults import checkpoints as checkpointing
from adaptive_batching.faults import restart
from adaptive_batching.runtime.distributed import barrier
from adaptive_batching.training.model import full_optimizer_state_dict, full_state_dict, load_optimizer_state_dict


class RunState:
    """Saving and restoring the recipe state (see the module docstring)."""

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
            **self.plan.state_dict(self.epochs_run),
            "segment": self.segment.state_dict(),
            "noise_scale": self.steps.noise.state_dict(),
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

