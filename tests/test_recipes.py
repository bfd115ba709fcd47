"""End-to-end runs of both recipes on the offline tiny model, launched with ``tune run`` as a user would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from recipe_runs import FIXED_BATCH_SIZE, check, losses, read_metrics, tune_run
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e

RECIPES = {"full": ("adaptive_full_finetune", "tiny_full"), "lora": ("adaptive_lora_finetune", "tiny_lora")}


def run(method: str, assets: Path, out: Path, *overrides: str, nproc: int | None = None) -> Path:
    recipe, config = RECIPES[method]
    check(
        tune_run(
            recipe,
            config,
            [f"assets_dir={assets}", f"output_dir={out}", *FIXED_BATCH_SIZE, *overrides],
            cwd=out.parent,
            nproc=nproc,
        )
    )
    return out


# A fixed batch of the first 8 samples, seen at every step.
FIXED_BATCH = (
    "dataset.split=train[:8]",
    "batch_size=8",
    "max_steps_per_epoch=1",
    "shuffle=False",
    "lr_scheduler=null",
    "clip_grad_norm=null",
)


OVERFIT_LR = {"full": "3e-3", "lora": "3e-2"}


@pytest.fixture(scope="module")
def overfit(assets: Path, runs: Path) -> Callable[[str], Path]:
    """Per method, 25 epochs of one step on the fixed batch; run when a test first asks for it."""
    done: dict[str, Path] = {}

    def of(method: str) -> Path:
        if method not in done:
            done[method] = run(
                method,
                assets,
                runs / f"overfit-{method}",
                *FIXED_BATCH,
                "epochs=25",
                f"optimizer.lr={OVERFIT_LR[method]}",
            )
        return done[method]

    return of


@pytest.mark.parametrize("method,bar", [("full", 0.6), ("lora", 0.7)])
def test_loss_falls_when_overfitting_a_fixed_batch(method: str, bar: float, overfit: Callable[[str], Path]) -> None:
    """LoRA (rank 8 on a width-64 model) has less capacity, so its bar is lower."""
    trace = losses(overfit(method) / "logs")
    assert len(trace) == 25
    assert trace[-1] < bar * trace[0], trace
    assert sum(trace[-5:]) < sum(trace[5:10]) < sum(trace[:5]), trace


def test_lora_trains_only_the_adapter(assets: Path, overfit: Callable[[str], Path]) -> None:
    """Read from the LoRA overfitting run's last checkpoint."""
    out = overfit("lora")
    base = load_file(assets / "model" / "model.safetensors")
    merged = load_file(next((out / "epoch_24").glob("model-*.safetensors")))
    adapter = torch.load(out / "epoch_24" / "adapter_model.pt", weights_only=True)
    assert adapter and all("lora" in k for k in adapter)
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_b" in k), "lora_b never trained"
    # Modules without an adapter are unchanged; adapted projections moved.
    for key in (
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.input_layernorm.weight",
    ):
        assert torch.equal(base[key], merged[key]), key
    assert not torch.equal(
        base["model.layers.0.self_attn.q_proj.weight"], merged["model.layers.0.self_attn.q_proj.weight"]
    )


def test_lora_adapter_only_save(assets: Path, tmp_path: Path) -> None:
    out = run("lora", assets, tmp_path / "run", *FIXED_BATCH, "epochs=1", "save_adapter_weights_only=True")
    files = {p.name for p in (out / "epoch_0").iterdir()}
    assert {"adapter_model.pt", "adapter_config.json"} <= files
    assert not any(name.startswith("model-") for name in files)


ACCUMULATING = ("batch_size=4", "epochs=1", "max_steps_per_epoch=4")


@pytest.fixture(scope="module")
def one_rank_accumulating(assets: Path, runs: Path) -> Callable[[str], Path]:
    """Per method, 1 rank x micro batch 4 x accumulation 2, 4 steps; run when a test first asks for it."""
    done: dict[str, Path] = {}

    def of(method: str) -> Path:
        if method not in done:
            done[method] = run(method, assets, runs / f"one-{method}", *ACCUMULATING, "gradient_accumulation_steps=2")
        return done[method]

    return of


