"""Telling an out-of-memory error apart from every other failure.

The profiler and OOM recovery treat an OOM as "this batch is too big" and anything else as a
bug to re-raise, so the test errs on the side of the messages torch actually produces.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from adaptive_batching.errors import PeerOutOfMemory

# Substrings of RuntimeError messages that mean memory ran out. The cuDNN/cuBLAS statuses are
# what those libraries report when their workspace allocation fails (Lightning treats them so too).
OOM_MESSAGES = (
    "DefaultCPUAllocator: can't allocate memory",
    "CUDA out of memory",
    "out of memory",  # CUDA error: out of memory, HIP, XPU, "MPS backend out of memory"
    "CUDNN_STATUS_NOT_SUPPORTED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
)


_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    t
    for t in (
        getattr(torch, "OutOfMemoryError", None),
        getattr(torch.cuda, "OutOfMemoryError", None),
        MemoryError,
        PeerOutOfMemory,
    )
    if t is not None
)


def _is_oom_itself(error: BaseException) -> bool:
    if isinstance(error, _OOM_TYPES):
        return True
    if not isinstance(error, RuntimeError):
        return False
    message = str(error).lower()
    return any(needle.lower() in message for needle in OOM_MESSAGES)


def _with_causes(error: BaseException) -> Iterator[BaseException]:
    """The error and, for ordinary exceptions, the error it explicitly wraps (``raise ... from``).

    An error merely raised while an OOM was being handled (``__context__``) is a bug of its own,
    not an OOM: counting it would retry a step that failed for another reason.
    """
    yield error
    if isinstance(error, Exception) and error.__cause__ is not None:
        yield error.__cause__


def is_out_of_memory(error: BaseException) -> bool:
    """True when ``error`` (or the error it explicitly wraps) means memory ran out on any device.

    A KeyboardInterrupt or SystemExit is never an OOM, even if it interrupted the handling of one.
    """
    return any(_is_oom_itself(e) for e in _with_causes(error))
