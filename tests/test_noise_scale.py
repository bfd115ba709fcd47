"""The two-batch noise scale estimator against linear regression, whose noise scale is known exactly.

The regression and its closed-form noise scale are ``benchmarks/noise_scale_accuracy.py``'s (which publishes the
figures); these tests draw real minibatch gradients with torch at a fixed ``w``, feed the estimator as the
trainer would, and bound the error.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from forked_ranks import run_forked_ranks
from noise_scale_accuracy import (  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
    MICRO,
    RANKS,
    SIGMA,
    STEPS,
    D,
    draw,
    per_rank_noise_scale,
    relative_errors,
    run_single_process,
    true_noise_scale,
    unit_delta,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from adaptive_batching.growth.gradient_noise import NoiseScaleEstimator, squared_grad_norm, two_batch_estimates

TOLERANCE = 0.15


# --------------------------------------------------------------------------- #
# Accuracy, one process
# --------------------------------------------------------------------------- #


def test_all_micro_batches_as_small_batches_track_the_true_noise_scale() -> None:
    truth, values = run_single_process(0, steps=400, accumulation=8, micro=32, decay=0.95, first_only=False)
    errors = relative_errors(truth, values[100:])
    print(
        f"1 process, per micro batch: truth {truth:.1f}, final {values[-1]:.1f}, "
        f"error final {errors[-1]:.3f} max over steps 100-400 {max(errors):.3f}"
    )
    assert max(errors) < TOLERANCE


def test_first_micro_batch_only_tracks_it_with_a_longer_average() -> None:
    # One small draw per step (the FSDP2 case, micro = per-rank micro x ranks): noisier per step,
    # so a 0.99 decay; unbiased all the same.
    truth, values = run_single_process(1, steps=1000, accumulation=8, micro=64, decay=0.99, first_only=True)
    errors = relative_errors(truth, values[500:])
    print(
        f"1 process, first micro batch only: truth {truth:.1f}, final {values[-1]:.1f}, "
        f"error final {errors[-1]:.3f} max over steps 500-1000 {max(errors):.3f}"
    )
    assert errors[-1] < TOLERANCE
    assert sum(errors) / len(errors) < TOLERANCE


def test_two_batch_estimates_invert_the_expected_squared_norms() -> None:
    g2, trace, b, B = 2.5, 300.0, 8, 96
    got = two_batch_estimates(g2 + trace / b, b, g2 + trace / B, B)
    assert got == pytest.approx((g2, trace))


# --------------------------------------------------------------------------- #
# The estimator's bookkeeping
# --------------------------------------------------------------------------- #


def feed(estimator: NoiseScaleEstimator, g2: float, trace: float, b: float = 4, B: float = 32):
    """Update with the squared norms whose estimates are exactly ``(g2, trace)``."""
    return estimator.update(g2 + trace / b, b, g2 + trace / B, B)


def test_value_is_the_ratio_of_the_averages_not_the_average_of_the_ratios() -> None:
    decay, pairs = 0.5, [(1.0, 10.0), (9.0, 10.0), (4.0, 40.0)]
    estimator = NoiseScaleEstimator(decay=decay, warmup=1)
    for g2, trace in pairs:
        value = feed(estimator, g2, trace)
    weights = [decay ** (len(pairs) - 1 - i) for i in range(len(pairs))]  # newest weighs 1
    ratio_of_emas = sum(w * t for w, (_, t) in zip(weights, pairs)) / sum(w * g for w, (g, _) in zip(weights, pairs))
    ema_of_ratios = sum(w * t / g for w, (g, t) in zip(weights, pairs)) / sum(weights)
    assert value == pytest.approx(ratio_of_emas)
    assert abs(value - ema_of_ratios) > 0.5
    # each average is bias-corrected on its own: the weighted mean of what was fed
    assert estimator.gradient_sq_norm == pytest.approx(sum(w * g for w, (g, _) in zip(weights, pairs)) / sum(weights))
    assert estimator.trace_sigma == pytest.approx(sum(w * t for w, (_, t) in zip(weights, pairs)) / sum(weights))


def test_no_value_before_warm_up_then_one() -> None:
    estimator = NoiseScaleEstimator(warmup=3)
    assert estimator.value is None and estimator.gradient_sq_norm is None
    assert [feed(estimator, 1.0, 50.0) for _ in range(4)][:2] == [None, None]
    assert estimator.value == pytest.approx(50.0)


def test_no_value_while_the_gradient_norm_average_is_not_positive() -> None:
    estimator = NoiseScaleEstimator(decay=0.9, warmup=1)
    assert feed(estimator, -2.0, 50.0) is None  # noise swamped the signal
    assert feed(estimator, 0.0, 50.0) is None
    assert feed(estimator, 100.0, 50.0) is not None


def test_a_negative_trace_average_reads_as_no_noise() -> None:
    estimator = NoiseScaleEstimator(warmup=1)
    assert feed(estimator, 1.0, -5.0) == 0.0


def test_non_finite_norms_are_skipped_and_counted() -> None:
    estimator = NoiseScaleEstimator(warmup=1)
    feed(estimator, 2.0, 20.0)
    assert estimator.update(math.inf, 4, 1.0, 32) == pytest.approx(10.0)
    assert estimator.update(1.0, 4, math.nan, 32) == pytest.approx(10.0)
    assert (estimator.updates, estimator.skipped) == (1, 2)


@pytest.mark.parametrize("small, big", [(8, 8), (16, 8), (0, 8), (4, math.inf), (True, 8)])
def test_sizes_must_be_positive_and_ordered(small, big) -> None:
    with pytest.raises(ValueError, match="size"):
        NoiseScaleEstimator().update(1.0, small, 1.0, big)


@pytest.mark.parametrize(
    "kwargs, name",
    [({"decay": 1.0}, "decay"), ({"decay": -0.1}, "decay"), ({"warmup": 0}, "warmup"), ({"warmup": 2.0}, "warmup")],
)
def test_bad_settings_are_refused_by_name(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        NoiseScaleEstimator(**kwargs)


def test_state_dict_round_trip_continues_identically() -> None:
    gen = torch.Generator().manual_seed(3)
    stream = [(float(torch.rand((), generator=gen)) * 4, float(torch.rand((), generator=gen)) * 90) for _ in range(30)]
    first, second = NoiseScaleEstimator(decay=0.9, warmup=5), NoiseScaleEstimator(decay=0.9, warmup=5)
    for g2, trace in stream[:12]:
        feed(first, g2 + 1.0, trace)
    state = first.state_dict()
    assert all(type(v) in (int, float) for v in state.values())
    second.load_state_dict(json.loads(json.dumps(state)))  # survives a text checkpoint
    assert second.state_dict() == state and second.value == first.value
    for g2, trace in stream[12:]:
        assert feed(first, g2 + 1.0, trace) == feed(second, g2 + 1.0, trace)


def test_load_state_dict_names_missing_keys() -> None:
    state = NoiseScaleEstimator().state_dict()
    del state["ema_weight"]
    with pytest.raises(ValueError, match="ema_weight"):
        NoiseScaleEstimator().load_state_dict(state)


def test_squared_grad_norm_sums_all_gradients_and_skips_missing_ones() -> None:
    a, c = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))  # a bf16 model's gradient
    a.grad, b.grad = torch.arange(3.0), torch.ones(5, dtype=torch.bfloat16)
    got = squared_grad_norm([a, b, c])
    assert got.dim() == 0 and got.dtype == torch.float32
    assert float(got) == pytest.approx(0 + 1 + 4 + 5)
    assert float(squared_grad_norm([c])) == 0.0


# --------------------------------------------------------------------------- #
# Two ranks (gloo)
# --------------------------------------------------------------------------- #


class _Regression(torch.nn.Module):
    """``x . w + z . v``: ``v`` has an odd size, so FSDP2 shards it unevenly."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.v = torch.nn.Parameter(torch.randn(D)), torch.nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :D] @ self.w + x[:, D:] @ self.v


