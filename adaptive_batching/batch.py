"""The batch shape of a training step: micro batch, gradient accumulation and data-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchShape:
    """micro batch: samples one forward sees on one rank;
    global batch: micro batch x gradient accumulation x data-parallel ranks."""

    micro_batch: int
    accumulation: int = 1
    data_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("micro_batch", "accumulation", "data_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.data_parallel

    def describe(self) -> str:
        return (
            f"micro batch {self.micro_batch} x accumulation {self.accumulation} "
            f"x {self.data_parallel} rank(s) = global batch {self.global_batch}"
        )
