"""LR scaling rules and the sample-driven LR schedule, against torchtune's own schedulers."""

from __future__ import annotations

import math

import pytest
import torch
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

from adaptive_batching.batching.lr_scaling import SampleDrivenLR, default_rule, lr_factor, reference_steps


def optimizer(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups)


def cosine(opt: torch.optim.Optimizer, total: int, warmup: int = 4) -> torch.optim.lr_scheduler.LambdaLR:
    return get_cosine_schedule_with_warmup(opt, num_warmup_steps=warmup, num_training_steps=total)


@pytest.mark.parametrize(
    "rule,batch,reference,expected",
    [
        ("linear", 32, 8, 4.0),
        ("sqrt", 32, 8, 2.0),
        ("none", 32, 8, 1.0),
        ("linear", 4, 8, 0.5),
        ("sqrt", 2, 8, 0.5),
        ("sqrt", 8, 8, 1.0),
        ("linear", 86, 16, 86 / 16),
    ],
)
def test_factor(rule: str, batch: int, reference: int, expected: float) -> None:
    assert lr_factor(batch, reference, rule) == pytest.approx(expected)


def test_factor_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="linear | sqrt | none"):
        lr_factor(8, 8, "cubic")
    with pytest.raises(ValueError, match=">= 1"):
        lr_factor(0, 8, "linear")


@pytest.mark.parametrize(
    "component,rule",
    [
        ("torch.optim.AdamW", "sqrt"),
        ("torch.optim.Adam", "sqrt"),
        ("bitsandbytes.optim.PagedAdamW8bit", "sqrt"),
        ("torchao.optim.AdamW8bit", "sqrt"),
        ("torch.optim.SGD", "linear"),
        ("torch.optim.Adagrad", "sqrt"),
    ],
)
def test_default_rule(component: str, rule: str) -> None:
    assert default_rule(component) == rule


def test_at_the_reference_batch_the_schedule_is_the_stock_one() -> None:
    """Progress in reference steps equals the step count: the same LRs as stepping the LambdaLR."""
    stock_opt, ours_opt = optimizer(1e-3), optimizer(1e-3)
    stock = cosine(stock_opt, total=20)
    ours = SampleDrivenLR(ours_opt, [1e-3], cosine(ours_opt, total=20), reference_global_batch=8, rule="sqrt")
    for _ in range(20):
        assert ours_opt.param_groups[0]["lr"] == pytest.approx(stock_opt.param_groups[0]["lr"], rel=1e-12)
        stock_opt.step(), stock.step()
        ours.advance(8)


@pytest.mark.parametrize("rule", ["linear", "sqrt", "none"])
def test_a_bigger_batch_keeps_the_schedule_shape_and_scales_it(rule: str) -> None:
    """Batch 4x the reference: each step covers 4 reference steps of warmup/decay, times the factor."""
    opt = optimizer(1e-3)
    lr = SampleDrivenLR(opt, [1e-3], cosine(opt, total=40, warmup=8), reference_global_batch=8, rule=rule)
    lr.set_global_batch(32)
    reference_opt = optimizer(1e-3)
    reference = cosine(reference_opt, total=40, warmup=8)
    factor = {"linear": 4.0, "sqrt": 2.0, "none": 1.0}[rule]
    seen = []
    for step in range(10):
        expected = reference.lr_lambdas[0](4 * step) * 1e-3 * factor
        assert opt.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        seen.append(opt.param_groups[0]["lr"])
        lr.advance(32)
    # Warmup is over after 2 steps of 32 (8 reference steps), then the decay reaches zero at 40.
    assert seen[0] == 0.0 and seen[2] == pytest.approx(1e-3 * factor)
    assert seen[9] < seen[5] < seen[2]
    assert lr.progress == 40


def test_batch_change_mid_run_continues_from_the_samples_consumed() -> None:
    opt = optimizer(1e-3)
    lr = SampleDrivenLR(opt, [1e-3], cosine(opt, total=100, warmup=10), reference_global_batch=10, rule="sqrt")
    for _ in range(5):
        lr.advance(10)  # 50 samples at the reference batch
    lr.set_global_batch(40)
    shape = cosine(optimizer(1.0), total=100, warmup=10).lr_lambdas[0]
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * shape(5) * 2.0)
    lr.advance(40)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * shape(9) * 2.0)
    lr.advance(25)  # a smaller last step of the epoch advances by what it consumed
    assert lr.progress == pytest.approx(11.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * shape(11.5) * 2.0)


def test_every_param_group_and_no_scheduler() -> None:
    opt = optimizer(1e-3, 5e-4)
    lr = SampleDrivenLR(opt, [1e-3, 5e-4], None, reference_global_batch=16, rule="linear")
    lr.set_global_batch(48)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([3e-3, 1.5e-3])
    lr.advance(48)  # no scheduler: constant apart from the factor, and never compounding
    lr.advance(48)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([3e-3, 1.5e-3])


def test_state_round_trip() -> None:
    opt = optimizer(1e-3)
    lr = SampleDrivenLR(opt, [1e-3], cosine(opt, total=50), reference_global_batch=8, rule="sqrt")
    lr.set_global_batch(24)
    for _ in range(3):
        lr.advance(24)
    fresh_opt = optimizer(1e-3)
    fresh = SampleDrivenLR(fresh_opt, [1e-3], cosine(fresh_opt, total=50), reference_global_batch=8, rule="sqrt")
    fresh.load_state_dict(lr.state_dict())
    assert fresh.progress == lr.progress == 9
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_peak_shape_follows_the_warmup_then_holds() -> None:
    """Seesaw's reference: the schedule's largest multiplier so far (not its value now), saved for resume."""
    opt = optimizer(1e-3)
    lr = SampleDrivenLR(opt, [1e-3], cosine(opt, total=40, warmup=8), reference_global_batch=8, rule="sqrt")
    assert lr.peak_shape == 0.0
    lr.advance(32)  # progress 4: half-way up the warm-up
    assert lr.peak_shape == pytest.approx(0.5)
    for _ in range(10):
        lr.advance(32)  # past the warm-up and into the decay
    assert lr.peak_shape == pytest.approx(1.0)
    assert lr.schedule_shape() < 0.5
    fresh_opt = optimizer(1e-3)
    fresh = SampleDrivenLR(
        fresh_opt, [1e-3], cosine(fresh_opt, total=40, warmup=8), reference_global_batch=8, rule="sqrt"
    )
    fresh.load_state_dict(lr.state_dict())
    assert fresh.peak_shape == lr.peak_shape


def test_only_lambda_schedulers() -> None:
    opt = optimizer(1e-3)
    with pytest.raises(TypeError, match="LambdaLR"):
        SampleDrivenLR(opt, [1e-3], torch.optim.lr_scheduler.StepLR(opt, 2), reference_global_batch=8, rule="sqrt")


def test_reference_steps() -> None:
    assert reference_steps(4816, 16) == math.ceil(4816 / 16) == 301
    assert reference_steps(160, 16) == 10
    assert reference_steps(0, 16) == 1
