"""The batch over the run (planning.py), without a model: where it starts, and the growth state machine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from adaptive_batching.batching.lr_scaling import SampleDrivenLR
from adaptive_batching.batching.shape import BatchShape
from adaptive_batching.config.settings import KNOBS, AdaptiveSettings, sections
from adaptive_batching.growth import plan
from adaptive_batching.growth.plan import BatchPlan

REFERENCE = BatchShape(4, 2, 1)  # batch_size 4 x accumulation 2: global batch 8


def settings(use_max: bool = False, fn: Any = None, **values: Any) -> AdaptiveSettings:
    return AdaptiveSettings(use_max, **sections({**{k: v.default for k, v in KNOBS.items()}, **values}, fn))


def starting_batch(settings: AdaptiveSettings, reference: BatchShape, ranks: int, profiled: Any) -> Any:
    return plan.starting_batch(
        settings.growth,
        settings.elastic,
        reference,
        ranks,
        profiled,
        use_maximum_batch_size=settings.use_maximum_batch_size,
        optimizer_in_bwd=settings.optimizer_in_bwd,
    )


def test_the_profiled_micro_batch_starts_the_plan_and_the_lr_follows_it() -> None:
    """``use_maximum_batch_size`` alone changes the batch: 16 x 2 = 32 samples, so the LR is x2 under sqrt."""
    start = starting_batch(settings(use_max=True), REFERENCE, 1, 16)
    assert (start.micro_batch, start.accumulation, start.memory_cap, start.reference) == (16, 2, 16, REFERENCE)
    batches = BatchPlan(settings(use_max=True).growth, epochs=2, ranks=1)
    entries = batches.make(start=start.micro_batch, accumulation=start.accumulation, memory_cap=start.memory_cap)
    optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
    lr = SampleDrivenLR(optimizer, [1e-3], None, reference_global_batch=REFERENCE.global_batch, rule="sqrt")
    lr.set_global_batch(entries[0].shape.global_batch)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)
    off = starting_batch(settings(), REFERENCE, 1, 16)
    assert (off.micro_batch, off.memory_cap) == (4, 16)  # profiled only for the cap on growth


def test_keeping_the_global_batch_starts_at_the_profiled_micro_batch_with_the_rest_as_accumulation(
    said: Callable[[], list[str]],
) -> None:
    start = starting_batch(settings(use_max=True, keep_global_batch=True), BatchShape(4, 4, 1), 1, 8)
    assert start.micro_batch * start.accumulation == 16 and start.micro_batch <= 8 and start.memory_cap is None
    assert "Keeping the config's global batch 16" in said()[0]


def double(epoch: int, current: int) -> int:
    return current


def test_growth_periods_inside_epochs_change_the_batch_from_there_on_and_survive_a_resume() -> None:
    plan = BatchPlan(settings(fn=double, growth_interval="3 steps").growth, epochs=3, ranks=2, epochs_run=lambda: 1)
    plan.make(start=2, accumulation=1, memory_cap=None)
    assert [e.shape.global_batch for e in plan.entries] == [4, 4, 4]  # the plan made before training: no growth
    assert [plan.period_after_step(s, 4 * s, 4) for s in (1, 2, 3, 4, 6)] == [None, None, 1, None, 2]
    previous, entry = plan.grow_in_period(0, 1, stats={})
    assert previous.shape.micro_batch == 2 and entry.shape.micro_batch == 4
    assert [e.shape.micro_batch for e in plan.entries] == [4, 4, 4] and [e.epoch for e in plan.entries] == [0, 1, 2]
    assert plan.start_global_batch == 4  # what the run started at, whatever entries[0] holds now
    saved = plan.state_dict()  # saved in epoch 2 (one epoch run)
    again = BatchPlan(settings(fn=double, growth_interval="3 steps").growth, epochs=3, ranks=2, epochs_run=lambda: 1)
    again.load_state_dict(saved)
    again.make(start=2, accumulation=1, memory_cap=None)
    assert [e.shape.micro_batch for e in again.entries] == [2, 4, 4]
    assert "not at epoch starts" in again.switch_reason(1)


def test_a_statistics_reading_function_decides_at_the_epoch_start_and_the_decision_is_saved() -> None:
    seen: list[float | None] = []

    def grow(epoch: int, current: int, *, stats: Any = None) -> int:
        seen.append(None if stats is None else stats.get("noise_scale"))
        return 0 if stats is None else 3

    plan = BatchPlan(settings(fn=grow).growth, epochs=3, ranks=1)
    plan.make(start=2, accumulation=1, memory_cap=None)
    assert [e.shape.micro_batch for e in plan.entries] == [2, 2, 2]
    entries = plan.entries
    assert plan.measure_at_epoch_start(1, {"noise_scale": 12.5}) == 3
    assert plan.entries is entries and [e.shape.micro_batch for e in plan.entries] == [2, 5, 5]
    assert 12.5 in seen and plan.measure_at_epoch_start(1, {"noise_scale": 99.0}) is None  # decided once
    again = BatchPlan(settings(fn=grow).growth, epochs=3, ranks=1, epochs_run=lambda: 1)
    again.load_state_dict(plan.state_dict())
    again.make(start=2, accumulation=1, memory_cap=None)
    assert [e.shape.micro_batch for e in again.entries] == [2, 5, 5]
    assert plan.period_after_step(5, 10, 2) is None  # per-epoch growth has no periods inside epochs


@pytest.mark.parametrize("accumulation, note", [(1, True), (2, False)])
def test_noise_scale_growth_that_cannot_measure_says_so_in_the_plan(accumulation: int, note: bool) -> None:
    import functools

    from adaptive_batching.growth.plan import BatchPlan
    from adaptive_batching.growth.settings import GrowthSettings
    from adaptive_batching.growth.statistics import noise_scale

    plan = BatchPlan(GrowthSettings(increase=functools.partial(noise_scale, fraction=0.5)), epochs=2, ranks=1)
    plan.make(start=8, accumulation=accumulation, memory_cap=None)
    described = plan.describe(lambda rows, *_: rows, [(2, 16)] * 2, 8 * accumulation, "sqrt", 4)
    assert ("cannot measure it here" in described) == note
    assert (plan.unmeasurable_note() is not None) == note