@pytest.mark.multiprocess
@pytest.mark.parametrize("method", ["full", "lora"])
def test_two_processes_match_one_process_with_accumulation(
    method: str, assets: Path, tmp_path: Path, one_rank_accumulating: Callable[[str], Path]
) -> None:
    """2 ranks x micro batch 4 see the same global batches as 1 rank x micro 4 x accumulation 2."""
    two = tmp_path / "two"
    result = check(
        tune_run(
            RECIPES[method][0],
            RECIPES[method][1],
            [f"assets_dir={assets}", f"output_dir={two}", *FIXED_BATCH_SIZE, *ACCUMULATING],
            cwd=tmp_path,
            nproc=2,
        )
    )
    one = one_rank_accumulating(method)
    two_rows, one_rows = read_metrics(two / "logs"), read_metrics(one / "logs")
    assert [r["global_batch_size"] for r in two_rows] == [8.0] * 4
    assert [r["global_batch_size"] for r in one_rows] == [8.0] * 4
    assert [r["gradient_accumulation_steps"] for r in one_rows] == [2.0] * 4
    assert [r["loss"] for r in two_rows] == pytest.approx([r["loss"] for r in one_rows], rel=1e-4)
    finals = [
        line.split("last loss ")[1]
        for line in (result.stdout + result.stderr).splitlines()
        if "finished at optimizer step" in line
    ]
    assert len(finals) == 2 and finals[0] == finals[1], finals
    assert (two / "epoch_0").is_dir()


# LoRA runs with activation checkpointing: its wrapped layers once made the adapter's checkpoint unloadable.
@pytest.mark.parametrize("method", ["full", "lora"])
def test_resume_after_an_epoch_reproduces_the_uninterrupted_run(method: str, assets: Path, tmp_path: Path) -> None:
    common = (
        "batch_size=4",
        "max_steps_per_epoch=5",
        "lr_scheduler=null",
        *(["enable_activation_checkpointing=True"] if method == "lora" else []),
    )
    whole = run(method, assets, tmp_path / "whole", *common, "epochs=2")
    part = run(method, assets, tmp_path / "part", *common, "epochs=1")
    run(method, assets, part, *common, "epochs=2", "resume_from_checkpoint=True")
    whole_rows, part_rows = read_metrics(whole / "logs"), read_metrics(part / "logs")
    assert [r["step"] for r in part_rows] == list(range(1, 11))
    assert [r["loss"] for r in part_rows] == pytest.approx([r["loss"] for r in whole_rows], rel=1e-6, abs=1e-7)


def test_packed_dataset_with_activation_checkpointing_and_tensorboard(assets: Path, tmp_path: Path) -> None:
    out = run(
        "full",
        assets,
        tmp_path / "run",
        "dataset.packed=True",
        "tokenizer.max_seq_len=256",
        "batch_size=2",
        "epochs=1",
        "max_steps_per_epoch=3",
        "enable_activation_checkpointing=True",
        "metric_logger._component_=torchtune.training.metric_logging.TensorBoardLogger",
    )
    assert list((out / "logs").rglob("events.out.tfevents.*"))


# Packed data keeps shapes fixed, so the compiled layers and loss compile once.
PACKED = ("dataset.packed=True", "tokenizer.max_seq_len=128", "batch_size=2", "epochs=1", "max_steps_per_epoch=2")


@pytest.fixture(scope="module")
def packed_eager(assets: Path, runs: Path) -> Path:
    """The eager run on packed data that the activation-checkpointed and the compiled runs are compared with."""
    return run("full", assets, runs / "packed-eager", *PACKED)


def test_activation_checkpointing_does_not_change_the_losses(assets: Path, tmp_path: Path, packed_eager: Path) -> None:
    ckpt = run("full", assets, tmp_path / "ckpt", *PACKED, "enable_activation_checkpointing=True")
    assert losses(ckpt / "logs") == pytest.approx(losses(packed_eager / "logs"), rel=1e-5)


def test_metrics_are_logged_with_their_names(one_rank_accumulating: Callable[[str], Path]) -> None:
    """Read from the 1-rank run with accumulation: micro batch 4 x accumulation 2, 4 steps."""
    rows = read_metrics(one_rank_accumulating("full") / "logs")
    assert len(rows) == 4
    for row in rows:
        assert {
            "loss",
            "lr",
            "micro_batch_size",
            "gradient_accumulation_steps",
            "global_batch_size",
            "tokens_per_second_per_gpu",
        } <= set(row)
        assert (row["micro_batch_size"], row["gradient_accumulation_steps"], row["global_batch_size"]) == (4, 2, 8)
        assert row["tokens_per_second_per_gpu"] > 0


def test_compile_matches_eager(assets: Path, tmp_path: Path, packed_eager: Path) -> None:
    """torchtune's default backend (inductor); test_compile.py's run checks the recompiles, with aot_eager."""
    compiled = run("full", assets, tmp_path / "compiled", *PACKED, "compile=True")
    assert losses(compiled / "logs") == pytest.approx(losses(packed_eager / "logs"), rel=1e-4)
