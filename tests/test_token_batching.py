"""Token-budget micro batches and their step-aware sampler, run for real (with torchdata)."""

from __future__ import annotations

import copy
import pickle
import time

import pytest
import torch
from batch_checks import assert_covers_once, split_steps
from torchdata.stateful_dataloader import StatefulDataLoader

from adaptive_batching.batching.sampler import _pieces
from adaptive_batching.batching.token_sampler import (
    PICKING_ORDERS,
    TokenBudgetBatchSampler,
    balance_over_ranks,
    padded_tokens,
    padding_waste,
    picking_order,
    token_micro_batches,
)

# torchdata 0.11 calls a deprecated torch function each time a loader is built.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

MAX_TOKENS = 256


def tokens_in_step(sampler: TokenBudgetBatchSampler, step: int) -> int:
    """Padded tokens of the ``step``-th step's forwards as served (after ``split``), over all ranks."""
    return sum(
        padded_tokens(sampler.lengths, piece)
        for mine in sampler.layout()[step]
        for batch in mine
        for piece in _pieces(batch, sampler.split)
    )


def long_tailed(n: int, seed: int, *, mean: float = 3.5, sigma: float = 1.0, cap: int = MAX_TOKENS) -> list[int]:
    """Lognormal lengths in [1, cap]: mostly short, a few long, like real instruction data."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.empty(n).log_normal_(mean, sigma, generator=generator)
    return [int(x) for x in lengths.clamp(1, cap).round()]


LENGTHS = long_tailed(97, seed=1)


def make(lengths: list[int], rank: int, world: int, **kwargs) -> TokenBudgetBatchSampler:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    kwargs.setdefault("picking_order", "dataloader")
    kwargs.setdefault("min_batch_size", None)
    kwargs.setdefault("max_batch_size", None)
    kwargs.setdefault("accumulation", 2)
    kwargs.setdefault("shuffle", True)
    kwargs.setdefault("seed", 7)
    return TokenBudgetBatchSampler(lengths, rank=rank, world_size=world, **kwargs)


def rank_batches(lengths: list[int], world: int, **kwargs) -> list[list[list[int]]]:
    """Every rank's micro batches of one epoch."""
    return [list(make(lengths, r, world, **kwargs)) for r in range(world)]


# ---------------------------------------------------------------- picking order
def test_picking_orders() -> None:
    lengths = [5, 1, 5, 3, 1, 9]
    assert picking_order(lengths, "seqlen", shuffle=True, seed=0, epoch=0) == [1, 4, 3, 0, 2, 5]
    assert picking_order(lengths, "dataloader", shuffle=False, seed=0, epoch=3) == list(range(6))
    rng = torch.get_rng_state()
    for order in ("dataloader", "random"):
        expected = torch.randperm(6, generator=torch.Generator().manual_seed(4 + 2)).tolist()
        assert picking_order(lengths, order, shuffle=True, seed=4, epoch=2) == expected
    assert picking_order(lengths, "random", shuffle=False, seed=4, epoch=2) == expected
    assert torch.equal(torch.get_rng_state(), rng)
    big = list(range(50))
    assert picking_order(big, "random", shuffle=False, seed=4, epoch=2) != picking_order(
        big, "random", shuffle=False, seed=4, epoch=3
    )
    with pytest.raises(ValueError, match="unknown picking order 'longest'"):
        picking_order(lengths, "longest", shuffle=True, seed=0, epoch=0)


