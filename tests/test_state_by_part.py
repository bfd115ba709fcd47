"""The checkpoint's adaptive state, one entry per part: a state written before (one flat mapping, as 51b76ca
wrote it) reads as the parts' entries, and the same run resumes from either (end to end in
test_growth_inside_epoch.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from adaptive_batching.training.state import STATE_VERSION, state_by_part

DATA = Path(__file__).parent / "data"
# Both saved at optimizer step 8 (inside epoch 1, after the batch grew inside it) of the same run, test_growth_inside_epoch's
# GROWING killed after step 9, sharing one profile cache: by 51b76ca (flat) and by this version (by part).
FLAT = json.loads((DATA / "adaptive_state_51b76ca.json").read_text())
BY_PART = json.loads((DATA / "adaptive_state_v2.json").read_text())


def flat(state: dict[str, Any]) -> dict[str, Any]:
    """A state by part written as one flat mapping, as before version 2 (for the end-to-end resume test)."""
    feed = {k: v for k, v in state["feed"].items() if k not in ("span", "recovery", "batching")}
    return {**state["progress"], **feed, **state["feed"]["recovery"], **state["feed"]["batching"],
            "segment": state["feed"]["span"], **state["plan"], "lr": state["lr"], "profile": state["profile"]["result"],
            "noise_scale": state["noise_scale"]}


def without_cache_flag(state: dict[str, Any]) -> dict[str, Any]:
    """The second run took the first one's profile from the cache, which is all that tells them apart."""
    result = {**state["profile"]["result"], "from_cache": None}
    return {**state, "profile": {**state["profile"], "result": result}}


def test_a_flat_state_written_before_reads_as_the_parts_entries() -> None:
    assert "version" not in FLAT and BY_PART["version"] == STATE_VERSION
    assert without_cache_flag(state_by_part(FLAT)) == without_cache_flag(BY_PART)


def test_the_flat_writer_of_the_tests_writes_what_51b76ca_wrote() -> None:
    assert flat(without_cache_flag(BY_PART)) == {**FLAT, "profile": {**FLAT["profile"], "from_cache": None}}


def test_a_state_by_part_is_read_as_it_is_and_old_names_are_read_too() -> None:
    assert state_by_part(BY_PART) == BY_PART
    old = state_by_part({"global_step": 3, "epoch": 1, "data_parallel": 2, "micro_cap": 4, "split": 2})
    assert old["feed"]["ranks"] == 2 and old["profile"]["ranks"] == 2 and old["feed"]["recovery"]["micro_cap"] == 4
    assert old["progress"] == {"global_step": 3, "epoch": 1}
