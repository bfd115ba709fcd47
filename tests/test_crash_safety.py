"""kill -9 during training and during a checkpoint save, then resume: the run ends as if never killed."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
import torch
from recipe_runs import read_metrics
from test_oom_recovery import faulty_run, final_weights, ok

pytestmark = pytest.mark.e2e

RECIPES = {"full": ("adaptive_full_finetune", "tiny_full"), "lora": ("adaptive_lora_finetune", "tiny_lora")}
SAVES = ("batch_size=8", "save_every_n_steps=2")  # 5 steps per epoch: saves after steps 2, 4, 5, 6, 8, 10


@pytest.mark.parametrize("method", ["full", "lora"])
def test_killed_in_training_then_in_a_save_the_resumed_run_equals_the_whole_run(
    method: str, assets: Path, tmp_path: Path
) -> None:
    recipe, config = RECIPES[method]
    kill_step = random.Random(f"{method}-20261122").randint(3, 7)
    run = lambda name, fault, *extra: faulty_run(  # noqa: E731
        tmp_path, name, fault, assets, *SAVES, *extra, recipe=recipe, config=config
    )
    ok(run("whole", {"phase": "none"}))

    part = f"output_dir={tmp_path / 'part'}"
    first = run("part", {"kill_after": kill_step})
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    last_save = max(s for s in (2, 4, 5, 6) if s < kill_step)
    second = run("part-2", {"kill_in_save": 2}, part, "resume_from_checkpoint=True")
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    assert f"(optimizer step {last_save})" in second.stdout + second.stderr
    saves_after = [s for s in (2, 4, 5, 6, 8, 10) if s > last_save]
    resumed_from = saves_after[0]  # the second save of the second run was killed half-way
    third = ok(run("part-3", {"phase": "none"}, part, "resume_from_checkpoint=True"))
    assert f"(optimizer step {resumed_from})" in third.split("Resuming at", 1)[1].splitlines()[0]
    assert list((tmp_path / "part").glob(".incomplete-*")) == []

    whole, resumed = read_metrics(tmp_path / "whole" / "logs"), read_metrics(tmp_path / "part" / "logs")
    assert [r["step"] for r in resumed] == list(range(1, 11))
    for key in ("loss", "lr", "micro_batch_size", "global_batch_size"):
        assert [r[key] for r in resumed] == [r[key] for r in whole], key
    if method == "full":
        a, b = final_weights(tmp_path / "whole"), final_weights(tmp_path / "part")
        assert all(torch.equal(a[k], b[k]) for k in a)
