"""Elastic global batch sizes, against cases worked out by hand."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
from omegaconf import OmegaConf

from adaptive_batching.batching.elastic import (
    ElasticChoice,
    ElasticSpec,
    choose_global_batch,
    shape_at,
    valid_world_sizes,
)
from adaptive_batching.batching.shape import BatchShape
from adaptive_batching.errors import ConfigError


def spec(max_global_batch: int, micro_batches: list[int], max_ranks: int, **extra: Any) -> ElasticSpec:
    return ElasticSpec.from_config(
        {"max_global_batch": max_global_batch, "micro_batches": micro_batches, "max_ranks": max_ranks, **extra}
    )


def assert_invariant(choice: ElasticChoice) -> None:
    """Every valid world size gets the same global batch: the LR and the trajectory survive a resize."""
    for w in choice.world_sizes:
        shape = choice.shape_for(w)
        assert shape.global_batch == choice.global_batch
        assert shape.ranks == w
        assert shape.micro_batch in choice.micro_batches


# max 64, micro [1, 2, 4], 1..8 ranks. Micro batch 1 is allowed, so w is valid iff w divides G.
# Divisors of G in 1..8: 7 of them needs lcm 120 or more (e.g. without 7: lcm(1..6, 8) = 120), so 6 is
# the most. 6 needs G a multiple of lcm(1,2,3,4,6,8) = 24 or lcm(1..6) = 60: G in {24, 48, 60}.
def test_max_64_picks_60_at_1_to_6_ranks() -> None:
    choice = choose_global_batch(spec(64, [1, 2, 4], 8))
    assert choice.global_batch == 60
    assert choice.world_sizes == [1, 2, 3, 4, 5, 6]
    assert 7 not in choice.world_sizes and 8 not in choice.world_sizes
    # per-rank share 60, 30, 20, 15, 12, 10; the largest of 1, 2, 4 dividing it
    assert choice.shape_for(1) == BatchShape(4, 15, 1)
    assert choice.shape_for(2) == BatchShape(2, 15, 2)
    assert choice.shape_for(3) == BatchShape(4, 5, 3)
    assert choice.shape_for(4) == BatchShape(1, 15, 4)
    assert choice.shape_for(5) == BatchShape(4, 3, 5)
    assert choice.shape_for(6) == BatchShape(2, 5, 6)
    assert_invariant(choice)


def test_ties_go_to_the_smaller_batch_when_asked() -> None:
    choice = choose_global_batch(spec(64, [1, 2, 4], 8, prefer_larger=False))
    assert choice.global_batch == 24
    assert choice.world_sizes == [1, 2, 3, 4, 6, 8]
    assert choice.shape_for(8) == BatchShape(1, 3, 8)
    assert choice.shape_for(6) == BatchShape(4, 1, 6)
    assert_invariant(choice)


def test_valid_world_sizes() -> None:
    s = spec(64, [1, 2, 4], 8)
    assert valid_world_sizes(60, s) == [1, 2, 3, 4, 5, 6]
    assert valid_world_sizes(64, s) == [1, 2, 4, 8]
    assert valid_world_sizes(7, s) == [1, 7]
    assert valid_world_sizes(7, spec(64, [2, 4], 8)) == []
    # micro 4 only: 4w must divide 24
    assert valid_world_sizes(24, s, memory_cap=4) == [1, 2, 3, 4, 6, 8]
    assert valid_world_sizes(24, spec(64, [4], 8)) == [1, 2, 3, 6]


# max 48, micro [2, 4, 8], 1..6 ranks: w is valid iff 2w divides G, i.e. w divides G/2 <= 24.
# Divisors of G/2 in 1..6: five at most (1, 2, 3, 4, 6, for G/2 in {12, 24}); 5 never joins them.
def test_describe_and_largest_micro_batch() -> None:
    choice = choose_global_batch(spec(48, [2, 4, 8], 6))
    assert choice.global_batch == 48
    assert choice.describe() == "elastic: global batch 48 valid at 1, 2, 3, 4, 6 ranks (micro batches 2, 4, 8)"
    # per-rank share 48, 24, 16, 12, 8
    assert [choice.shape_for(w) for w in (1, 2, 3, 4, 6)] == [
        BatchShape(8, 6, 1),
        BatchShape(8, 3, 2),
        BatchShape(8, 2, 3),
        BatchShape(4, 3, 4),
        BatchShape(8, 1, 6),
    ]
    assert_invariant(choice)
    assert choose_global_batch(spec(48, [2, 4, 8], 6, prefer_larger=False)).global_batch == 24


def test_memory_cap_limits_the_micro_batch() -> None:
    choice = choose_global_batch(spec(48, [2, 4, 8], 6), memory_cap=5)
    assert choice.global_batch == 48
    assert choice.micro_batches == (2, 4)
    assert choice.describe().endswith("(micro batches 2, 4)")
    assert choice.shape_for(1) == BatchShape(4, 12, 1)
    assert choice.shape_for(3) == BatchShape(4, 4, 3)
    assert choice.shape_for(6) == BatchShape(4, 2, 6)
    assert_invariant(choice)


# max 48, micro [3, 8], 1..4 ranks: w is valid iff 3w or 8w divides G.
# Without a cap 24, 36 and 48 are valid at all four (24: 3, 6, 24, 12; 36: 3, 6, 9, 12; 48: 3, 6, 24, 12).
# Capped at 4 only micro 3 is left: 3, 6, 9 and 12 must divide G, so G is a multiple of 36.
def test_memory_cap_changes_the_choice() -> None:
    s = spec(48, [3, 8], 4)
    free = choose_global_batch(s)
    assert (free.global_batch, free.world_sizes) == (48, [1, 2, 3, 4])
    assert [free.shape_for(w) for w in (1, 2, 3, 4)] == [
        BatchShape(8, 6, 1),
        BatchShape(8, 3, 2),
        BatchShape(8, 2, 3),
        BatchShape(3, 4, 4),
    ]
    capped = choose_global_batch(s, memory_cap=4)
    assert (capped.global_batch, capped.world_sizes) == (36, [1, 2, 3, 4])
    assert [capped.shape_for(w) for w in (1, 2, 3, 4)] == [
        BatchShape(3, 12, 1),
        BatchShape(3, 6, 2),
        BatchShape(3, 4, 3),
        BatchShape(3, 3, 4),
    ]
    assert_invariant(free)
    assert_invariant(capped)
    assert choose_global_batch(spec(48, [3, 8], 4, prefer_larger=False)).global_batch == 24
    assert choose_global_batch(spec(48, [3, 8], 4, prefer_larger=False), memory_cap=4).global_batch == 36


# A prime max is valid at one world size only; the winner (6 of 1..8, see above) is well below it.
@pytest.mark.parametrize("max_global_batch,expected", [(59, 48), (47, 24)])
def test_prime_max_is_not_chosen(max_global_batch: int, expected: int) -> None:
    s = spec(max_global_batch, [1], 8)
    assert valid_world_sizes(max_global_batch, s) == [1]
    choice = choose_global_batch(s)
    assert choice.global_batch == expected
    assert choice.world_sizes == [1, 2, 3, 4, 6, 8]
    assert_invariant(choice)


# max 7, micro [2], 1..4 ranks: 2 -> [1], 4 -> [1, 2], 6 -> [1, 3]; 4 and 6 tie.
@pytest.mark.parametrize("prefer_larger,expected,ranks", [(True, 6, [1, 3]), (False, 4, [1, 2])])
def test_ties(prefer_larger: bool, expected: int, ranks: list[int]) -> None:
    choice = choose_global_batch(spec(7, [2], 4, prefer_larger=prefer_larger))
    assert (choice.global_batch, choice.world_sizes) == (expected, ranks)
    assert_invariant(choice)


def test_min_ranks() -> None:
    # 2..4 ranks, micro [2, 4]: 4, 6 and 8 must divide G, so 24 is the only one <= 32 valid at all three
    choice = choose_global_batch(spec(32, [2, 4], 4, min_ranks=2))
    assert (choice.global_batch, choice.world_sizes) == (24, [2, 3, 4])
    assert [choice.shape_for(w) for w in (2, 3, 4)] == [BatchShape(4, 3, 2), BatchShape(4, 2, 3), BatchShape(2, 3, 4)]
    with pytest.raises(ValueError, match="valid world sizes: 2, 3, 4"):
        choice.shape_for(1)


def test_more_ranks_than_samples() -> None:
    # divisors of G <= 10: 6 -> 1, 2, 3, 6; 8 -> 1, 2, 4, 8; 10 -> 1, 2, 5, 10 (four each, the most)
    choice = choose_global_batch(spec(10, [1], 1024))
    assert (choice.global_batch, choice.world_sizes) == (10, [1, 2, 5, 10])
    assert choice.shape_for(10) == BatchShape(1, 1, 10)
    start = time.perf_counter()
    assert choose_global_batch(spec(10, [1], 10**9)).global_batch == 10
    assert valid_world_sizes(10, spec(10, [1], 10**9)) == [1, 2, 5, 10]
    assert time.perf_counter() - start < 5


def test_shape_for_refuses_an_invalid_world_size() -> None:
    choice = choose_global_batch(spec(48, [2, 4, 8], 6))
    for w in (5, 7, 0):
        with pytest.raises(ValueError, match=rf"{w} rank\(s\); valid world sizes: 1, 2, 3, 4, 6$"):
            choice.shape_for(w)


def test_nothing_valid_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"max_global_batch' \(3\).*micro batch 4 x 1 rank\(s\) = 4"):
        choose_global_batch(spec(3, [4, 8], 2))
    with pytest.raises(ConfigError, match=r"micro batch 2 x 4 rank\(s\) = 8"):
        choose_global_batch(spec(6, [2], 8, min_ranks=4))
    with pytest.raises(
        ConfigError,
        match=r"'adaptive_batching.elastic.micro_batches' = \[4, 8\] fits the memory "
        r"cap of 2",
    ):
        choose_global_batch(spec(64, [4, 8], 2), memory_cap=2)
    with pytest.raises(ValueError, match="memory_cap"):
        choose_global_batch(spec(64, [4, 8], 2), memory_cap=0)


def brute_force(
    max_global_batch: int, micro: list[int], lo: int, hi: int, prefer_larger: bool
) -> tuple[int, list[int]]:
    """Straight from the definition, for small cases."""
    best: tuple[int, list[int]] = (0, [])
    for g in range(1, max_global_batch + 1):
        ranks = [w for w in range(lo, hi + 1) if any(g % (m * w) == 0 for m in micro)]
        if ranks and (len(ranks) > len(best[1]) or (len(ranks) == len(best[1]) and prefer_larger)):
            best = (g, ranks)
    return best


@pytest.mark.parametrize(
    "max_global_batch,micro,lo,hi",
    [
        (100, [1, 2, 4], 1, 8),
        (97, [3, 5], 1, 6),
        (200, [2, 6, 7], 2, 12),
        (30, [4], 1, 3),
        (128, [8, 12, 16], 1, 16),
    ],
)
@pytest.mark.parametrize("prefer_larger", [True, False])
def test_matches_brute_force(max_global_batch: int, micro: list[int], lo: int, hi: int, prefer_larger: bool) -> None:
    choice = choose_global_batch(spec(max_global_batch, micro, hi, min_ranks=lo, prefer_larger=prefer_larger))
    assert (choice.global_batch, choice.world_sizes) == brute_force(max_global_batch, micro, lo, hi, prefer_larger)
    assert_invariant(choice)


def test_large_search_is_fast() -> None:
    start = time.perf_counter()
    choice = choose_global_batch(spec(100_000, [2, 3, 4, 8], 1024))
    assert time.perf_counter() - start < 5
    assert choice.global_batch <= 100_000
    assert len(choice.world_sizes) > 80
    assert_invariant(choice)
    start = time.perf_counter()
    choose_global_batch(spec(100_000, [5, 7, 11, 13, 17, 19], 1024))
    assert time.perf_counter() - start < 5


def test_spec_from_config() -> None:
    node = OmegaConf.create({"max_global_batch": 64, "micro_batches": [8, 2, 4, 2], "max_ranks": 8})
    s = ElasticSpec.from_config(node)
    assert s == ElasticSpec(max_global_batch=64, micro_batches=(2, 4, 8), min_ranks=1, max_ranks=8, prefer_larger=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.max_ranks = 16  # type: ignore[misc]


GOOD = {"max_global_batch": 64, "micro_batches": [2, 4], "max_ranks": 8}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"max_global_batch": None}, "'adaptive_batching.elastic.max_global_batch' is missing"),
        ({"micro_batches": None}, "'adaptive_batching.elastic.micro_batches' is missing"),
        ({"max_ranks": None}, "'adaptive_batching.elastic.max_ranks' is missing"),
        (
            {"max_global_batch": -8},
            "'adaptive_batching.elastic.max_global_batch' = -8 is invalid: expected an integer >= 1",
        ),
        ({"max_global_batch": 0}, "max_global_batch' = 0 is invalid: expected an integer >= 1"),
        ({"max_global_batch": "64"}, "max_global_batch' = '64' is invalid: expected an integer >= 1"),
        ({"max_global_batch": 64.0}, "max_global_batch' = 64.0 is invalid"),
        ({"max_global_batch": True}, "max_global_batch' = True is invalid"),
        (
            {"micro_batches": []},
            "'adaptive_batching.elastic.micro_batches' = [] is invalid: expected a non-empty list of integers >= 1",
        ),
        ({"micro_batches": [2, 0]}, "micro_batches' = [2, 0] is invalid: expected a non-empty list of integers >= 1"),
        ({"micro_batches": [2, -4]}, "micro_batches' = [2, -4] is invalid"),
        ({"micro_batches": [2, 2.5]}, "micro_batches' = [2, 2.5] is invalid"),
        ({"micro_batches": 4}, "micro_batches' = 4 is invalid: expected a non-empty list"),
        ({"micro_batches": "2,4"}, "micro_batches' = '2,4' is invalid"),
        ({"min_ranks": 0}, "'adaptive_batching.elastic.min_ranks' = 0 is invalid: expected an integer >= 1"),
        ({"min_ranks": -1}, "min_ranks' = -1 is invalid"),
        (
            {"max_ranks": -2},
            "'adaptive_batching.elastic.max_ranks' = -2 is invalid: expected an integer >= "
            "adaptive_batching.elastic.min_ranks (1)",
        ),
        ({"min_ranks": 9}, "max_ranks' = 8 is invalid: expected an integer >= adaptive_batching.elastic.min_ranks (9)"),
        ({"max_ranks": "8"}, "max_ranks' = '8' is invalid"),
        (
            {"prefer_larger": "yes"},
            "'adaptive_batching.elastic.prefer_larger' = 'yes' is invalid: expected true or false",
        ),
        (
            {"world_size": 4, "batch": 2},
            "unknown config key(s) adaptive_batching.elastic.batch, "
            "adaptive_batching.elastic.world_size; "
            "known keys under 'adaptive_batching.elastic': "
            "max_global_batch, micro_batches, min_ranks, max_ranks, prefer_larger",
        ),
    ],
)
def test_validation_names_keys_and_allowed_values(change: dict[str, Any], message: str) -> None:
    node = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as error:
        ElasticSpec.from_config(node)
    assert message in str(error.value)


def test_node_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match="'adaptive_batching.elastic' = 64 is invalid: expected a mapping"):
        ElasticSpec.from_config(64)  # type: ignore[arg-type]


def test_shape_at_keeps_the_global_batch_chosen_without_the_cap() -> None:
    """The run's global batch must not depend on the profile (which differs per world size)."""
    spec = ElasticSpec(max_global_batch=48, micro_batches=(2, 4, 8), max_ranks=6)
    for world, cap, shape in ((1, None, (8, 6)), (2, 4, (4, 6)), (3, 8, (8, 2)), (6, 2, (2, 4))):
        choice, got = shape_at(spec, world, memory_cap=cap)
        assert choice.global_batch == 48 and got.global_batch == 48
        assert (got.micro_batch, got.accumulation, got.ranks) == (*shape, world)
    with pytest.raises(ValueError, match="valid world sizes: 1, 2, 3, 4, 6"):
        shape_at(spec, 5)
