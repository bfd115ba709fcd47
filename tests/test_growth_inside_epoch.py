"""Growth inside an epoch, end to end: the batch doubles every 3 optimizer steps, each new sampler goes on
with the epoch's order, and a run killed after an in-epoch switch resumes exactly (one process)."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from recipe_runs import read_metrics
from test_oom_recovery import faulty_run, ok

from adaptive_batching.training.state import STATE_VERSION

SAMPLES = 40
# geometric x2 (the config's function) every 3 steps, from micro batch 2, under a budget that caps it.
GROWING = (
    "use_maximum_batch_size=False",
    f"dataset.split=train[:{SAMPLES}]",
    "epochs=2",
    "max_steps_per_epoch=null",
    "gradient_accumulation_steps=1",
    "batch_size=2",
    "adaptive_batching.growth_interval=3 steps",
    "save_every_n_steps=4",
    "adaptive_batching.memory_budget=96MiB",
    "batch_increase_function._component_=adaptive_batching.growth.geometric",
    "batch_increase_function.factor=2",
)


@pytest.fixture(scope="module")
def grown(runs: Path, assets: Path) -> dict[str, str]:
    """The uninterrupted run, one killed after optimizer step 9, and its resume (sharing one profile cache); and
    the resume of a copy of the killed run whose checkpoint holds its adaptive state in an older format version."""
    cache = f"adaptive_batching.cache_dir={runs / 'cache'}"
    outputs = {"straight": ok(faulty_run(runs, "straight", {}, assets, *GROWING, cache))}
    killed = faulty_run(runs, "killed", {"kill_after": 9}, assets, *GROWING, cache)
    assert killed.returncode != 0
    outputs["killed"] = killed.stdout + killed.stderr
    shutil.copytree(runs / "killed", runs / "older")
    recipe_state = runs / "older" / "epoch_0" / "recipe_state.pt"
    saved = torch.load(recipe_state, weights_only=False)
    saved["adaptive_batching"]["version"] = STATE_VERSION - 1
    torch.save(saved, recipe_state)
    record_file = recipe_state.parent / "checkpoint.json"  # it lists each file's size, which the new state changed
    record = json.loads(record_file.read_text())
    record["files"]["recipe_state.pt"] = recipe_state.stat().st_size
    record_file.write_text(json.dumps(record))
    older = faulty_run(
        runs,
        "older-resumed",
        {},
        assets,
        *GROWING,
        cache,
        f"output_dir={runs / 'older'}",
        "resume_from_checkpoint=True",
    )
    assert older.returncode == 1
    outputs["older"] = older.stdout + older.stderr
    outputs["resumed"] = ok(
        faulty_run(
            runs, "resumed", {}, assets, *GROWING, cache, f"output_dir={runs / 'killed'}", "resume_from_checkpoint=True"
        )
    )
    return outputs


def steps(runs: Path, name: str) -> list[dict]:
    return json.loads((runs / f"{name}-rank0.json").read_text())


def assert_every_sample_once(recorded: list[dict]) -> None:
    for epoch in (0, 1):
        counts = Counter(i for s in recorded if s["epoch"] == epoch for i in s["samples"])
        assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}, epoch


@pytest.mark.e2e
def test_the_batch_grows_every_3_steps_inside_the_epoch_and_every_sample_is_trained_once(
    grown: dict[str, str], runs: Path
) -> None:
    output = grown["straight"]
    assert "Growth period 1 (every 3 steps) after optimizer step 3: micro batch 2 -> 4" in output
    assert "for the rest of this epoch" in output
    assert "(the batch grows every 3 steps, not at epoch starts)" in output  # the epoch switch calls nothing
    # The progress bar names the epoch, the global batch it trains at, the LR and the loss.
    assert re.search(r"epoch 1/2: .*global batch 4 lr \d\.\d\de[-+]\d\d loss \d+\.\d{4}", output)
    assert re.search(r"epoch 2/2: .*global batch \d+ lr ", output)
    recorded = steps(runs, "straight")
    assert_every_sample_once(recorded)
    batches = [len(s["samples"]) for s in recorded]
    assert batches[:3] == [2, 2, 2] and batches[3:6] == [4, 4, 4]
    metrics = read_metrics(runs / "straight" / "logs")
    assert [m["global_batch_size"] for m in metrics] == batches
    # The memory budget caps the doubling; the cap is what the profile found, whatever it is on this machine.
    cap = int(max(m["micro_batch_size"] for m in metrics))
    assert all(b <= cap for b in batches) and batches[6] == min(8, cap)
    lrs = [m["lr"] for m in metrics]
    assert lrs[3] > lrs[2]  # the LR follows the global batch (sqrt rule), sample-driven warm-up on top


@pytest.mark.e2e
def test_a_resume_after_an_in_epoch_switch_trains_the_same_samples_and_losses(
    grown: dict[str, str], runs: Path
) -> None:
    assert "Resuming at step 8 of epoch 1 (optimizer step 8)" in grown["resumed"]
    before = [s for s in steps(runs, "killed") if s["step"] <= 8]
    assert_every_sample_once(before + steps(runs, "resumed"))
    assert [s["samples"] for s in before + steps(runs, "resumed")] == [s["samples"] for s in steps(runs, "straight")]
    straight = {int(m["step"]): m["loss"] for m in read_metrics(runs / "straight" / "logs")}
    resumed = {int(m["step"]): m["loss"] for m in read_metrics(runs / "killed" / "logs") if m["step"] > 8}
    assert resumed and all(resumed[k] == pytest.approx(straight[k], rel=1e-5) for k in resumed)


@pytest.mark.e2e
def test_a_checkpoint_in_an_older_state_format_stops_the_resume_in_one_line(grown: dict[str, str]) -> None:
    line = (
        f"config error: the checkpoint to resume holds adaptive state format version {STATE_VERSION - 1}, and "
        f"this adaptive-batching reads version {STATE_VERSION} only: start a fresh output_dir, or resume it "
        "with the adaptive-batching version that wrote it"
    )
    assert line in grown["older"].splitlines()
    assert "Traceback" not in grown["older"] and "Resuming at" not in grown["older"]
