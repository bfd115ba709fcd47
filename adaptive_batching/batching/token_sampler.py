"""Micro batches cut by a token budget instead of a sample count, and a step-aware sampler over them.

With samples of very different lengths, a fixed number of samples per micro batch either wastes
memory on short samples or runs out of it on long ones. Here a micro batch takes samples while its
padded size (samples x the longest of them) stays within ``max_tokens``, as DeepSpeed's
``batch_by_seqlens`` does, so the batch size in samples varies from step to step and the LR of
each step is scaled by the samples it actually trained on (``samples_in_step``).

The sampler behaves toward the trainer as ``StepBatchSampler`` does: the same number of forwards
per step and of steps per epoch on every rank (a rank short of data gets empty micro batches),
``split`` after an out-of-memory error, ``start_step``, and torchdata's Stateful protocol.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from adaptive_batching.batching.sampler import StepSampler, _ceil_div, _pieces

PICKING_ORDERS = ("dataloader", "seqlen", "random")

_CHECKED_KEYS = (
    "dataset_size",
    "lengths_digest",
    "max_tokens",
    "picking_order",
    "min_batch_size",
    "max_batch_size",
    "accumulation",
    "split",
    "world_size",
    "seed",
    "shuffle",
)


def _permutation(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def picking_order(lengths: Sequence[int], order: str, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The epoch's order of dataset indices in which samples are picked into micro batches.

    ``dataloader``: a permutation seeded by ``seed + epoch`` when ``shuffle``, else the dataset order.
    ``seqlen``: by length, shortest first (stable), so each micro batch holds similar lengths and
    pads little. ``random``: a seeded permutation whatever ``shuffle`` says. The global RNG is not used.
    """
    if order not in PICKING_ORDERS:
        raise ValueError(f"unknown picking order {order!r}; expected {' | '.join(PICKING_ORDERS)}")
    n = len(lengths)
    if order == "seqlen":
        return sorted(range(n), key=lengths.__getitem__)
    if order == "random" or shuffle:
        return _permutation(n, seed + epoch)
    return list(range(n))


def budget_lengths(lengths: Sequence[int], sequences_per_sample: int) -> list[int]:
    """Each sample's length as the budget counts it: its padded length (``core.objective.sample_length``) times the
    sequences the collate makes of it. A preference pair's chosen and rejected answers are both padded to the micro
    batch's longest sequence, so a pair counts 2 x its longer sequence and ``padded_tokens`` of a micro batch of
    pairs is then every token position of its forward, both sequences."""
    if sequences_per_sample < 1:
        raise ValueError(f"sequences_per_sample must be >= 1, got {sequences_per_sample}")
    return [sequences_per_sample * length for length in lengths]


def padded_tokens(lengths: Sequence[int], batch: Sequence[int]) -> int:
    """Positions a padded micro batch holds: its samples x its longest sample (0 when empty)."""
    return len(batch) * max(map(lengths.__getitem__, batch), default=0)


def padding_waste(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """The share of padding among all positions of ``batches``: 1 - real tokens / padded tokens."""
    padded = sum(padded_tokens(lengths, batch) for batch in batches)
    if padded == 0:
        return 0.0
    return 1.0 - sum(sum(map(lengths.__getitem__, batch)) for batch in batches) / padded


def _check_bounds(max_tokens: int, min_batch_size: int | None, max_batch_size: int | None) -> None:
    if max_tokens < 1:
        raise ValueError(f"adaptive_batching.max_tokens must be >= 1, got {max_tokens}")
    if min_batch_size is not None and min_batch_size < 1:
        raise ValueError(f"adaptive_batching.min_batch_size must be >= 1 or None, got {min_batch_size}")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"adaptive_batching.max_batch_size must be >= 1 or None, got {max_batch_size}")
    if min_batch_size is not None and max_batch_size is not None and min_batch_size > max_batch_size:
        raise ValueError(
            f"adaptive_batching.min_batch_size {min_batch_size} > adaptive_batching.max_batch_size {max_batch_size}"
        )


