"""The memory budget: explicit sizes, the accelerator product, and the tightest host limit on CPU."""

from __future__ import annotations

import math
import resource
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from adaptive_batching.errors import ConfigError
from adaptive_batching.profiling.budget import Budget, cpu_room_bytes, memory_budget

GIB = 2**30
MIB = 2**20
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_address_space_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real rlimit of the test process must not leak into the fake hosts."""
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_host(
    root: Path,
    *,
    vm_size: int = 2 * GIB,
    available: int = 64 * GIB,
    cgroup: str = "0::/\n",
    v2: dict[str, tuple[str, int]] | None = None,
    v1: dict[str, tuple[int, int]] | None = None,
) -> Path:
    """A fake /proc and /sys/fs/cgroup: ``v2`` maps a cgroup dir to (memory.max, memory.current)."""
    write(
        root,
        "proc/self/status",
        f"Name:\tpython\nVmPeak:\t{vm_size // 1024 + 10} kB\nVmSize:\t{vm_size // 1024} kB\nVmRSS:\t1000 kB\n",
    )
    write(
        root,
        "proc/meminfo",
        f"MemTotal:       {128 * GIB // 1024} kB\nMemFree:        1000 kB\nMemAvailable:   {available // 1024} kB\n",
    )
    write(root, "proc/self/cgroup", cgroup)
    if v2 is not None:
        write(root, "sys/fs/cgroup/cgroup.controllers", "cpu io memory pids\n")
        for directory, (limit, current) in v2.items():
            write(root, f"sys/fs/cgroup/{directory}/memory.max", f"{limit}\n")
            write(root, f"sys/fs/cgroup/{directory}/memory.current", f"{current}\n")
    for directory, (limit_v1, usage) in (v1 or {}).items():
        write(root, f"sys/fs/cgroup/memory/{directory}/memory.limit_in_bytes", f"{limit_v1}\n")
        write(root, f"sys/fs/cgroup/memory/{directory}/memory.usage_in_bytes", f"{usage}\n")
    return root


def set_address_space_limit(monkeypatch: pytest.MonkeyPatch, soft: int) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, resource.RLIM_INFINITY))


# --- explicit -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "explicit, expected",
    [
        ("12GiB", 12 * GIB),
        ("500MB", 500 * 10**6),
        ("1.5GiB", int(1.5 * GIB)),
        ("64 MiB", 64 * MIB),
        (1073741824, GIB),
        ("2048", 2048),
    ],
)
def test_explicit_budget_is_taken_as_is(explicit: str | int, expected: int) -> None:
    budget = memory_budget(CPU, explicit=explicit, fraction=0.5, live_tensor_bytes=GIB)
    assert budget == Budget(expected, f"explicit adaptive_batching.memory_budget={explicit}")


def test_explicit_budget_never_queries_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object) -> None:
        raise AssertionError("the device was queried")

    monkeypatch.setattr(torch.cuda, "get_device_properties", boom)
    assert memory_budget(torch.device("cuda", 0), explicit="40GiB", fraction=0.9).bytes == 40 * GIB


@pytest.mark.parametrize("explicit", ["12 parsecs", "", "GiB", -5, 0, "-1GiB", True])
def test_unparsable_explicit_budget_names_the_key(explicit: object) -> None:
    with pytest.raises(ConfigError, match=r"adaptive_batching\.memory_budget.*'12GiB'"):
        memory_budget(CPU, explicit=explicit, fraction=0.9)  # type: ignore[arg-type]


@pytest.mark.parametrize("fraction", [0, 0.0, -0.1, 1.01, 2, math.nan, math.inf, True, "0.9", None])
def test_fraction_outside_zero_one_names_the_key(fraction: object) -> None:
    with pytest.raises(ConfigError, match=r"adaptive_batching\.memory_fraction.*\(0, 1\]"):
        memory_budget(CPU, explicit=None, fraction=fraction)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"adaptive_batching\.memory_fraction"):
        memory_budget(CPU, explicit="1GiB", fraction=fraction)  # type: ignore[arg-type]


# --- CUDA ---------------------------------------------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """An 80 GiB device capped at half by set_per_process_memory_fraction; records the queried indices."""
    queried: list[int] = []

    def properties(index: int) -> SimpleNamespace:
        queried.append(index)
        return SimpleNamespace(total_memory=80 * GIB, name="NVIDIA H100 80GB HBM3")

    def per_process(index: int) -> float:
        queried.append(index)
        return 0.5

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", per_process)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (80 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: 0)
    return queried


def test_cuda_budget_is_total_times_per_process_fraction_times_fraction(fake_cuda: list[int]) -> None:
    budget = memory_budget(torch.device("cuda", 1), explicit=None, fraction=0.9, live_tensor_bytes=5 * GIB)
    assert budget.bytes == int(80 * GIB * 0.5 * 0.9)
    assert fake_cuda == [1, 1]
    assert budget.source == (
        "cuda:1 (NVIDIA H100 80GB HBM3) 80.0 GiB x per-process fraction 0.50 x memory_fraction 0.90"
    )


def test_cuda_without_an_index_uses_the_current_device(fake_cuda: list[int]) -> None:
    budget = memory_budget(torch.device("cuda"), explicit=None, fraction=1.0)
    assert budget.bytes == 40 * GIB
    assert fake_cuda == [3, 3]
    assert budget.source.startswith("cuda:3 ")


def test_cuda_without_the_per_process_fraction_api_counts_it_as_one(
    fake_cuda: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction")
    monkeypatch.delattr(torch.cuda.memory, "get_per_process_memory_fraction")
    budget = memory_budget(torch.device("cuda", 0), explicit=None, fraction=0.5)
    assert budget.bytes == 40 * GIB
    assert "per-process fraction 1.00" in budget.source


@pytest.mark.parametrize("free_gib, reserved_gib, expected_gib", [(30, 2, 32), (80, 0, 40), (10, 35, 40)])
def test_cuda_budget_counts_what_other_processes_hold(
    fake_cuda: list[int], monkeypatch: pytest.MonkeyPatch, free_gib: int, reserved_gib: int, expected_gib: int
) -> None:
    """The room is the free memory plus what this process's allocator already reserves, capped by the
    per-process fraction (half of 80 GiB here): another job holding 48 GiB leaves 32."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (free_gib * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: reserved_gib * GIB)
    budget = memory_budget(torch.device("cuda", 0), explicit=None, fraction=0.5)
    assert budget.bytes == int(expected_gib * GIB * 0.5)
    if expected_gib < 40:
        assert f"{free_gib:.1f} GiB free + {reserved_gib:.1f} GiB this process reserves" in budget.source
        assert f"others hold {80 - free_gib - reserved_gib:.1f} GiB" in budget.source


