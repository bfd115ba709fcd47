"""The forked ranks of the suite (``forked_ranks.run_forked_ranks``) run autograd whatever the calling process ran."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from forked_ranks import run_forked_ranks
from recipe_runs import check, run_command

HERE = Path(__file__).resolve().parent

# A process whose autograd engine has started a thread (here: the one that takes over a re-entrant backward past its
# depth limit, as PyPI's CUDA build starts device threads), then forked ranks that run a backward each.
AFTER_A_DEEP_BACKWARD = """
import json, os, sys
sys.path.insert(0, {tests!r})
import test_forked_ranks
from forked_ranks import run_forked_ranks

test_forked_ranks.deep_reentrant_backward()
run_forked_ranks(test_forked_ranks.rank, ({out!r},), 2, seconds=120, what="2 ranks after a deep backward")
print(json.dumps({{"pid": os.getpid()}}))
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
