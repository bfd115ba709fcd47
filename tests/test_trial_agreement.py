"""Two ranks agree on each profiler trial (runtime/distributed.py ``agree_on_trial``): a trial that runs out of
memory on one rank only failed for both, its values are the ranks' largest, and the search that follows picks a
micro batch that fits on the tighter rank. Two gloo processes, forked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from forked_ranks import run_forked_ranks

from adaptive_batching.profiling.search import Trial, search_max_micro_batch
from adaptive_batching.runtime.distributed import ParallelInfo, agree_on_trial, minimum_over_ranks

RANKS = 2
FITS = {0: 10, 1: 6}  # the largest micro batch each rank holds (rank 1 has less memory free)


def _rank(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS)
    try:
        parallel = ParallelInfo(world_size=RANKS, rank=rank)
        agree = agree_on_trial(parallel, torch.device("cpu"))
        # rank 1 runs out of memory, rank 0 does not; then the other way round; then neither.
        seen = [agree(rank == 0, [100.0 + rank, 7.0 - rank]), agree(rank == 1, [1.0, 2.0]), agree(True, [3.0 * rank])]

        def run(micro_batch: int) -> Trial:
            ok, (peak,) = agree(micro_batch <= FITS[rank], [micro_batch * 10.0 + rank])
            return Trial(micro_batch, ok, peak if ok else None, 0.0, "verify")

        found = search_max_micro_batch(run, 8, tolerance=0.0)
        result = {
            "seen": seen,
            "max_ok": found.max_ok,
            "trials": [(t.micro_batch, t.ok) for t in found.trials],
            "minimum": minimum_over_ranks(5 + 3 * rank, parallel, torch.device("cpu")),
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def agreed(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each rank's results. Forked: the children inherit the imported torch; a deadline turns a hang into a
    failure."""
    out = tmp_path_factory.mktemp("agree")
    run_forked_ranks(_rank, (str(out / "store"), str(out)), RANKS, seconds=120, what="the 2-rank agreement")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


@pytest.mark.multiprocess
def test_a_trial_out_of_memory_on_one_rank_only_failed_on_both(agreed: list[dict]) -> None:
    for result in agreed:
        assert result["seen"] == [[False, [101.0, 7.0]], [False, [1.0, 2.0]], [True, [3.0]]]


@pytest.mark.multiprocess
def test_the_search_picks_what_fits_on_the_tighter_rank(agreed: list[dict]) -> None:
    assert agreed[0]["max_ok"] == agreed[1]["max_ok"] == FITS[1]
    assert agreed[0]["trials"] == agreed[1]["trials"]
    assert agreed[0]["trials"][0] == [8, False]  # the estimate fits rank 0 only
    assert [r["minimum"] for r in agreed] == [5, 5]
