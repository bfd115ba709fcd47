"""The one OOM-recovery state machine, in both batching modes (no model)."""

from __future__ import annotations

import pytest

from adaptive_batching.faults.guard import piece_size
from adaptive_batching.faults.recovery import OomRecovery, SampleCuts, TokenCuts

MODES = {"samples": SampleCuts, "tokens": TokenCuts}


def test_sample_mode_caps_the_micro_batch_and_grows_back_to_the_plan() -> None:
    recovery = OomRecovery(SampleCuts(), grow_back_after=2)
    assert recovery.out_of_memory(failed=8, planned=8) == 4
    assert (recovery.split, piece_size(8, recovery.split)) == (2, 4)
    assert recovery.out_of_memory(failed=4, planned=8) == 2
    assert (recovery.split, piece_size(8, recovery.split)) == (4, 2)
    recovery.step_done()
    assert not recovery.grow_back_due()
    recovery.step_done()
    assert recovery.grow_back_due()
    recovery.grow_back(planned=8)
    assert (recovery.split, recovery.oom_cap) == (2, 4)
    recovery.step_done(), recovery.step_done()
    recovery.grow_back(planned=8)
    assert (recovery.split, recovery.oom_cap) == (1, None) and not recovery.grow_back_due()


def test_token_mode_doubles_the_cut_and_halves_it_back() -> None:
    recovery = OomRecovery(TokenCuts(), grow_back_after=1)
    recovery.out_of_memory(failed=30, planned=8)
    recovery.out_of_memory(failed=15, planned=8)
    assert recovery.split == 4
    recovery.step_done()
    recovery.grow_back(planned=8)
    assert recovery.split == 2
    recovery.step_done()
    recovery.grow_back(planned=8)
    assert recovery.split == 1 and not recovery.grow_back_due()


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_grow_back_doubles_the_wait_in_each_mode(mode: str) -> None:
    recovery = OomRecovery(MODES[mode](), grow_back_after=3)
    recovery.out_of_memory(failed=8, planned=8)
    for _ in range(3):
        recovery.step_done()
    recovery.grow_back(planned=8)
    recovery.out_of_memory(failed=8, planned=8)  # the size grown back to fails again
    assert recovery.state.wait == 6
    for _ in range(5):
        recovery.step_done()
    assert not recovery.grow_back_due()
    recovery.step_done()
    assert recovery.grow_back_due()
    recovery.out_of_memory(failed=4, planned=8)  # an OOM that did not follow a grow-back keeps the wait
    assert recovery.state.wait == 6


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_gives_the_profile_cache_a_smaller_micro_batch(mode: str) -> None:
    recovery = OomRecovery(MODES[mode](), grow_back_after=None)
    assert recovery.cache_cap(profiled=40) == 40
    recovery.out_of_memory(failed=40, planned=40)
    assert recovery.cache_cap(profiled=40) == 20


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_restores_its_cut_and_counters_on_resume(mode: str) -> None:
    recovery = OomRecovery(MODES[mode](), grow_back_after=2)
    recovery.out_of_memory(failed=8, planned=8)
    recovery.step_done()
    resumed = OomRecovery(MODES[mode](), grow_back_after=2)
    resumed.load_state_dict(recovery.state_dict())
    assert resumed.state == recovery.state and resumed.split == 2
    resumed.step_done()
    assert resumed.grow_back_due()


def test_a_state_without_every_field_is_refused() -> None:
    """No defaults for an older save's missing fields before the first release (docs/contributing.md)."""
    resumed = OomRecovery(SampleCuts(), grow_back_after=None)
    with pytest.raises(ValueError, match=r"missing \['oom_cap', 'clean_steps', 'grew_back', 'wait'\]"):
        resumed.load_state_dict({"micro_cap": 4, "split": 2})


def test_nothing_below_one_sample() -> None:
    recovery = OomRecovery(SampleCuts(), grow_back_after=None)
    assert recovery.out_of_memory(failed=1, planned=8) is None
    recovery.give_up()
    assert (recovery.split, recovery.oom_cap) == (1, None)
