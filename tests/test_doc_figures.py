"""tests/doc_figures.py's agreement of a page's figure with a run's: wide enough for a CPU run's noise, not for a
page whose figure is stale."""

from __future__ import annotations

from doc_figures import agrees


def test_a_quoted_cost_of_a_sample_agrees_within_a_cpu_runs_noise_and_not_beyond() -> None:
    assert agrees(1.0, 1.36) and agrees(1.0, 0.74)  # the KD page's command, run to run on the 2-core machine
    assert not agrees(4.05, 2.71) and not agrees(1.0, 2.0)


def test_a_quoted_micro_batch_agrees_within_a_fifth_or_one_sample() -> None:
    assert agrees(8, 9, samples=True) and agrees(40, 48, samples=True)
    assert not agrees(8, 11, samples=True) and not agrees(40, 52, samples=True)
