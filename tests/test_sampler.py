"""The step batch sampler and the empty-tolerant collate, run for real (with torchdata and torchtune)."""

from __future__ import annotations

import copy
import pickle
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from batch_checks import assert_covers_once, split_steps
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtune.data import padded_collate_packed, padded_collate_sft
from torchtune.modules.loss import CEWithChunkedOutputLoss

from adaptive_batching.batching.sampler import StepBatchSampler, collate_allowing_empty, epoch_extent

IGNORE = -100
PAD = 0


def make(n: int, micro: int, acc: int, rank: int, world: int, **kwargs) -> StepBatchSampler:
    kwargs.setdefault("shuffle", True)
    kwargs.setdefault("seed", 7)
    return StepBatchSampler(n, micro_batch=micro, accumulation=acc, rank=rank, world_size=world, **kwargs)


def rank_batches(n: int, micro: int, acc: int, world: int, **kwargs) -> list[list[list[int]]]:
    """Every rank's micro batches of one epoch."""
    return [list(make(n, micro, acc, r, world, **kwargs)) for r in range(world)]


# ---------------------------------------------------------------- layout and coverage
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("acc", [1, 2, 3])
@pytest.mark.parametrize("micro", [1, 3, 8])
def test_every_sample_once_and_same_layout_on_all_ranks(micro: int, acc: int, world: int) -> None:
    g = micro * acc * world
    for n in (2 * g, 2 * g + 1, 3 * g - 1, 1, g - 1):
        samplers = [make(n, micro, acc, r, world) for r in range(world)]
        per_rank = [list(s) for s in samplers]
        assert_covers_once(per_rank, n)
        layout = samplers[0].step_layout()
        full, remainder = divmod(n, g)
        assert layout[:full] == [acc] * full
        assert len(layout) == full + (1 if remainder else 0)
        for sampler, batches in zip(samplers, per_rank):
            assert sampler.step_layout() == layout
            assert sampler.steps == len(layout)
            assert len(batches) == len(sampler) == sum(layout)
            assert all(len(batch) <= micro for batch in batches)
            steps = split_steps(batches, layout)
            for step in steps[:full]:
                assert [len(batch) for batch in step] == [micro] * acc
            if remainder:
                # Filled in order: full micro batches, at most one partial, then empty ones.
                sizes = [len(batch) for batch in steps[-1]]
                share = sum(sizes)
                filled = [micro] * (share // micro) + ([share % micro] if share % micro else [])
                assert sizes == filled + [0] * (len(sizes) - len(filled))
        if remainder:
            shares = [sum(len(b) for b in split_steps(batches, layout)[-1]) for batches in per_rank]
            assert sum(shares) == remainder
            assert max(shares) - min(shares) <= 1
            assert shares == sorted(shares, reverse=True)


def test_steps_are_contiguous_slices_in_rank_order() -> None:
    # 14 samples, steps of 2 * 2 * 2 = 8: one full step, then a remainder of 6 shared 3 and 3.
    per_rank = rank_batches(14, 2, 2, 2, shuffle=False)
    assert per_rank == [[[0, 1], [2, 3], [8, 9], [10]], [[4, 5], [6, 7], [11, 12], [13]]]
    assert make(14, 2, 2, 0, 2).step_layout() == [2, 2]


def test_remainder_step_gives_short_ranks_empty_micro_batches() -> None:
    # 17 samples, steps of 3 * 2 * 3 = 18: one remainder step of 17, shares 6, 6, 5.
    per_rank = rank_batches(17, 3, 2, 3, shuffle=False)
    assert per_rank == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]], [[12, 13, 14], [15, 16]]]
    # 4 samples over 3 ranks with micro batches of 2 and accumulation 4: shares 2, 1, 1; one forward each.
    assert rank_batches(4, 2, 4, 3, shuffle=False) == [[[0, 1]], [[2]], [[3]]]
    # 2 samples over 3 ranks: the last rank has nothing but must still run the forward.
    assert rank_batches(2, 1, 4, 3, shuffle=False) == [[[0]], [[1]], [[]]]
    # 10 samples, micro 2, acc 3, 2 ranks: step of 12 -> remainder 10, shares 5, 5, 3 micro batches.
    assert rank_batches(10, 2, 3, 2, shuffle=False) == [[[0, 1], [2, 3], [4]], [[5, 6], [7, 8], [9]]]
    # 7 samples, micro 3, acc 3, 3 ranks: shares 3, 2, 2 -> one micro batch each.
    assert make(7, 3, 3, 0, 3).step_layout() == [1]
    # 13 samples, micro 2, acc 4, 2 ranks: 16 per step -> shares 7, 6 -> 4 micro batches, last one short.
    assert rank_batches(13, 2, 4, 2, shuffle=False) == [[[0, 1], [2, 3], [4, 5], [6]], [[7, 8], [9, 10], [11, 12], []]]


