"""Per-epoch batch growth inside the recipes: the plan, the sampler swap, LR scaling and exact mid-epoch resume."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from config_edits import CONFIGS, modified
from omegaconf import OmegaConf
from recipe_runs import check, read_metrics, run_command, tune_run
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
RECIPES = {"full": ("adaptive_full_finetune", "tiny_full"), "lora": ("adaptive_lora_finetune", "tiny_lora")}
BATCH_KEYS = ("micro_batch_size", "gradient_accumulation_steps", "global_batch_size")


@pytest.fixture(scope="module")
def profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One profile per set-up for the whole module: runs after the first read it from the cache."""
    return tmp_path_factory.mktemp("profile_cache")


def config_file(tmp_path: Path, method: str, updates: dict[str, Any]) -> Path:
    path = tmp_path / f"{method}_{len(list(tmp_path.glob('*.yaml')))}.yaml"
    OmegaConf.save(modified(OmegaConf.load(CONFIGS / f"{RECIPES[method][1]}.yaml"), updates), path)
    return path


# The runs that share the module's profile: a budget that holds the largest micro batch they train (16) with room,
# where the config's 512MiB has the profile's trials reach about 90 samples.
SHARED_BUDGET = {"adaptive_batching.memory_budget": "160MiB"}


def growth(component: str, **kwargs: Any) -> dict[str, Any]:
    return {"batch_increase_function": {"_component_": f"adaptive_batching.growth.{component}", **kwargs}}


def run(
    method: str, config: Path, assets: Path, out: Path, cache: Path, *overrides: str, nproc: int | None = None
) -> str:
    result = check(
        tune_run(
            RECIPES[method][0],
            str(config),
            [f"assets_dir={assets}", f"output_dir={out}", f"adaptive_batching.cache_dir={cache}", *overrides],
            cwd=out.parent,
            nproc=nproc,
        )
    )
    return result.stdout + result.stderr


def test_growth_plan_switch_lines_and_scaled_lr(assets: Path, profile_cache: Path, tmp_path: Path) -> None:
    """Batch 4 growing by 4 each epoch, linear LR rule, cosine schedule over consumed samples."""
    config = config_file(
        tmp_path,
        "full",
        {
            **growth("linear_ramp", increment=4),
            "use_maximum_batch_size": False,
            "batch_size": 4,
            "epochs": 3,
            "max_steps_per_epoch": 4,
            "lr_scaling": "linear",
            "lr_scheduler.num_warmup_steps": 3,
            **SHARED_BUDGET,
        },
    )
    output = run("full", config, assets, tmp_path / "run", profile_cache)
    rows = read_metrics(tmp_path / "run" / "logs")
    assert [r["micro_batch_size"] for r in rows] == [4] * 4 + [8] * 4 + [12] * 4
    assert [r["global_batch_size"] for r in rows] == [4] * 4 + [8] * 4 + [12] * 4
    # The schedule runs over 4*4 + 4*8 + 4*12 = 96 samples = 24 reference steps of 4.
    shape = get_cosine_schedule_with_warmup(_one_param_optimizer(), 3, 24).lr_lambdas[0]
    consumed = 0
    for row in rows:
        batch = int(row["global_batch_size"])
        consumed += batch
        # Logged after the step, as torchtune does: the LR the next step will use.
        assert row["lr"] == pytest.approx(1e-3 * shape(consumed / 4) * batch / 4, rel=1e-9, abs=1e-15)
    assert "Batch plan" in output and "LR schedule over 24 reference steps" in output
    assert "Epoch switch 1 -> 2: micro batch 4 -> 8, accumulation 1 -> 1, global batch 4 -> 8" in output
    assert "Epoch switch 2 -> 3: micro batch 8 -> 12" in output
    assert "function returned +4" in output and "ms)" in output


def _one_param_optimizer() -> Any:
    import torch

    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


@pytest.mark.parametrize("rule", ["skip", "accumulate"])
def test_memory_cap_with_and_without_accumulate(rule: str, assets: Path, profile_cache: Path, tmp_path: Path) -> None:
    """A 40 MiB budget caps the micro batch near 6; growth of +8 per epoch passes it at once."""
    config = config_file(
        tmp_path,
        "full",
        {
            **growth("linear_ramp", increment=8),
            "use_maximum_batch_size": False,
            "batch_size": 4,
            "epochs": 3,
            "max_steps_per_epoch": 2,
            "adaptive_batching.memory_budget": "40MiB",
            "adaptive_batching.grow_past_memory": rule,
            "adaptive_batching.round_to": "none",
        },
    )
    output = run("full", config, assets, tmp_path / "run", profile_cache)
    import json

    cap = json.loads((tmp_path / "run" / "profile" / "profile.json").read_text())["micro_batch"]
    assert 4 <= cap < 12, cap
    rows = read_metrics(tmp_path / "run" / "logs")
    shapes = [tuple(int(r[k]) for k in BATCH_KEYS) for r in rows]
    if rule == "skip":
        assert shapes == [(4, 1, 4)] * 6
        assert "capped at micro batch" in output and "not applied" in output
    else:
        # Requested 12 then 20: micro batch held at the cap, accumulation round(requested / cap).
        k2, k3 = (max(1, math.floor(r / cap + 0.5)) for r in (12, 20))
        assert shapes == [(4, 1, 4)] * 2 + [(cap, k2, cap * k2)] * 2 + [(cap, k3, cap * k3)] * 2
        assert max(s[0] for s in shapes) <= cap


