"""Batching policies: one interface, samples per micro batch or a token budget."""

from __future__ import annotations

import pytest

from adaptive_batching.batching.policy import DataContext, SampleBatching, TokenBatching, batching_for
from adaptive_batching.batching.settings import BatchingSettings
from adaptive_batching.batching.shape import BatchShape, EpochBatch
from adaptive_batching.faults.recovery import SampleCuts, TokenCuts
from adaptive_batching.runtime.distributed import ParallelInfo

DEFAULT = BatchingSettings()


def context(n: int = 40) -> DataContext:
    return DataContext(
        dataset=list(range(n)), collate=list, parallel=ParallelInfo(), shuffle=False, seed=0, max_steps=None
    )


def test_max_tokens_picks_the_token_policy() -> None:
    assert type(batching_for(DEFAULT)) is SampleBatching
    token = batching_for(BatchingSettings(max_tokens=512))
    assert type(token) is TokenBatching
    assert isinstance(SampleBatching(DEFAULT).cuts(), SampleCuts) and isinstance(token.cuts(), TokenCuts)


def test_the_sample_policy_serves_every_sample_once_in_planned_steps() -> None:
    policy = SampleBatching(DEFAULT)
    policy.prepare(context(), lengths=None, profiles=False)  # type: ignore[arg-type]
    shape = BatchShape(micro_batch=4, accumulation=2, ranks=1)
    policy.use_plan(
        [EpochBatch(epoch=0, requested=4, increment=0, shape=shape, reason="start")],
        start=4,
        profiled=None,
        verify=None,
    )  # type: ignore[arg-type]
    assert policy.extent(0) == (5, 40)
    sampler = policy.loader(0, split=2, start_step=0).batch_sampler
    micro_batches = list(sampler)
    assert sorted(i for micro in micro_batches for i in micro) == list(range(40))
    assert max(len(micro) for micro in micro_batches) == 2
    assert policy.lr_global_batch(shape, sampler, 0) == 8
    assert policy.metrics(0, split=2, micro_piece=2) == {"micro_batch_size": 2}
    assert policy.state_dict() == {"token_budget": None}


def test_the_token_policy_scales_its_budget_with_the_plan_and_sets_the_lr_per_step() -> None:
    policy = TokenBatching(BatchingSettings(max_tokens=64))
    policy.data = context()
    policy.lengths = [8 + (i % 5) for i in range(40)]
    shapes = [BatchShape(micro_batch=m, accumulation=1, ranks=1) for m in (4, 8)]
    plan = [
        EpochBatch(epoch=e, requested=s.micro_batch, increment=0, shape=s, reason="start") for e, s in enumerate(shapes)
    ]
    policy.use_plan(plan, start=4, profiled=None, verify=None)  # type: ignore[arg-type]
    assert policy.budgets == [64, 128] and policy.served(1) == 128
    assert policy.metrics(1, split=2, micro_piece=0) == {"max_tokens": 64}
    steps, samples = policy.extent(0)
    assert samples == 40 and steps >= 40 * 8 // 64
    sampler = policy.loader(0, split=1, start_step=0).batch_sampler
    assert policy.lr_global_batch(shapes[0], sampler, 0) == sampler.samples_in_step(0)
    assert policy.lr_global_batch(shapes[0], sampler, sampler.steps) is None
    assert policy.state_dict() == {"token_budget": 64}
    resumed = TokenBatching(BatchingSettings(max_tokens=64))
    resumed.load_state_dict({"token_budget": 48})
    resumed.use_plan(plan, start=4, profiled=None, verify=None)  # type: ignore[arg-type]
    assert resumed.budgets == [48, 96]


@pytest.mark.parametrize("policy", [SampleBatching(DEFAULT), TokenBatching(BatchingSettings(max_tokens=64))])
def test_both_policies_describe_a_cut(policy: SampleBatching) -> None:
    policy.budgets = [64]  # type: ignore[attr-defined]
    shape = BatchShape(micro_batch=4, accumulation=1, ranks=1)
    assert policy.split_note(1, 4, shape) == ""
    assert "2 pieces" in policy.split_note(2, 2, shape)
    assert "LR unchanged" in policy.oom_line(
        failed=4, where="step 1", error="e", samples=4, split=2, micro_piece=2, batch=shape, ranks=1, cap=2
    )
