"""What the trainer does about an out-of-memory error in a training step.

The decisions (cut, cap, grow back, the growing wait) are :class:`~adaptive_batching.faults.recovery.OomRecovery`'s;
this object acts on them through the :class:`~adaptive_batching.training.feed.Feed`: serve the same step again in
smaller pieces, grow back at a step boundary, record the cut and exit for a torchrun restart outside a guard
window, or save and stop when even one sample does not fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import torch

from adaptive_batching.core import logs
from adaptive_batching.errors import OutOfMemoryStop, UnguardedOutOfMemory
from adaptive_batching.faults import restart
from adaptive_batching.faults.guard import StepGuard
from adaptive_batching.faults.oom import is_out_of_memory
from adaptive_batching.profiling.profiler import StartupProfiler
from adaptive_batching.runtime import memory
from adaptive_batching.runtime.distributed import ParallelInfo
from adaptive_batching.training.feed import Feed
from adaptive_batching.training.state import Checkpoints, Progress


class OomResponse:
    """The response to an OOM in training (see the module docstring). ``checkpoints`` saves what is done before a
    stop; the cut goes into ``profiler``'s cache."""

    def __init__(
        self,
        feed: Feed,
        progress: Progress,
        *,
        parallel: ParallelInfo,
        device: torch.device,
        guard: StepGuard,
        output_dir: Path,
        checkpoints: Checkpoints,
        profiler: StartupProfiler,
    ) -> None:
        self.feed, self.progress = feed, progress
        self.parallel, self.device, self.guard = parallel, device, guard
        self.output_dir = output_dir
        self.checkpoints, self.profiler = checkpoints, profiler
        self.process_group_broken = False

    def _where(self, epoch: int, index: int) -> str:
        return f"step {index + 1} of epoch {epoch + 1} (optimizer step {self.progress.global_step + 1})"

    def after_out_of_memory(self, epoch: int, index: int) -> None:
        """Serve the same step again in smaller micro batches, for the rest of the run; stop if 1 sample is too many."""
        feed, recovery = self.feed, self.feed.recovery
        failed = feed.largest_piece(index)
        where = self._where(epoch, index)
        first = recovery.oom_cap is None and recovery.split == 1
        cap = recovery.out_of_memory(failed, feed.batch.micro_batch)
        if cap is None:
            self.stop_out_of_memory(epoch, where)
        if self.device.type == "cpu" and first and memory.pin_cpu_allocator():
            logs.info("glibc set to return freed tensors' memory at once, so the smaller micro batch keeps fitting")
            memory.release_memory(self.device)
        feed.serve(epoch, start_step=index)
        logs.info(
            feed.batching.oom_line(
                failed=failed,
                where=where,
                error=self.guard.last_error,
                samples=feed.samples_in_step(index),
                split=feed.split,
                micro_piece=feed.micro_piece,
                batch=feed.batch,
                ranks=self.parallel.world_size,
                cap=cap,
            )
        )
        self.profiler.remember_cap(recovery.cache_cap, any_rank=False)

    def maybe_grow_back(self, epoch: int) -> None:
        """After ``oom_grow_back_after`` clean steps under a cut, undo one level of it (at a step boundary)."""
        feed, recovery = self.feed, self.feed.recovery
        if not recovery.grow_back_due():
            return
        waited, before = recovery.state.wait, feed.micro_piece
        assert waited is not None, "a grow-back follows an out-of-memory cut, which starts the wait"
        recovery.grow_back(feed.batch.micro_batch)
        if self.progress.step_in_epoch < feed.epoch_steps:
            feed.serve(epoch, start_step=self.progress.step_in_epoch)
        logs.info(
            feed.batching.grow_back_line(
                waited=waited, before=before, micro_piece=feed.micro_piece, split=feed.split, cap=recovery.oom_cap
            )
        )

    def stop_for_restart(self, epoch: int, index: int, error: str) -> NoReturn:
        """An OOM outside a guard window: the other ranks cannot be told, so record the cut the rest of the
        run needs (output folder and profile cache) and exit; torchrun's agent stops the other ranks and,
        with ``--max-restarts``, restarts the job, which resumes under the cut."""
        feed = self.feed
        failed = feed.largest_piece(index)
        feed.recovery.out_of_memory(failed, feed.batch.micro_batch)
        path = restart.record_cut(
            self.output_dir,
            feed.recovery.state_dict(),
            step=self.progress.global_step + 1,
            failed_micro_batch=failed,
            rank=self.parallel.rank,
            job_id=restart.job_id(),
        )
        self.profiler.remember_cap(feed.recovery.cache_cap, any_rank=True)
        self.process_group_broken = True  # the other ranks wait in a collective this rank never joins
        cut = feed.batching.cut_description(feed.split, feed.micro_piece)
        raise OutOfMemoryStop(
            f"rank {self.parallel.rank}: out of memory at micro batch {failed} in {self._where(epoch, index)}, outside "
            f"the guard window ({error}). Recorded the cut ({cut}) in {path}. Under torchrun with --max-restarts the "
            f"job restarts and resumes by itself from the last complete checkpoint (optimizer step "
            f"{self.progress.saved_step}); otherwise continue with resume_from_checkpoint=True, which resumes under "
            f"the same cut."
        )

    def stop(self, error: Exception, epoch: int, index: int, *, retries: bool) -> NoReturn:
        """Stop after an OOM the step did not recover from in place: outside a guard window (``UnguardedOutOfMemory``,
        with several ranks), or in a step that cannot be retried (``retries`` False: optimizer_in_bwd)."""
        if not retries:
            self.stop_not_retried(epoch, index, str(error), broken=isinstance(error, UnguardedOutOfMemory))
        self.stop_for_restart(epoch, index, str(error))

    def stop_not_retried(self, epoch: int, index: int, error: str, *, broken: bool) -> NoReturn:
        """An OOM with ``optimizer_in_bwd``: the step cannot run again in smaller pieces (that needs gradient
        accumulation), and its backward may have stepped part of the model, which must not be saved or trained
        on. Stop; the last complete checkpoint stays as it was. ``broken``: other ranks were not told (outside
        a guard window)."""
        self.process_group_broken = broken
        failed = self.feed.largest_piece(index)
        saved = (
            f"the last complete checkpoint (optimizer step {self.progress.saved_step}) is in {self.output_dir}"
            if self.progress.saved_step is not None
            else "nothing was saved yet"
        )
        raise OutOfMemoryStop(
            f"out of memory at micro batch {failed} in {self._where(epoch, index)} ({error}). With "
            f"optimizer_in_bwd=True a step is not run again in smaller micro batches (that needs gradient "
            f"accumulation), and its backward may already have stepped part of the model, so the run stops without "
            f"saving it; {saved}. Continue with resume_from_checkpoint=True and a smaller micro batch "
            f"(adaptive_batching.memory_fraction lower, or optimizer_in_bwd=False to recover in place)."
        )

    def stop_out_of_memory(self, epoch: int, where: str) -> NoReturn:
        """Save what is done (the state before this step is whole) and stop with what to change."""
        progress, output_dir = self.progress, self.output_dir
        # Every size down to 1 failed in this step, so no cap is known to be safe: a resume starts from the plan.
        self.feed.recovery.give_up()
        if progress.global_step == 0:
            saved = "nothing was trained yet, so no checkpoint was written"
        elif progress.saved_step != progress.global_step:
            self.feed.serve(epoch, start_step=progress.step_in_epoch)  # the loader's position: before this step
            try:
                self.checkpoints.save(epoch)
                saved = f"saved the checkpoint of optimizer step {progress.global_step} in {output_dir}"
            except Exception as error:  # noqa: BLE001 - the previous checkpoint is still whole
                if not is_out_of_memory(error):
                    raise
                saved = (
                    f"saving ran out of memory too; the last complete checkpoint (optimizer step "
                    f"{progress.saved_step}) is in {output_dir}"
                )
        else:
            saved = f"the checkpoint of optimizer step {progress.global_step} in {output_dir} is up to date"
        raise OutOfMemoryStop(
            f"a micro batch of 1 sample does not fit in memory in {where} ({self.guard.last_error}); {saved}. "
            "Free memory (a shorter tokenizer.max_seq_len, enable_activation_checkpointing=True, more ranks, "
            "a smaller model) and continue with resume_from_checkpoint=True."
        )
