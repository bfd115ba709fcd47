"""The profiler's orchestration on simulated steps, and its no-trace guarantee on a real model."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torchtune.models.llama3 import llama3

from adaptive_batching.assets.tiny import TINY_MODEL_ARGS
from adaptive_batching.config.settings import KNOBS
from adaptive_batching.core.steps import StepMemory
from adaptive_batching.errors import ProfileError
from adaptive_batching.profiling.budget import Budget
from adaptive_batching.profiling.max_micro_batch import find_max_micro_batch, preserved_training_state

MIB = 2**20
OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes."


def simulated_step(
    *,
    steady: int,
    fixed: int,
    per_sample: int,
    optimizer_peak: int,
    capacity: int,
    noise: float = 0.0,
    seed: int = 0,
    small_batch_extra: dict[int, int] | None = None,
):
    """A step whose forward/backward peak is steady + fixed + per_sample x b (+ ``small_batch_extra[b]``);
    real OOM above ``capacity``."""
    rng = random.Random(seed)
    calls: list[int] = []
    extra = small_batch_extra or {}

    def step(b: int) -> StepMemory:
        calls.append(b)
        activation = int((fixed + per_sample * b + extra.get(b, 0)) * (1 + rng.uniform(-noise, noise)))
        if steady + activation > capacity:
            raise RuntimeError(OOM)
        return StepMemory(activation, steady + activation, optimizer_peak, steady)

    return step, calls


def true_max(steady: int, fixed: int, per_sample: int, limit: int) -> int:
    return (limit - steady - fixed) // per_sample


@pytest.mark.parametrize("capacity_share", [1.0, 0.97, 0.9])
def test_finds_the_largest_micro_batch_in_few_steps(capacity_share: float) -> None:
    """The allocator may fail below the budget (fragmentation): the search still lands within 3%,
    at about two more steps each time the estimate's error doubles past the tolerance. Steps: a warm-up,
    2 probes, the far probe, verification."""
    error = 1 / capacity_share - 1  # how far the estimate (from the budget) lies above what fits
    max_steps = 4 + 2 + 2 * math.ceil(math.log2(max(1.0, error / KNOBS["search_tolerance"].default)))
    budget = Budget(4096 * MIB, "test")
    capacity = int(budget.bytes * capacity_share)
    step, calls = simulated_step(
        steady=300 * MIB, fixed=40 * MIB, per_sample=9 * MIB, optimizer_peak=500 * MIB, capacity=capacity
    )
    result = find_max_micro_batch(step, budget, seq_len=256, safety_margin=0.05, round_to="none", upper_limit=10_000)
    best = true_max(300 * MIB, 40 * MIB, 9 * MIB, min(capacity, budget.bytes))
    assert 0.97 * best <= result.max_micro_batch <= best
    assert result.trial_steps == len(calls) == len(set(calls))
    assert result.trial_steps <= max_steps
    assert result.micro_batch == int(result.max_micro_batch * 0.95)
    assert result.bytes_per_sample == pytest.approx(9 * MIB, rel=1e-6)


@pytest.mark.parametrize("judged_by", ["reserved", "retries"])
def test_reserved_memory_and_allocator_retries_count_against_the_budget(judged_by: str) -> None:
    """A caching allocator can stay within the budget by allocated bytes while its reservation
    (fragmentation) passes it, or while it frees its cache and retries: both are over budget, so the
    answer is the largest micro batch below where that starts, not the allocated-bytes maximum."""
    budget = Budget(4096 * MIB, "test")
    steady, fixed, per_sample = 300 * MIB, 40 * MIB, 9 * MIB
    trouble_from = 250  # allocated bytes would allow ~417

    def step(b: int) -> StepMemory:
        activation = fixed + per_sample * b
        allocated = steady + activation
        if judged_by == "reserved":
            reserved = int(allocated * (1.0 if b < trouble_from else 2.0))
            return StepMemory(activation, allocated, 500 * MIB, steady, reserved_peak=reserved)
        return StepMemory(
            activation, allocated, 500 * MIB, steady, reserved_peak=allocated, alloc_retries=int(b >= trouble_from)
        )

    result = find_max_micro_batch(step, budget, seq_len=256, safety_margin=0.0, round_to="none", upper_limit=10_000)
    assert trouble_from * 0.97 <= result.max_micro_batch < trouble_from
    refused = [t for t in result.trials if not t["ok"]]
    assert refused and all(t["micro_batch"] >= trouble_from for t in refused)
    if judged_by == "retries":
        assert all(t["alloc_retries"] == 1 for t in refused)
    else:
        assert all(t["reserved_bytes"] > budget.bytes for t in refused)


def test_optimizer_peak_does_not_distort_the_slope() -> None:
    """At small batches the optimizer step sets the peak; the fit uses the activation part only."""
    budget = Budget(2048 * MIB, "test")
    step, _ = simulated_step(
        steady=600 * MIB, fixed=10 * MIB, per_sample=5 * MIB, optimizer_peak=1200 * MIB, capacity=budget.bytes
    )
    result = find_max_micro_batch(step, budget, seq_len=128, safety_margin=0.0, round_to="none", upper_limit=10_000)
    best = true_max(600 * MIB, 10 * MIB, 5 * MIB, budget.bytes)
    assert result.estimate == best
    assert result.max_micro_batch == best
    assert result.trial_steps <= 6


def test_the_far_probe_corrects_a_slope_measured_on_few_samples() -> None:
    """As on CPU: micro batch 2 peaks higher than the line (5.47 MiB per sample measured from 4 up, 5.15 from
    2 and 4), so the first estimate is 6% high; the far probe at an eighth of it brings the estimate within 1%,
    and verification then takes 2 steps."""
    budget = Budget(1600 * MIB, "test")
    step, calls = simulated_step(
        steady=0,
        fixed=int(0.9 * MIB),
        per_sample=int(5.47 * MIB),
        optimizer_peak=0,
        capacity=budget.bytes,
        small_batch_extra={2: int(0.65 * MIB)},
    )
    result = find_max_micro_batch(step, budget, seq_len=256, safety_margin=0.0, round_to="none", upper_limit=10_000)
    best = true_max(0, int(0.9 * MIB), int(5.47 * MIB), budget.bytes)
    first_estimate = 311  # the line through micro batches 2 and 4
    assert calls[:4] == [1, 2, 4, first_estimate // 8]
    assert [t["phase"] for t in result.trials[:4]] == ["warmup", "probe", "probe", "probe"]
    assert abs(result.estimate - best) <= 0.01 * best
    assert best - 1 <= result.max_micro_batch <= best
    assert result.trial_steps == 6


def test_noisy_measurements_never_exceed_the_true_maximum() -> None:
    budget = Budget(4096 * MIB, "test")
    for seed in range(10):
        step, _ = simulated_step(
            steady=200 * MIB,
            fixed=50 * MIB,
            per_sample=7 * MIB,
            optimizer_peak=300 * MIB,
            capacity=budget.bytes,
            noise=0.01,
            seed=seed,
        )
        result = find_max_micro_batch(step, budget, seq_len=64, safety_margin=0.0, round_to="none", upper_limit=10_000)
        assert result.max_micro_batch <= true_max(200 * MIB, 50 * MIB, int(7 * MIB * 0.99), budget.bytes) + 1
        assert result.max_micro_batch >= 0.95 * true_max(200 * MIB, 50 * MIB, 7 * MIB, budget.bytes)


def test_the_upper_limit_caps_the_search() -> None:
    budget = Budget(4096 * MIB, "test")
    step, calls = simulated_step(steady=1, fixed=1, per_sample=MIB, optimizer_peak=1, capacity=budget.bytes)
    result = find_max_micro_batch(step, budget, seq_len=8, safety_margin=0.0, round_to="power_of_two", upper_limit=100)
    assert max(calls) <= 100
    assert result.max_micro_batch == 100 and result.micro_batch == 64


def test_batch_one_not_fitting_is_a_clear_error() -> None:
    budget = Budget(100 * MIB, "explicit adaptive_batching.memory_budget=100MiB")
    step, calls = simulated_step(steady=90 * MIB, fixed=20 * MIB, per_sample=MIB, optimizer_peak=1, capacity=10**12)
    with pytest.raises(ProfileError, match=r"micro batch 1 does not fit .* \(its step used 0\.108 GiB\)"):
        find_max_micro_batch(step, budget, seq_len=4096, safety_margin=0.05, round_to="none", upper_limit=100)
    assert calls == [1, 1]  # the warm-up, and the second step that confirms it


def test_a_warm_up_over_the_budget_from_one_time_costs_is_measured_again() -> None:
    """The first step's peak holds one-time costs (on CPU: lazy initialisation in resident memory); micro
    batch 1 is refused only when a second step at it is over the budget too."""
    budget = Budget(100 * MIB, "test")
    step, calls = simulated_step(steady=10 * MIB, fixed=5 * MIB, per_sample=MIB, optimizer_peak=1, capacity=10**12)
    first = [True]

    def warming(b: int) -> StepMemory:
        used = step(b)
        if first.pop() if first else False:
            return StepMemory(used.activation_bytes, 200 * MIB, used.optimizer_peak, used.steady_bytes)
        return used

    result = find_max_micro_batch(warming, budget, seq_len=64, safety_margin=0.0, round_to="none", upper_limit=1000)
    assert calls[:3] == [1, 1, 2]
    assert [t["phase"] for t in result.trials[:2]] == ["warmup", "warmup"]
    assert result.trials[0]["ok"] is False and result.trials[1]["ok"] is True
    assert result.max_micro_batch == true_max(10 * MIB, 5 * MIB, MIB, budget.bytes)


def test_other_errors_are_not_swallowed() -> None:
    def step(b: int) -> StepMemory:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        find_max_micro_batch(step, Budget(MIB, "t"), seq_len=1, safety_margin=0, round_to="none", upper_limit=9)


def test_ranks_agree_on_the_smallest_outcome() -> None:
    """An agreement that fails a trial on another rank (e.g. its OOM) makes this rank fail it too."""
    budget = Budget(4096 * MIB, "test")
    step, _ = simulated_step(
        steady=100 * MIB, fixed=10 * MIB, per_sample=4 * MIB, optimizer_peak=1, capacity=budget.bytes
    )
    other_rank_max = 960  # this rank alone would reach (4096 - 110) // 4 = 996

    def agree(ok: bool, values):
        return ok and agree.sizes[-1] <= other_rank_max, list(values)

    agree.sizes = []

    def tracked_step(b: int) -> StepMemory:
        agree.sizes.append(b)
        return step(b)

    result = find_max_micro_batch(
        tracked_step, budget, seq_len=64, safety_margin=0.0, round_to="none", upper_limit=10_000, agree=agree
    )
    assert 0.97 * other_rank_max <= result.max_micro_batch <= other_rank_max


def test_profiling_leaves_no_trace_bitwise() -> None:
    torch.manual_seed(0)
    model = llama3(**TINY_MODEL_ARGS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randint(0, 1280, (2, 16))
    model(x).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = {k: {n: t.clone() for n, t in v.items()} for k, v in optimizer.state_dict()["state"].items()}
    np.random.seed(3)
    random.seed(3)
    torch.manual_seed(3)
    with preserved_training_state(model, optimizer):
        for b in (1, 3, 5):
            model(torch.randint(0, 1280, (b, 32))).mean().backward()
            optimizer.step()
        np.random.rand(4)
        random.random()
    after_rng = (torch.rand(3), np.random.rand(3), random.random())
    np.random.seed(3)
    random.seed(3)
    torch.manual_seed(3)
    assert torch.equal(after_rng[0], torch.rand(3))
    assert np.array_equal(after_rng[1], np.random.rand(3)) and after_rng[2] == random.random()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    state = optimizer.state_dict()["state"]
    assert all(torch.equal(opt_state[k][n], state[k][n]) for k in opt_state for n in opt_state[k])
    assert all(p.grad is None for p in model.parameters())


def test_the_weight_copies_are_held_in_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies the profiler restores from never sit on the model's device (where they would be part
    of every trial's measured peak): one host tensor per trainable weight, sharing no storage."""
    import adaptive_batching.profiling.max_micro_batch as profiler

    model = llama3(**TINY_MODEL_ARGS)
    model.tok_embeddings.weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    real_copy = profiler.host_copy
    monkeypatch.setattr(profiler, "host_copy", lambda t: copies.append((t, real_copy(t))) or copies[-1][1])
    with preserved_training_state(model, optimizer):
        pass
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(copies) == len(trainable)
    for param, copy in copies:
        assert copy.device.type == "cpu" and copy.is_pinned() == (param.device.type == "cuda")
        assert copy.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()
        assert torch.equal(copy, param)
    assert sum(c.nbytes for _, c in copies) == sum(p.nbytes for p in trainable)
