"""The trainer's public seam: where a harness sees or changes a run (fault injection in tests, timing in benchmarks).

A :class:`TrainerHooks` subclass overrides what it needs; every method here does nothing. Give one to
:meth:`Trainer.build <adaptive_batching.training.trainer.Trainer.build>` (``hooks=``), or :func:`install` one for the
whole process before a recipe builds its trainer (a recipe run through ``tune run`` takes no arguments but its
config). The hooks see the run's :class:`~adaptive_batching.training.parts.Parts` (``parts``): its model, optimizer,
data, step guard, feed and progress. They are plain calls: none reads a device value, so none makes the host wait
for the device. Production code uses none of them.

Where each is called, in the order a run meets them:

- :meth:`~TrainerHooks.before_setup` as set-up begins, with the run's stop handling (``preemption``, installed:
  the one part that exists then), and :meth:`~TrainerHooks.after_setup` at its end, every part built, before the
  profile;
- :meth:`~TrainerHooks.collate` once in set-up, when the collate is built: the collate the run then uses
  everywhere (training, the profiler's trial steps); a hook may wrap it, to see which samples each step takes;
- :meth:`~TrainerHooks.before_trial` before each trial step (the profiler's, and growth's checks of a batch);
- :meth:`~TrainerHooks.before_train` and :meth:`~TrainerHooks.after_train` around the whole training (the latter
  when it finishes: not after a stop signal or an error);
- :meth:`~TrainerHooks.before_epoch` and :meth:`~TrainerHooks.after_epoch` around an epoch's step loop (after
  its batch switch, before its save);
- :meth:`~TrainerHooks.before_step` before each optimizer step, its micro batches collated,
  ``parts.progress.global_step`` steps done;
- :meth:`~TrainerHooks.before_forward` and :meth:`~TrainerHooks.after_loss` for each micro batch, in training and
  trial steps alike: before its forward (its tensors on the device) and with its loss, before its backward (a hook
  may raise ``torch.OutOfMemoryError`` here, or register a tensor hook that raises in the backward);
- :meth:`~TrainerHooks.after_step` after each optimizer step, before the trainer counts it
  (``parts.progress.global_step`` is still the step before), with its statistics, or None when it ran out of memory
  and is served again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Preemption = Any  # faults/preemption.py's: the run's stop handling
Parts = Any  # training/parts.py's Parts (it imports this module): every part of the run
StepStats = Any  # training/stepping.py's: the optimizer step's statistics, or None


class TrainerHooks:
    """No-op hooks (see the module docstring for where each is called)."""

    def before_setup(self, preemption: Preemption) -> None:
        pass

    def collate(self, collate: Callable) -> Callable:
        return collate

    def after_setup(self, parts: Parts) -> None:
        pass

    def before_trial(self, micro_batch: int) -> None:
        pass

    def before_train(self, parts: Parts) -> None:
        pass

    def after_train(self, parts: Parts) -> None:
        pass

    def before_epoch(self, parts: Parts, epoch: int) -> None:
        pass

    def after_epoch(self, parts: Parts, epoch: int) -> None:
        pass

    def before_step(self, parts: Parts, micro_batches: list[dict[str, Any]]) -> None:
        pass

    def before_forward(self, batch: dict[str, torch.Tensor]) -> None:
        pass

    def after_loss(self, loss: torch.Tensor) -> None:
        pass

    def after_step(self, parts: Parts, stats: StepStats) -> None:
        pass


_installed: list[TrainerHooks] = [TrainerHooks()]


def install(hooks: TrainerHooks) -> None:
    """Make ``hooks`` those of every trainer built from now on in this process without its own."""
    _installed[0] = hooks


def installed() -> TrainerHooks:
    """The hooks :func:`install` set (no-op hooks if none)."""
    return _installed[0]
