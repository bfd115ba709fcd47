"""Batching policies: how an epoch's samples become micro batches, one interface, two implementations.

:class:`SampleBatching` puts a fixed number of samples in each micro batch; :class:`TokenBatching`
fills each micro batch up to a token budget (padded tokens). Each builds the epoch's sampler and
loader, knows its steps and the samples in each, says how to cut and grow back after an OOM (its
``cuts``), describes itself for the plan, the logs and the metrics, and saves and loads its state.
The trainer never asks which one it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from adaptive_batching.batching import worst_case
from adaptive_batching.batching.checks import check_plan_against_data, lr_factor_warnings
from adaptive_batching.batching.data import build_dataloader, build_token_dataloader
from adaptive_batching.batching.lr_scaling import lr_factor
from adaptive_batching.batching.sampler import SamplerSpan, epoch_extent
from adaptive_batching.batching.settings import BatchingSettings
from adaptive_batching.batching.shape import BatchShape, EpochBatch
from adaptive_batching.batching.token_sampler import budget_lengths, padding_waste
from adaptive_batching.batching.worst_case import LengthSource, WorstCase
from adaptive_batching.core import logs
from adaptive_batching.core.steps import StepMemory
from adaptive_batching.errors import OutOfMemoryStop
from adaptive_batching.faults.guard import piece_size
from adaptive_batching.faults.oom import is_out_of_memory
from adaptive_batching.faults.recovery import Cuts, SampleCuts, TokenCuts
from adaptive_batching.runtime.distributed import ParallelInfo


@dataclass
class DataContext:
    """What a policy builds loaders from: the data set, how it is collated, and the run's order."""

    dataset: Any
    collate: Callable
    parallel: ParallelInfo
    shuffle: bool
    seed: int
    max_steps: int | None
    packed: bool = False
    sequences_per_sample: int = 1  # sequences the collate makes of a sample, each padded to the longest (a pair: 2)

    def common(self, epoch: int, split: int, start_step: int) -> dict[str, Any]:
        return dict(
            collate_fn=self.collate,
            parallel=self.parallel,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            max_steps=self.max_steps,
            split=split,
            start_step=start_step,
        )


