"""Ranks on one host share its memory: on CPU, with no explicit budget, each rank's budget is its share of the host
(``profiling.budget.cpu_room_bytes`` divides the host's room by torchrun's local world size), and the log says so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from recipe_runs import check, tune_run

from adaptive_batching.profiling.budget import proc_field_bytes

BUDGET = re.compile(r"Profiler: budget ([0-9.]+) GiB \((CPU: .*)\); worst-case")


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_two_cpu_ranks_budgets_sum_to_at_most_the_host(assets: Path, tmp_path: Path) -> None:
    """2 ranks profile with no memory_budget (the tiny config's 512MiB taken off): the budget both use (the smaller of
    theirs) is at most half the host's memory, so together they ask for no more than it has (before: each took the whole
    host's room, 19.5 GiB of 23)."""
    result = check(
        tune_run(
            "adaptive_full_finetune",
            "tiny_full",
            [
                f"assets_dir={assets}",
                f"output_dir={tmp_path / 'run'}",
                f"adaptive_batching.cache_dir={tmp_path / 'cache'}",
                "adaptive_batching.memory_budget=null",
                "use_maximum_batch_size=True",
                "gradient_accumulation_steps=1",
                "epochs=1",
                "max_steps_per_epoch=1",
                "dataset.split=train[:16]",
                "tokenizer.max_seq_len=64",
            ],
            cwd=tmp_path,
            nproc=2,
        )
    )
    (found,) = BUDGET.findall(result.stdout + result.stderr)
    gib, source = float(found[0]), found[1]
    host = proc_field_bytes(Path("/proc/meminfo").read_text(), "MemTotal")
    assert host is not None
    assert 2 * gib * 2**30 <= host, (gib, source, host)
    assert "/ 2 ranks on this host" in source and source.endswith("; minimum over 2 ranks"), source
