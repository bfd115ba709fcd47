"""What the trainer does about an out-of-memory error in a training step.

The decisions (cut, cap, grow back, the growing wait) are :class:`~adaptive_batching.faults.recovery.OomRecovery`'s;
this part of the trainer acts on them: serve the same step again in smaller pieces, grow back at a step
boundary, record the cut and exit for a torchrun restart outside a guard window, or save and stop when
even one sample does not fit. Mixed into :class:`~adaptive_batching.training.trainer.Trainer`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from adaptive_batching.errors import OutOfMemoryStop
from adaptive_batching.faults import restart
from adaptive_batching.faults.guard import piece_size
from adaptive_batching.faults.oom import is_out_of_memory
from adaptive_batching.profiling.run import remember_out_of_memory
from adaptive_batching.runtime import memory


class OomHandling:
    """The trainer's response to an OOM (see the module docstring); uses the trainer's state."""

    recovery: Any
    batching: Any
    batch: Any

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
                path = remember_out_of_memory(self.profile_context(), self.profile_result, limit)
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
            remember_out_of_memory(self.profile_context(), self.profile_result,
                                   self.recovery.cache_cap(self.profile_result.micro_batch))
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

