"""A step-aware batch sampler and a collate that accepts empty micro batches.

The sampler hands each rank its micro batches one optimizer step at a time. A new sampler over the
same dataset changes the batch size between epochs without rebuilding (re-tokenising, re-packing)
the dataset. Every sample is seen once per epoch: the samples that do not fill a whole step form
one smaller last step, in which every rank still runs the same number of forwards (FSDP needs
that); a rank short of samples gets empty micro batches, which the collate turns into a batch
that counts no tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

Batch = dict[str, torch.Tensor]

_CHECKED_KEYS = (
    "dataset_size",
    "micro_batch",
    "accumulation",
    "split",
    "world_size",
    "seed",
    "shuffle",
    "first_sample",
)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def epoch_extent(dataset_size: int, global_batch: int, max_steps: int | None) -> tuple[int, int]:
    """Optimizer steps and samples (all ranks) in one epoch: whole steps, then the remainder's smaller step."""
    steps = _ceil_div(dataset_size, global_batch)
    if max_steps is not None:
        steps = min(steps, max_steps)
    return steps, min(dataset_size, steps * global_batch)


class StepSampler(Sampler[list[int]]):
    """What the step samplers share: this rank's forwards of one epoch, a position within it that
    torchdata's ``StatefulDataLoader`` saves and restores, and the check that a restored position
    belongs to the same layout.

    A subclass sets ``checked_keys`` (attributes a saved state must match) and ``resume_advice``, and
    provides ``step_layout()`` and ``_micro_batches(start)``.
    """

    checked_keys: tuple[str, ...] = ()
    resume_advice = "the same batch settings"
    epoch: int

    def _take_step_arguments(
        self,
        *,
        accumulation: int,
        rank: int,
        world_size: int,
        shuffle: bool,
        seed: int,
        epoch: int = 0,
        max_steps: int | None = None,
        split: int = 1,
    ) -> None:
        """Check and keep the arguments every step sampler takes."""
        if accumulation < 1:
            raise ValueError(f"accumulation must be >= 1, got {accumulation}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        self.accumulation, self.rank, self.world_size = accumulation, rank, world_size
        self.shuffle, self.seed, self.epoch, self.max_steps, self.split = shuffle, seed, epoch, max_steps, split

    def _start_at(self, start_step: int) -> None:
        self._yielded = 0
        self._resume = False
        if start_step:
            layout = self.step_layout()
            if not 0 <= start_step <= len(layout):
                raise ValueError(f"start_step must be in [0, {len(layout)}], got {start_step}")
            self._yielded = sum(layout[:start_step])
            self._resume = True

    def step_layout(self) -> list[int]:
        """Forwards in each step of the current epoch, the same on every rank; computed once per epoch.

        The training loop asks at every step, so recomputing it would make an epoch quadratic in its steps.
        The list is shared: read it, do not change it.
        """
        cached = getattr(self, "_layout", None)
        if cached is None or cached[0] != self.epoch:
            cached = self._layout = (self.epoch, self._step_layout())
        return cached[1]

    def _step_layout(self) -> list[int]:
        raise NotImplementedError

    def _micro_batches(self, start: int) -> Iterator[list[int]]:
        raise NotImplementedError

    @property
    def steps(self) -> int:
        """Optimizer steps in the current epoch."""
        return len(self.step_layout())

    def __len__(self) -> int:
        return sum(self.step_layout())

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order from its first micro batch on.

        A state just loaded for this same epoch and not yet iterated is kept, so loading a state
        and then setting its epoch still resumes mid-epoch.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if self._resume and epoch == self.epoch:
            return
        self.epoch = epoch
        self._yielded = 0
        self._resume = False

    def __iter__(self) -> Iterator[list[int]]:
        # Eager on purpose: the position is fixed when the iterator is made, as torchdata expects.
        start = self._yielded if self._resume else 0
        self._resume = False
        self._yielded = start
        return self._generate(start)

    def _generate(self, start: int) -> Iterator[list[int]]:
        for batch in self._micro_batches(start):
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Where this epoch stands, plus the layout it was cut with, to check on load."""
        return {"epoch": self.epoch, "yielded": self._yielded, **{key: getattr(self, key) for key in self.checked_keys}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at micro batch ``yielded`` of the saved epoch on the next iteration.

        A state saved after the last micro batch of its epoch resumes at the start of the next
        epoch. The saved layout must be this sampler's: the same position in a different layout
        names other samples, so some would be repeated and others skipped.
        """
        name = type(self).__name__
        missing = [key for key in ("epoch", "yielded", *self.checked_keys) if key not in state_dict]
        if missing:
            raise ValueError(f"{name} state is missing {missing}")
        differ = [
            f"{key} {state_dict[key]!r} (saved) != {getattr(self, key)!r} (now)"
            for key in self.checked_keys
            if state_dict[key] != getattr(self, key)
        ]
        if differ:
            raise ValueError(
                "Cannot resume the data order: the saved sampler state was made with a different "
                f"layout: {'; '.join(differ)}. Resume with {self.resume_advice}, or start the epoch afresh."
            )
        epoch, yielded = int(state_dict["epoch"]), int(state_dict["yielded"])
        if epoch < 0 or yielded < 0:
            raise ValueError(f"{name} state has a negative epoch or position: {dict(state_dict)}")
        self.epoch = epoch
        if yielded >= len(self):
            self.epoch, yielded = epoch + 1, 0
        self._yielded = yielded
        self._resume = True


class StepBatchSampler(StepSampler):
    """This rank's micro batches of dataset indices, step after step, for one epoch per iteration.

    The epoch's order (a permutation seeded by ``seed + epoch``, or ``range`` without shuffle) is cut
    into steps of ``micro_batch * accumulation * world_size`` samples; rank ``r`` takes the ``r``-th
    contiguous slice of each step, cut into ``accumulation`` micro batches. The remaining samples
    form one last step, shared as evenly as possible over the ranks, with the same number of micro
    batches on every rank; a rank with fewer samples gets trailing empty lists.

    ``split`` cuts each of those micro batches into that many near-equal pieces (after an
    out-of-memory error): the same samples in the same steps, in smaller forwards. ``start_step``
    makes the first iteration begin at that optimizer step of the epoch.

    ``first_sample`` serves only the epoch's order from that position on: after the batch grew inside
    an epoch, the new sampler continues where the old one stopped, so no sample is skipped or repeated.
    Its steps are counted from there.

    Stateful (torchdata's protocol), so a ``StatefulDataLoader`` resumes exactly mid-epoch.
    """

    checked_keys = _CHECKED_KEYS
    resume_advice = "the same batch size, gradient accumulation, ranks, dataset, seed and shuffle"

    def __init__(
        self,
        dataset_size: int,
        *,
        micro_batch: int,
        accumulation: int,
        rank: int,
        world_size: int,
        shuffle: bool,
        seed: int,
        epoch: int = 0,
        max_steps: int | None = None,
        split: int = 1,
        start_step: int = 0,
        first_sample: int = 0,
    ) -> None:
        if dataset_size < 0:
            raise ValueError(f"dataset_size must be >= 0, got {dataset_size}")
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        self._take_step_arguments(
            accumulation=accumulation,
            rank=rank,
            world_size=world_size,
            shuffle=shuffle,
            seed=seed,
            epoch=epoch,
            max_steps=max_steps,
            split=split,
        )
        if not 1 <= split <= micro_batch:
            raise ValueError(f"split must be in [1, micro_batch={micro_batch}], got {split}")
        if not 0 <= first_sample <= dataset_size:
            raise ValueError(f"first_sample must be in [0, dataset_size={dataset_size}], got {first_sample}")
        self.dataset_size, self.first_sample, self.micro_batch = dataset_size, first_sample, micro_batch
        self._start_at(start_step)

    @property
    def piece_size(self) -> int:
        """The most samples one forward sees: a micro batch cut into ``split`` pieces."""
        return _ceil_div(self.micro_batch, self.split)

    @property
    def global_batch(self) -> int:
        """Samples in one full step, over all ranks."""
        return self.micro_batch * self.accumulation * self.world_size

    @property
    def remaining(self) -> int:
        """Samples this sampler serves per epoch: the order from ``first_sample`` on."""
        return self.dataset_size - self.first_sample

    def _step_layout(self) -> list[int]:
        full, remainder = divmod(self.remaining, self.global_batch)
        layout = [self.accumulation] * full
        if remainder:
            layout.append(_ceil_div(_ceil_div(remainder, self.world_size), self.micro_batch))
        layout = [count * self.split for count in layout]
        return layout if self.max_steps is None else layout[: self.max_steps]

    def samples_in_step(self, step: int) -> int:
        """Samples the ``step``-th step of the epoch trains on, over all ranks."""
        return min(self.global_batch, self.remaining - step * self.global_batch)

    def order(self) -> list[int]:
        """The current epoch's order of all dataset indices, before it is cut into steps."""
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def _micro_batches(self, start: int) -> Iterator[list[int]]:
        """This rank's micro batches of the epoch from the ``start``-th on."""
        layout = self.step_layout()
        if start >= sum(layout):
            return
        order = self.order()[self.first_sample :]
        share = self.micro_batch * self.accumulation
        full = self.remaining // self.global_batch
        skip = start
        for step, count in enumerate(layout):
            count //= self.split
            if skip >= count * self.split:
                skip -= count * self.split
                continue
            begin = step * self.global_batch
            if step < full:
                offset = begin + self.rank * share
                mine = order[offset : offset + share]
            else:
                remainder = self.remaining - begin
                base, extra = divmod(remainder, self.world_size)
                offset = begin + self.rank * base + min(self.rank, extra)
                mine = order[offset : offset + base + (1 if self.rank < extra else 0)]
            pieces = [
                piece
                for i in range(count)
                for piece in _pieces(mine[i * self.micro_batch : (i + 1) * self.micro_batch], self.split)
            ]
            yield from pieces[skip:]
            skip = 0


def _pieces(indices: list[int], split: int) -> list[list[int]]:
    """``indices`` cut in order into ``split`` near-equal lists, the longer ones first (some may be empty)."""
    base, extra = divmod(len(indices), split)
    bounds = [0]
    for i in range(split):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return [indices[a:b] for a, b in zip(bounds, bounds[1:])]


class EmptyTolerantCollate:
    """A collate function that turns an empty micro batch into one ignored 1-token sample.

    The sample goes through the real collate, so keys and dtypes match the other batches, and its
    only label is ``ignore_index``, so it adds no loss and no tokens to the step.
    """

    def __init__(
        self,
        collate_fn: Callable[[list[Any]], Batch],
        *,
        pad_id: int,
        ignore_index: int,
        packed: bool,
        empty: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.collate_fn = collate_fn
        self.pad_id = pad_id
        self.ignore_index = ignore_index
        self.packed = packed
        self.empty = empty

    def empty_sample(self) -> dict[str, Any]:
        """The placeholder sample, in the dataset's own format (``empty``'s, when given: a vision sample's image)."""
        if self.empty is not None:
            return self.empty()
        if self.packed:
            return {
                "tokens": torch.tensor([self.pad_id]),
                "labels": torch.tensor([self.ignore_index]),
                "input_pos": torch.tensor([0]),
                "seq_lens": torch.tensor([1]),
            }
        return {"tokens": [self.pad_id], "labels": [self.ignore_index]}

    def __call__(self, batch: list[Any]) -> Batch:
        return self.collate_fn(batch if batch else [self.empty_sample()])


def collate_allowing_empty(
    collate_fn: Callable[[list[Any]], Batch], *, pad_id: int, ignore_index: int, packed: bool
) -> Callable[[list[Any]], Batch]:
    """Wrap a torchtune collate so that the sampler's empty micro batches become ignored batches."""
    return EmptyTolerantCollate(collate_fn, pad_id=pad_id, ignore_index=ignore_index, packed=packed)


@dataclass
class SamplerSpan:
    """The part of an epoch one sampler serves: from ``first_sample`` in the epoch's order, after
    ``start_step`` optimizer steps of the epoch served by earlier samplers."""

    first_sample: int = 0
    start_step: int = 0

    def local(self, step_in_epoch: int) -> int:
        """The sampler's own step index of the epoch's step ``step_in_epoch``."""
        return step_in_epoch - self.start_step

    def state_dict(self) -> dict[str, int]:
        return {"first_sample": self.first_sample, "start_step": self.start_step}

    @classmethod
    def from_state(cls, state: Any) -> SamplerSpan:
        return cls(**state) if state else cls()
