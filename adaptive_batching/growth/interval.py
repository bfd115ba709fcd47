"""When the batch grows: at epoch starts, or every N optimizer steps or N samples inside epochs.

``adaptive_batching.growth_interval`` cuts the run into *growth periods*: epochs (the default), or
periods of N optimizer steps or N samples counted from the start of the run. At the start of every
period after the first, ``batch_increase_function(period, current_batch_size)`` is called, with the
period's 0-based index in the place of the epoch: with ``epoch`` the two are the same, so a function
keeps its meaning (``linear_ramp`` with ``every: 2`` grows at every second boundary).

Growth inside an epoch swaps the sampler at a step boundary; the new one continues the epoch's
order where the old one stopped (:class:`~adaptive_batching.batching.sampler.SamplerSpan`), so no sample is skipped or
repeated, and a checkpoint saves the segment so resume stays exact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

KEY = "adaptive_batching.growth_interval"
UNITS = ("steps", "samples")
ALLOWED = "'epoch', 'N steps' or 'N samples' (N an integer >= 1, e.g. '50 steps')"
_PATTERN = re.compile(r"^\s*(\d+)\s*(steps?|samples?)\s*$")


@dataclass(frozen=True)
class GrowthInterval:
    """``unit`` 'epoch', 'steps' or 'samples'; ``every`` the period's length in that unit."""

    unit: str = "epoch"
    every: int = 1
    spelling: str = field(default="epoch", compare=False)  # as the config wrote it, for messages

    @property
    def per_epoch(self) -> bool:
        return self.unit == "epoch"

    def describe(self) -> str:
        return "at every epoch start" if self.per_epoch else f"every {self.every} {self.unit}"

    def period(self, steps: int, samples: int) -> int:
        """The 0-based growth period a run stands in after ``steps`` optimizer steps and ``samples`` samples."""
        if self.per_epoch:
            raise ValueError("per-epoch growth periods are epochs")
        return (steps if self.unit == "steps" else samples) // self.every


def growth_interval_error(value: Any) -> str | None:
    """None if ``value`` is a valid interval, else the allowed values (for the settings check)."""
    try:
        parse_growth_interval(value)
    except ValueError:
        return ALLOWED
    return None


def parse_growth_interval(value: Any) -> GrowthInterval:
    """``'epoch'``, ``'N steps'`` or ``'N samples'`` (singular accepted) as a :class:`GrowthInterval`."""
    if value == "epoch":
        return GrowthInterval()
    match = _PATTERN.match(value) if isinstance(value, str) else None
    if match is None or int(match.group(1)) < 1:
        raise ValueError(f"config key '{KEY}' = {value!r} is invalid: expected {ALLOWED}")
    unit = match.group(2) if match.group(2).endswith("s") else match.group(2) + "s"
    return GrowthInterval(unit, int(match.group(1)), value)
