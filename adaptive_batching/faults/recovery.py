"""The out-of-memory recovery state machine, shared by sample-count and token-budget batching.

After an OOM in a training step, the same samples run again with each planned micro batch cut into
``split`` micro batches (more accumulation, the same global batch and LR), for the rest of the run.
After ``grow_back_after`` clean steps the cut is undone one level; if the size grown back to fails
again, the wait before the next try doubles. What differs between the batching modes is only how a
cut is computed (:class:`SampleCuts`, :class:`TokenCuts`); the states, the counters, the resume state
and the cap written to the profile cache are one machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from adaptive_batching.faults.guard import larger_cap, piece_size, smaller_cap, split_for


class Cuts(Protocol):
    """How a batching mode cuts its planned micro batches after an OOM, and undoes a cut."""

    def after_oom(self, split: int, oom_cap: int | None, failed: int, planned: int) -> tuple[int, int | None]:
        """``(split, oom_cap)`` after a micro batch of ``failed`` samples ran out of memory."""

    def grown_back(self, split: int, oom_cap: int | None, planned: int) -> tuple[int, int | None]:
        """``(split, oom_cap)`` one level larger again."""

    def for_plan(self, split: int, oom_cap: int | None, planned: int) -> int:
        """The split for a newly planned micro batch (an epoch switch), under the same cap."""

    def is_cut(self, split: int, oom_cap: int | None) -> bool:
        """Whether anything is cut now (grow-back has something to undo)."""

    def cache_cap(self, split: int, oom_cap: int | None, profiled: int) -> int:
        """The profile's micro batch a later run should start at most at, for the profile cache."""


class SampleCuts:
    """Micro batches of a fixed sample count: the cap is the most samples one forward may see."""

    def after_oom(self, split: int, oom_cap: int | None, failed: int, planned: int) -> tuple[int, int | None]:
        cap = smaller_cap(failed)
        assert cap is not None
        return split_for(planned, cap), cap

    def grown_back(self, split: int, oom_cap: int | None, planned: int) -> tuple[int, int | None]:
        assert oom_cap is not None
        cap = larger_cap(oom_cap, planned)
        return split_for(planned, cap), cap

    def for_plan(self, split: int, oom_cap: int | None, planned: int) -> int:
        return split_for(planned, oom_cap)

    def is_cut(self, split: int, oom_cap: int | None) -> bool:
        return oom_cap is not None

    def cache_cap(self, split: int, oom_cap: int | None, profiled: int) -> int:
        return profiled if oom_cap is None else min(oom_cap, profiled)


class TokenCuts:
    """Micro batches of a token budget vary in samples: each is cut into twice as many parts per OOM."""

    def after_oom(self, split: int, oom_cap: int | None, failed: int, planned: int) -> tuple[int, int | None]:
        return split * 2, smaller_cap(failed)

    def grown_back(self, split: int, oom_cap: int | None, planned: int) -> tuple[int, int | None]:
        split //= 2
        return split, None if split == 1 else oom_cap

    def for_plan(self, split: int, oom_cap: int | None, planned: int) -> int:
        return split

    def is_cut(self, split: int, oom_cap: int | None) -> bool:
        return split > 1

    def cache_cap(self, split: int, oom_cap: int | None, profiled: int) -> int:
        # The budget is the profiled micro batch x the longest sample; cut by ``split``, so is the micro batch.
        return piece_size(profiled, split)


@dataclass
class RecoveryState:
    """What a checkpoint keeps of the recovery: the cut, the cap, and the grow-back counters."""

    split: int = 1
    oom_cap: int | None = None
    clean_steps: int = 0
    grew_back: bool = False
    wait: int | None = None


class OomRecovery:
    """One machine for both batching modes: cut after an OOM, count clean steps, grow back, wait longer."""

    def __init__(self, cuts: Cuts, grow_back_after: int | None) -> None:
        self.cuts = cuts
        self.state = RecoveryState(wait=grow_back_after)

    @property
    def split(self) -> int:
        return self.state.split

    @property
    def oom_cap(self) -> int | None:
        return self.state.oom_cap

    def out_of_memory(self, failed: int, planned: int) -> int | None:
        """Cut further after ``failed`` samples in one forward ran out of memory; return the new cap.

        None when ``failed`` is already 1: nothing smaller exists, training cannot go on.
        """
        if smaller_cap(failed) is None:
            return None
        state = self.state
        if state.grew_back and state.wait is not None:
            state.wait *= 2  # the size just grown back to failed: wait twice as long before the next try
        state.split, state.oom_cap = self.cuts.after_oom(state.split, state.oom_cap, failed, planned)
        state.clean_steps, state.grew_back = 0, False
        return state.oom_cap

    def step_done(self) -> None:
        self.state.clean_steps += 1

    def grow_back_due(self) -> bool:
        state = self.state
        return (
            state.wait is not None and state.clean_steps >= state.wait and self.cuts.is_cut(state.split, state.oom_cap)
        )

    def grow_back(self, planned: int) -> None:
        state = self.state
        state.split, state.oom_cap = self.cuts.grown_back(state.split, state.oom_cap, planned)
        state.clean_steps, state.grew_back = 0, True

    def split_for(self, planned: int) -> int:
        """Apply the cut to a newly planned micro batch; return the split."""
        self.state.split = self.cuts.for_plan(self.state.split, self.state.oom_cap, planned)
        return self.state.split

    def cache_cap(self, profiled: int) -> int:
        """The micro batch a later run's profile should start at most at (see the profile cache)."""
        return self.cuts.cache_cap(self.state.split, self.state.oom_cap, profiled)

    def give_up(self) -> None:
        """Every size down to 1 failed: no cap is known to be safe, a resume starts from the plan."""
        self.state.split, self.state.oom_cap = 1, None

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore from a checkpoint's adaptive state (or a rank's record before a restart): every field."""
        missing = [name for name in RecoveryState.__dataclass_fields__ if name not in saved]
        if missing:
            raise ValueError(f"the OOM recovery state is missing {missing}")
        self.state = RecoveryState(**{name: saved[name] for name in RecoveryState.__dataclass_fields__})

    def adopt(self, recorded: Mapping[str, Any]) -> bool:
        """Take a recorded state (a rank's cut before a restart) if it cuts deeper than this one."""
        other = OomRecovery(self.cuts, None)
        other.load_state_dict(recorded)
        deeper = other.state.split > self.state.split or (
            other.state.oom_cap is not None and (self.state.oom_cap is None or other.state.oom_cap < self.state.oom_cap)
        )
        if deeper:
            self.state = other.state
        return deeper
