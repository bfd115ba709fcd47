"""FakeOffload (adaptive_batching/estimate/activation_offload.py), counted exactly: which saves go to host, the forward
stash as the largest total of distinct offloaded tensors among 5 consecutive saves, and a freed tensor's storage address
taken by a later one (each is its own tensor, both counted)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from adaptive_batching.estimate.activation_offload import FakeOffload

KB = 1024  # 256 float32 values, the smallest tensor offloaded


def floats(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes // 4, requires_grad=True)


def save(offload: FakeOffload, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Save each tensor for backward once, in order (``sin`` saves its input), under ``offload``."""
    with offload:
        return [t.sin() for t in tensors]


def test_the_stash_is_the_most_distinct_offloaded_bytes_among_5_consecutive_saves() -> None:
    # 8 kB, five 1 kB tensors, 8 kB: 5 in a row hold at most 8 + 4 = 12 kB (6 would hold 13, 4 hold 11).
    offload = FakeOffload()
    tensors = [floats(8 * KB), *(floats(KB) for _ in range(5)), floats(8 * KB)]
    kept = save(offload, *tensors)
    assert len(offload.saved) == 7 and all(s.offloaded for s in offload.saved)
    assert offload.stash_bytes() == 12 * KB
    assert offload.host_bytes() == 21 * KB
    assert kept


def test_small_tensors_and_parameters_stay_on_the_device_but_take_their_place_in_the_stash() -> None:
    # 8 kB, a 1 kB parameter, a 1020-byte tensor (under 1024), 1 kB, 2 kB, 4 kB: the first five saves stash
    # 8 + 1 + 2 = 11 kB, the last five 7 kB (six would stash 15, four 9).
    offload = FakeOffload()
    parameter = nn.Parameter(torch.zeros(KB // 4))
    kept = save(
        offload,
        floats(8 * KB),
        parameter,
        torch.zeros(255, requires_grad=True),
        floats(KB),
        floats(2 * KB),
        floats(4 * KB),
    )
    assert [s.offloaded for s in offload.saved] == [True, False, False, True, True, True]
    assert offload.stash_bytes() == 11 * KB
    assert offload.host_bytes() == 15 * KB
    assert kept


def test_a_tensor_saved_twice_in_the_window_is_stashed_once_and_copied_twice() -> None:
    offload = FakeOffload()
    twice, other = floats(4 * KB), floats(KB)
    with offload:
        kept = [twice.sin(), twice.view(2, -1).cos(), other.sin()]
    assert offload.saved[0].storage == offload.saved[1].storage != offload.saved[2].storage
    assert offload.stash_bytes() == 5 * KB
    assert offload.host_bytes() == 9 * KB
    assert kept


def test_segments_repeat_as_often_as_they_run() -> None:
    # segment 0: 8 kB once; segment 1: two 1 kB tensors, run 3 times: 8 kB then six 1 kB saves.
    segment = [0]
    offload = FakeOffload(segment=lambda: segment[0])
    kept = save(offload, floats(8 * KB))
    segment[0] = 1
    kept += save(offload, floats(KB), floats(KB))
    assert offload.stash_bytes([1, 3]) == 12 * KB
    assert offload.stash_bytes() == 10 * KB
    assert offload.host_bytes([1, 3]) == 14 * KB
    assert kept


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_a_freed_tensor_and_a_new_one_at_its_address_are_two_tensors(fake: bool) -> None:
    """Offloaded, a saved tensor is not kept alive, so the next one's storage can take its address (here it
    does within a few steps on CPU, fake or real). Each save below is a new 1 kB tensor: any 5 in a row hold 5 kB."""
    offload = FakeOffload()
    with FakeTensorMode() if fake else contextlib.nullcontext():
        x = torch.zeros(KB // 4, requires_grad=True)
        with offload:
            for _ in range(50):
                y = x.exp()  # saves y, its output
                z = y * 2  # saves nothing
                del y
                z.sin()  # saves z
                del z
    assert len(offload.saved) == 100 and len({s.storage for s in offload.saved}) == 100
    assert offload.stash_bytes() == 5 * KB
    assert offload.host_bytes() == 100 * KB