def token_micro_batches(
    lengths: Sequence[int],
    order_indices: Sequence[int],
    *,
    max_tokens: int,
    min_batch_size: int | None,
    max_batch_size: int | None,
) -> list[list[int]]:
    """Cut ``order_indices`` greedily, in order, into micro batches of at most ``max_tokens`` padded tokens.

    A sample joins the current micro batch while ``(samples + 1) x max(longest, its length) <= max_tokens``
    and ``samples + 1 <= max_batch_size``; otherwise it starts the next one. Every micro batch but the
    last holds at least ``min_batch_size`` samples: since ``min_batch_size x`` the longest length ``<= max_tokens``
    (checked), a micro batch of fewer samples always admits the next sample, so it is never closed early.
    A sample longer than ``max_tokens`` is an error: it cannot be trained on without truncation.
    """
    _check_bounds(max_tokens, min_batch_size, max_batch_size)
    if not order_indices:
        return []
    picked = list(map(lengths.__getitem__, order_indices))
    longest_sample, shortest_sample = max(picked), min(picked)
    if shortest_sample < 0:
        index = next(i for i in order_indices if lengths[i] < 0)
        raise ValueError(f"sample {index} has a negative length {lengths[index]}")
    if longest_sample > max_tokens:
        index = next(i for i in order_indices if lengths[i] > max_tokens)
        raise ValueError(
            f"sample {index} has {lengths[index]} tokens, more than adaptive_batching.max_tokens={max_tokens}: "
            "raise max_tokens or lower tokenizer.max_seq_len"
        )
    if min_batch_size is not None and min_batch_size * longest_sample > max_tokens:
        raise ValueError(
            f"adaptive_batching.min_batch_size={min_batch_size} and adaptive_batching.max_tokens={max_tokens} "
            f"contradict each other: {min_batch_size} samples of the longest sample's {longest_sample} tokens "
            f"need {min_batch_size * longest_sample} tokens. Lower min_batch_size to at most "
            f"{max_tokens // longest_sample}, or raise max_tokens to at least {min_batch_size * longest_sample}"
        )
    cap = len(order_indices) if max_batch_size is None else max_batch_size
    batches: list[list[int]] = []
    current: list[int] = []
    count = longest = 0
    for index in order_indices:
        length = lengths[index]
        wider = length if length > longest else longest
        if count and (count >= cap or (count + 1) * wider > max_tokens):
            batches.append(current)
            current, count, wider = [], 0, length
        current.append(index)
        count += 1
        longest = wider
    batches.append(current)
    return batches


