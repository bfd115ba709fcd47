"""The batching's settings: its section of ``adaptive_batching:`` (see docs/config-keys.md)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchingSettings:
    """How each step's samples are chosen: a number of samples, or a token budget per micro batch."""

    max_tokens: int | str | None = None
    """Padded tokens per micro batch (token-budget batching); ``'auto'``: the profiler's; None: count samples."""
    picking_order: str = "dataloader"
    """``dataloader``, ``seqlen`` or ``random``: the order a token budget is filled in."""
    min_batch_size: int | None = None
    """The fewest samples in a token-budget micro batch; None: no bound."""
    max_batch_size: int | None = None
    """The most samples in a token-budget micro batch; None: no bound."""
    allow_global_batch_above_data: bool = False
    """Let a planned global batch exceed the epoch's samples (else a config error)."""

    @property
    def token_budget(self) -> bool:
        return self.max_tokens is not None
