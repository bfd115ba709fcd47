"""Two nodes on one machine: two torchrun agents (``--nnodes 2 --nproc_per_node 1``, c10d rendezvous) profile
and agree on the micro batch, train, stop together when one node's agent gets SIGTERM, and resume."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_runs import FAULTY_RUN, check, losses, run_command, unclean_exit
from test_preemption import logged_steps

# 24 MiB: a micro batch of about 7 per node, so the profile's trials and the steps train half the samples they
# would at 48 MiB.
RUN = (
    "use_maximum_batch_size=True",
    "batch_increase_function=null",
    "adaptive_batching.memory_budget=24MiB",
    "dataset.split=train[:600]",
    "epochs=2",
    "max_steps_per_epoch=6",
    "save_every_n_steps=2",
    "tokenizer.max_seq_len=128",
)
# Both agents at once, each one's output in its own files; prints their exit codes.
AGENTS = """
import json, subprocess, sys
prefix, cmd = sys.argv[1], json.loads(sys.argv[2])
agents = []
for node in range(2):
    with open(f"{prefix}{node}.out", "w") as out, open(f"{prefix}{node}.err", "w") as err:
        agents.append(subprocess.Popen(cmd, stdout=out, stderr=err))
print(json.dumps([agent.wait() for agent in agents]))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_nodes(
    tmp: Path, name: str, fault: dict, assets: Path, *overrides: str, fresh: bool = False
) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents, each a node of one process, meeting at a c10d rendezvous on this machine. ``fresh``:
    agents and workers are new interpreters; otherwise they are forked from the suite's fork server
    (``run_command(fork_python=True)``), real processes with their own signals, rendezvous and exit codes."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv_id",
        name,
        str(FAULTY_RUN),
        json.dumps(fault),
        str(tmp / f"{name}-"),
        "adaptive_full_finetune",
        "--config",
        "tiny_full",
        f"assets_dir={assets}",
        f"output_dir={tmp / name}",
        *RUN,
        f"adaptive_batching.cache_dir={tmp / 'two_nodes_profile'}",
        *overrides,
    ]  # one profile for all runs
    (tmp / "agents.py").write_text(AGENTS)
    prefix = tmp / f"{name}-{'fresh' if fresh else 'forked'}-agent"
    driver = check(
        run_command("script", [str(tmp / "agents.py"), str(prefix), json.dumps(cmd)], cwd=tmp, fork_python=not fresh)
    )
    codes = json.loads(driver.stdout)
    return [
        subprocess.CompletedProcess(
            cmd, code, Path(f"{prefix}{node}.out").read_text(), Path(f"{prefix}{node}.err").read_text()
        )
        for node, code in enumerate(codes)
    ]


@pytest.fixture(scope="module")
def nodes(assets: Path, runs: Path) -> dict[str, list[subprocess.CompletedProcess]]:
    """The stopped run starts real interpreters: the start and the exit, after a signal, of real agents and
    workers (the suite's other runs fork theirs; benchmarks/clean_exits.py's test exits a finished 2-rank run of
    new interpreters). The whole and resumed runs fork theirs."""
    whole = two_nodes(runs, "whole", {}, assets)
    stopped = two_nodes(
        runs, "stopped", {"signal": "SIGTERM", "signal_at": 3, "to": "parent", "rank": 1}, assets, fresh=True
    )
    resumed = two_nodes(runs, "stopped", {}, assets, "resume_from_checkpoint=True")
    return {"whole": whole, "stopped": stopped, "resumed": resumed}


def output(results: list[subprocess.CompletedProcess]) -> str:
    return "".join(r.stdout + r.stderr for r in results)


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_two_nodes_profile_agree_on_the_micro_batch_and_train(nodes: dict) -> None:
    whole = nodes["whole"]
    assert [r.returncode for r in whole] == [0, 0], output(whole)[-4000:]
    assert all(unclean_exit(r) is None for r in whole)
    text = output(whole)
    assert "chosen micro batch" in text  # the profile ran, every trial agreed over both nodes
    finished = re.findall(r"Rank (\d): finished at optimizer step (\d+), micro batch (\d+)", text)
    assert sorted(rank for rank, _, _ in finished) == ["0", "1"]
    assert len({(step, micro) for _, step, micro in finished}) == 1  # both nodes ran the same micro batch


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_sigterm_to_one_nodes_agent_stops_both_nodes_at_one_step_with_a_save(nodes: dict) -> None:
    stopped = nodes["stopped"]
    assert all(r.returncode != 0 for r in stopped)
    assert all(unclean_exit(r) is None for r in stopped), output(stopped)[-4000:]
    steps = re.findall(r"stopped after optimizer step (\d+)", output(stopped))
    assert len(steps) == 2 and len(set(steps)) == 1 and int(steps[0]) >= 3, output(stopped)[-4000:]
    assert f"saved the checkpoint of optimizer step {steps[0]}" in output(stopped)


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_the_rerun_of_both_nodes_resumes_and_trains_every_step_once(nodes: dict, runs: Path) -> None:
    resumed = nodes["resumed"]
    assert [r.returncode for r in resumed] == [0, 0], output(resumed)[-4000:]
    assert "Resuming at" in output(resumed)
    assert logged_steps(runs / "stopped" / "logs") == logged_steps(runs / "whole" / "logs")
    assert losses(runs / "stopped" / "logs") == losses(runs / "whole" / "logs")