def _fsdp_checks(rank: int, world: int) -> dict:
    """What FSDP2 leaves after each micro batch, and the squared norm from one batched all-reduce."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # same initial weights on every rank
    model = _Regression()
    fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(3000 + rank)
    out = {}
    for step in range(2):
        tokens = [MICRO - rank - step, MICRO]  # uneven counts, as real token counts are
        batches = [draw(gen, (n,), D + 3, SIGMA) for n in tokens]
        for k, (x, y) in enumerate(batches):
            loss = 0.5 * (model(x) - y).pow(2).sum()  # summed, as the trainer's token loss
            loss.backward()
            if k == 0:
                small = squared_grad_norm(model.parameters())
                first_full = torch.cat([p.grad.full_tensor() for p in model.parameters()])
        # the trainer's normalisation: undo FSDP's 1/world, divide by the step's tokens
        all_tokens = torch.tensor(float(sum(tokens)))
        dist.all_reduce(all_tokens)
        for p in model.parameters():
            p.grad.mul_(world / all_tokens)
        big = squared_grad_norm(model.parameters())
        packed = torch.stack([small, big, torch.tensor(float(tokens[0]))])
        dist.all_reduce(packed)  # ONE all-reduce for the pair and the first micro batch's tokens
        s_small = float(packed[0]) * (world / float(packed[2])) ** 2
        # references from the unsharded weights: every rank's first micro batch, pooled
        full_w = torch.cat([p.full_tensor() for p in model.parameters()]).detach()
        x0, y0 = batches[0]
        local_first = x0.T @ (x0 @ full_w - y0)
        pooled = local_first.clone()
        dist.all_reduce(pooled)
        big_full = torch.cat([p.grad.full_tensor() for p in model.parameters()])
        out[f"step{step}"] = {
            "first_is_rank_average": torch.allclose(first_full, pooled / world, rtol=1e-4, atol=1e-4),
            "s_small": s_small,
            "s_small_ref": float((pooled / float(packed[2])).pow(2).sum()),
            "s_big": float(packed[1]),
            "s_big_ref": float(big_full.pow(2).sum()),
        }
        for p in model.parameters():
            p.grad = None
    full = torch.arange(6.0)
    replicated = torch.nn.Parameter(DTensor.from_local(full, mesh, [Replicate()]))
    replicated.grad = DTensor.from_local(full, mesh, [Replicate()])
    value = squared_grad_norm([replicated])
    dist.all_reduce(value)
    out["replicated"] = [float(value), float(full.pow(2).sum())]
    partial = torch.nn.Parameter(DTensor.from_local(full, mesh, [Replicate()]))
    partial.grad = DTensor.from_local(full, mesh, [Partial()])
    with pytest.raises(ValueError, match="Partial"):
        squared_grad_norm([partial])
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())
    return out


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = {"values": per_rank_noise_scale(rank, world), "fsdp": _fsdp_checks(rank, world)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_ranks_track_the_true_noise_scale_and_fsdp_norms_are_exact(tmp_path: Path) -> None:
    run_forked_ranks(
        _worker, (RANKS, str(tmp_path / "store"), str(tmp_path)), RANKS, seconds=180, what="the 2-rank noise scale run"
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]
    values = results[0]["values"]
    assert values == results[1]["values"]  # every rank holds the same estimate
    truth = true_noise_scale(D, SIGMA, unit_delta(D, seed=7))
    errors = relative_errors(truth, values[100:])
    print(
        f"{RANKS} ranks, per rank per micro batch: truth {truth:.1f}, final {values[-1]:.1f}, "
        f"error final {errors[-1]:.3f} max over steps 100-{STEPS} {max(errors):.3f}"
    )
    assert max(errors) < TOLERANCE
    for result in results:
        fsdp = result["fsdp"]
        for step in ("step0", "step1"):
            assert fsdp[step]["first_is_rank_average"]
            assert fsdp[step]["s_small"] == pytest.approx(fsdp[step]["s_small_ref"], rel=1e-4)
            assert fsdp[step]["s_big"] == pytest.approx(fsdp[step]["s_big_ref"], rel=1e-4)
        assert fsdp["replicated"][0] == pytest.approx(fsdp["replicated"][1])
