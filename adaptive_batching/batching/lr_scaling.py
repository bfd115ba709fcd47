"""Learning rate under a changing batch: scaled by a rule, scheduled by consumed samples.

The user's LR scheduler keeps its shape when the global batch changes because it is driven by
*progress*, the samples consumed so far in units of the reference global batch (``batch_size`` x
``gradient_accumulation_steps`` x ranks as written in the config), as Megatron-LM does. On top of
it, every param group's LR is multiplied by a factor of the global batch against that reference:

- ``linear`` (Goyal et al. 2017): k times the batch, k times the LR. Right for SGD.
- ``sqrt`` (Krizhevsky 2014; Malladi et al. 2022 for Adam): k times the batch, sqrt(k) times the LR.
  Adaptive optimisers already divide by a running gradient scale, so a linear rule overshoots.
- ``none``: the LR ignores the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.optim.lr_scheduler import LambdaLR

LR_SCALING_RULES = ("linear", "sqrt", "none")


def default_rule(optimizer_component: str) -> str:
    """``linear`` for SGD, ``sqrt`` for Adam-family and other adaptive optimisers."""
    name = optimizer_component.rsplit(".", 1)[-1].lower()
    return "linear" if "sgd" in name else "sqrt"


def lr_factor(global_batch: int, reference_global_batch: int, rule: str) -> float:
    """The LR multiplier for ``global_batch`` relative to ``reference_global_batch`` under ``rule``."""
    if rule not in LR_SCALING_RULES:
        raise ValueError(f"unknown LR scaling rule {rule!r}; expected {' | '.join(LR_SCALING_RULES)}")
    if global_batch < 1 or reference_global_batch < 1:
        raise ValueError(f"batch sizes must be >= 1, got {global_batch} and {reference_global_batch}")
    ratio = global_batch / reference_global_batch
    return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


def reference_steps(total_samples: int, reference_global_batch: int) -> int:
    """The length of a run in steps of the reference global batch (the scheduler's ``num_training_steps``)."""
    return max(1, math.ceil(total_samples / reference_global_batch))


class SampleDrivenLR:
    """Sets every param group's LR to ``base_lr x schedule(progress) x lr_factor(global batch)``.

    ``schedule`` is the user's :class:`~torch.optim.lr_scheduler.LambdaLR` (every torchtune LR
    scheduler is one), evaluated at ``progress = consumed_samples / reference_global_batch``;
    with no scheduler it is 1. With the reference batch throughout, progress after n steps is n:
    exactly the stock recipe's schedule.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        base_lrs: Sequence[float],
        scheduler: LambdaLR | None,
        *,
        reference_global_batch: int,
        rule: str,
    ) -> None:
        if scheduler is not None and not isinstance(scheduler, LambdaLR):
            raise TypeError(f"the LR scheduler must be a LambdaLR, got {type(scheduler).__name__}")
        if len(base_lrs) != len(optimizer.param_groups):
            raise ValueError(f"{len(base_lrs)} base LRs for {len(optimizer.param_groups)} param groups")
        self.optimizer = optimizer
        self.base_lrs = list(base_lrs)
        self.scheduler = scheduler
        self.reference_global_batch = reference_global_batch
        self.rule = rule
        self.consumed_samples = 0
        self.global_batch = reference_global_batch
        self.peak_shape = self.schedule_shape()  # the schedule's largest multiplier so far (Seesaw's reference)
        self.apply()

    @classmethod
    def from_config(
        cls,
        scheduler_cfg: Any,
        optimizer: torch.optim.Optimizer,
        base_lrs: Sequence[float],
        *,
        total_steps: int,
        reference_global_batch: int,
        rule: str,
        state: dict[str, Any] | None = None,
    ) -> SampleDrivenLR:
        """From the config's ``lr_scheduler`` node (None: constant), over ``total_steps`` reference steps;
        ``state`` (a resumed run's) puts it where the run stood."""
        from torchtune import config

        scheduler = (
            None
            if scheduler_cfg is None
            else config.instantiate(scheduler_cfg, optimizer, num_training_steps=total_steps)
        )
        lr = cls(optimizer, base_lrs, scheduler, reference_global_batch=reference_global_batch, rule=rule)
        if state is not None:
            lr.load_state_dict(state)
        return lr

    @property
    def progress(self) -> float:
        """Samples consumed, in steps of the reference global batch."""
        return self.consumed_samples / self.reference_global_batch

    @property
    def factor(self) -> float:
        return lr_factor(self.global_batch, self.reference_global_batch, self.rule)

    def _shapes(self) -> list[float] | None:
        """Each param group's schedule multiplier at :attr:`progress`, or None without a schedule. torch types a
        LambdaLR's functions for whole epochs; torchtune's schedules take a (fractional) step count."""
        if self.scheduler is None:
            return None
        functions = cast(list[Callable[[float], float]], self.scheduler.lr_lambdas)
        return [float(function(self.progress)) for function in functions]

    def schedule_shape(self) -> float | None:
        """The LR schedule's multiplier now (1.0 at its peak), or None without a schedule."""
        shapes = self._shapes()
        return None if shapes is None else shapes[0]

    def lrs(self) -> list[float]:
        """What each param group's LR is now."""
        shape = self._shapes() or [1.0] * len(self.base_lrs)
        return [base * s * self.factor for base, s in zip(self.base_lrs, shape)]

    def apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.lrs()):
            group["lr"] = lr

    def set_global_batch(self, global_batch: int) -> None:
        """The batch changed: rescale the LR from now on."""
        self.global_batch = global_batch
        self.apply()

    def advance(self, samples: int) -> None:
        """After an optimizer step over ``samples`` samples (all ranks)."""
        self.consumed_samples += samples
        shape = self.schedule_shape()
        if shape is not None:
            self.peak_shape = shape if self.peak_shape is None else max(self.peak_shape, shape)
        self.apply()

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed_samples": self.consumed_samples,
            "global_batch": self.global_batch,
            "peak_shape": self.peak_shape,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed_samples = int(state["consumed_samples"])
        self.global_batch = int(state["global_batch"])
        self.peak_shape = state["peak_shape"]
        self.apply()
