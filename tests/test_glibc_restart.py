"""Starting a CPU profile's process again with glibc pinned from its start, under an address-space limit."""

from __future__ import annotations

import pytest

from adaptive_batching.runtime.memory import PINNED_TUNABLES, RESTARTED_ENV, pinned_from_start, restart_for_glibc

PINNED = "glibc.malloc.mmap_threshold=131072:glibc.malloc.arena_max=1"
# ``tune run`` as the shell started it, and the recipe's arguments as ``tune`` hands them on.
ORIG = ["/venv/bin/python", "/venv/bin/tune", "run", "adaptive_full_finetune", "--config", "tiny_full", "a=1"]
ARGV = ["adaptive_full_finetune", "--config", "tiny_full", "a=1"]


def test_under_an_address_space_limit_the_same_command_runs_again_with_the_tunables() -> None:
    args, env = restart_for_glibc({"PATH": "/bin"}, ARGV, ORIG, address_space_limited=True)
    assert args == ORIG[1:]
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": PINNED, RESTARTED_ENV: "1"}
    assert pinned_from_start(env)


@pytest.mark.parametrize(
    "orig, argv",
    [
        (
            ["/venv/bin/python", "-u", "/r/adaptive_full_finetune.py", "--config", "c.yaml"],  # a torchrun worker
            ["/r/adaptive_full_finetune.py", "--config", "c.yaml"],
        ),
        (
            ["python", "-m", "adaptive_full_finetune", "--config", "c.yaml"],
            ["/r/adaptive_full_finetune.py", "--config", "c.yaml"],
        ),
        (
            ["/venv/bin/python", "/venv/bin/adaptive-batching", "profile", "--config", "c"],
            ["adaptive-batching", "profile", "--config", "c"],
        ),
    ],
)
def test_every_launcher_whose_command_line_ends_with_the_arguments(orig: list[str], argv: list[str]) -> None:
    restart = restart_for_glibc({}, argv, orig, address_space_limited=True)
    assert restart is not None and restart[0] == orig[1:]


@pytest.mark.parametrize(
    "env, limited",
    [
        ({}, False),  # no ulimit -v: a reserved arena costs no resident memory
        ({RESTARTED_ENV: "1"}, True),  # once only, even if glibc ignored the tunables
        ({"GLIBC_TUNABLES": PINNED}, True),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4:glibc.malloc.mmap_threshold=1048576"}, True),  # the user's own
    ],
)
def test_no_restart_when_not_needed(env: dict[str, str], limited: bool) -> None:
    assert restart_for_glibc(env, ARGV, ORIG, address_space_limited=limited) is None


@pytest.mark.parametrize(
    "orig, argv",
    [
        (["/venv/bin/python", "tests/forkserver.py"], ARGV),  # a process forked by another program
        (ORIG, ["adaptive_full_finetune"]),  # no arguments to recognise the command by
        (ARGV[1:], ARGV),  # the command line is only the arguments
        (ORIG[:-1] + ["a=2"], ARGV),
    ],
)
def test_no_restart_when_running_the_command_again_might_run_something_else(orig: list[str], argv: list[str]) -> None:
    assert restart_for_glibc({}, argv, orig, address_space_limited=True) is None


def test_the_users_other_tunables_are_kept_and_a_setting_of_theirs_wins() -> None:
    user = "glibc.malloc.tcache_count=0:glibc.malloc.arena_max=2"
    _, env = restart_for_glibc({"GLIBC_TUNABLES": user}, ARGV, ORIG, address_space_limited=True)
    tunables = dict(item.split("=") for item in env["GLIBC_TUNABLES"].split(":"))
    assert tunables == {
        "glibc.malloc.mmap_threshold": PINNED_TUNABLES["glibc.malloc.mmap_threshold"],
        "glibc.malloc.arena_max": "2",
        "glibc.malloc.tcache_count": "0",
    }


KEPT = """
import ctypes, sys, torch
from adaptive_batching.runtime import memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "reuse":
    assert memory.reuse_freed_memory()
tensor = torch.ones(5 * 2**20)  # 20 MiB, touched
del tensor
print(libc.mallinfo2().fordblks)
"""


def test_a_run_that_does_not_profile_keeps_freed_tensors_memory_for_its_next_step() -> None:
    """With glibc's defaults a fresh process maps a 20 MiB tensor and unmaps it when freed (the next step faults its
    pages in again); after ``reuse_freed_memory`` it comes from the heap and stays there, free, for the next step."""
    import subprocess
    import sys

    free = {
        mode: int(subprocess.run([sys.executable, "-c", KEPT, mode], capture_output=True, text=True, check=True).stdout)
        for mode in ("default", "reuse")
    }
    assert free["default"] < 2**20 and free["reuse"] >= 20 * 2**20, free


@pytest.mark.parametrize(
    "env, pinned, limit, reuses",
    [
        ({}, False, None, True),
        ({}, True, None, False),  # pinned for a profile or an out-of-memory recovery: the address space follows tensors
        ({}, False, 2**34, False),  # under ulimit -v memory kept would count against the micro batch that fits
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, False, None, False),  # the user's own setting
        ({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}, False, None, True),  # not malloc's
    ],
)
def test_freed_memory_is_kept_only_where_nothing_else_decides(
    env: dict[str, str], pinned: bool, limit: int | None, reuses: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from adaptive_batching.runtime import memory

    monkeypatch.setattr(memory, "_pinned", pinned)
    monkeypatch.setattr(memory, "address_space_limit", lambda: limit)
    assert memory.reuses_freed_memory(env) is reuses