def test_empty_dataset_has_no_steps() -> None:
    sampler = make(0, 2, 2, 0, 1)
    assert sampler.step_layout() == [] and len(sampler) == 0 and list(sampler) == []


# ---------------------------------------------------------------- order
def test_order_is_deterministic_per_seed_and_epoch_and_leaves_global_rng_alone() -> None:
    rng = torch.get_rng_state()
    first = rank_batches(50, 3, 2, 2, seed=3, epoch=1)
    assert torch.equal(torch.get_rng_state(), rng)
    assert rank_batches(50, 3, 2, 2, seed=3, epoch=1) == first
    assert rank_batches(50, 3, 2, 2, seed=3, epoch=2) != first
    assert rank_batches(50, 3, 2, 2, seed=4, epoch=1) != first
    sampler = make(50, 3, 2, 0, 2, seed=3)
    sampler.set_epoch(1)
    assert list(sampler) == first[0]
    expected = torch.randperm(50, generator=torch.Generator().manual_seed(3 + 1)).tolist()
    assert sampler.order() == expected


def test_without_shuffle_the_order_is_the_dataset_order() -> None:
    batches = list(make(23, 3, 2, 0, 1, shuffle=False, epoch=5))
    assert [i for batch in batches for i in batch] == list(range(23))


def test_batch_size_can_change_between_epochs_over_the_same_dataset() -> None:
    n, world = 101, 3
    for epoch, (micro, acc) in enumerate([(4, 2), (7, 1), (1, 5), (16, 3)]):
        samplers = [make(n, micro, acc, r, world) for r in range(world)]
        for sampler in samplers:
            sampler.set_epoch(epoch)
        per_rank = [list(s) for s in samplers]
        assert_covers_once(per_rank, n)
        assert len({len(batches) for batches in per_rank}) == 1


def test_a_new_iteration_starts_the_epoch_again() -> None:
    sampler = make(30, 2, 2, 1, 2)
    first = list(sampler)
    assert sampler.state_dict()["yielded"] == len(first)
    assert list(sampler) == first
    iterator = iter(sampler)
    next(iterator), next(iterator)
    assert sampler.state_dict()["yielded"] == 2
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert sampler.state_dict()["yielded"] == 0 and sampler.state_dict()["epoch"] == 1


# ---------------------------------------------------------------- max_steps
def test_max_steps_truncates_the_epoch() -> None:
    # 50 samples, steps of 2 * 2 * 2 = 8: layout [2] * 6 + [1] (remainder of 2).
    assert make(50, 2, 2, 0, 2).step_layout() == [2] * 6 + [1]
    sampler = make(50, 2, 2, 0, 2, max_steps=3)
    assert sampler.step_layout() == [2, 2, 2] and sampler.steps == 3 and len(sampler) == 6
    assert list(sampler) == list(make(50, 2, 2, 0, 2))[:6]
    assert make(50, 2, 2, 1, 2, max_steps=7).step_layout() == [2] * 6 + [1]
    assert list(make(50, 2, 2, 1, 2, max_steps=7)) == list(make(50, 2, 2, 1, 2))
    assert make(50, 2, 2, 1, 2, max_steps=100).step_layout() == [2] * 6 + [1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dataset_size": -1},
        {"micro_batch": 0},
        {"accumulation": 0},
        {"world_size": 0},
        {"rank": 2},
        {"rank": -1},
        {"epoch": -1},
        {"max_steps": 0},
        {"split": 0},
        {"split": 3},
        {"start_step": -1},
        {"start_step": 6},
    ],
)
def test_invalid_arguments_raise(kwargs: dict) -> None:
    args = dict(dataset_size=10, micro_batch=2, accumulation=1, rank=0, world_size=2, shuffle=True, seed=0)
    args.update(kwargs)
    size = args.pop("dataset_size")
    with pytest.raises(ValueError):
        StepBatchSampler(size, **args)