def balance_over_ranks(tokens: Sequence[int], world_size: int) -> list[list[int | None]]:
    """Deal one step's micro batches (given by their padded tokens) to ranks, balancing tokens.

    Each rank gets ``ceil(len(tokens) / world_size)`` entries: positions into ``tokens``, and None
    where a rank is short (an empty micro batch). In rounds of ``world_size``, largest first, the
    largest micro batch of a round goes to the rank with the fewest tokens so far; each round keeps
    the spread between ranks within max(its previous value, the round's largest - its smallest), so
    the spread never exceeds the largest micro batch's tokens. Ties go to the lower position and rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    slots = _ceil_div(len(tokens), world_size)
    largest_first = sorted(range(len(tokens)), key=lambda i: (-tokens[i], i))
    ranked: list[int | None] = [*largest_first, *[None] * (slots * world_size - len(tokens))]
    loads = [0] * world_size
    dealt: list[list[int | None]] = [[] for _ in range(world_size)]
    for start in range(0, len(ranked), world_size):
        ranks = sorted(range(world_size), key=lambda r: (loads[r], r))
        for item, rank in zip(ranked[start : start + world_size], ranks):
            dealt[rank].append(item)
            loads[rank] += 0 if item is None else tokens[item]
    return dealt


def _lengths_digest(lengths: Sequence[int]) -> str:
    return hashlib.sha256(array("q", lengths).tobytes()).hexdigest()[:16]


class TokenBudgetBatchSampler(StepSampler):
    """This rank's token-budget micro batches of dataset indices, step after step, one epoch per iteration.

    The epoch's micro batches come from ``token_micro_batches`` over ``picking_order(...)``; every
    ``world_size x accumulation`` consecutive micro batches form one optimizer step, dealt to the
    ranks by ``balance_over_ranks`` so each rank runs ``accumulation`` forwards of similar tokens.
    The remaining micro batches form one last, smaller step with ``ceil(remaining / world_size)``
    forwards on every rank; a rank with fewer micro batches gets trailing empty lists.

    With picking order ``seqlen`` the steps are then shuffled with ``seed + epoch`` (whatever
    ``shuffle`` says): each step keeps samples of similar lengths, which pad little, but training does
    not see the lengths grow step after step. ``shuffle`` only matters for the ``dataloader`` order.

    ``split`` cuts each micro batch into that many near-equal pieces (after an out-of-memory error):
    the same samples in the same steps, in smaller forwards (some possibly empty). ``start_step``
    makes the first iteration begin at that optimizer step of the epoch. The plan depends only on
    the arguments, so every rank computes the same one.

    Stateful (torchdata's protocol), so a ``StatefulDataLoader`` resumes exactly mid-epoch.
    """

    checked_keys = _CHECKED_KEYS
    resume_advice = (
        "the same max_tokens, picking order, batch size bounds, gradient accumulation, split, ranks, "
        "dataset and sequence lengths, seed and shuffle"
    )

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        max_tokens: int,
        picking_order: str,
        min_batch_size: int | None,
        max_batch_size: int | None,
        start_step: int = 0,
        **step_arguments: Any,
    ) -> None:
        """``step_arguments``: accumulation, rank, world_size, shuffle, seed and optionally epoch (0),
        max_steps (None) and split (1), as every step sampler takes them (:meth:`_take_step_arguments`)."""
        _check_bounds(max_tokens, min_batch_size, max_batch_size)
        if picking_order not in PICKING_ORDERS:
            raise ValueError(f"unknown picking order {picking_order!r}; expected {' | '.join(PICKING_ORDERS)}")
        self._take_step_arguments(**step_arguments)
        if self.split < 1:
            raise ValueError(f"split must be >= 1, got {self.split}")
        self.lengths = list(map(int, lengths))
        self.dataset_size = len(self.lengths)
        self.lengths_digest = _lengths_digest(self.lengths)
        self.max_tokens, self.picking_order = max_tokens, picking_order
        self.min_batch_size, self.max_batch_size = min_batch_size, max_batch_size
        self._layouts: dict[int, list[list[list[list[int]]]]] = {}
        # Fails here, on every rank alike, when a sample or the bounds cannot fit max_tokens.
        self.layout()
        self._start_at(start_step)

    def layout(self) -> list[list[list[list[int]]]]:
        """The current epoch's steps (after ``max_steps``): per step, per rank, the micro batches before ``split``."""
        if self.epoch not in self._layouts:
            self._layouts = {self.epoch: self._make_layout(self.epoch)}
        return self._layouts[self.epoch]

    def _make_layout(self, epoch: int) -> list[list[list[list[int]]]]:
        order = picking_order(self.lengths, self.picking_order, shuffle=self.shuffle, seed=self.seed, epoch=epoch)
        batches = token_micro_batches(
            self.lengths,
            order,
            max_tokens=self.max_tokens,
            min_batch_size=self.min_batch_size,
            max_batch_size=self.max_batch_size,
        )
        per_step = self.world_size * self.accumulation
        steps = []
        for start in range(0, len(batches), per_step):
            group = batches[start : start + per_step]
            dealt = balance_over_ranks([padded_tokens(self.lengths, b) for b in group], self.world_size)
            steps.append([[[] if i is None else group[i] for i in mine] for mine in dealt])
        if self.picking_order == "seqlen":
            steps = [steps[i] for i in _permutation(len(steps), self.seed + epoch)]
        return steps if self.max_steps is None else steps[: self.max_steps]

    def _step_layout(self) -> list[int]:
        return [len(step[0]) * self.split for step in self.layout()]

    def samples_in_step(self, step: int) -> int:
        """Samples the ``step``-th step of the epoch trains on, over all ranks."""
        return sum(len(batch) for mine in self.layout()[step] for batch in mine)

    def _micro_batches(self, start: int) -> Iterator[list[int]]:
        """This rank's pieces of the epoch from the ``start``-th on."""
        skip = start
        for step in self.layout():
            mine = step[self.rank]
            count = len(mine) * self.split
            if skip >= count:
                skip -= count
                continue
            pieces = [piece for batch in mine for piece in _pieces(list(batch), self.split)]
            yield from pieces[skip:]
            skip = 0