# ---------------------------------------------------------------- micro batches
def test_micro_batches_on_a_hand_checked_example() -> None:
    lengths = [3, 5, 2, 8, 1, 1, 1]
    cut = token_micro_batches(lengths, range(7), max_tokens=10, min_batch_size=None, max_batch_size=None)
    # [3, 5] pads to 2 x 5 = 10; [5] + 2 would be 3 x 5; 8 alone; then 1, 1, 1 after 8 would be 4 x 8.
    assert cut == [[0, 1], [2], [3], [4, 5, 6]]
    assert token_micro_batches(lengths, range(7), max_tokens=10, min_batch_size=None, max_batch_size=2) == [
        [0, 1],
        [2],
        [3],
        [4, 5],
        [6],
    ]
    assert token_micro_batches(
        lengths, [6, 5, 4, 2, 0, 1, 3], max_tokens=10, min_batch_size=None, max_batch_size=None
    ) == [[6, 5, 4, 2], [0, 1], [3]]
    assert token_micro_batches([], [], max_tokens=10, min_batch_size=2, max_batch_size=4) == []
    # Only the picked samples count: an unpicked long one neither errs nor limits min_batch_size.
    assert token_micro_batches([1, 50, 2, 3], [0, 2, 3], max_tokens=10, min_batch_size=3, max_batch_size=None) == [
        [0, 2, 3]
    ]


def test_padding_on_a_hand_checked_example() -> None:
    lengths = [3, 5, 2, 8]
    assert padded_tokens(lengths, [0, 1]) == 10
    assert padded_tokens(lengths, [2, 3]) == 16
    assert padded_tokens(lengths, []) == 0
    # 18 real tokens in 10 + 16 positions.
    assert padding_waste(lengths, [[0, 1], [2, 3]]) == pytest.approx(8 / 26)
    assert padding_waste(lengths, [[0], [1], [2], [3], []]) == 0.0
    assert padding_waste(lengths, []) == 0.0


