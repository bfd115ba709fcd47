"""Checks the sampler tests share: a rank's batches cut into optimizer steps, and every sample served once."""

from __future__ import annotations

from collections import Counter


def split_steps(batches: list[list[int]], layout: list[int]) -> list[list[list[int]]]:
    """``batches`` cut into optimizer steps of ``layout[i]`` micro batches each, which must use them all."""
    steps, start = [], 0
    for count in layout:
        steps.append(batches[start : start + count])
        start += count
    assert start == len(batches)
    return steps


def assert_covers_once(per_rank: list[list[list[int]]], n: int) -> None:
    """Every sample index below ``n`` appears in exactly one micro batch of one rank."""
    counts = Counter(i for batches in per_rank for batch in batches for i in batch)
    assert sorted(counts) == list(range(n))
    assert set(counts.values()) <= {1}
