"""What each optimizer step trains on, and at which LR.

The :class:`Feed` serves an epoch's planned batch through a resumable loader: from a position inside the
epoch, in the part of the epoch a sampler covers (a :class:`~adaptive_batching.growth.interval.Segment`,
new after growth inside the epoch), and with each micro batch cut into ``split`` pieces after an
out-of-memory error (the cut is :class:`~adaptive_batching.faults.recovery.OomRecovery`'s). How a batch
is counted (samples or a token budget) is the batching policy's; the feed only asks it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from adaptive_batching.batching.policy import SampleBatching
from adaptive_batching.batching.shape import BatchShape
from adaptive_batching.faults.guard import StepGuard, piece_size
from adaptive_batching.faults.recovery import OomRecovery
from adaptive_batching.growth.interval import Segment
from adaptive_batching.growth.lr_scaling import SampleDrivenLR


class Feed:
    """The batches of the run (see the module docstring). ``batch`` is the planned shape of the current
    epoch; ``segment`` the part of the epoch the current loader serves."""

    def __init__(self, batching: SampleBatching, recovery: OomRecovery, guard: StepGuard, guard_steps: int,
                 batch: BatchShape) -> None:
        self.batching = batching
        self.recovery = recovery
        self.guard, self.guard_steps = guard, guard_steps
        self.batch = batch
        self.segment = Segment()
        self.lr: Optional[SampleDrivenLR] = None  # set once the plan is made
        self.dataloader: Any = None
        self._batches: Any = None
        self._served: Optional[tuple[int, int, int]] = None  # (micro batch, split, token budget) last served

    @property
    def split(self) -> int:
        """Micro batches each planned one runs as (1 until an OOM)."""
        return self.recovery.split

    @property
    def micro_piece(self) -> int:
        """The most samples one forward sees now: the micro batch, or its largest piece after an OOM."""
        return piece_size(self.batch.micro_batch, self.split)

    @property
    def sampler(self) -> Any:
        return self.dataloader.batch_sampler

    @property
    def epoch_steps(self) -> int:
        """Optimizer steps in the current epoch (all its segments)."""
        return self.segment.start_step + self.sampler.steps

    def plan(self, batch: BatchShape) -> None:
        """From now on serve ``batch`` (an epoch's or a growth period's), under the current cut."""
        self.batch = batch
        self.recovery.plan(batch.micro_batch)

    def serve(self, epoch: int, start_step: int, state: Optional[dict[str, Any]] = None) -> None:
        """Serve ``epoch`` from its step ``start_step`` on; ``state`` (a saved loader state) puts the loader
        where it stood and is checked against the new loader, so a resume with another dataset, seed or
        ranks fails instead of silently training on other samples."""
        self.dataloader = self.batching.loader(epoch, self.split, 0 if state else self.segment.local(start_step),
                                               self.segment)
        served = (self.batch.micro_batch, self.split, self.batching.served(epoch))
        if served != self._served:
            self._served = served
            self.guard.open_window(self.guard_steps)
        if start_step and state:
            self.dataloader.load_state_dict(state)
        self._batches = iter(self.dataloader)

    def continue_after(self, step_in_epoch: int) -> None:
        """The next loader serves the epoch from the first sample not served by step ``step_in_epoch``."""
        served = sum(self.sampler.samples_in_step(i) for i in range(self.segment.local(step_in_epoch)))
        self.segment = Segment(self.segment.first_sample + served, step_in_epoch)

    def next_step(self, index: int) -> list[dict[str, torch.Tensor]]:
        """The micro batches of the epoch's step ``index`` on this rank."""
        return [next(self._batches) for _ in range(self.sampler.step_layout()[self.segment.local(index)])]

    def samples_in_step(self, index: int) -> int:
        """Samples of the epoch's step ``index`` over all ranks."""
        return self.sampler.samples_in_step(self.segment.local(index))

    def set_step_lr(self, index: int) -> None:
        """The LR of step ``index``: for the planned global batch, or for the samples this step holds."""
        assert self.lr is not None
        global_batch = self.batching.lr_global_batch(self.batch, self.sampler, self.segment.local(index))
        if global_batch is not None:
            self.lr.set_global_batch(global_batch)

    def largest_piece(self, index: int) -> int:
        """The most samples a forward of step ``index`` sees, on any rank."""
        return self.batching.largest_piece(self.sampler, self.segment.local(index), self.micro_piece, self.split)

    def split_note(self) -> str:
        return self.batching.split_note(self.split, self.micro_piece, self.batch)

    def describe_epoch(self, epoch: int) -> str:
        return self.batching.describe_epoch(epoch, self.batch, self.sampler, self.split_note())

    def final_batch(self, epochs_run: int) -> str:
        return self.batching.final_batch(epochs_run, self.split, self.micro_piece)

    def metrics(self, epochs_run: int) -> dict[str, float]:
        return self.batching.metrics(epochs_run, self.split, self.micro_piece)

    def state_dict(self, step_in_epoch: int) -> dict[str, Any]:
        """What ran (after an OOM, the planned micro batch cut into ``split``, as the metrics log it), what was
        planned, and where the loader stands inside the epoch."""
        return {
            "micro_batch": self.micro_piece,
            "accumulation": self.batch.accumulation * self.split,
            "planned_micro_batch": self.batch.micro_batch,
            "planned_accumulation": self.batch.accumulation,
            "ranks": self.batch.ranks,
            "dataloader": self.dataloader.state_dict() if step_in_epoch else None,
            **self.recovery.state_dict(),
            **self.batching.state_dict(),
            "segment": self.segment.state_dict(),
        }
