"""The gradient noise scale inside a recipe run: logged every step once warmed up, and resumed exactly."""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest

from recipe_runs import read_metrics
from test_oom_recovery import faulty_run, ok

pytestmark = pytest.mark.e2e

# 80 samples, micro batch 4 x accumulation 2: 10 steps per epoch, 2 epochs; the first micro batch of each
# step against the whole step gives one measurement per step, reported after 10 (the warm-up).
RUN = ("batch_size=4", "gradient_accumulation_steps=2", "dataset.split=train[:80]", "epochs=2",
       "max_steps_per_epoch=null", "save_every_n_steps=6")


def test_the_noise_scale_is_logged_and_survives_a_kill_and_resume(assets: Path, tmp_path: Path) -> None:
    ok(faulty_run(tmp_path, "whole", {}, assets, *RUN))
    whole = read_metrics(tmp_path / "whole" / "logs")
    assert all("gradient_noise_scale" not in r for r in whole[:9])
    values = [r["gradient_noise_scale"] for r in whole[9:]]
    assert len(values) == 11 and all(math.isfinite(v) and v > 0 for v in values)
    assert len(set(values)) > 1  # it moves with every step

    killed = faulty_run(tmp_path, "part", {"kill_after": 15}, assets, *RUN)
    assert killed.returncode == -signal.SIGKILL
    ok(faulty_run(tmp_path, "part-2", {}, assets, *RUN, f"output_dir={tmp_path / 'part'}",
                  "resume_from_checkpoint=True"))
    resumed = {int(r["step"]): r for r in read_metrics(tmp_path / "part" / "logs")}
    for row in whole[12:]:  # resumed from the step-12 save: the EMA state came back with it
        assert resumed[int(row["step"])]["gradient_noise_scale"] == row["gradient_noise_scale"]