def test_the_cuda_budget_is_the_minimum_over_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's own free memory, then the smallest over ranks: one crowded GPU sets everyone's budget."""
    from adaptive_batching.runtime import distributed
    from adaptive_batching.runtime.distributed import ParallelInfo

    reduced: list[str] = []

    def all_reduce(tensor: torch.Tensor, op: object) -> None:
        reduced.append(str(op))
        tensor.copy_(torch.minimum(tensor, torch.tensor([12.0 * GIB], dtype=tensor.dtype)))

    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    parallel = ParallelInfo(rank=0, world_size=2, local_rank=0)
    assert distributed.minimum_over_ranks(30 * GIB, parallel, torch.device("cpu")) == 12 * GIB
    assert reduced == [str(distributed.dist.ReduceOp.MIN)]


def test_device_without_a_memory_api_asks_for_an_explicit_budget() -> None:
    with pytest.raises(ConfigError, match=r"adaptive_batching\.memory_budget"):
        memory_budget(torch.device("meta"), explicit=None, fraction=0.9)


# --- CPU ----------------------------------------------------------------------------------------


def test_meminfo_binds_without_other_limits(tmp_path: Path) -> None:
    root = fake_host(tmp_path, available=6 * GIB)
    assert cpu_room_bytes(root=root) == (6 * GIB, "MemAvailable")


def test_cgroup_v2_limit_binds(tmp_path: Path) -> None:
    root = fake_host(
        tmp_path,
        cgroup="0::/user.slice/job.scope\n",
        v2={"user.slice": ("max", 30 * GIB), "user.slice/job.scope": (str(4 * GIB), GIB)},
    )
    room, source = cpu_room_bytes(root=root)
    assert room == 3 * GIB
    assert source == "cgroup v2 memory.max of /sys/fs/cgroup/user.slice/job.scope"


def test_an_ancestor_cgroup_limit_binds_too(tmp_path: Path) -> None:
    root = fake_host(
        tmp_path,
        cgroup="0::/user.slice/job.scope\n",
        v2={"user.slice": (str(10 * GIB), 9 * GIB), "user.slice/job.scope": (str(4 * GIB), GIB)},
    )
    assert cpu_room_bytes(root=root) == (GIB, "cgroup v2 memory.max of /sys/fs/cgroup/user.slice")


def test_cgroup_max_means_no_limit(tmp_path: Path) -> None:
    root = fake_host(tmp_path, available=7 * GIB, cgroup="0::/job\n", v2={"job": ("max", 100 * GIB)})
    assert cpu_room_bytes(root=root) == (7 * GIB, "MemAvailable")


def test_container_cgroup_is_the_mount_itself_when_the_host_path_is_absent(tmp_path: Path) -> None:
    root = fake_host(tmp_path, cgroup="0::/system.slice/docker-abc.scope\n", v2={".": (str(2 * GIB), GIB // 2)})
    assert cpu_room_bytes(root=root) == (GIB + GIB // 2, "cgroup v2 memory.max of /sys/fs/cgroup")


def test_cgroup_v1_limit_binds_and_its_no_limit_value_is_ignored(tmp_path: Path) -> None:
    cgroup = "5:cpu,cpuacct:/\n4:memory:/docker/abc\n0::/\n"
    root = fake_host(
        tmp_path, cgroup=cgroup, v1={"docker": (9223372036854771712, 50 * GIB), "docker/abc": (3 * GIB, GIB)}
    )
    assert cpu_room_bytes(root=root) == (2 * GIB, "cgroup v1 memory.limit_in_bytes of /sys/fs/cgroup/memory/docker/abc")
    unlimited = fake_host(
        tmp_path / "unlimited", cgroup=cgroup, available=5 * GIB, v1={"docker/abc": (9223372036854771712, GIB)}
    )
    assert cpu_room_bytes(root=unlimited) == (5 * GIB, "MemAvailable")


def test_address_space_limit_binds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_host(tmp_path, vm_size=3 * GIB, cgroup="0::/job\n", v2={"job": (str(8 * GIB), GIB)})
    set_address_space_limit(monkeypatch, 3 * GIB + 256 * MIB)
    room, source = cpu_room_bytes(root=root)
    assert room == 256 * MIB
    assert source.startswith("address-space limit")


def test_the_tightest_limit_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_host(tmp_path, vm_size=GIB, available=5 * GIB, cgroup="0::/job\n", v2={"job": (str(8 * GIB), GIB)})
    set_address_space_limit(monkeypatch, 20 * GIB)
    assert cpu_room_bytes(root=root) == (5 * GIB, "MemAvailable")
    set_address_space_limit(monkeypatch, 4 * GIB)
    assert cpu_room_bytes(root=root)[0] == 3 * GIB


def test_cpu_budget_adds_live_tensors_to_the_fraction_of_the_room(tmp_path: Path) -> None:
    root = fake_host(tmp_path, available=8 * GIB)
    budget = memory_budget(CPU, explicit=None, fraction=0.75, live_tensor_bytes=GIB, root=root)
    assert budget.bytes == GIB + 6 * GIB
    assert budget.source == "CPU: MemAvailable leaves 8.0 GiB, x memory_fraction 0.75, + 1.0 GiB live tensors"


def test_cpu_budget_on_this_host_is_positive() -> None:
    room, source = cpu_room_bytes()
    assert room > 0 and source
    budget = memory_budget(CPU, explicit=None, fraction=0.9, live_tensor_bytes=MIB)
    assert budget.bytes > MIB and budget.source.startswith("CPU: ")


# --- ranks on one host ---------------------------------------------------------------------------


def test_ranks_on_one_host_share_its_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of the host's ranks gets its share of what the host has left, and the source says so; what one rank
    already holds (its live tensors) is its own."""
    root = fake_host(tmp_path, available=8 * GIB)
    assert cpu_room_bytes(root=root, ranks_on_host=2) == (4 * GIB, "MemAvailable 8.0 GiB / 2 ranks on this host")
    budget = memory_budget(CPU, explicit=None, fraction=0.75, live_tensor_bytes=GIB, ranks_on_host=4, root=root)
    assert budget.bytes == GIB + int(2 * GIB * 0.75)
    assert budget.source == (
        "CPU: MemAvailable 8.0 GiB / 4 ranks on this host leaves 2.0 GiB, x memory_fraction "
        "0.75, + 1.0 GiB live tensors"
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's, when not given
    assert memory_budget(CPU, explicit=None, fraction=1.0, root=root).bytes == 4 * GIB


def test_a_cgroup_is_shared_by_the_hosts_ranks_and_the_address_space_limit_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = fake_host(tmp_path, vm_size=GIB, available=64 * GIB, cgroup="0::/job\n", v2={"job": (str(9 * GIB), GIB)})
    assert cpu_room_bytes(root=root, ranks_on_host=2) == (
        4 * GIB,
        "cgroup v2 memory.max of /sys/fs/cgroup/job 8.0 GiB / 2 ranks on this host",
    )
    set_address_space_limit(monkeypatch, 4 * GIB)  # 3 GiB of room, this process's own: not divided
    assert cpu_room_bytes(root=root, ranks_on_host=2) == (3 * GIB, "address-space limit (RLIMIT_AS)")


def test_an_accelerator_budget_is_not_divided_by_the_hosts_ranks(fake_cuda: list[int]) -> None:
    budget = memory_budget(torch.device("cuda", 1), explicit=None, fraction=1.0, ranks_on_host=8)
    assert budget.bytes == 40 * GIB
