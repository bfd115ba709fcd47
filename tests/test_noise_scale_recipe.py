"""The gradient noise scale inside a recipe run: logged every step once warmed up, the batch grown from it at
epoch starts, and both resumed exactly (one run, one killed run and its resume)."""

from __future__ import annotations

import math
import re
import signal
from pathlib import Path

import pytest
from recipe_runs import read_metrics
from test_oom_recovery import faulty_run, ok

pytestmark = pytest.mark.e2e

GROWTH = (
    "batch_increase_function._component_=adaptive_batching.growth.noise_scale",
    "~batch_increase_function.factor",
    "batch_increase_function.fraction=50.0",
    "epochs=3",
    "batch_size=4",
    "gradient_accumulation_steps=2",
    "dataset.split=train[:80]",
    "max_steps_per_epoch=null",
    "save_every_n_steps=3",
    "tokenizer.max_seq_len=96",
)  # shorter samples (still all distinct): cheaper steps


def test_noise_scale_growth_decides_at_the_epoch_start_and_resumes_exactly(assets: Path, tmp_path: Path) -> None:
    """The noise scale is logged at every step once warmed up (the first micro batch of each step against the whole
    step gives one measurement per step, reported after 10); the shipped noise-scale function grows the batch at
    each epoch start from it (x2 at most per call); a run killed after that switch and resumed trains the same steps
    and logs the same noise scale (its EMA state came back with the checkpoint)."""
    whole = ok(faulty_run(tmp_path, "whole", {}, assets, *GROWTH))
    grown = re.findall(
        r"Growth from statistics at epoch (\d): gradient noise scale ([\d.]+), global batch (\d+): "
        r"the function returned \+(\d+)",
        whole,
    )
    assert [(int(e), int(g), int(i)) for e, _, g, i in grown] == [(2, 8, 4), (3, 16, 8)]
    rows = read_metrics(tmp_path / "whole" / "logs")
    assert [int(r["global_batch_size"]) for r in rows] == [8] * 10 + [16] * 5 + [32, 32, 16]  # 80 samples
    assert all("gradient_noise_scale" not in r for r in rows[:9])
    values = [r["gradient_noise_scale"] for r in rows[9:]]
    assert len(values) == len(rows) - 9 and all(math.isfinite(v) and v > 0 for v in values)
    assert len(set(values)) > 1  # it moves with every step
    killed = faulty_run(tmp_path, "part", {"kill_after": 14}, assets, *GROWTH)
    assert killed.returncode == -signal.SIGKILL
    resumed = ok(
        faulty_run(
            tmp_path, "part-2", {}, assets, *GROWTH, f"output_dir={tmp_path / 'part'}", "resume_from_checkpoint=True"
        )
    )
    assert "Resuming at step 2 of epoch 2 (optimizer step 12)" in resumed
    again = {int(r["step"]): r for r in read_metrics(tmp_path / "part" / "logs")}
    for row in rows:
        assert (
            again[int(row["step"])]["loss"] == row["loss"]
            and again[int(row["step"])]["global_batch_size"] == row["global_batch_size"]
        )
        assert again[int(row["step"])].get("gradient_noise_scale") == row.get("gradient_noise_scale")
