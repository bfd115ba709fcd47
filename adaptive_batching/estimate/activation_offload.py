"""torchtune's activation offloading, replayed on fake tensors: what stays on the device, and what goes to host.

torchtune's ``OffloadActivations`` (``enable_activation_offloading: True``, only with activation checkpointing on
CUDA) is a ``saved_tensors_hooks`` around the model's forward. Each tensor autograd saves there, of at least
``min_offload_size`` (1024) bytes and neither a parameter nor a buffer, is copied to pinned host memory, and
the device copy is dropped once ``max_fwd_stash_size`` (5) later tensors were saved (its forward stash, which
lets the copy overlap compute on a second stream); the backward copies it back when a node needs it. The output
projection runs under ``NoOpManager``, so its saved tensors stay on the device. With activation checkpointing
the tensors it saves are mostly each layer's input (the checkpoint keeps them through ``save_for_backward``);
the loss runs outside the hooks, as in the recipes.

:class:`FakeOffload` does the same with fake tensors: a saved tensor it offloads keeps only its shape and dtype,
and comes back as a new (fake) device tensor in the backward, so the step's counted memory is what stays on the
device. It records every saved tensor, so that

* the host memory the offloaded tensors need in one step is their total size (:meth:`host_bytes`), and
* the forward stash is added as a bound (:meth:`stash_bytes`): the largest total of distinct tensors among any
  5 consecutive saves of the forward, which the stash holds on top of what the trace counts. It is an upper
  bound, because part of what the stash holds is still alive anyway when it is counted.

Copies in flight on the second stream in the backward (a tensor brought back for one node is freed after the
next one) are not modelled.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torchtune.training import NoOpManager

MIN_OFFLOAD_SIZE = 1024  # torchtune's OffloadActivations defaults, as the recipes use them
MAX_FWD_STASH_SIZE = 5


@dataclass(frozen=True)
class Saved:
    """One tensor saved for backward in the forward: its bytes, whether it went to host, its storage (a number
    that no other storage of the forward gets), the segment."""

    nbytes: int
    offloaded: bool
    storage: int
    segment: int


class _Offloaded:
    """What autograd keeps of an offloaded tensor: enough to bring a tensor of its size back."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = tuple(tensor.shape), tensor.dtype, tensor.device


class FakeOffload(saved_tensors_hooks):
    """``OffloadActivations`` for fake tensors (see the module docstring); ``segment`` says which stretch of
    the pass a save belongs to (a layer timeline's current segment; 0 without one)."""

    def __init__(self, segment: Callable[[], int] | None = None, min_offload_size: int = MIN_OFFLOAD_SIZE) -> None:
        self.saved: list[Saved] = []
        self._segment = segment or (lambda: 0)
        self._min = min_offload_size
        self._storages: dict[int, tuple[weakref.ref, int]] = {}  # address: the storage there, its number

        def pack(tensor: torch.Tensor) -> Any:
            nbytes = tensor.element_size() * tensor.nelement()
            offload = nbytes >= self._min and not isinstance(tensor, (nn.Parameter, nn.Buffer))
            self.saved.append(Saved(nbytes, offload, self._storage_number(tensor), self._segment()))
            return _Offloaded(tensor) if offload else tensor

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, _Offloaded):
                return torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
            return packed

        super().__init__(pack, unpack)

    def _storage_number(self, tensor: torch.Tensor) -> int:
        """The same number for the saves of one storage, a new one for each other storage. An offloaded tensor is
        not kept alive, so a later tensor's storage can take a freed one's address: the weak reference tells them
        apart (a storage's Python object lives as long as the storage)."""
        storage = tensor.untyped_storage()
        known = self._storages.get(storage._cdata)
        if known is not None and known[0]() is storage:
            return known[1]
        number = len(self.saved)  # the index of its first save: no other storage has it
        self._storages[storage._cdata] = (weakref.ref(storage), number)
        return number

    def host_bytes(self, counts: Sequence[int] | None = None) -> int:
        """Bytes in host memory after the forward: every offloaded tensor (a tensor saved twice is copied twice,
        as torchtune does); ``counts[i]``: how often segment ``i`` runs (layer extrapolation)."""
        return sum(s.nbytes * (counts[s.segment] if counts is not None else 1) for s in self.saved if s.offloaded)

    def stash_bytes(self, counts: Sequence[int] | None = None) -> int:
        """The most bytes of distinct offloaded tensors among ``max_fwd_stash_size`` consecutive saves (the forward
        stash), over the forward with segment ``i`` repeated ``counts[i]`` times (enough repeats to hold every
        window)."""
        sequence: list[tuple[Saved, int]] = []  # a save, and which repeat of its segment it is in
        by_segment: dict[int, list[Saved]] = {}
        for s in self.saved:
            by_segment.setdefault(s.segment, []).append(s)
        for segment in sorted(by_segment):
            repeat = 1 if counts is None else min(counts[segment], MAX_FWD_STASH_SIZE + 1)
            sequence.extend((s, r) for r in range(repeat) for s in by_segment[segment])
        best = 0
        for end in range(len(sequence)):
            window = sequence[max(0, end - MAX_FWD_STASH_SIZE + 1) : end + 1]
            distinct = {(s.storage, r): s.nbytes for s, r in window if s.offloaded}
            best = max(best, sum(distinct.values()))
        return best


def offloading_forward(model: nn.Module, offload: FakeOffload) -> list[Any]:
    """Run ``model``'s forward under ``offload`` and its output projection under ``NoOpManager``, as torchtune's
    ``get_act_offloading_ctx_manager`` and the recipes' ``with activations_handling_ctx: logits = model(...)`` do;
    the handles remove the hooks."""
    noop = NoOpManager()
    handles = [
        model.register_forward_pre_hook(lambda *args: offload.__enter__()),
        model.register_forward_hook(lambda *args: offload.__exit__(None, None, None), always_call=True),
    ]
    output = getattr(model, "output", None)
    head = output if isinstance(output, nn.Module) else getattr(output, "linear", None)
    if isinstance(head, nn.Module):
        handles += [
            head.register_forward_pre_hook(lambda *args: noop.__enter__()),
            head.register_forward_hook(lambda *args: noop.__exit__(None, None, None), always_call=True),
        ]
    return handles
