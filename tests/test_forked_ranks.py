"""The suite's forked processes run autograd whatever the process they come from ran: the forked ranks
(``forked_ranks.run_forked_ranks``) and a run's forked ``python`` children (``forkserver.fork_python_children``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from recipe_runs import check, run_command

HERE = Path(__file__).resolve().parent

# A process whose autograd engine has started a thread (here: the one that takes over a re-entrant backward past its
# depth limit, as PyPI's CUDA build starts device threads), then forked ranks that run a backward each.
AFTER_A_DEEP_BACKWARD = """
import json, os, sys
os.environ["ADAPTIVE_TESTS_FORKSERVER"] = "0"  # the ranks' parent a new interpreter, not a second fork server
sys.path.insert(0, {tests!r})
import test_forked_ranks
from forked_ranks import run_forked_ranks

test_forked_ranks.deep_reentrant_backward()
run_forked_ranks(test_forked_ranks.rank, ({out!r},), 2, seconds=120, what="2 ranks after a deep backward")
print(json.dumps({{"pid": os.getpid()}}))
"""

# A run with forked python children (fork_python) that starts a python child before and after a deep backward: the
# first is forked (torch is imported in it at once), the second a new interpreter.
PYTHON_CHILDREN_AROUND_A_DEEP_BACKWARD = """
import json, subprocess, sys
sys.path.insert(0, {tests!r})
import test_forked_ranks

def child():
    return subprocess.run([sys.executable, {probe!r}], capture_output=True, text=True, check=True).stdout.strip()

before = child()
test_forked_ranks.deep_reentrant_backward()
print(json.dumps([before, child()]))
"""


class _Deep(torch.autograd.Function):
    """A backward that runs another backward, ``depth`` deep."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, depth: int) -> torch.Tensor:
        ctx.depth = depth
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.depth > 0:
            with torch.enable_grad():
                _Deep.apply(torch.ones(1, requires_grad=True), ctx.depth - 1).sum().backward()
        return grad, None


def deep_reentrant_backward(depth: int = 70) -> None:
    """Past autograd's re-entrant depth limit (60) the engine hands the backward to a thread of its own: from then on a
    forked child cannot run autograd."""
    _Deep.apply(torch.ones(1, requires_grad=True), depth).sum().backward()


def rank(rank: int, out: str) -> None:
    x = torch.ones(2, requires_grad=True)
    (x * 3).sum().backward()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"parent": os.getppid(), "grad": x.grad.tolist()}))


def test_ranks_run_autograd_after_their_caller_ran_a_deep_backward(tmp_path: Path) -> None:
    (tmp_path / "caller.py").write_text(AFTER_A_DEEP_BACKWARD.format(tests=str(HERE), out=str(tmp_path)))
    caller = json.loads(check(run_command("script", [str(tmp_path / "caller.py")], cwd=tmp_path)).stdout)
    for number in range(2):
        result = json.loads((tmp_path / f"rank{number}.json").read_text())
        assert result["grad"] == [3.0, 3.0]
        assert result["parent"] not in (caller["pid"], os.getpid())  # forked from a process that ran no autograd


def test_a_run_forks_its_python_children_only_while_they_can_run_autograd(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text("import sys\nprint('torch' in sys.modules)\n")
    (tmp_path / "run.py").write_text(
        PYTHON_CHILDREN_AROUND_A_DEEP_BACKWARD.format(tests=str(HERE), probe=str(tmp_path / "probe.py"))
    )
    result = check(run_command("script", [str(tmp_path / "run.py")], cwd=tmp_path, fork_python=True))
    assert json.loads(result.stdout) == ["True", "False"]  # forked, then a new interpreter
