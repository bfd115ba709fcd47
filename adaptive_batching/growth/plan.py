"""The batch over the whole run: the plan made before training, and its growth while training.

One state machine for growth. The plan fixes every epoch's batch from the growth function and the memory
cap (:func:`~adaptive_batching.growth.planning.plan_batches`). While training it changes in two ways only:

* at an epoch start, a growth function that reads training statistics decides that epoch's increment
  from what the run measured, and the epochs from there are planned again;
* with ``adaptive_batching.growth_interval`` in steps or samples, at each growth period the function
  decides the batch in force from then on (the rest of this epoch and the later ones).

Both decisions are saved (``state_dict``) so a resumed run plans the same batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from adaptive_batching.batching.elastic import ElasticSpec, shape_at
from adaptive_batching.batching.shape import BatchShape, EpochBatch, shape_keeping_global_batch
from adaptive_batching.core import logs
from adaptive_batching.errors import ConfigError
from adaptive_batching.growth.planning import (
    checked_increment,
    describe_plan,
    epoch_switch_reason,
    grow_entry,
    plan_batches,
    seen_size,
)
from adaptive_batching.growth.settings import GrowthSettings
from adaptive_batching.growth.statistics import accepts_stats, call_increase, noise_scale, unwrapped


@dataclass(frozen=True)
class Start:
    """Where the plan starts: epoch 1's micro batch and accumulation, the memory cap on growth, and the
    reference batch for LR scaling (the config's, or the elastic choice for these ranks)."""

    micro_batch: int
    accumulation: int
    memory_cap: int | None
    reference: BatchShape


def reference_batch(batch_size: int, accumulation: int, elastic: ElasticSpec | None, ranks: int) -> BatchShape:
    """The batch as written in the config (``batch_size``, ``gradient_accumulation_steps``), or the elastic global
    batch at these ranks: the reference for LR scaling and the LR schedule. An elastic spec that does not fit these
    ranks fails here, before any model loads."""
    reference = BatchShape(batch_size, accumulation, ranks)
    if elastic is None:
        return reference
    try:
        return shape_at(elastic, ranks)[1]
    except ValueError as error:
        raise ConfigError(f"config key 'adaptive_batching.elastic': {error}") from None


def starting_batch(
    growth: GrowthSettings,
    elastic: ElasticSpec | None,
    reference: BatchShape,
    ranks: int,
    profiled: int | None,
    *,
    use_maximum_batch_size: bool,
    optimizer_in_bwd: bool,
) -> Start:
    """Epoch 1's batch from the mode asked for: an elastic global batch, the config's global batch kept
    (``keep_global_batch``), the profiled micro batch (``use_maximum_batch_size``), or ``batch_size``."""
    if elastic is not None:
        try:
            choice, reference = shape_at(elastic, ranks, memory_cap=profiled)
        except ValueError as error:
            raise ConfigError(
                f"config key 'adaptive_batching.elastic' with the profiled micro batch {profiled}: {error}"
            ) from None
        logs.info(
            f"{choice.describe()}; this run: {reference.describe()} "
            "(batch_size and gradient_accumulation_steps in the config are not used)"
        )
        return Start(reference.micro_batch, reference.accumulation, None, reference)
    if growth.keep_global_batch:
        assert profiled is not None, "keep_global_batch needs use_maximum_batch_size (validate_config), so a profile"
        shape, why = shape_keeping_global_batch(reference.global_batch, ranks, profiled)
        if optimizer_in_bwd and shape.accumulation > 1:
            raise ConfigError(
                f"config keys 'adaptive_batching.keep_global_batch' = True and 'optimizer_in_bwd' = True: the "
                f"config's global batch {reference.global_batch} needs {reference.global_batch // ranks} samples per "
                f"forward on each of {ranks} rank(s), above the profiled micro batch {profiled}, and an optimizer "
                f"stepped inside the backward cannot accumulate; lower batch_size x gradient_accumulation_steps to "
                f"at most {profiled * ranks}, or set one of the two keys to false"
            )
        logs.info(
            f"Keeping the config's global batch {reference.global_batch}: {shape.describe()} ({why}); LR unchanged"
        )
        return Start(shape.micro_batch, shape.accumulation, None, reference)
    micro_batch = profiled if profiled is not None and use_maximum_batch_size else reference.micro_batch
    return Start(micro_batch, reference.accumulation, profiled, reference)


class BatchPlan:
    """Every epoch's batch, and how it grows (see the module docstring)."""

    def __init__(
        self, settings: GrowthSettings, epochs: int, ranks: int, epochs_run: Callable[[], int] = lambda: 0
    ) -> None:
        self.fn = settings.increase
        self.grow_past_memory: str = settings.grow_past_memory
        self.interval = settings.growth_interval
        self.epochs, self.ranks, self.epochs_run = epochs, ranks, epochs_run
        self._grown: Mapping[str, Any] | None = None  # a resumed run's batch grown inside its epoch
        self.entries: list[EpochBatch] = []
        self.measured: dict[int, int] = {}  # epoch -> what a statistics-reading function returned at its start
        self.start, self.accumulation = 1, 1
        self.memory_cap: int | None = None
        self.start_global_batch = 1

    def _function(self) -> Callable[..., int]:
        """The growth function, which only a growing run calls."""
        assert self.fn is not None, "the batch grows only with a batch_increase_function"
        return self.fn

    @property
    def grows_per_epoch(self) -> bool:
        return self.fn is not None and self.interval.per_epoch

    @property
    def grows_inside_epochs(self) -> bool:
        return self.fn is not None and not self.interval.per_epoch

    def make(self, *, start: int, accumulation: int, memory_cap: int | None) -> list[EpochBatch]:
        """The plan from ``start`` (micro batch) and ``accumulation``, with what a resumed run had decided."""
        self.start, self.accumulation, self.memory_cap = start, accumulation, memory_cap
        self.entries = self._plan()
        self.start_global_batch = self.entries[0].shape.global_batch  # before any growth inside an epoch
        grown, epoch = self._grown, self.epochs_run()
        if grown is not None:
            shape = BatchShape(grown["micro_batch"], grown["accumulation"], self.ranks)
            self.continue_with(
                EpochBatch(epoch, grown["requested"], grown["increment"], shape, grown["reason"], memory_cap), epoch
            )
        return self.entries

    def _plan(self) -> list[EpochBatch]:
        return plan_batches(
            epochs=self.epochs,
            start=self.start,
            accumulation=self.accumulation,
            ranks=self.ranks,
            memory_cap=self.memory_cap,
            increase=self._increase if self.grows_per_epoch else None,
            grow_past_memory=self.grow_past_memory,
        )

    def _increase(self, epoch: int, current: int) -> int:
        """The growth function as the plan calls it: an increment measured at an epoch start, where one was."""
        if epoch in self.measured:
            return self.measured[epoch]
        return self._function()(epoch, current)

    def measure_at_epoch_start(self, epoch: int, stats: Mapping[str, Any]) -> int | None:
        """Let a statistics-reading function decide ``epoch``'s increment now and plan the epochs again
        (the list is changed in place); the increment, or None when nothing was asked."""
        if not self.grows_per_epoch or epoch == 0 or epoch in self.measured or not accepts_stats(self._function()):
            return None
        self.measured[epoch] = int(call_increase(self._function(), epoch, self.entries[epoch - 1].requested, stats))
        self.entries[:] = self._plan()
        return self.measured[epoch]

    def period_after_step(self, steps: int, samples: int, step_samples: int) -> int | None:
        """The growth period that starts after a step of ``step_samples`` samples that brought the run to
        ``steps`` optimizer steps and ``samples`` samples, or None."""
        if not self.grows_inside_epochs:
            return None
        now = self.interval.period(steps, samples)
        return now if now > self.interval.period(steps - 1, samples - step_samples) else None

    def grow_in_period(self, epoch: int, period: int, stats: Mapping[str, Any]) -> tuple[EpochBatch, EpochBatch]:
        """The batch from growth period ``period`` on (inside ``epoch``): the entry before and the new one."""
        previous = self.entries[epoch]
        fn = self._function()
        inc = checked_increment(
            lambda p, c: call_increase(fn, p, c, stats), period, seen_size(previous, self.grow_past_memory)
        )
        entry = grow_entry(
            previous,
            inc,
            epoch=epoch,
            accumulation=self.accumulation,
            ranks=self.ranks,
            memory_cap=self.memory_cap,
            grow_past_memory=self.grow_past_memory,
        )
        self.continue_with(entry, epoch)
        return previous, entry

    def continue_with(self, entry: EpochBatch, epoch: int) -> None:
        """``entry`` is the batch from ``epoch`` on; the list is changed in place."""
        self.entries[epoch:] = [
            EpochBatch(e, entry.requested, entry.increment, entry.shape, entry.reason, entry.memory_cap)
            for e in range(epoch, self.epochs)
        ]

    def describe(
        self,
        plan_rows: Callable[..., list[str]],
        extents: list[tuple[int, int]],
        reference_global_batch: int,
        rule: str,
        total_steps: int,
        sized_for: str = "",
    ) -> str:
        """The batch plan as logged: a header line, then a table row per epoch (``plan_rows`` adds the
        batching policy's columns); ``sized_for`` names the worst-case sample the memory cap was measured with."""
        header, *rows = describe_plan(self.entries)
        rows = plan_rows(rows, extents, reference_global_batch, rule)
        grows = (
            f"; the batch grows {self.interval.describe()}, so the rows show where it starts"
            if self.grows_inside_epochs
            else ""
        )
        note = self.unmeasurable_note()
        return (
            "Batch plan (micro batch = samples per forward per rank; global batch = micro x accumulation x ranks; "
            f"reference global batch {reference_global_batch} from the config; LR scaling '{rule}'; "
            f"LR schedule over {total_steps} reference steps{grows}"
            f"{f'; memory cap measured with worst-case samples of {sized_for}' if sized_for else ''}):\n"
            + "\n".join([header, *rows, *([note] if note else [])])
        )

    def unmeasurable_note(self) -> str | None:
        """A line when the growth function reads the gradient noise scale but no step can measure it: the estimate
        compares a micro batch's gradient with its step's, so it needs two or more micro batches per rank."""
        reads_noise = self.fn is not None and unwrapped(self.fn) is noise_scale
        if not reads_noise or not self.entries or self.entries[0].shape.accumulation > 1:
            return None
        return (
            "Note: growth from the gradient noise scale cannot measure it here: every optimizer step runs one micro "
            "batch per rank, and the estimate needs two or more (set gradient_accumulation_steps >= 2); the batch "
            "will not grow"
        )

    def switch_reason(self, epoch: int) -> str:
        """Why ``epoch`` starts at its batch, for the epoch-switch log line."""
        if self.grows_inside_epochs:
            return f"the batch grows {self.interval.describe()}, not at epoch starts"
        return epoch_switch_reason(self.entries[epoch - 1], self.entries[epoch])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A resumed run's decisions, which :meth:`make` plans with."""
        self.measured = {int(k): v for k, v in (state.get("measured_increments") or {}).items()}
        self._grown = state.get("grown")

    def state_dict(self) -> dict[str, Any]:
        """The decisions made while training: measured increments, and the batch grown inside epochs."""
        grown, epochs_run = None, self.epochs_run()
        if self.grows_inside_epochs and epochs_run < len(self.entries):
            entry = self.entries[epochs_run]
            grown = {
                "requested": entry.requested,
                "increment": entry.increment,
                "reason": entry.reason,
                "micro_batch": entry.shape.micro_batch,
                "accumulation": entry.shape.accumulation,
            }
        return {"measured_increments": {str(k): v for k, v in self.measured.items()}, "grown": grown}
