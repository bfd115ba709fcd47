"""The torchrun agent's death (faults/preemption.py): a worker takes it as one stop signal however often it comes,
where a scheduler's stop signal that comes twice ends the process at once (test_preemption.py). Raised by the
worker itself, so the test does not depend on how often this machine's kernel repeats the parent-death signal; the
worker is forked from the warm fork server (recipe_runs.run_command), since a fresh interpreter's start is not the
point here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from recipe_runs import run_command

from adaptive_batching.faults.preemption import PARENT_DEATH

WORKER = """
import signal
from adaptive_batching.faults.preemption import PARENT_DEATH, Preemption
from adaptive_batching.runtime.distributed import ParallelInfo
stop = Preemption(["SIGTERM", "SIGUSR1"], ParallelInfo(), None)
stop.install()
for _ in range(17):  # once per thread of a dying agent
    signal.raise_signal(stop.launcher_death)
print(stop.launcher_death == PARENT_DEATH, stop.end_step(4), stop.signal_name, flush=True)
"""


@pytest.mark.skipif(PARENT_DEATH is None, reason="the kernel's parent-death signal is Linux's")
def test_the_agents_death_signalled_17_times_stops_the_worker_once(tmp_path: Path) -> None:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1")  # as torchrun starts a worker
    (tmp_path / "worker.py").write_text(WORKER)
    result = run_command("script", [str(tmp_path / "worker.py")], cwd=tmp_path, env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "True True the torchrun agent's death seen by the end of optimizer step 4"
