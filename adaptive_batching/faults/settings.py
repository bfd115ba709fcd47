"""The fault handling's settings: OOM recovery and stop signals (its section of ``adaptive_batching:``)."""

from __future__ import annotations

from dataclasses import dataclass

from adaptive_batching.faults.preemption import DEFAULT as DEFAULT_STOP_SIGNALS


@dataclass(frozen=True)
class FaultSettings:
    """What a step that runs out of memory, and a stop signal, do."""

    oom_recovery: bool = True
    """Recover from an out-of-memory step by cutting its micro batches into pieces (else the run stops)."""
    oom_grow_back_after: int | None = None
    """Optimizer steps without an OOM after which a cut micro batch grows back; None: it stays cut."""
    guard_steps: int = 4
    """The first steps after a start or a change of batch that every rank checks for an OOM."""
    stop_signals: tuple[str, ...] = DEFAULT_STOP_SIGNALS
    """Signals that stop the run cleanly with a checkpoint (``[]`` turns it off)."""
