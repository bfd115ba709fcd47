"""End-to-end runs of both recipes on the offline tiny model, launched with ``tune run`` as a user would."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from recipe_runs import FIXED_BATCH_SIZE, check, losses, read_metrics, tune_run
from safetensors.torch import load_file

pytestmark = pytest.mark.e2e

RECIPES = {"full": ("adaptive_full_finetune", "tiny_full"), "lora": ("adaptive_lora_finetune", "tiny_lora")}


def run(method: str, assets: Path, out: Path, *overrides: str, nproc: int | None = None) -> Path:
    recipe, config = RECIPES[method]
    check(tune_run(recipe, config, [f"assets_dir={assets}", f"output_dir={out}", *FIXED_BATCH_SIZE,
                                    *overrides], cwd=out.parent, nproc=nproc))
    return out


# A fixed batch of the first 8 samples, seen at every step.
FIXED_BATCH = ("dataset.split=train[:8]", "batch_size=8", "max_steps_per_epoch=1", "shuffle=False",
               "lr_scheduler=null", "clip_grad_norm=null")


@pytest.mark.parametrize("method,lr,bar", [("full", "3e-3", 0.6), ("lora", "3e-2", 0.7)])
def test_loss_falls_when_overfitting_a_fixed_batch(method: str, lr: str, bar: float, assets: Path,
                                                   tmp_path: Path) -> None:
    """LoRA (rank 8 on a width-64 model) has less capacity, so its bar is lower."""
    out = run(method, assets, tmp_path / "run", *FIXED_BATCH, "epochs=25", f"optimizer.lr={lr}")
    trace = losses(out / "logs")
    assert len(trace) == 25
    assert trace[-1] < bar * trace[0], trace
    assert sum(trace[-5:]) < sum(trace[5:10]) < sum(trace[:5]), trace


def test_lora_trains_only_the_adapter(assets: Path, tmp_path: Path) -> None:
    out = run("lora", assets, tmp_path / "run", *FIXED_BATCH, "epochs=3", "optimizer.lr=1e-2")
    base = load_file(assets / "model" / "model.safetensors")
    merged = load_file(next((out / "epoch_2").glob("model-*.safetensors")))
    adapter = torch.load(out / "epoch_2" / "adapter_model.pt", weights_only=True)
    assert adapter and all("lora" in k for k in adapter)
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_b" in k), "lora_b never trained"
    # Modules without an adapter are unchanged; adapted projections moved.
    for key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                "model.layers.0.self_attn.k_proj.weight", "model.layers.1.input_layernorm.weight"):
        assert torch.equal(base[key], merged[key]), key
    assert not torch.equal(base["model.layers.0.self_attn.q_proj.weight"],
                           merged["model.layers.0.self_attn.q_proj.weight"])


def test_lora_adapter_only_save(assets: Path, tmp_path: Path) -> None:
    out = run("lora", assets, tmp_path / "run", *FIXED_BATCH, "epochs=1", "save_adapter_weights_only=True")
    files = {p.name for p in (out / "epoch_0").iterdir()}
    assert {"adapter_model.pt", "adapter_config.json"} <= files
    assert not any(name.startswith("model-") for name in files)


@pytest.mark.multiprocess
@pytest.mark.parametrize("method", ["full", "lora"])
def test_two_processes_match_one_process_with_accumulation(method: str, assets: Path, tmp_path: Path) -> None:
    """2 ranks x micro batch 4 see the same global batches as 1 rank x micro 4 x accumulation 2."""
    common = ("batch_size=4", "epochs=1", "max_steps_per_epoch=4")
    two = tmp_path / "two"
    result = check(tune_run(RECIPES[method][0], RECIPES[method][1],
                            [f"assets_dir={assets}", f"output_dir={two}", *FIXED_BATCH_SIZE, *common],
                            cwd=tmp_path, nproc=2))
    one = run(method, assets, tmp_path / "one", *common, "gradient_accumulation_steps=2")
    two_rows, one_rows = read_metrics(two / "logs"), read_metrics(one / "logs")
    assert [r["global_batch_size"] for r in two_rows] == [8.0] * 4
    assert [r["global_batch_size"] for r in one_rows] == [8.0] * 4
    assert [r["gradient_accumulation_steps"] for r in one_rows] == [2.0] * 4
    assert [r["loss"] for r in two_rows] == pytest.approx([r["loss"] for r in one_rows], rel=1e-4)
    finals = [line.split("last loss ")[1] for line in (result.stdout + result.stderr).splitlines()
              if "finished at optimizer step" in line]
    assert len(finals) == 2 and finals[0] == finals[1], finals
    assert (two / "epoch_0").is_dir()


# LoRA runs with activation checkpointing: its wrapped layers once made the adapter's checkpoint unloadable.
@pytest.mark.parametrize("method", ["full", "lora"])
def test_resume_after_an_epoch_reproduces_the_uninterrupted_run(method: str, assets: Path, tmp_path: Path) -> None:
    common = ("batch_size=4", "max_steps_per_epoch=5", "lr_scheduler=null",
              *(["enable_activation_checkpointing=True"] if method == "lora" else []))
    whole = run(method, assets, tmp_path / "whole", *common, "epochs=2")
    part = run(method, assets, tmp_path / "part", *common, "epochs=1")
    run(method, assets, part, *common, "epochs=2", "resume_from_checkpoint=True")
    whole_rows, part_rows = read_metrics(whole / "logs"), read_metrics(part / "logs")
    assert [r["step"] for r in part_rows] == list(range(1, 11))
    assert [r["loss"] for r in part_rows] == pytest.approx([r["loss"] for r in whole_rows], rel=1e-6, abs=1e-7)


def test_packed_dataset_with_activation_checkpointing_and_tensorboard(assets: Path, tmp_path: Path) -> None:
    out = run("full", assets, tmp_path / "run", "dataset.packed=True", "tokenizer.max_seq_len=256",
              "batch_size=2", "epochs=1", "max_steps_per_epoch=3", "enable_activation_checkpointing=True",
              "metric_logger._component_=torchtune.training.metric_logging.TensorBoardLogger")
    assert list((out / "logs").rglob("events.out.tfevents.*"))


def test_activation_checkpointing_does_not_change_the_losses(assets: Path, tmp_path: Path) -> None:
    common = ("batch_size=4", "epochs=1", "max_steps_per_epoch=3")
    plain = run("full", assets, tmp_path / "plain", *common)
    ckpt = run("full", assets, tmp_path / "ckpt", *common, "enable_activation_checkpointing=True")
    assert losses(ckpt / "logs") == pytest.approx(losses(plain / "logs"), rel=1e-5)


def test_metrics_are_logged_with_their_names(assets: Path, tmp_path: Path) -> None:
    out = run("full", assets, tmp_path / "run", "batch_size=2", "gradient_accumulation_steps=3",
              "epochs=1", "max_steps_per_epoch=2")
    rows = read_metrics(out / "logs")
    assert len(rows) == 2
    for row in rows:
        assert {"loss", "lr", "micro_batch_size", "gradient_accumulation_steps", "global_batch_size",
                "tokens_per_second_per_gpu"} <= set(row)
        assert (row["micro_batch_size"], row["gradient_accumulation_steps"], row["global_batch_size"]) == (2, 3, 6)
        assert row["tokens_per_second_per_gpu"] > 0


def test_compile_matches_eager(assets: Path, tmp_path: Path) -> None:
    """Packed data keeps shapes fixed, so the compiled layers and loss compile once."""
    common = ("dataset.packed=True", "tokenizer.max_seq_len=128", "batch_size=2", "epochs=1",
              "max_steps_per_epoch=2")
    eager = run("full", assets, tmp_path / "eager", *common)
    compiled = run("full", assets, tmp_path / "compiled", *common, "compile=True")
    assert losses(compiled / "logs") == pytest.approx(losses(eager / "logs"), rel=1e-4)
