"""The batch shape of a training step: micro batch, gradient accumulation and ranks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchShape:
    """micro batch: samples one forward sees on one rank;
    global batch: micro batch x gradient accumulation x ranks."""

    micro_batch: int
    accumulation: int = 1
    ranks: int = 1

    def __post_init__(self) -> None:
        for name in ("micro_batch", "accumulation", "ranks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.ranks

    def describe(self) -> str:
        return (
            f"micro batch {self.micro_batch} x accumulation {self.accumulation} "
            f"x {self.ranks} rank(s) = global batch {self.global_batch}"
        )


def shape_keeping_global_batch(global_batch: int, ranks: int, memory_cap: int) -> tuple[BatchShape, str]:
    """The fastest shape that trains on exactly ``global_batch`` samples per step, and why it was chosen.

    Each rank's share (``global_batch / ranks``) is cut into equal micro batches: the micro batch is the
    largest divisor of the share at or under ``memory_cap`` (what fits in memory), the accumulation
    the rest. A share with few divisors can force a micro batch well under what fits; the reason says so.
    """
    if global_batch < 1 or ranks < 1 or memory_cap < 1:
        raise ValueError(
            f"expected positive sizes, got global batch {global_batch}, ranks {ranks}, micro batch cap {memory_cap}"
        )
    share, remainder = divmod(global_batch, ranks)
    if remainder:
        raise ValueError(f"global batch {global_batch} is not divisible by {ranks} ranks")
    micro = max(d for d in range(1, min(share, memory_cap) + 1) if share % d == 0)
    shape = BatchShape(micro, share // micro, ranks)
    if micro == min(share, memory_cap):
        why = (
            f"the profiled micro batch {memory_cap} covers it"
            if share <= memory_cap
            else f"{share} samples per rank divide evenly by the profiled micro batch {memory_cap}"
        )
    else:
        why = (
            f"{share} samples per rank do not divide evenly by the profiled micro batch {memory_cap}; "
            f"{micro} is the largest divisor under it (a global batch with more divisors, such as a power of "
            "two, lets the micro batch come closer)"
        )
    return shape, why


@dataclass(frozen=True)
class EpochBatch:
    """The batch of one epoch in a plan.

    ``requested``: the micro batch asked for at this epoch: ``start`` at epoch 0, then what the
    function saw plus its increment (under ``skip`` a growth past the cap is not asked for, so
    it stays what the function saw). ``increment``: what the function returned (0 at epoch 0).
    ``shape``: the micro batch, accumulation and ranks realised. ``reason``: ``start`` (epoch 0
    within the cap), ``function`` (the function's change applied within the cap), ``capped``
    (the cap held the micro batch back), ``accumulated`` (the requested size realised with extra
    accumulation), ``unchanged`` (the function returned 0). ``memory_cap``: the memory cap
    the plan used (None = none).
    """

    epoch: int
    requested: int
    increment: int
    shape: BatchShape
    reason: str
    memory_cap: int | None = None
