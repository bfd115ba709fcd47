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