# LoRA's exact mid-epoch resume is covered by test_crash_safety; growth across the resume is method-independent.
@pytest.mark.parametrize("method", ["full"])
def test_mid_epoch_resume_reproduces_the_uninterrupted_run(
    method: str, assets: Path, profile_cache: Path, tmp_path: Path
) -> None:
    """Killed after optimizer step 7 (inside epoch 2), resumed from the step-6 checkpoint: every
    step's loss, LR and batch shape equal the uninterrupted run's, bit for bit."""
    config = config_file(
        tmp_path,
        method,
        {
            **growth("step_increase", at_epochs=[1, 2], increment=[2, 3]),
            "use_maximum_batch_size": False,
            "batch_size": 3,
            "gradient_accumulation_steps": 2,
            "epochs": 3,
            "max_steps_per_epoch": 4,
            "save_every_n_steps": 3,
            "lr_scaling": "sqrt",
            "lr_scheduler.num_warmup_steps": 2,
            **SHARED_BUDGET,
        },
    )
    whole = tmp_path / "whole"
    run(method, config, assets, whole, profile_cache)
    part = tmp_path / "part"
    crashed = run_command(
        "script",
        [
            str(HERE / "crashing_run.py"),
            "7",
            RECIPES[method][0],
            "--config",
            str(config),
            f"assets_dir={assets}",
            f"output_dir={part}",
            f"adaptive_batching.cache_dir={profile_cache}",
        ],
        cwd=tmp_path,
    )
    assert crashed.returncode == 17, crashed.stderr[-3000:]
    assert len(read_metrics(part / "logs")) == 7
    output = run(method, config, assets, part, profile_cache, "resume_from_checkpoint=True")
    assert "Resuming at step 2 of epoch 2 (optimizer step 6)" in output
    assert "using the profile saved in the checkpoint" in output
    whole_rows, part_rows = read_metrics(whole / "logs"), read_metrics(part / "logs")
    assert [r["step"] for r in part_rows] == list(range(1, 13))
    for key in ("loss", "lr", *BATCH_KEYS):
        assert [r[key] for r in part_rows] == [r[key] for r in whole_rows], key
    assert [r["micro_batch_size"] for r in whole_rows] == [3] * 4 + [5] * 4 + [8] * 4


@pytest.mark.multiprocess
def test_two_ranks_cover_an_uneven_epoch_like_one_rank(assets: Path, tmp_path: Path) -> None:
    """9 samples, global batch 8: the last step has 1 sample, so one of the 2 ranks gets an empty
    micro batch. The losses match 1 rank with accumulation 2 on the same 9 samples."""
    common = (
        "use_maximum_batch_size=False",
        "batch_increase_function=null",
        "dataset.split=train[:9]",
        "batch_size=4",
        "epochs=2",
        "max_steps_per_epoch=null",
        "lr_scheduler=null",
    )
    two, one = tmp_path / "two", tmp_path / "one"
    check(
        tune_run(
            "adaptive_full_finetune",
            "tiny_full",
            [f"assets_dir={assets}", f"output_dir={two}", *common],
            cwd=tmp_path,
            nproc=2,
        )
    )
    check(
        tune_run(
            "adaptive_full_finetune",
            "tiny_full",
            [f"assets_dir={assets}", f"output_dir={one}", *common, "gradient_accumulation_steps=2"],
            cwd=tmp_path,
        )
    )
    two_rows, one_rows = read_metrics(two / "logs"), read_metrics(one / "logs")
    assert len(two_rows) == len(one_rows) == 4  # 2 steps per epoch: 8 samples, then 1
    assert all(math.isfinite(r["loss"]) for r in two_rows)
    assert [r["loss"] for r in two_rows] == pytest.approx([r["loss"] for r in one_rows], rel=1e-4)


def test_keep_global_batch_trains_like_the_configs_batch(assets: Path, profile_cache: Path, tmp_path: Path) -> None:
    """The profiled micro batch with the accumulation that keeps batch_size x accumulation: same steps, same LR,
    same losses as the config's 4 x 4 (only the summation order differs)."""
    common = {
        "batch_size": 4,
        "gradient_accumulation_steps": 4,
        "epochs": 1,
        "max_steps_per_epoch": 3,
        "batch_increase_function": None,
        **SHARED_BUDGET,
    }
    kept = tmp_path / "kept"
    output = run(
        "full",
        config_file(tmp_path, "full", {**common, "adaptive_batching.keep_global_batch": True}),
        assets,
        kept,
        profile_cache,
    )
    plain = tmp_path / "plain"
    run(
        "full", config_file(tmp_path, "full", {**common, "use_maximum_batch_size": False}), assets, plain, profile_cache
    )
    assert "Keeping the config's global batch 16: micro batch 16 x accumulation 1 x 1 rank(s)" in output
    kept_rows, plain_rows = read_metrics(kept / "logs"), read_metrics(plain / "logs")
    assert [r["micro_batch_size"] for r in kept_rows] == [16] * 3
    assert [r["micro_batch_size"] for r in plain_rows] == [4] * 3
    assert [r["global_batch_size"] for r in kept_rows] == [r["global_batch_size"] for r in plain_rows] == [16] * 3
    assert [r["lr"] for r in kept_rows] == [r["lr"] for r in plain_rows]
    assert [r["loss"] for r in kept_rows] == pytest.approx([r["loss"] for r in plain_rows], rel=1e-5)
