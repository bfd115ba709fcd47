#!/usr/bin/env python
"""What OOM recovery's look at the optimizer's step counters costs before each optimizer step.

``faults.guard.optimizer_step_counts`` on a stepped AdamW beside reading each counter by value (as before) and
``float(step)`` alone: best of ``--repeats`` timings of ``--number`` calls, microseconds per call.
"""

from __future__ import annotations

import argparse
import timeit
from typing import Optional

import torch

from adaptive_batching.faults.guard import optimizer_step_counts


def read_values(optimizer: torch.optim.Optimizer) -> tuple[float, ...]:
    return tuple(float(state["step"]) for state in optimizer.state.values() if "step" in state)


def before_versions(optimizer: torch.optim.Optimizer) -> tuple[tuple[float, ...], Optional[torch.Tensor]]:
    """``optimizer_step_counts`` as it was at 966a1c4."""
    steps = [state["step"] for state in optimizer.state.values() if "step" in state]
    on_device = [s for s in steps if isinstance(s, torch.Tensor) and s.device.type != "cpu"]
    return (tuple(float(s) for s in steps if not (isinstance(s, torch.Tensor) and s.device.type != "cpu")),
            torch.stack([s.reshape(()) for s in on_device]) if on_device else None)


def stepped_adamw(tensors: int) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(tensors)]
    optimizer = torch.optim.AdamW(params)
    for param in params:
        param.grad = torch.ones(4)
    optimizer.step()
    return optimizer


def best_us(call, number: int, repeats: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=repeats)) / number * 1e6


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", default="22,300", help="parameter tensor counts, comma-separated (default 22,300)")
    p.add_argument("--repeats", type=int, default=5, help="timings per figure; the best is shown (default 5)")
    p.add_argument("--number", type=int, default=200, help="calls per timing (default 200)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print("| parameter tensors | now: versions (us per call) | before (us per call) | before / now "
          "| values alone (us per call) |")
    print("|---:|---:|---:|---:|---:|")
    for tensors in (int(t) for t in args.tensors.split(",")):
        optimizer = stepped_adamw(tensors)
        versions = best_us(lambda: optimizer_step_counts(optimizer), args.number, args.repeats)
        before = best_us(lambda: before_versions(optimizer), args.number, args.repeats)
        values = best_us(lambda: read_values(optimizer), args.number, args.repeats)
        print(f"| {tensors} | {versions:.1f} | {before:.1f} | {before / versions:.1f}x | {values:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
