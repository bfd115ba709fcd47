"""Token-budget batching and elastic global batches inside the recipes (real `tune run`s on the tiny model)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
from recipe_runs import read_metrics
from test_oom_recovery import assert_close_weights, faulty_run, final_weights, ok

pytestmark = pytest.mark.e2e

SAMPLES = 120
TOKENS = (
    "use_maximum_batch_size=False",
    "batch_increase_function=null",
    f"dataset.split=train[:{SAMPLES}]",
    "max_steps_per_epoch=null",
    "epochs=2",
    "lr_scheduler=null",
    "adaptive_batching.max_tokens=2048",
    "adaptive_batching.picking_order=seqlen",
    "batch_size=16",
)


def steps_of(runs: Path, name: str) -> list[dict]:
    return [step for record in sorted(runs.glob(f"{name}-rank*.json")) for step in json.loads(record.read_text())]


def per_step_samples(runs: Path, name: str) -> dict[int, list[int]]:
    merged: dict[int, list[int]] = {}
    for step in steps_of(runs, name):
        merged.setdefault(step["step"], []).extend(step["samples"])
    return merged


def assert_every_sample_once_per_epoch(runs: Path, name: str, samples: int = SAMPLES) -> None:
    counts: dict[int, Counter] = {}
    for step in steps_of(runs, name):
        counts.setdefault(step["epoch"], Counter()).update(step["samples"])
    for epoch, counter in counts.items():
        assert sorted(counter) == list(range(samples)) and set(counter.values()) == {1}, epoch


@pytest.fixture(scope="module")
def one_rank(runs: Path, assets: Path) -> Path:
    ok(faulty_run(runs, "tokens-1", {}, assets, *TOKENS, "gradient_accumulation_steps=2"))
    return runs / "tokens-1"


def test_token_budget_run_sees_every_sample_once_and_scales_the_lr_per_step(one_rank: Path, runs: Path) -> None:
    assert_every_sample_once_per_epoch(runs, "tokens-1")
    rows = read_metrics(one_rank / "logs")
    samples = per_step_samples(runs, "tokens-1")
    assert [r["global_batch_size"] for r in rows] == [len(samples[r["step"]]) for r in rows]
    assert len({r["global_batch_size"] for r in rows}) > 3  # the batch size in samples varies
    assert {r["max_tokens"] for r in rows} == {2048}
    # The logged LR is the next step's: 1e-3 x sqrt(samples of that step / reference 16 x 2), no scheduler.
    per_epoch = len(rows) // 2
    for row, following in [pair for half in (rows[:per_epoch], rows[per_epoch:]) for pair in zip(half, half[1:])]:
        assert row["lr"] == pytest.approx(1e-3 * math.sqrt(following["global_batch_size"] / 32), rel=1e-6)


@pytest.mark.multiprocess
def test_token_budget_on_two_ranks_matches_one_rank_with_accumulation(one_rank: Path, runs: Path, assets: Path) -> None:
    """Each step's micro batches are dealt to 2 ranks (balanced by tokens) instead of run one after the
    other on 1 rank: the same samples per step, the same losses."""
    ok(faulty_run(runs, "tokens-2", {}, assets, *TOKENS, nproc=2, timeout=600))
    assert_every_sample_once_per_epoch(runs, "tokens-2")
    assert per_step_samples(runs, "tokens-2").keys() == per_step_samples(runs, "tokens-1").keys()
    for step, both in per_step_samples(runs, "tokens-2").items():
        assert sorted(both) == sorted(per_step_samples(runs, "tokens-1")[step])
    two, one = read_metrics(runs / "tokens-2" / "logs"), read_metrics(one_rank / "logs")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4)


def test_token_budget_oom_cuts_micro_batches_and_keeps_the_trajectory(one_rank: Path, runs: Path, assets: Path) -> None:
    output = ok(
        faulty_run(
            runs,
            "tokens-oom",
            {"phase": "forward", "from_step": 4, "above": 12},
            assets,
            *TOKENS,
            "gradient_accumulation_steps=2",
        )
    )
    assert "running the same" in output and "each micro batch cut into 2 pieces" in output
    assert_every_sample_once_per_epoch(runs, "tokens-oom")
    assert per_step_samples(runs, "tokens-oom") == per_step_samples(runs, "tokens-1")
    assert_close_weights(final_weights(runs / "tokens-oom"), final_weights(one_rank))


def test_the_profiler_sets_the_token_budget_and_checks_it_on_the_shortest_samples(runs: Path, assets: Path) -> None:
    output = ok(
        faulty_run(
            runs,
            "tokens-auto",
            {},
            assets,
            *TOKENS,
            "use_maximum_batch_size=True",
            "adaptive_batching.max_tokens=auto",
            "epochs=1",
        )
    )
    line = next(text for text in output.splitlines() if text.startswith("Token budget: "))
    budget = int(line.split()[2])
    assert "the longest sample's" in line and budget > 2048
    assert f"Token budget {budget} verified with" in output
    assert {r["max_tokens"] for r in read_metrics(runs / "tokens-auto" / "logs")} == {budget}
    assert_every_sample_once_per_epoch(runs, "tokens-auto")


# ---------------------------------------------------------------- elastic
ELASTIC = (
    "use_maximum_batch_size=False",
    "batch_increase_function=null",
    "dataset.split=train[:32]",
    "tokenizer.max_seq_len=96",
    "max_steps_per_epoch=null",
    "epochs=2",
    "save_every_n_steps=2",
    "lr_scheduler=null",
    "adaptive_batching.elastic={max_global_batch: 10, micro_batches: [2, 4], max_ranks: 2}",
)


@pytest.mark.multiprocess
def test_elastic_run_resumed_on_another_world_size_keeps_the_global_batch(runs: Path, assets: Path) -> None:
    """Global batch 8 (valid at 1 and 2 ranks): killed on 2 ranks after step 3, resumed on 1 rank; each step
    trains on the same samples with the same LR, and the losses match the uninterrupted 2-rank run."""
    whole = ok(faulty_run(runs, "elastic-whole", {}, assets, *ELASTIC, nproc=2))
    assert "elastic: global batch 8 valid at 1, 2 ranks (micro batches 2, 4)" in whole
    assert "this run: micro batch 4 x accumulation 1 x 2 rank(s) = global batch 8" in whole
    killed = faulty_run(runs, "elastic-part", {"kill_after": 3}, assets, *ELASTIC, nproc=2)
    assert killed.returncode != 0
    resumed = ok(
        faulty_run(
            runs,
            "elastic-part-1",
            {},
            assets,
            *ELASTIC,
            f"output_dir={runs / 'elastic-part'}",
            "resume_from_checkpoint=True",
        )
    )
    assert "this run: micro batch 4 x accumulation 2 x 1 rank(s) = global batch 8" in resumed
    assert "Resuming on 1 rank(s) instead of 2: the same global batch 8" in resumed
    whole_rows, part_rows = read_metrics(runs / "elastic-whole" / "logs"), read_metrics(runs / "elastic-part" / "logs")
    assert [r["step"] for r in part_rows] == list(range(1, 9))
    assert {r["global_batch_size"] for r in part_rows} == {8}
    assert [r["lr"] for r in part_rows] == [r["lr"] for r in whole_rows]
    assert [r["loss"] for r in part_rows] == pytest.approx([r["loss"] for r in whole_rows], rel=1e-4)
    whole_samples, part_samples = (
        per_step_samples(runs, "elastic-whole"),
        {**per_step_samples(runs, "elastic-part"), **per_step_samples(runs, "elastic-part-1")},
    )
    assert {k: sorted(v) for k, v in part_samples.items()} == {k: sorted(v) for k, v in whole_samples.items()}


def test_elastic_refuses_a_world_size_it_cannot_hold_before_loading_the_model(runs: Path, assets: Path) -> None:
    result = faulty_run(
        runs,
        "elastic-bad",
        {},
        assets,
        *ELASTIC[:-1],
        "adaptive_batching.elastic={max_global_batch: 10, micro_batches: [2], min_ranks: 2, max_ranks: 2}",
    )
    assert result.returncode == 1
    assert (
        "config error: config key 'adaptive_batching.elastic': global batch 8 does not split evenly over "
        "1 rank(s); valid world sizes: 2" in result.stderr
    )
    assert not (runs / "elastic-bad" / "logs").exists()


def test_growth_scales_the_token_budget(runs: Path, assets: Path) -> None:
    """geometric(factor=2) doubles the requested batch each epoch; in token mode the budget doubles with it."""
    growth = (
        "batch_increase_function._component_=adaptive_batching.growth.geometric",
        "batch_increase_function.factor=2",
    )
    output = ok(faulty_run(runs, "tokens-growth", {}, assets, *TOKENS[2:], "use_maximum_batch_size=False", *growth))
    assert "token budget 2048 -> 4096 padded tokens per micro batch" in output
    rows = read_metrics(runs / "tokens-growth" / "logs")
    budgets = [r["max_tokens"] for r in rows]
    first = budgets.count(2048)
    assert first > 0 and budgets == [2048] * first + [4096] * (len(rows) - first)
    assert_every_sample_once_per_epoch(runs, "tokens-growth")