@pytest.mark.parametrize("order", PICKING_ORDERS)
def test_micro_batches_respect_the_budget_and_bounds_on_long_tailed_lengths(order: str) -> None:
    checked_min = 0
    for seed in range(40):
        lengths = long_tailed(1 + seed * 13 % 300, seed=seed, sigma=0.5 + seed % 4 * 0.4)
        max_tokens = MAX_TOKENS * (1 + seed % 3)
        longest = max(lengths)
        min_size = [None, 1, max(1, max_tokens // longest)][seed % 3]
        max_size = [None, 4, 17, None][seed % 4]
        if min_size is not None and max_size is not None and min_size > max_size:
            max_size = min_size
        indices = picking_order(lengths, order, shuffle=True, seed=seed, epoch=0)
        batches = token_micro_batches(
            lengths, indices, max_tokens=max_tokens, min_batch_size=min_size, max_batch_size=max_size
        )
        assert [i for batch in batches for i in batch] == indices
        for k, batch in enumerate(batches):
            assert batch
            assert padded_tokens(lengths, batch) <= max_tokens
            assert max_size is None or len(batch) <= max_size
            if k < len(batches) - 1:
                assert min_size is None or len(batch) >= min_size
                checked_min += min_size is not None and min_size > 1
                # Greedy: the micro batch was closed because the next sample did not fit.
                grown = batch + [batches[k + 1][0]]
                assert padded_tokens(lengths, grown) > max_tokens or len(grown) > (max_size or len(grown))
    assert checked_min > 0


def test_a_sample_longer_than_the_budget_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"sample 2 has 12 tokens, more than adaptive_batching.max_tokens=10"):
        token_micro_batches([3, 4, 12, 1], range(4), max_tokens=10, min_batch_size=None, max_batch_size=None)
    with pytest.raises(ValueError, match="sample 2 has 12 tokens"):
        make([3, 4, 12, 1], 0, 1, max_tokens=10)


def test_contradicting_bounds_are_an_error() -> None:
    lengths = [3, 4, 9, 1]
    with pytest.raises(
        ValueError,
        match=r"adaptive_batching.min_batch_size=2 and adaptive_batching.max_tokens=10 "
        r"contradict",
    ):
        token_micro_batches(lengths, range(4), max_tokens=10, min_batch_size=2, max_batch_size=None)
    with pytest.raises(ValueError, match="contradict"):
        make(lengths, 0, 1, max_tokens=17, min_batch_size=2)
    assert token_micro_batches(lengths, range(4), max_tokens=18, min_batch_size=2, max_batch_size=None) == [
        [0, 1],
        [2, 3],
    ]
    with pytest.raises(ValueError, match="min_batch_size 3 > adaptive_batching.max_batch_size 2"):
        token_micro_batches(lengths, range(4), max_tokens=100, min_batch_size=3, max_batch_size=2)


# ---------------------------------------------------------------- balance within a step
def test_balance_over_ranks_deals_largest_first_to_the_lightest_rank() -> None:
    assert balance_over_ranks([5, 9, 1, 7], 2) == [[1, 2], [3, 0]]
    # 5 micro batches over 2 ranks: 3 forwards each, the lighter rank's last one empty.
    assert balance_over_ranks([4, 4, 4, 4, 4], 2) == [[0, 2, 4], [1, 3, None]]
    assert balance_over_ranks([2], 3) == [[0], [None], [None]]
    assert balance_over_ranks([], 3) == [[], [], []]


def test_balance_spread_stays_within_the_largest_micro_batch() -> None:
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        world, slots = 1 + trial % 5, 1 + trial % 4
        count = world * slots - trial % (world * slots) // 2
        tokens = torch.randint(0, 1 + 10 ** (1 + trial % 3), (count,), generator=generator).tolist()
        dealt = balance_over_ranks(tokens, world)
        assert [len(mine) for mine in dealt] == [-(-count // world)] * world
        assert sorted(i for mine in dealt for i in mine if i is not None) == list(range(count))
        loads = [sum(tokens[i] for i in mine if i is not None) for mine in dealt]
        assert max(loads) - min(loads) <= max(tokens)


# ---------------------------------------------------------------- the sampler: layout and coverage
@pytest.mark.parametrize("order", PICKING_ORDERS)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("acc", [1, 2])
def test_every_sample_once_and_the_same_layout_on_all_ranks(order: str, world: int, acc: int) -> None:
    for seed, n in enumerate([1, 2, 5, 40, 97, 150]):
        lengths = long_tailed(n, seed=seed)
        samplers = [
            make(lengths, r, world, picking_order=order, accumulation=acc, max_batch_size=8) for r in range(world)
        ]
        per_rank = [list(s) for s in samplers]
        assert_covers_once(per_rank, n)
        plan = samplers[0].layout()
        micro = sum(1 for step in plan for mine in step for batch in mine if batch)
        full, remainder = divmod(micro, world * acc)
        layout = samplers[0].step_layout()
        expected = [acc] * full + ([-(-remainder // world)] if remainder else [])
        assert (sorted(layout, reverse=True) if order == "seqlen" else layout) == expected
        assert sum(samplers[0].samples_in_step(i) for i in range(len(layout))) == n
        for sampler, batches in zip(samplers, per_rank):
            assert sampler.layout() == plan
            assert sampler.step_layout() == layout
            assert sampler.steps == len(layout)
            assert len(batches) == len(sampler) == sum(layout)
            for step, mine in zip(split_steps(batches, layout), plan):
                assert step == mine[sampler.rank]
                assert all(padded_tokens(lengths, batch) <= MAX_TOKENS and len(batch) <= 8 for batch in step)
                # Empty micro batches only trail a rank's share of a step.
                sizes = [len(batch) for batch in step]
                assert sizes == sorted(sizes, key=lambda size: size == 0)


def test_tokens_are_balanced_across_ranks_in_every_step() -> None:
    lengths = long_tailed(600, seed=3, sigma=1.3)
    for world in (2, 3, 4):
        sampler = make(lengths, 0, world, accumulation=3)
        assert sampler.steps > 5
        for index, step in enumerate(sampler.layout()):
            per_batch = [padded_tokens(lengths, batch) for mine in step for batch in mine]
            loads = [sum(padded_tokens(lengths, batch) for batch in mine) for mine in step]
            assert max(loads) - min(loads) <= max(per_batch)
            assert sum(loads) == tokens_in_step(sampler, index)
            assert sum(len(batch) for mine in step for batch in mine) == sampler.samples_in_step(index)


def test_the_last_step_gives_short_ranks_empty_micro_batches() -> None:
    # Without shuffle and with 2 samples of 10 per micro batch: 7 micro batches, steps of 2 ranks x 2.
    lengths = [10] * 13
    per_rank = rank_batches(lengths, 2, max_tokens=20, shuffle=False)
    assert make(lengths, 0, 2, max_tokens=20, shuffle=False).step_layout() == [2, 2]
    assert per_rank == [[[0, 1], [4, 5], [8, 9], [12]], [[2, 3], [6, 7], [10, 11], []]]
    # One micro batch over 3 ranks: one forward each, two of them empty.
    assert rank_batches([1, 1], 3, max_tokens=20, shuffle=False) == [[[0, 1]], [[]], [[]]]


def test_empty_dataset_has_no_steps() -> None:
    sampler = make([], 0, 2)
    assert sampler.step_layout() == [] and len(sampler) == 0 and list(sampler) == []


# ---------------------------------------------------------------- order across epochs
def test_plan_is_deterministic_per_seed_and_epoch_and_leaves_global_rng_alone() -> None:
    for order in PICKING_ORDERS:
        rng = torch.get_rng_state()
        first = rank_batches(LENGTHS, 2, picking_order=order, seed=3, epoch=1)
        assert torch.equal(torch.get_rng_state(), rng)
        assert rank_batches(LENGTHS, 2, picking_order=order, seed=3, epoch=1) == first
        assert rank_batches(LENGTHS, 2, picking_order=order, seed=3, epoch=2) != first
        assert rank_batches(LENGTHS, 2, picking_order=order, seed=4, epoch=1) != first
        sampler = make(LENGTHS, 0, 2, picking_order=order, seed=3)
        sampler.set_epoch(1)
        assert list(sampler) == first[0]


def test_without_shuffle_the_dataloader_order_is_the_dataset_order() -> None:
    batches = list(make(LENGTHS, 0, 1, accumulation=1, shuffle=False, epoch=5))
    assert [i for batch in batches for i in batch] == list(range(len(LENGTHS)))
    # With accumulation, a step holds consecutive samples, its micro batches dealt largest first.
    sampler = make(LENGTHS, 0, 1, accumulation=3, shuffle=False)
    steps = [sorted(i for batch in step for i in batch) for step in split_steps(list(sampler), sampler.step_layout())]
    assert [i for step in steps for i in step] == list(range(len(LENGTHS)))


def test_seqlen_steps_hold_similar_lengths_in_shuffled_order() -> None:
    lengths = long_tailed(800, seed=5, sigma=1.2)
    plans = [make(lengths, 0, 2, picking_order="seqlen", epoch=epoch).layout() for epoch in (0, 1)]
    as_sets = [sorted(sorted(i for mine in step for batch in mine for i in batch) for step in plan) for plan in plans]
    assert as_sets[0] == as_sets[1]  # the same steps...
    assert plans[0] != plans[1]  # ...in another order
    longest = [max(lengths[i] for mine in step for batch in mine for i in batch) for step in plans[0]]
    assert longest != sorted(longest)
    assert padding_waste(lengths, [b for step in plans[0] for mine in step for b in mine]) < padding_waste(
        lengths, [b for step in make(lengths, 0, 2).layout() for mine in step for b in mine]
    )


# ---------------------------------------------------------------- max_steps, split, start_step
def test_max_steps_truncates_the_epoch() -> None:
    whole = make(LENGTHS, 1, 2)
    assert whole.steps > 3
    cut = make(LENGTHS, 1, 2, max_steps=3)
    assert cut.step_layout() == whole.step_layout()[:3] and cut.steps == 3
    assert list(cut) == list(whole)[: sum(whole.step_layout()[:3])]
    assert make(LENGTHS, 1, 2, max_steps=1000).step_layout() == whole.step_layout()


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("split", [2, 3])
def test_split_serves_the_same_samples_per_step_in_smaller_pieces(world: int, split: int) -> None:
    for order in PICKING_ORDERS:
        for rank in range(world):
            whole = make(LENGTHS, rank, world, picking_order=order)
            cut = make(LENGTHS, rank, world, picking_order=order, split=split)
            assert cut.step_layout() == [count * split for count in whole.step_layout()]
            for step, pieces in zip(
                split_steps(list(whole), whole.step_layout()), split_steps(list(cut), cut.step_layout())
            ):
                assert [i for piece in pieces for i in piece] == [i for batch in step for i in batch]
                for k, batch in enumerate(step):
                    own = pieces[k * split : (k + 1) * split]
                    assert [i for piece in own for i in piece] == batch
                    assert max(map(len, own)) - min(map(len, own)) <= 1
            assert [cut.samples_in_step(i) for i in range(cut.steps)] == [
                whole.samples_in_step(i) for i in range(whole.steps)
            ]
            assert all(tokens_in_step(cut, i) <= tokens_in_step(whole, i) for i in range(cut.steps))


@pytest.mark.parametrize("start", [0, 1, 2, 5])
def test_start_step_begins_the_first_iteration_at_that_step(start: int) -> None:
    whole = make(LENGTHS, 1, 2, split=2)
    layout = whole.step_layout()
    later = make(LENGTHS, 1, 2, split=2, start_step=start)
    assert list(later) == list(whole)[sum(layout[:start]) :]
    assert list(later) == list(whole)  # the next iteration is the whole epoch again


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"min_batch_size": 0},
        {"max_batch_size": 0},
        {"min_batch_size": 3, "max_batch_size": 2},
        {"picking_order": "sorted"},
        {"accumulation": 0},
        {"world_size": 0},
        {"rank": 2},
        {"rank": -1},
        {"epoch": -1},
        {"max_steps": 0},
        {"split": 0},
        {"start_step": -1},
        {"start_step": 1000},
    ],
)
def test_invalid_arguments_raise(kwargs: dict) -> None:
    args = dict(
        max_tokens=MAX_TOKENS,
        picking_order="dataloader",
        min_batch_size=None,
        max_batch_size=None,
        accumulation=1,
        rank=0,
        world_size=2,
        shuffle=True,
        seed=0,
    )
    args.update(kwargs)
    with pytest.raises(ValueError):
        TokenBudgetBatchSampler(LENGTHS, **args)


def test_a_large_dataset_plans_quickly() -> None:
    lengths = long_tailed(100_000, seed=0, mean=5.5, sigma=1.0, cap=4096)
    start = time.perf_counter()
    sampler = make(lengths, 3, 8, max_tokens=8192, picking_order="seqlen", min_batch_size=1, max_batch_size=64)
    batches = list(sampler)
    assert time.perf_counter() - start < 5
    assert len(batches) == len(sampler) > 0


# ---------------------------------------------------------------- resume through torchdata
def loader_over(lengths: list[int], rank: int, world: int, **kwargs) -> StatefulDataLoader:
    sampler = make(lengths, rank, world, **kwargs)
    return StatefulDataLoader(list(range(1000, 1000 + len(lengths))), batch_sampler=sampler, collate_fn=list)


@pytest.mark.parametrize(
    "order, world, acc, split", [("dataloader", 2, 2, 1), ("seqlen", 3, 1, 2), ("random", 2, 3, 1)]
)
def test_loader_state_resumes_exactly_mid_epoch(order: str, world: int, acc: int, split: int) -> None:
    lengths = LENGTHS[:60]
    kwargs = dict(picking_order=order, accumulation=acc, split=split)
    for rank in range(world):
        for epoch in (0, 2):
            reference = loader_over(lengths, rank, world, **kwargs)
            reference.batch_sampler.set_epoch(epoch)
            full = list(reference)
            assert full == [[1000 + i for i in b] for b in make(lengths, rank, world, epoch=epoch, **kwargs)]
            for k in range(len(full) + 1):
                loader = loader_over(lengths, rank, world, **kwargs)
                loader.batch_sampler.set_epoch(epoch)
                iterator = iter(loader)
                head = [next(iterator) for _ in range(k)]
                state = copy.deepcopy(loader.state_dict())
                assert state["_index_sampler_state"]["yielded"] == k
                resumed = loader_over(lengths, rank, world, **kwargs)
                resumed.load_state_dict(state)
                if k < len(full):
                    resumed.batch_sampler.set_epoch(epoch)  # the recipe sets the epoch it resumes
                    assert head + list(resumed) == full
                # Then the following epochs go on as in an uninterrupted run.
                resumed.batch_sampler.set_epoch(epoch + 1)
                reference.batch_sampler.set_epoch(epoch + 1)
                assert list(resumed) == list(reference)


def test_sampler_state_round_trip_without_a_loader() -> None:
    sampler = make(LENGTHS, 1, 2, epoch=1, max_tokens=600, min_batch_size=2, max_batch_size=9)
    full = list(sampler)
    iterator = iter(sampler)
    [next(iterator) for _ in range(3)]
    state = pickle.loads(pickle.dumps(sampler.state_dict()))
    assert {k: v for k, v in state.items() if k != "lengths_digest"} == {
        "epoch": 1,
        "yielded": 3,
        "dataset_size": len(LENGTHS),
        "max_tokens": 600,
        "picking_order": "dataloader",
        "min_batch_size": 2,
        "max_batch_size": 9,
        "accumulation": 2,
        "split": 1,
        "world_size": 2,
        "seed": 7,
        "shuffle": True,
    }
    fresh = make(LENGTHS, 1, 2, max_tokens=600, min_batch_size=2, max_batch_size=9)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert list(fresh) == full[3:]
    assert list(fresh) == full


def test_state_after_a_finished_epoch_resumes_at_the_next_epoch() -> None:
    loader = loader_over(LENGTHS, 0, 2, epoch=3)
    iterator = iter(loader)
    [next(iterator) for _ in range(len(loader))]
    resumed = loader_over(LENGTHS, 0, 2)
    resumed.load_state_dict(loader.state_dict())
    resumed.batch_sampler.set_epoch(4)
    assert list(resumed) == list(loader_over(LENGTHS, 0, 2, epoch=4))


@pytest.mark.parametrize(
    "changed",
    [
        {"max_tokens": 300},
        {"picking_order": "random"},
        {"min_batch_size": 1},
        {"max_batch_size": 50},
        {"accumulation": 1},
        {"split": 2},
        {"world": 3},
        {"lengths": LENGTHS[:-1]},
        {"lengths": LENGTHS[:-1] + [LENGTHS[-1] + 1]},
        {"seed": 8},
        {"shuffle": False},
    ],
)
def test_a_state_from_another_layout_is_refused(changed: dict) -> None:
    args = {"lengths": LENGTHS, "world": 2} | changed
    other = make(args.pop("lengths"), 0, args.pop("world"), **args)
    saved = loader_over(LENGTHS, 0, 2)
    iterator = iter(saved)
    next(iterator)
    with pytest.raises(ValueError, match="different layout"):
        other.load_state_dict(saved.batch_sampler.state_dict())
    loader = StatefulDataLoader(list(range(len(other.lengths))), batch_sampler=other, collate_fn=list)
    loader.load_state_dict(saved.state_dict())
    with pytest.raises(ValueError, match="different layout"):
        iter(loader)


def test_an_incomplete_state_is_refused() -> None:
    with pytest.raises(ValueError, match="missing"):
        make(LENGTHS, 0, 2).load_state_dict({"yielded": 1})
