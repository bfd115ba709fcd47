"""The adaptive state a resume reads (training/state.py): each part's entry comes back to it, where the run
stood included, and a state in another format version stops the resume in one line before any model loads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torchtune import training

from adaptive_batching.errors import ConfigError
from adaptive_batching.faults import checkpoints as checkpointing
from adaptive_batching.runtime.distributed import ParallelInfo
from adaptive_batching.training.state import STATE_VERSION, Progress, SavedState, read_state, resume_training


class Recorded:
    """A part that keeps the state it was given."""

    def __init__(self) -> None:
        self.loaded: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


class Feed(Recorded):
    """What a resume asks of the feed besides its state: the OOM cut and whether a recorded one is deeper."""

    class recovery:
        oom_cap = None

    def adopt_cut(self, recorded: dict[str, Any]) -> bool:
        return False


def test_progress_comes_back_where_it_was_saved_inside_an_epoch() -> None:
    saved = Progress(epochs_run=1, step_in_epoch=5, global_step=12)
    resumed = Progress()
    resumed.load_state_dict(saved.state_dict())
    assert (resumed.epochs_run, resumed.step_in_epoch, resumed.global_step, resumed.saved_step) == (1, 5, 12, 12)
    assert resumed.where() == "step 5 of epoch 2"


def adaptive_state(version: Any = STATE_VERSION) -> dict[str, Any]:
    return {
        "version": version,
        "progress": {"global_step": 12, "epoch": 1, "step_in_epoch": 5},
        "feed": {"ranks": 1, "span": None},
        "plan": {"grown": None},
        "lr": {"consumed_samples": 40},
        "noise_scale": None,
        "profile": {"result": None, "ranks": 1},
    }


def restore(state: dict[str, Any], tmp_path: Path) -> tuple[dict[str, Any], torch.optim.Optimizer]:
    """A resume as set-up runs it, of a tiny model's checkpoint holding ``state``: each part takes its entry
    (SavedState.restore), then resume_training puts the optimizer back; the parts and the optimizer."""
    model = torch.nn.Linear(2, 2)
    saved_optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    saved_optimizer.step()
    checkpoint = {
        training.SEED_KEY: 7,
        training.OPT_KEY: saved_optimizer.state_dict(),
        checkpointing.ADAPTIVE_KEY: state,
    }
    saved = SavedState(checkpoint[checkpointing.ADAPTIVE_KEY])
    parts = {
        "progress": Progress(),
        "feed": Feed(),
        "plan": Recorded(),
        "lr": Recorded(),
        "noise_scale": Recorded(),
        "profile": Recorded(),
    }
    for key, part in parts.items():
        saved.restore(key, part)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seed = resume_training(
        checkpoint,
        seed=7,
        feed=parts["feed"],  # type: ignore[arg-type]
        progress=parts["progress"],
        model=model,
        optimizer=optimizer,
        parallel=ParallelInfo(),
        device=torch.device("cpu"),
        output_dir=tmp_path,
    )
    assert seed == 7
    return parts, optimizer


def test_a_resume_puts_each_part_back_where_the_run_stood(tmp_path: Path, said: Callable[[], list[str]]) -> None:
    parts, optimizer = restore(adaptive_state(), tmp_path)
    progress = parts["progress"]
    assert (progress.epochs_run, progress.step_in_epoch, progress.global_step) == (1, 5, 12)
    assert parts["feed"].loaded == {"ranks": 1, "span": None} and parts["plan"].loaded == {"grown": None}
    assert parts["lr"].loaded == {"consumed_samples": 40} and parts["profile"].loaded == {"result": None, "ranks": 1}
    assert parts["noise_scale"].loaded is None  # a part saved as None keeps its own start
    assert said() == ["Resuming at step 5 of epoch 2 (optimizer step 12)"]
    assert all("momentum_buffer" in state for state in optimizer.state.values()) and optimizer.state


@pytest.mark.parametrize("version", [STATE_VERSION - 1, STATE_VERSION + 1, None])
def test_a_state_in_another_format_version_fails_in_one_line_naming_both(version: Any, tmp_path: Path) -> None:
    state = adaptive_state(version)
    if version is None:
        del state["version"]  # written before the state recorded its version: version 1
    saved = 1 if version is None else version
    expected = (
        f"the checkpoint to resume holds adaptive state format version {saved}, and this adaptive-batching "
        f"reads version {STATE_VERSION} only: start a fresh output_dir, or resume it with the "
        "adaptive-batching version that wrote it"
    )
    with pytest.raises(ConfigError) as raised:
        read_state(state)
    assert str(raised.value) == expected
    with pytest.raises(ConfigError, match=f"format version {saved},"):
        restore(state, tmp_path)


def test_a_state_in_this_format_version_is_read_as_it_is() -> None:
    state = adaptive_state()
    assert read_state(state) == state and read_state(state) is not state