# ---------------------------------------------------------------- split after an out-of-memory error
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("micro, acc, split", [(8, 1, 2), (7, 2, 3), (5, 3, 5), (87, 1, 2), (4, 2, 4)])
def test_split_serves_the_same_samples_per_step_in_smaller_pieces(micro: int, acc: int, split: int, world: int) -> None:
    g = micro * acc * world
    for n in (2 * g, 2 * g + 1, 3 * g - 1, 1):
        for rank in range(world):
            whole, cut = make(n, micro, acc, rank, world), make(n, micro, acc, rank, world, split=split)
            assert cut.step_layout() == [count * split for count in whole.step_layout()]
            assert cut.piece_size == -(-micro // split)
            for step, pieces in zip(
                split_steps(list(whole), whole.step_layout()), split_steps(list(cut), cut.step_layout())
            ):
                assert [i for piece in pieces for i in piece] == [i for batch in step for i in batch]
                assert all(len(piece) <= cut.piece_size for piece in pieces)
                sizes = [len(piece) for piece in pieces if piece]
                assert max(sizes, default=0) - min(sizes, default=0) <= 1 or len(step) > 1
        assert_covers_once([list(make(n, micro, acc, r, world, split=split)) for r in range(world)], n)


def test_split_in_halves_equals_the_smaller_micro_batch_with_double_accumulation() -> None:
    # The run an OOM falls back to is the run that used the smaller micro batch from the start.
    for rank in range(2):
        cut = make(64, 8, 2, rank, 2, split=2)
        assert list(cut) == list(make(64, 4, 4, rank, 2))


@pytest.mark.parametrize("start", [0, 1, 2, 3])
def test_start_step_begins_the_first_iteration_at_that_step(start: int) -> None:
    whole = make(27, 3, 2, 0, 2, split=2)
    layout = whole.step_layout()
    later = make(27, 3, 2, 0, 2, split=2, start_step=start)
    assert list(later) == list(whole)[sum(layout[:start]) :]
    assert list(later) == list(whole)  # the next iteration is the whole epoch again


def test_a_state_from_another_split_or_without_one_is_refused() -> None:
    sampler = make(40, 4, 1, 0, 1, split=2)
    iterator = iter(sampler)
    next(iterator)
    state = sampler.state_dict()
    with pytest.raises(ValueError, match="split 2 \\(saved\\) != 1 \\(now\\)"):
        make(40, 4, 1, 0, 1).load_state_dict(state)
    without = {k: v for k, v in make(40, 4, 1, 0, 1).state_dict().items() if k != "split"}
    with pytest.raises(ValueError, match=r"missing \['split'\]"):
        make(40, 4, 1, 0, 1).load_state_dict(without)


# ---------------------------------------------------------------- resume through torchdata
def loader_over(n: int, micro: int, acc: int, rank: int, world: int, **kwargs) -> StatefulDataLoader:
    sampler = make(n, micro, acc, rank, world, **kwargs)
    return StatefulDataLoader(list(range(1000, 1000 + n)), batch_sampler=sampler, collate_fn=list)


@pytest.mark.parametrize("n, micro, acc, world", [(50, 2, 2, 2), (13, 2, 4, 2), (40, 3, 3, 3), (2, 1, 4, 3)])
def test_loader_state_resumes_exactly_mid_epoch(n: int, micro: int, acc: int, world: int) -> None:
    for rank in range(world):
        for epoch in (0, 2):
            reference = loader_over(n, micro, acc, rank, world)
            reference.batch_sampler.set_epoch(epoch)
            full = list(reference)
            assert full == [[1000 + i for i in b] for b in make(n, micro, acc, rank, world, epoch=epoch)]
            for k in range(len(full) + 1):
                loader = loader_over(n, micro, acc, rank, world)
                loader.batch_sampler.set_epoch(epoch)
                iterator = iter(loader)
                head = [next(iterator) for _ in range(k)]
                state = copy.deepcopy(loader.state_dict())
                assert state["_index_sampler_state"]["yielded"] == k
                resumed = loader_over(n, micro, acc, rank, world)
                resumed.load_state_dict(state)
                if k < len(full):
                    resumed.batch_sampler.set_epoch(epoch)  # the recipe sets the epoch it resumes
                    assert head + list(resumed) == full
                # Then the following epochs go on as in an uninterrupted run.
                resumed.batch_sampler.set_epoch(epoch + 1)
                reference.batch_sampler.set_epoch(epoch + 1)
                assert list(resumed) == list(reference)


def test_state_after_a_finished_epoch_resumes_at_the_next_epoch() -> None:
    loader = loader_over(50, 2, 2, 0, 2)
    loader.batch_sampler.set_epoch(3)
    list(loader)
    state = loader.state_dict()
    resumed = loader_over(50, 2, 2, 0, 2)
    resumed.load_state_dict(state)
    following = loader_over(50, 2, 2, 0, 2, epoch=4)
    assert list(resumed) == list(following)
    # The same when the recipe stopped at the last step without running the iterator dry.
    loader = loader_over(50, 2, 2, 0, 2, epoch=3)
    iterator = iter(loader)
    [next(iterator) for _ in range(len(loader))]
    resumed = loader_over(50, 2, 2, 0, 2)
    resumed.load_state_dict(loader.state_dict())
    resumed.batch_sampler.set_epoch(4)
    assert list(resumed) == list(following)


def test_sampler_state_round_trip_without_a_loader() -> None:
    sampler = make(40, 3, 2, 1, 2, epoch=1)
    full = list(sampler)
    iterator = iter(sampler)
    [next(iterator) for _ in range(3)]
    state = pickle.loads(pickle.dumps(sampler.state_dict()))
    assert state == {
        "epoch": 1,
        "yielded": 3,
        "dataset_size": 40,
        "micro_batch": 3,
        "accumulation": 2,
        "split": 1,
        "world_size": 2,
        "seed": 7,
        "shuffle": True,
        "first_sample": 0,
    }
    fresh = make(40, 3, 2, 1, 2)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert list(fresh) == full[3:]
    assert list(fresh) == full


def test_loaded_state_survives_setting_its_own_epoch_only() -> None:
    full = list(make(40, 3, 2, 1, 2, epoch=2))
    saved = make(40, 3, 2, 1, 2, epoch=2)
    iterator = iter(saved)
    [next(iterator) for _ in range(4)]
    fresh = make(40, 3, 2, 1, 2)
    fresh.load_state_dict(saved.state_dict())
    fresh.set_epoch(2)
    assert list(fresh) == full[4:]
    fresh.load_state_dict(saved.state_dict())
    fresh.set_epoch(3)
    assert list(fresh) == list(make(40, 3, 2, 1, 2, epoch=3))


def test_loader_state_is_the_position_of_the_iterator_just_made() -> None:
    loader = loader_over(50, 2, 2, 0, 2)
    full = list(loader)
    iter(loader)  # a second pass over the same epoch, not yet started
    state = loader.state_dict()
    assert state["_index_sampler_state"]["yielded"] == 0
    resumed = loader_over(50, 2, 2, 0, 2)
    resumed.load_state_dict(state)
    assert list(resumed) == full
    # Asked again before iterating, a resumed loader reports the loaded position.
    iterator = iter(loader)
    [next(iterator) for _ in range(3)]
    resumed = loader_over(50, 2, 2, 0, 2)
    resumed.load_state_dict(loader.state_dict())
    assert resumed.state_dict()["_index_sampler_state"]["yielded"] == 3
    assert list(resumed) == full[3:]


@pytest.mark.parametrize(
    "changed",
    [{"micro": 4}, {"acc": 1}, {"world": 3}, {"n": 41}, {"seed": 8}, {"shuffle": False}],
)
def test_a_state_from_another_layout_is_refused(changed: dict) -> None:
    args = {"n": 40, "micro": 3, "acc": 2, "world": 2, "seed": 7, "shuffle": True} | changed
    other = make(args["n"], args["micro"], args["acc"], 0, args["world"], seed=args["seed"], shuffle=args["shuffle"])
    saved = loader_over(40, 3, 2, 0, 2)
    iterator = iter(saved)
    next(iterator)
    with pytest.raises(ValueError, match="different layout"):
        other.load_state_dict(saved.batch_sampler.state_dict())
    loader = StatefulDataLoader(list(range(args["n"])), batch_sampler=other, collate_fn=list)
    loader.load_state_dict(saved.state_dict())
    with pytest.raises(ValueError, match="different layout"):
        iter(loader)


def test_an_incomplete_state_is_refused() -> None:
    sampler = make(40, 3, 2, 0, 2)
    with pytest.raises(ValueError, match="missing"):
        sampler.load_state_dict({"yielded": 1})


# ---------------------------------------------------------------- collate
SFT = partial(padded_collate_sft, padding_idx=PAD, ignore_idx=IGNORE)


def sft_samples() -> list[dict[str, list[int]]]:
    return [{"tokens": [5, 6, 7], "labels": [IGNORE, 6, 7]}, {"tokens": [8], "labels": [8]}]


def packed_samples(seq_len: int = 4) -> list[dict[str, torch.Tensor]]:
    return [
        {
            "tokens": torch.tensor([5, 6, 7, 8]),
            "labels": torch.tensor([5, 6, 7, 8]),
            "input_pos": torch.tensor([0, 1, 0, 1]),
            "seq_lens": torch.tensor([2, 2]),
        },
        {
            "tokens": torch.tensor([9, 10, 11, 0]),
            "labels": torch.tensor([9, 10, 11, IGNORE]),
            "input_pos": torch.tensor([0, 1, 2, 3]),
            "seq_lens": torch.tensor([3, 1]),
        },
    ]


def assert_same_batch(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("packed", [False, True])
def test_empty_micro_batch_becomes_one_ignored_token(packed: bool) -> None:
    collate_fn, samples = (padded_collate_packed, packed_samples()) if packed else (SFT, sft_samples())
    collate = collate_allowing_empty(collate_fn, pad_id=PAD, ignore_index=IGNORE, packed=packed)
    real = collate(samples)
    assert_same_batch(real, collate_fn(samples))
    empty = collate([])
    assert empty.keys() == real.keys()
    for key in empty:
        assert empty[key].dtype == real[key].dtype, key
        assert empty[key].shape[0] == 1, key
    assert empty["tokens"].tolist() == [[PAD]]
    assert empty["labels"].tolist() == [[IGNORE]]
    if packed:
        assert empty["input_pos"].tolist() == [[0]]
        assert empty["mask"].shape == (1, 1, 1)
    assert pickle.loads(pickle.dumps(collate))([]).keys() == empty.keys()


def test_empty_micro_batch_adds_no_loss_and_no_tokens() -> None:
    collate = collate_allowing_empty(SFT, pad_id=PAD, ignore_index=IGNORE, packed=False)
    vocab = 11
    generator = torch.Generator().manual_seed(0)
    loss_fn = CEWithChunkedOutputLoss(ignore_index=IGNORE)
    for batch in (collate([]), collate(sft_samples())):
        labels = F.pad(batch["labels"][..., 1:], (0, 1), value=IGNORE)  # shifted as in the recipes
        logits = torch.randn(*labels.shape, vocab, generator=generator)
        tokens = int((labels != IGNORE).sum())
        summed = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=IGNORE, reduction="sum")
        chunked = sum(
            loss_fn.compute_cross_entropy(c.reshape(-1, vocab), labels_chunk.reshape(-1))
            for c, labels_chunk in zip(logits.chunk(2, dim=1), labels.chunk(2, dim=1))
        )
        assert torch.allclose(summed, chunked)
        if batch["tokens"].numel() == 1:
            assert tokens == 0 and summed.item() == 0.0
        else:
            assert tokens == 2 and summed.item() > 0


def test_loader_with_empty_micro_batches_yields_real_batches() -> None:
    # 13 samples, micro 2, acc 4, 2 ranks: rank 1's last micro batch is empty.
    dataset = [{"tokens": [i + 1, i + 2], "labels": [i + 1, i + 2]} for i in range(13)]
    collate = collate_allowing_empty(SFT, pad_id=PAD, ignore_index=IGNORE, packed=False)
    batches = list(StatefulDataLoader(dataset, batch_sampler=make(13, 2, 4, 1, 2), collate_fn=collate))
    assert [b["tokens"].shape[0] for b in batches] == [2, 2, 2, 1]
    assert batches[-1]["labels"].tolist() == [[IGNORE]]
    assert all((b["labels"] != IGNORE).any() for b in batches[:-1])


@pytest.mark.parametrize(
    "size,micro,accumulation,world,max_steps",
    [
        (100, 4, 2, 2, None),
        (96, 4, 3, 2, None),
        (7, 3, 1, 3, None),
        (100, 4, 2, 2, 5),
        (100, 4, 2, 2, 13),
    ],
)
def test_epoch_extent_matches_the_sampler(
    size: int, micro: int, accumulation: int, world: int, max_steps: int | None
) -> None:
    samplers = [
        StepBatchSampler(
            size,
            micro_batch=micro,
            accumulation=accumulation,
            rank=r,
            world_size=world,
            shuffle=True,
            seed=3,
            max_steps=max_steps,
        )
        for r in range(world)
    ]
    seen = sum(len(batch) for sampler in samplers for batch in sampler)
    steps, samples = epoch_extent(size, micro * accumulation * world, max_steps)
    assert steps == samplers[0].steps
    assert samples == seen == sum(samplers[0].samples_in_step(i) for i in range(steps))


def test_the_step_layout_is_computed_once_per_epoch() -> None:
    """The loop reads the layout at every step; it is computed again only when the epoch changes."""
    sampler = make(50, 2, 2, 0, 2)
    calls = []
    compute = sampler._step_layout

    def counted() -> list[int]:
        calls.append(sampler.epoch)
        return compute()

    sampler._step_layout = counted  # type: ignore[method-assign]
    for _ in range(5):
        assert sampler.step_layout() == [2] * 6 + [1]
    sampler.set_epoch(1)
    assert sampler.steps == 7 and len(sampler) == 13
    assert calls == [0, 1]


# ---------------------------------------------------------------- growth inside an epoch
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("cut_after", [1, 2, 3])
def test_a_sampler_from_first_sample_continues_the_epoch_so_every_sample_is_seen_once(
    world: int, cut_after: int
) -> None:
    """The batch grows after ``cut_after`` steps: a new, larger sampler starts at the samples the old one served."""
    n, small = 37, make(37, 2, 1, 0, world, epoch=3)
    served = sum(small.samples_in_step(i) for i in range(cut_after))
    before = [
        split_steps(list(make(n, 2, 1, r, world, epoch=3)), small.step_layout())[:cut_after] for r in range(world)
    ]
    after = rank_batches(n, 5, 2, world, epoch=3, first_sample=served)
    per_rank = [[b for step in before[r] for b in step] + after[r] for r in range(world)]
    assert_covers_once(per_rank, n)
    grown = make(n, 5, 2, 0, world, epoch=3, first_sample=served)
    assert grown.remaining == n - served and sum(grown.samples_in_step(i) for i in range(grown.steps)) == n - served
    order = small.order()
    assert sorted(i for r in range(world) for b in after[r] for i in b) == sorted(order[served:])


def test_a_state_from_another_first_sample_or_without_one_is_refused() -> None:
    grown = make(40, 3, 1, 0, 1, first_sample=6)
    it = iter(grown)
    next(it)
    state = grown.state_dict()
    assert state["first_sample"] == 6
    with pytest.raises(ValueError, match="first_sample 6 \\(saved\\) != 0"):
        make(40, 3, 1, 0, 1).load_state_dict(state)
    without = {k: v for k, v in make(40, 3, 1, 0, 1).state_dict().items() if k != "first_sample"}
    with pytest.raises(ValueError, match=r"missing \['first_sample'\]"):
        make(40, 3, 1, 0, 1).load_state_dict(without)
    with pytest.raises(ValueError, match="first_sample"):
        make(40, 3, 1, 0, 1, first_sample=41)
