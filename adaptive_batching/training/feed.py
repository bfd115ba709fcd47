"""What each optimizer step trains on, and at which LR.

The :class:`Feed` serves an epoch's planned batch through a resumable loader: from a position inside the
epoch, in the part of the epoch a sampler covers (a :class:`~adaptive_batching.batching.sampler.SamplerSpan`,
new after growth inside the epoch), and with each micro batch cut into ``split`` pieces after an
out-of-memory error (the cut is :class:`~adaptive_batching.faults.recovery.OomRecovery`'s). How a batch
is counted (samples or a token budget) is the batching policy's; the feed only asks it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from adaptive_batching.batching.lr_scaling import SampleDrivenLR
from adaptive_batching.batching.policy import SampleBatching
from adaptive_batching.batching.sampler import SamplerSpan
from adaptive_batching.batching.shape import BatchShape
from adaptive_batching.core import logs
from adaptive_batching.faults.guard import StepGuard, piece_size
from adaptive_batching.faults.recovery import OomRecovery


class Feed:
    """The batches of the run (see the module docstring). ``batch`` is the planned shape of the current
    epoch; ``span`` the part of the epoch the current loader serves. Only the feed's own methods change them:
    :meth:`start_epoch`, :meth:`grow_inside_epoch`, :meth:`end_epoch`, :meth:`serve` (the same batch again, after
    an OOM's cut) and :meth:`load_state_dict`. ``step_in_epoch`` tells where the run stands, for the saved loader
    position; ``elastic``: a resume on other ranks keeps the global batch."""

    def __init__(
        self,
        batching: SampleBatching,
        recovery: OomRecovery,
        guard: StepGuard,
        guard_steps: int,
        batch: BatchShape,
        *,
        step_in_epoch: Callable[[], int],
        elastic: bool = False,
    ) -> None:
        self.batching = batching
        self.recovery = recovery
        self.guard, self.guard_steps = guard, guard_steps
        self.batch = batch
        self.span = SamplerSpan()
        self.step_in_epoch, self.elastic = step_in_epoch, elastic
        self.lr: SampleDrivenLR | None = None  # the schedule, once the plan is made (:meth:`follow`)
        self.dataloader: Any = None
        self._batches: Any = None
        self._served: tuple[int, int, int] | None = None  # (micro batch, split, token budget) last served
        self._saved_position: dict[str, Any] | None = None  # a resumed run's loader state, served once
        self._saved_ranks: int | None = None

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
        """Optimizer steps in the current epoch (all its spans)."""
        return self.span.start_step + self.sampler.steps

    def follow(self, lr: SampleDrivenLR) -> None:
        """Set each step's LR on ``lr`` from now on."""
        self.lr = lr

    def use_batch(self, batch: BatchShape) -> None:
        """From now on serve ``batch`` (an epoch's or a growth period's), under the current cut."""
        self.batch = batch
        self.recovery.split_for(batch.micro_batch)

    def start_epoch(self, epoch: int, batch: BatchShape) -> None:
        """Serve ``epoch`` at its planned ``batch`` from where the run stands in it (a resumed run's saved loader
        position, once), at the LR of that step."""
        step = self.step_in_epoch()
        self.use_batch(batch)
        self.serve(epoch, start_step=step, state=self._take_saved_position())
        self.set_step_lr(step)

    def grow_inside_epoch(self, epoch: int, step: int, batch: BatchShape) -> None:
        """Serve the rest of ``epoch`` after its step ``step`` at ``batch``, from the first sample not served."""
        self.continue_after(step)
        self.use_batch(batch)
        self.serve(epoch, start_step=step)
        self.set_step_lr(step)

    def end_epoch(self) -> None:
        """The next epoch is served from its start by one sampler."""
        self.span = SamplerSpan()

    def _take_saved_position(self) -> dict[str, Any] | None:
        """The resumed run's saved loader position (it serves once). An elastic run resumed on another number of
        ranks has the same global batch, so the same samples per step: it starts at the saved step instead."""
        state, self._saved_position = self._saved_position, None
        if state and self.elastic and self._saved_ranks != self.batch.ranks:
            logs.info(
                f"Resuming on {self.batch.ranks} rank(s) instead of {self._saved_ranks}: the same global batch "
                f"{self.batch.global_batch}, as {self.batch.describe()}"
            )
            return None
        return state

    def adopt_cut(self, recorded: dict[str, Any]) -> bool:
        """Take a rank's cut recorded before a restart, if deeper than the saved one (whose loader position was
        for the old cut: the same samples then come from the step index)."""
        deeper = self.recovery.adopt(recorded)
        if deeper:
            self._saved_position = None
        return deeper

    def serve(self, epoch: int, start_step: int, state: dict[str, Any] | None = None) -> None:
        """Serve ``epoch`` from its step ``start_step`` on; ``state`` (a saved loader state) puts the loader
        where it stood and is checked against the new loader, so a resume with another dataset, seed or
        ranks fails instead of silently training on other samples."""
        self.dataloader = self.batching.loader(
            epoch, self.split, 0 if state else self.span.local(start_step), self.span
        )
        served = (self.batch.micro_batch, self.split, self.batching.served(epoch))
        if served != self._served:
            self._served = served
            self.guard.open_window(self.guard_steps)
        if start_step and state:
            self.dataloader.load_state_dict(state)
        self._batches = iter(self.dataloader)

    def continue_after(self, step_in_epoch: int) -> None:
        """The next loader serves the epoch from the first sample not served by step ``step_in_epoch``."""
        served = sum(self.sampler.samples_in_step(i) for i in range(self.span.local(step_in_epoch)))
        self.span = SamplerSpan(self.span.first_sample + served, step_in_epoch)

    def next_step(self, index: int) -> list[dict[str, torch.Tensor]]:
        """The micro batches of the epoch's step ``index`` on this rank."""
        return [next(self._batches) for _ in range(self.sampler.step_layout()[self.span.local(index)])]

    def samples_in_step(self, index: int) -> int:
        """Samples of the epoch's step ``index`` over all ranks."""
        return self.sampler.samples_in_step(self.span.local(index))

    def set_step_lr(self, index: int) -> None:
        """The LR of step ``index``: for the planned global batch, or for the samples this step holds."""
        assert self.lr is not None
        global_batch = self.batching.lr_global_batch(self.batch, self.sampler, self.span.local(index))
        if global_batch is not None:
            self.lr.set_global_batch(global_batch)

    def largest_piece(self, index: int) -> int:
        """The most samples a forward of step ``index`` sees, on any rank."""
        return self.batching.largest_piece(self.sampler, self.span.local(index), self.micro_piece, self.split)

    def split_note(self) -> str:
        return self.batching.split_note(self.split, self.micro_piece, self.batch)

    def describe_epoch(self, epoch: int) -> str:
        return self.batching.describe_epoch(epoch, self.batch, self.sampler, self.split_note())

    def final_batch(self, epochs_run: int) -> str:
        return self.batching.final_batch(epochs_run, self.split, self.micro_piece)

    def metrics(self, epochs_run: int) -> dict[str, float]:
        return self.batching.metrics(epochs_run, self.split, self.micro_piece)

    def state_dict(self) -> dict[str, Any]:
        """What ran (after an OOM, the planned micro batch cut into ``split``, as the metrics log it), what was
        planned, where the loader stands inside the epoch, the OOM cut and the batching's own state."""
        return {
            "micro_batch": self.micro_piece,
            "accumulation": self.batch.accumulation * self.split,
            "planned_micro_batch": self.batch.micro_batch,
            "planned_accumulation": self.batch.accumulation,
            "ranks": self.batch.ranks,
            "dataloader": self.dataloader.state_dict() if self.step_in_epoch() else None,
            "span": self.span.state_dict(),
            "recovery": self.recovery.state_dict(),
            "batching": self.batching.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed run's cut, span and loader position (served by the first :meth:`start_epoch`)."""
        self.recovery.load_state_dict(state["recovery"])
        self.batching.load_state_dict(state["batching"])
        self.span = SamplerSpan.from_state(state["span"])
        self._saved_position, self._saved_ranks = state.get("dataloader"), state.get("ranks")
