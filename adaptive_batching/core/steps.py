"""What one training step holds in memory: the profiler measures it, the trainer and the batching read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepMemory:
    """Tensor memory of one trial step, in bytes."""

    activation_bytes: int  # forward/backward peak above the memory the step started from
    forward_backward_peak: int
    optimizer_peak: int
    steady_bytes: int  # memory after the step: what the next step starts from
    reserved_peak: int | None = None  # the caching allocator's peak reservation (accelerators)
    alloc_retries: int = 0  # allocations the caching allocator had to retry after freeing its cache

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_backward_peak, self.optimizer_peak)

    def fits(self, budget_bytes: int) -> bool:
        """Within the budget by what the tensors hold and by what the allocator reserved for them, with
        no allocation retried: fragmentation and cache thrashing are what make a profiled micro
        batch fail later in training."""
        reserved = self.reserved_peak if self.reserved_peak is not None else 0
        return self.peak_bytes <= budget_bytes and reserved <= budget_bytes and self.alloc_retries == 0


# The far probe runs at the first estimate divided by this: a step at an eighth of the largest that fits
# costs little, and the slope it gives is extrapolated 8-fold instead of 50- to 100-fold.
