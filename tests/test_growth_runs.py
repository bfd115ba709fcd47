"""The pure parts of ``benchmarks/growth_runs.py``: smoothing, steps to a target, the table, the run set-up.

No recipe runs: the benchmark itself takes minutes; these keep its analysis and its configs from rotting.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

from adaptive_batching.batching.lr_scaling import SampleDrivenLR, reference_steps

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "growth_runs.py"
_SPEC = importlib.util.spec_from_file_location("growth_runs", _PATH)
growth_runs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(growth_runs)


def test_smoothing_weights_steps_by_their_samples_over_a_window_of_samples() -> None:
    losses, batches = [4.0, 3.0, 2.0, 1.0], [8, 8, 16, 32]
    smooth = growth_runs.smooth_by_samples(losses, batches, window=16)
    assert smooth[0] is None  # 8 samples so far: no whole window yet
    assert smooth[1] == pytest.approx(3.5)
    assert smooth[2] == pytest.approx(2.0)  # the 16-sample step fills the window alone
    assert smooth[3] == pytest.approx(1.0)
    # the oldest step in the window counts only with its part inside it
    assert growth_runs.smooth_by_samples(losses, batches, window=24)[2] == pytest.approx((3.0 * 8 + 2.0 * 16) / 24)
    assert growth_runs.smooth_by_samples(losses, batches, window=20)[3] == pytest.approx(1.0)
    assert growth_runs.smooth_by_samples(losses, batches, window=40)[3] == pytest.approx((2.0 * 8 + 1.0 * 32) / 40)


def test_smoothing_checks_its_input() -> None:
    with pytest.raises(ValueError, match="window"):
        growth_runs.smooth_by_samples([1.0], [8], window=0)
    with pytest.raises(ValueError, match="losses"):
        growth_runs.smooth_by_samples([1.0, 2.0], [8], window=8)


def test_first_at_or_below_and_value_at_samples() -> None:
    values = [None, 5.0, 4.0, 3.5, 3.0]
    assert growth_runs.first_at_or_below(values, 4.0) == 2
    assert growth_runs.first_at_or_below(values, 3.0) == 4
    assert growth_runs.first_at_or_below(values, 2.9) is None
    samples = growth_runs.cumulative([8, 8, 16, 32, 64])
    assert samples == [8, 16, 32, 64, 128]
    assert growth_runs.value_at_samples(samples, values, 20) == 4.0  # first step reaching 20 samples: 32
    assert growth_runs.value_at_samples(samples, values, 0.8 * 128) == 3.0
    assert growth_runs.value_at_samples(samples, values, 129) is None


def _run(name: str, batches: list[int], losses: list[float], noise: bool = False) -> dict:
    rows = []
    for i, (b, loss) in enumerate(zip(batches, losses)):
        row = {"step": i + 1, "t": 10.0 + i, "loss": loss, "lr": 1e-3, "global_batch_size": float(b)}
        if noise and i >= 1:
            row["gradient_noise_scale"] = 2.0 * i
        rows.append(row)
    return {"name": name, "rows": rows, "train_start": 9.5, "train_end": 10.0 + len(rows)}


def test_summary_and_table() -> None:
    small = _run("fixed small", [8] * 8, [6.0, 5.0, 4.0, 3.0, 2.5, 2.0, 1.9, 1.8])
    grown = _run("grown", [8, 8, 16, 32], [6.0, 4.0, 2.4, 2.2], noise=True)
    window = 16
    smooth = growth_runs.smooth_by_samples([r["loss"] for r in small["rows"]], [8] * 8, window)
    samples = growth_runs.cumulative([8] * 8)
    targets = {
        "fixed small at 80%": growth_runs.value_at_samples(samples, smooth, 0.8 * 64),
        "fixed small at 50%": growth_runs.value_at_samples(samples, smooth, 0.5 * 64),
    }
    assert targets["fixed small at 80%"] == pytest.approx(1.95)  # first step reaching 51.2 samples: 7; (2.0 + 1.9) / 2
    assert targets["fixed small at 50%"] == pytest.approx(3.5)  # step 4: (4.0 + 3.0) / 2
    s = growth_runs.summarise(small, targets, window)
    assert s["steps"] == 8 and s["samples"] == 64 and s["final_loss"] == pytest.approx(1.85)
    assert s["to_target"]["fixed small at 80%"] == {"target": 1.95, "steps": 7, "samples": 56, "seconds": 6.5}
    assert s["noise_scale"]["measured_steps"] == 0 and s["global_batches"] == [8]
    g = growth_runs.summarise(grown, targets, window)
    assert g["to_target"]["fixed small at 80%"] is None  # its smoothed loss ends at 2.2
    assert g["final_loss"] == pytest.approx(2.2)
    assert g["to_target"]["fixed small at 50%"]["steps"] == 3
    assert g["noise_scale"] == {"measured_steps": 3, "first": 2.0, "last": 6.0, "max": 6.0}
    table = growth_runs.markdown_table({"fixed small": s, "grown": g}, targets)
    lines = table.splitlines()
    assert len(lines) == 4 and lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert "| grown | 8 -> 32 | 4 |" in table and "never" in table and "2.0 -> 6.0, max 6.0 (3 steps)" in table


def test_growth_lines_are_split_off_progress_bars() -> None:
    text = (
        "epoch 1/1:  3%|x| 4/40 [00:01, loss 7.1]Growth period 1 (every 4 steps) after optimizer step 4: "
        "micro batch 8 -> 16\rEpoch switch 1 -> 2: micro batch 16 -> 16\nother line\n"
    )
    lines = growth_runs.split_log_lines(text)
    assert "Growth period 1 (every 4 steps) after optimizer step 4: micro batch 8 -> 16" in lines
    assert "Epoch switch 1 -> 2: micro batch 16 -> 16" in lines


def _args(**kw):
    return growth_runs.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


def test_every_run_sees_the_same_samples_and_lr_rule() -> None:
    args = _args(samples=1024, epochs=3, assets="/x")
    runs = growth_runs.run_overrides(args)
    assert list(runs) == ["fixed small", "fixed large", "per-epoch x2", "linear ramp", "noise scale", "seesaw"]
    common = growth_runs.common_overrides(args, Path("/w"))
    assert "dataset.split=train[:1024]" in common and "epochs=3" in common and "lr_scaling=sqrt" in common
    assert "use_maximum_batch_size=False" in common and "max_steps_per_epoch=null" in common
    for name, overrides in runs.items():
        keys = {o.split("=", 1)[0] for o in overrides}
        assert not keys & {"dataset.split", "epochs", "seed", "shuffle", "lr_scaling", "max_steps_per_epoch"}, name
        assert not any(o.startswith("+") for o in overrides), name
    assert "gradient_accumulation_steps=2" in runs["noise scale"]  # the estimator needs >= 2 micro batches
    assert "adaptive_batching.growth_interval=32 steps" in runs["linear ramp"]


def _lr_at_samples(batch: int, lr: float, warmup: int, total_samples: int, steps: int) -> list[float]:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = get_cosine_schedule_with_warmup(
        opt, num_warmup_steps=warmup, num_training_steps=reference_steps(total_samples, batch)
    )
    driven = SampleDrivenLR(opt, [lr], schedule, reference_global_batch=batch, rule="sqrt")
    driven.set_global_batch(64)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        driven.advance(64)
    return out


def test_fixed_large_has_the_lr_the_sqrt_rule_gives_a_batch_of_64() -> None:
    """The fixed-large run's config (reference 64) gives, at every sample, the LR a reference-8 config
    with lr_scaling sqrt gives at global batch 64: the LR configuration is the same in every run."""
    overrides = dict(o.split("=", 1) for o in growth_runs.run_overrides(_args())["fixed large"])
    lr, warmup = float(overrides["optimizer.lr"]), int(overrides["lr_scheduler.num_warmup_steps"])
    assert int(overrides["batch_size"]) == growth_runs.LARGE_BATCH
    assert lr == pytest.approx(growth_runs.BASE_LR * math.sqrt(8))
    total = 3 * 1024
    large = _lr_at_samples(64, lr, warmup, total, total // 64)
    small = _lr_at_samples(8, growth_runs.BASE_LR, growth_runs.WARMUP_SAMPLES // 8, total, total // 64)
    assert large == pytest.approx(small, rel=1e-9, abs=1e-15)
