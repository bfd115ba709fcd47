"""Out-of-memory classification, including a real CPU allocation failure in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from adaptive_batching.faults.oom import is_out_of_memory

ROOM_MIB = 300

CHILD = textwrap.dedent(f"""
    import json, resource, sys
    import torch
    from adaptive_batching.profiling.budget import cpu_room_bytes, proc_field_bytes
    from adaptive_batching.faults.oom import is_out_of_memory

    room = {ROOM_MIB} * 2**20
    with open("/proc/self/status") as f:
        limit = proc_field_bytes(f.read(), "VmSize") + room
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    measured, source = cpu_room_bytes()
    report = dict(room=room, measured=measured, source=source)
    try:
        torch.empty(2**34, dtype=torch.uint8)
    except BaseException as error:
        report.update(oom=is_out_of_memory(error), type=type(error).__name__, message=str(error)[:300])
    else:
        report.update(oom=None)
    report["recovered"] = float(torch.ones(1024, 1024).sum())
    print("REPORT " + json.dumps(report))
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_a_real_cpu_allocation_failure_is_an_oom_and_the_process_recovers() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    child = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert child.returncode == 0, child.stderr[-3000:]
    lines = [line for line in child.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, child.stdout[-3000:] + child.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT ") :])
    assert report["oom"] is True, report
    assert "DefaultCPUAllocator: can't allocate memory" in report["message"], report
    assert report["recovered"] == 1024 * 1024
    assert abs(report["measured"] - report["room"]) < 100 * 2**20, report
    assert report["source"].startswith("address-space limit"), report


def _raised(fn) -> BaseException:  # type: ignore[no-untyped-def]
    try:
        fn()
    except BaseException as error:
        return error
    raise AssertionError("nothing was raised")


OOMS = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.10 GiB total capacity)"),
    torch.cuda.OutOfMemoryError("anything"),
    MemoryError(),
    RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 17179869184 bytes. Error code 12 (Cannot allocate memory)"
    ),
    RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.00 GB)"),
    RuntimeError("XPU out of memory. Tried to allocate 1.00 GiB"),
    RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB"),
    RuntimeError(
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."
    ),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
]

NOT_OOMS = [
    _raised(lambda: torch.ones(4, 3) @ torch.ones(5, 6)),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("Expected all tensors to be on the same device"),
    ValueError("batch_size should be a positive integer"),
    TypeError("unsupported operand"),
    KeyboardInterrupt(),
    SystemExit(1),
]


@pytest.mark.parametrize("error", OOMS, ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_out_of_memory_errors_are_recognised(error: BaseException) -> None:
    assert is_out_of_memory(error)


@pytest.mark.parametrize("error", NOT_OOMS, ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}")
def test_other_errors_are_not_out_of_memory(error: BaseException) -> None:
    assert not is_out_of_memory(error)


def test_an_oom_wrapped_one_level_is_recognised() -> None:
    def explicit_cause() -> None:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except RuntimeError as error:
            raise RuntimeError("compiled training step failed") from error

    assert is_out_of_memory(_raised(explicit_cause))


def test_an_unrelated_error_raised_while_handling_an_oom_is_not_an_oom() -> None:
    """A bug in the OOM handling (here a KeyError) must surface, not be retried as another OOM."""

    def bug_in_handler() -> None:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except RuntimeError:
            {}["missing"]  # noqa: B018

    error = _raised(bug_in_handler)
    assert isinstance(error, KeyError) and isinstance(error.__context__, torch.OutOfMemoryError)
    assert not is_out_of_memory(error)


def test_a_wrapper_of_an_ordinary_error_is_not_an_oom() -> None:
    def wrapped() -> None:
        try:
            torch.ones(2, 3) @ torch.ones(4, 5)
        except RuntimeError as error:
            raise RuntimeError("step failed") from error

    assert not is_out_of_memory(_raised(wrapped))


def test_an_interrupt_during_oom_handling_is_not_an_oom() -> None:
    def interrupted() -> None:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except RuntimeError as error:
            raise KeyboardInterrupt from error

    assert not is_out_of_memory(_raised(interrupted))