class SampleBatching:
    """A fixed number of samples per micro batch: the plan's micro batch, cut into ``split`` after an OOM."""

    def __init__(self, settings: BatchingSettings) -> None:
        self.settings = settings
        self.data: DataContext | None = None
        self.epoch_plan: list[EpochBatch] = []
        self.worst: WorstCase | None = None  # the longest sample, when the profiler needs it

    def cuts(self) -> Cuts:
        return SampleCuts()

    def prepare(self, data: DataContext, lengths: LengthSource, *, profiles: bool) -> None:
        """Keep the data; when the run profiles, find its worst-case sample (see ``worst_case``) from ``lengths``,
        what the config says of the samples' token counts."""
        self.data = data
        if profiles:
            self.worst, _ = worst_case.measure(data.dataset, lengths, packed=data.packed)

    def use_plan(self, epoch_plan: list[EpochBatch], *, start: int, profiled: int | None, verify: Verifier) -> None:
        self.epoch_plan = epoch_plan

    def check(self, *, profiled: bool, reference_global_batch: int, rule: str) -> None:
        """The plan's guard rails (see :mod:`~adaptive_batching.batching.checks`)."""
        assert self.data is not None
        check_plan_against_data(
            self.epoch_plan,
            dataset_size=len(self.data.dataset),
            profiled=profiled,
            allow_above_data=self.settings.allow_global_batch_above_data,
            reference_global_batch=reference_global_batch,
            rule=rule,
        )
        warnings = lr_factor_warnings(self.epoch_plan, reference_global_batch=reference_global_batch, rule=rule)
        if warnings:
            logs.warning("\n".join(warnings))

    def loader(self, epoch: int, split: int, start_step: int, span: SamplerSpan | None = None) -> Any:
        """``epoch``'s loader from the sampler's step ``start_step``, serving ``span`` of the epoch."""
        assert self.data is not None
        span = span or SamplerSpan()
        shape = self.epoch_plan[epoch].shape
        common = self.data.common(epoch, split, start_step)
        if common["max_steps"] is not None:
            common["max_steps"] = max(1, common["max_steps"] - span.start_step)
        return build_dataloader(
            self.data.dataset,
            micro_batch=shape.micro_batch,
            accumulation=shape.accumulation,
            first_sample=span.first_sample,
            **common,
        )

    def extent(self, epoch: int) -> tuple[int, int]:
        """Optimizer steps and samples (all ranks) of ``epoch`` as planned."""
        assert self.data is not None
        return epoch_extent(len(self.data.dataset), self.epoch_plan[epoch].shape.global_batch, self.data.max_steps)

    def plan_rows(
        self, rows: list[str], extents: list[tuple[int, int]], reference_global_batch: int, rule: str
    ) -> list[str]:
        return [
            f"{row} | {steps} steps, {samples} samples, LR x"
            f"{lr_factor(entry.shape.global_batch, reference_global_batch, rule):.3f}"
            for row, entry, (steps, samples) in zip(rows, self.epoch_plan, extents)
        ]

    def lr_global_batch(self, batch: BatchShape, sampler: Any, index: int) -> int | None:
        """The global batch the LR is set for at step ``index`` (None: leave it)."""
        return batch.global_batch

    def served(self, epoch: int) -> int:
        """What, besides micro batch and split, a change of which opens a guard window."""
        return 0

    def largest_piece(self, sampler: Any, index: int, micro_piece: int, split: int) -> int:
        """The most samples a forward of step ``index`` sees, on any rank."""
        return micro_piece

    def split_note(self, split: int, micro_piece: int, batch: BatchShape) -> str:
        if split == 1:
            return ""
        return (
            f"; after an OOM each micro batch runs as {split} pieces of <= {micro_piece} "
            f"(micro batch {micro_piece} x accumulation {batch.accumulation * split})"
        )

    def describe_epoch(self, epoch: int, batch: BatchShape, sampler: Any, note: str) -> str:
        return f"{batch.describe()}{note}"

    def describe_change(self, epoch: int, previous: BatchShape, batch: BatchShape) -> str:
        return (
            f"micro batch {previous.micro_batch} -> {batch.micro_batch}, accumulation "
            f"{previous.accumulation} -> {batch.accumulation}, global batch "
            f"{previous.global_batch} -> {batch.global_batch}"
        )

    def final_batch(self, epoch: int, split: int, micro_piece: int) -> str:
        return f"micro batch {micro_piece}"

    def metrics(self, epoch: int, split: int, micro_piece: int) -> dict[str, float]:
        return {"micro_batch_size": micro_piece}

    def oom_line(
        self,
        *,
        failed: int,
        where: str,
        error: str,
        samples: int,
        split: int,
        micro_piece: int,
        batch: BatchShape,
        ranks: int,
        cap: int | None,
    ) -> str:
        return (
            f"Out of memory at micro batch {failed} in {where} ({error}): running the same "
            f"{samples} samples again as micro batch {micro_piece} x accumulation "
            f"{batch.accumulation * split} x {ranks} rank(s); global batch "
            f"{batch.global_batch} and LR unchanged; micro batch capped at {cap} for the rest of the run"
        )

    def grow_back_line(self, *, waited: int, before: int, micro_piece: int, split: int, cap: int | None) -> str:
        return (
            f"Growing back after {waited} clean steps: micro batch {before} -> "
            f"{micro_piece} (cap {cap if cap is not None else 'lifted'})"
        )

    def cut_description(self, split: int, micro_piece: int) -> str:
        return f"micro batch {micro_piece}"

    def state_dict(self) -> dict[str, Any]:
        return {"token_budget": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: a sample count is the plan's."""


# Opens a context (training state preserved) that yields ``trial_step(samples, seq_len) -> StepMemory``.
Verifier = Callable[[], AbstractContextManager[Callable[[int, int], StepMemory]]]


class TokenBatching(SampleBatching):
    """Micro batches filled up to a token budget (padded tokens); the budget grows as a micro batch would,
    and after an OOM each micro batch runs as ``split`` pieces."""

    def __init__(self, settings: BatchingSettings) -> None:
        super().__init__(settings)
        self.lengths: list[int] = []  # each sample's padded tokens alone: all its sequences (budget_lengths)
        self.budgets: list[int] = []
        self.sequences = 1

    def cuts(self) -> Cuts:
        return TokenCuts()

    def prepare(self, data: DataContext, lengths: LengthSource, *, profiles: bool) -> None:
        """Every sample's token count (cached, see ``worst_case``): the budget is filled by them."""
        self.data = data
        self.worst, counts = worst_case.measure(data.dataset, lengths, packed=False)
        assert counts is not None
        self.sequences = data.sequences_per_sample
        self.lengths = budget_lengths(counts, self.sequences)
        ordered = sorted(self.lengths)
        sizes = f"{ordered[0]} to {ordered[-1]} tokens (median {ordered[len(ordered) // 2]})"
        if self.sequences == 1:
            logs.info(f"Token budget batching: {len(self.lengths)} samples of {sizes}")
        else:
            logs.info(
                f"Token budget batching: {len(self.lengths)} samples of {sizes}, a sample's {self.sequences} "
                "sequences each counted at the longer one's length"
            )

    def use_plan(self, epoch_plan: list[EpochBatch], *, start: int, profiled: int | None, verify: Verifier) -> None:
        """Each epoch's budget; the first epoch's is decided once (a resumed run's and a re-plan keep it)."""
        self.epoch_plan = epoch_plan
        base = self.budgets[0] if self.budgets else self._base(start, profiled, verify)
        # Growth scales the budget as it would scale a micro batch of samples.
        self.budgets = [base * entry.shape.micro_batch // start for entry in epoch_plan]

    def _base(self, start: int, profiled: int | None, verify: Verifier) -> int:
        """The first epoch's padded tokens per micro batch: the config's, the profiler's, or the smaller of both."""
        value = self.settings.max_tokens
        assert value is not None, "a token budget policy is made only when adaptive_batching.max_tokens is set"
        if profiled is None:
            return int(value)
        seq_len = max(self.lengths)
        from_profile = start * seq_len
        budget = from_profile if value == "auto" else min(int(value), from_profile)
        logs.info(
            f"Token budget: {budget} padded tokens per micro batch (the profiler's micro batch {start} x "
            f"the longest sample's {seq_len} tokens"
            f"{'' if value == 'auto' else f', at most adaptive_batching.max_tokens={value}'})"
        )
        return self._verify_short_samples(budget, verify)

    def _verify_short_samples(self, budget: int, verify: Verifier) -> int:
        """Check the budget where it packs the most samples (the shortest ones): memory depends on the
        tokens and on their length. Halve it until a real step fits."""
        shortest, seq_len = min(self.lengths), max(self.lengths)
        with verify() as trial_step:
            while budget >= seq_len:
                samples = budget // shortest
                try:
                    used = trial_step(samples, shortest // self.sequences)
                except Exception as error:  # noqa: BLE001 - only an OOM lowers the budget
                    if not is_out_of_memory(error):
                        raise
                    logs.info(
                        f"Token budget {budget}: {samples} samples of {shortest} tokens ran out of memory; "
                        f"trying {budget // 2}"
                    )
                    budget //= 2
                    continue
                logs.info(
                    f"Token budget {budget} verified with {samples} samples of the shortest length, "
                    f"{shortest} tokens: peak {used.peak_bytes / 2**30:.3f} GiB"
                )
                return budget
        raise OutOfMemoryStop(
            f"no token budget of at least one longest sample ({seq_len} tokens) fits "
            f"{budget // shortest} samples of {shortest} tokens"
        )

    def check(self, *, profiled: bool, reference_global_batch: int, rule: str) -> None:
        """Steps hold as many samples as the budget packs: the sample-count rails do not apply."""

    def loader(self, epoch: int, split: int, start_step: int, span: SamplerSpan | None = None) -> Any:
        assert self.data is not None
        return build_token_dataloader(
            self.data.dataset,
            self.lengths,
            max_tokens=self.budgets[epoch],
            picking_order=self.settings.picking_order,
            min_batch_size=self.settings.min_batch_size,
            max_batch_size=self.settings.max_batch_size,
            accumulation=self.epoch_plan[epoch].shape.accumulation,
            **self.data.common(epoch, split, start_step),
        )

    def extent(self, epoch: int) -> tuple[int, int]:
        sampler = self.loader(epoch, split=1, start_step=0).batch_sampler
        return sampler.steps, sum(sampler.samples_in_step(i) for i in range(sampler.steps))

    def plan_rows(
        self, rows: list[str], extents: list[tuple[int, int]], reference_global_batch: int, rule: str
    ) -> list[str]:
        return [
            f"{row} | token budget {budget} | {steps} steps, {samples} samples, LR x per step by its samples"
            for row, budget, (steps, samples) in zip(rows, self.budgets, extents)
        ]

    def lr_global_batch(self, batch: BatchShape, sampler: Any, index: int) -> int | None:
        return sampler.samples_in_step(index) if index < sampler.steps else None

    def served(self, epoch: int) -> int:
        return self.budgets[epoch]

    def largest_piece(self, sampler: Any, index: int, micro_piece: int, split: int) -> int:
        step = sampler.layout()[index]
        return piece_size(max(len(micro) for rank in step for micro in rank), split)

    def split_note(self, split: int, micro_piece: int, batch: BatchShape) -> str:
        return "" if split == 1 else f"; after an OOM each micro batch runs as {split} pieces"

    def describe_epoch(self, epoch: int, batch: BatchShape, sampler: Any, note: str) -> str:
        waste = padding_waste(self.lengths, [mb for step in sampler.layout() for rank in step for mb in rank])
        samples = [sampler.samples_in_step(i) for i in range(sampler.steps)]
        return (
            f"token budget {self.budgets[epoch]} padded tokens per micro batch x accumulation "
            f"{batch.accumulation} x {batch.ranks} rank(s): {sampler.steps} steps of "
            f"{min(samples)}-{max(samples)} samples, padding {100 * waste:.1f}%{note}"
        )

    def describe_change(self, epoch: int, previous: BatchShape, batch: BatchShape) -> str:
        return (
            f"token budget {self.budgets[epoch - 1]} -> {self.budgets[epoch]} padded tokens "
            f"per micro batch, accumulation {previous.accumulation} -> {batch.accumulation}"
        )

    def final_batch(self, epoch: int, split: int, micro_piece: int) -> str:
        return f"token budget {self.budgets[-1]} in {split} piece(s)"

    def metrics(self, epoch: int, split: int, micro_piece: int) -> dict[str, float]:
        return {"max_tokens": self.budgets[epoch] // split}

    def oom_line(
        self,
        *,
        failed: int,
        where: str,
        error: str,
        samples: int,
        split: int,
        micro_piece: int,
        batch: BatchShape,
        ranks: int,
        cap: int | None,
    ) -> str:
        return (
            f"Out of memory at a micro batch of {failed} samples in {where} ({error}): "
            f"running the same {samples} samples again with each micro batch cut into {split} "
            "pieces; global batch and LR unchanged, for the rest of the run"
        )

    def grow_back_line(self, *, waited: int, before: int, micro_piece: int, split: int, cap: int | None) -> str:
        return f"Growing back after {waited} clean steps: micro batches cut into {split} piece(s)"

    def cut_description(self, split: int, micro_piece: int) -> str:
        return f"{split} piece(s) per micro batch"

    def state_dict(self) -> dict[str, Any]:
        return {"token_budget": self.budgets[0] if self.budgets else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.budgets = [state["token_budget"]] if state.get("token_budget") else []


def batching_for(settings: BatchingSettings) -> SampleBatching:
    """The policy ``adaptive_batching.max_tokens`` asks for: a token budget when set, else samples."""
    return TokenBatching(settings) if settings.token_budget else SampleBatching(settings)
