"""A finished run leaves no process-group thread behind for the interpreter's finalisation.

torch keeps an FSDP2 run's gloo process group alive after ``destroy_process_group()`` (its DeviceMesh sits in
DTensor's caches until the interpreter finalises); its worker threads then meet finalisation, and one that
frees a finished collective's Python-owned tensor there aborts the process ("terminate called without an
active exception"). ``release_destroyed_group`` ends them first; every recipe run of the suite also checks
its output for an unclean exit (``recipe_runs.check``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from forked_ranks import run_forked_ranks

from adaptive_batching.runtime import distributed, memory
from adaptive_batching.runtime.distributed import ParallelInfo, backend_threads, release_destroyed_group, shutdown

RANKS = 2


def test_nothing_to_release_in_a_process_that_left_no_group() -> None:
    assert release_destroyed_group() == []


def _train_a_step() -> None:
    """An FSDP2 step as a run makes one, DTensor redistribution included; nothing of it outlives the call."""
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    float(norm.full_tensor())
    optimizer.step()


def _worker(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    memory.freeze_long_lived_objects()  # as the entry points do, before the run makes its group and model
    unfrozen: list[int] = []
    distributed.gc.unfreeze = lambda: unfrozen.append(1)  # type: ignore[assignment]  # this forked rank only
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS)
    _train_a_step()
    started = backend_threads()
    shutdown(ParallelInfo(RANKS, rank, rank), together=True)
    after_destroy = backend_threads()
    left = release_destroyed_group()
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "started": started,
                "after_destroy": after_destroy,
                "left": left,
                "now": backend_threads(),
                "unfrozen": unfrozen,
            }
        )
    )


@pytest.mark.multiprocess
def test_release_ends_the_gloo_threads_that_destroy_process_group_leaves(tmp_path: Path) -> None:
    run_forked_ranks(_worker, (str(tmp_path / "store"), str(tmp_path)), RANKS, seconds=180, what="the 2-rank run")
    for rank in range(RANKS):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "pt_gloo_runloop" in result["started"]
        # torch's caches still hold the destroyed group: without the release its threads meet finalisation
        assert "pt_gloo_runloop" in result["after_destroy"], "torch now ends the group itself: see the module docstring"
        assert result["left"] == [] and result["now"] == []
        assert result["unfrozen"] == []  # one collection of the run's own objects ended them, not a full one


def test_release_only_after_this_process_destroyed_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    collected = []
    monkeypatch.setattr(distributed.gc, "collect", lambda: collected.append(1) or 0)
    monkeypatch.setattr(distributed, "_DESTROYED_HERE", False)
    release_destroyed_group()
    assert collected == []
    monkeypatch.setattr(distributed.gc, "unfreeze", lambda: None)
    monkeypatch.setattr(distributed, "_DESTROYED_HERE", True)
    release_destroyed_group()
    assert collected == [1]
