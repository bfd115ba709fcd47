#!/usr/bin/env python
"""The gradient noise scale estimator against linear regression, whose noise scale is known exactly."""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
from common import report

from adaptive_batching.growth.gradient_noise import NoiseScaleEstimator, squared_grad_norm

D, SIGMA = 64, 0.5  # B_simple = (d + 1) + d sigma^2 = 81 at |delta| = 1
RANKS, STEPS, ACCUMULATION, MICRO = 2, 400, 8, 32


def true_noise_scale(d: int, sigma: float, delta: torch.Tensor) -> float:
    """``tr(Sigma) / |G|^2`` of the regression at ``w - w* = delta``."""
    sq = float(delta.pow(2).sum())
    return ((d + 1) * sq + d * sigma**2) / sq


def unit_delta(d: int, seed: int) -> torch.Tensor:
    """A random direction of norm 1: ``w - w*``."""
    delta = torch.randn(d, generator=torch.Generator().manual_seed(seed))
    return delta / delta.norm()


def loss(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (x @ w - y).pow(2).mean()


_micro_batch_grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))


def draw(gen: torch.Generator, shape: tuple[int, ...], d: int, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``x`` of ``shape + (d,)`` and targets ``y = eps`` (w* = 0, so w = delta)."""
    return torch.randn(*shape, d, generator=gen), sigma * torch.randn(*shape, generator=gen)


def run_single_process(
    seed: int, *, steps: int, accumulation: int, micro: int, decay: float, first_only: bool
) -> tuple[float, list]:
    """``steps`` steps of ``accumulation`` micro batches: the truth and the estimates. The small batch: the first
    micro batch (``first_only``: what FSDP2 leaves observable) or the mean of all micro batches' norms."""
    delta, gen = unit_delta(D, seed), torch.Generator().manual_seed(1000 + seed)
    estimator, values = NoiseScaleEstimator(decay=decay), []
    for _ in range(steps):
        x, y = draw(gen, (accumulation, micro), D, SIGMA)
        grads = _micro_batch_grads(delta, x, y)  # one mean gradient per micro batch
        sq, big = grads.pow(2).sum(-1), float(grads.mean(0).pow(2).sum())
        small = float(sq[0]) if first_only else float(sq.mean())
        values.append(estimator.update(small, micro, big, micro * accumulation))
    return true_noise_scale(D, SIGMA, delta), values


def relative_errors(truth: float, values: list) -> list[float]:
    return [abs(v / truth - 1) if v is not None else math.inf for v in values]


def per_rank_noise_scale(rank: int, world: int) -> list:
    """Per-rank small batches (each rank's micro batches, one scalar all-reduce), big all-reduced."""
    import torch.distributed as dist

    w, gen = torch.nn.Parameter(unit_delta(D, seed=7)), torch.Generator().manual_seed(2000 + rank)
    estimator, values = NoiseScaleEstimator(decay=0.95), []
    for _ in range(STEPS):
        total, small = torch.zeros(D), torch.zeros(())
        for _ in range(ACCUMULATION):
            x, y = draw(gen, (MICRO,), D, SIGMA)
            loss(w, x, y).backward()
            small += squared_grad_norm([w])
            total += w.grad
            w.grad = None
        dist.all_reduce(small)  # the one scalar all-reduce for the small batches
        dist.all_reduce(total)  # the gradient all-reduce a step does anyway
        big = total / (ACCUMULATION * world)
        values.append(
            estimator.update(
                float(small) / (ACCUMULATION * world), MICRO, float(big.pow(2).sum()), MICRO * ACCUMULATION * world
            )
        )
    return values


def _rank(rank: int, world: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(per_rank_noise_scale(rank, world)))
    finally:
        dist.destroy_process_group()


def two_ranks() -> list:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(RANKS, f"{tmp}/store", tmp), nprocs=RANKS, start_method="fork")
        return json.loads(Path(tmp, "rank0.json").read_text())


def final_error(seed: int, decay: float) -> float:
    """The first-micro-batch estimate's relative error after 1000 steps."""
    truth, values = run_single_process(seed, steps=1000, accumulation=8, micro=64, decay=decay, first_only=True)
    return relative_errors(truth, values)[-1]


def row(setup: str, decay: float, truth: float, values: list, warm_up: int) -> str:
    errors = relative_errors(truth, values[warm_up:])
    return f"| {setup} | {decay:g} | {values[-1]:.1f} ({100 * errors[-1]:.1f}% off) | {100 * max(errors):.1f}% |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=30, help="seeds of the first-micro-batch set-up (default 30)")
    p.add_argument("--publish", action="store_true", help="write the table into docs/benchmarks.md")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    every_truth, every = run_single_process(0, steps=400, accumulation=8, micro=32, decay=0.95, first_only=False)
    first_truth, first = run_single_process(1, steps=1000, accumulation=8, micro=64, decay=0.99, first_only=True)
    ranks = two_ranks()
    ranks_truth = true_noise_scale(D, SIGMA, unit_delta(D, seed=7))
    sweep = {decay: max(final_error(seed, decay) for seed in range(args.seeds)) for decay in (0.99, 0.95)}
    with report("noise-scale" if args.publish else None):
        print(
            f"Noisy linear regression (`d = {D}`, `σ = {SIGMA}`), whose simple noise scale is known "
            f"(`B_simple = ((d+1)|δ|² + dσ²)/|δ|²`, {every_truth:.0f} at these parameters). Largest error: over "
            f"the steps after the estimator's warm-up (the first 100, or 500 for the first micro batch only).\n"
        )
        print("| setup | decay | final estimate | largest error after warm-up |\n|---|---|---|---|")
        print(row("1 process, every micro batch as a small batch (b=32, B=256)", 0.95, every_truth, every, 100))
        print(
            row(
                "1 process, the first micro batch only, as the trainer does (b=64, B=512)",
                0.99,
                first_truth,
                first,
                500,
            )
        )
        print(row(f"{RANKS} gloo ranks, per rank per micro batch (b=32, B=512)", 0.95, ranks_truth, ranks, 100))
        print(
            f"\nOver {args.seeds} seeds the first-micro-batch estimate ended within {100 * sweep[0.99]:.1f}% of the "
            f"truth at decay 0.99 (the trainer's), and within {100 * sweep[0.95]:.1f}% at 0.95."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
