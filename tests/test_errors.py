"""Every error that is the user's (a config, a file, a budget nothing fits in) is one line naming what to
change, from the recipes and from the ``adaptive-batching`` commands: never a traceback."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from recipe_runs import run_command, tune_run

pytestmark = pytest.mark.e2e


def last_line(result: object) -> str:
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "tokenizer.path=/nonexistent/tokenizer.model",
            "config error: config key 'tokenizer.path' = '/nonexistent/tokenizer.model': no such file",
        ),
        (
            "model._component_=torchtune.models.llama3.no_such_builder",
            "config error: config key 'model._component_' = 'torchtune.models.llama3.no_such_builder' does not import: "
            "torchtune.models.llama3 has no 'no_such_builder'",
        ),
        pytest.param(
            "metric_logger._component_=torchtune.training.metric_logging.WandBLogger",
            "config error: config key 'metric_logger._component_' = "
            "'torchtune.training.metric_logging.WandBLogger' needs wandb, which is not installed: pip install wandb",
            marks=pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed"),
        ),
        (
            "save_every_n_step=5",
            "config error: config key 'save_every_n_step' is not read by the recipes; did you mean "
            "'save_every_n_steps'?",
        ),
        (
            "quantizer._component_=torchtune.training.quantization.Int8DynActInt4WeightQuantizer",
            "config error: config key 'quantizer' = 'torchtune.training.quantization.Int8DynActInt4WeightQuantizer' "
            "asks for quantizing a trained model (post-training quantization), which adaptive_full_finetune does not "
            "do yet; use torchtune's quantize",
        ),
        (
            "model.no_such_argument=1",
            "config error: config key 'model': TypeError: llama3() got an unexpected keyword argument "
            "'no_such_argument'",
        ),
        ("adaptive_batching.memory_budget=1MiB", "profile error: micro batch 1 does not fit the memory budget"),
    ],
)
def test_a_recipe_reports_a_config_or_profile_error_in_one_line(
    override: str, expected: str, assets: Path, tmp_path: Path
) -> None:
    result = tune_run(
        "adaptive_full_finetune",
        "tiny_full",
        [f"assets_dir={assets}", f"output_dir={tmp_path}", override],
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert last_line(result).startswith(expected)


@pytest.mark.parametrize(
    "recipe, name, override, expected",
    [
        (
            "adaptive_knowledge_distillation",
            "tiny_kd",
            "teacher_checkpointer.checkpoint_files=[nothere.safetensors]",
            "config error: config key 'teacher_checkpointer.checkpoint_files' names 'nothere.safetensors', which is "
            "not in {assets}/model; it holds config.json, model.safetensors",
        ),
        (
            "adaptive_lora_dpo",
            "tiny_lora_dpo",
            "dataset.data_files={assets}/data/alpaca_tiny.json",
            "config error: config key 'dataset': the first sample of {assets}/data/alpaca_tiny.json has no column "
            "'chosen': torchtune.datasets.preference_dataset reads the columns 'chosen', 'rejected' and the data has "
            "'input', 'instruction', 'output'; give data with those columns, or map them with dataset.column_map",
        ),
    ],
)
def test_an_objectives_bad_input_is_one_line_before_any_model(
    recipe: str, name: str, override: str, expected: str, assets: Path, tmp_path: Path
) -> None:
    """Issue 53.1: before, torchtune's ValueError: No file with name (after the student was built), and
    KeyError: 'chosen' at DPO's first step; each case of every objective is tests/test_objective_inputs.py's."""
    result = tune_run(
        recipe, name, [f"assets_dir={assets}", f"output_dir={tmp_path}", override.format(assets=assets)], cwd=tmp_path
    )
    assert result.returncode == 1
    assert last_line(result) == expected.format(assets=assets)
    output = result.stdout + result.stderr
    assert "Teacher model" not in output and "Worst-case sample" not in output  # stopped before set-up built any


def test_an_unknown_config_name_is_one_line_with_close_names(tmp_path: Path) -> None:
    result = tune_run("adaptive_full_finetune", "tiny_fulll", [], cwd=tmp_path)
    assert result.returncode == 1
    line = last_line(result)
    assert line.startswith("error: --config 'tiny_fulll'") and "did you mean tiny_full" in line


def test_the_profile_command_reports_a_profile_error_in_one_line(assets: Path, tmp_path: Path) -> None:
    result = run_command(
        "cli",
        [
            "profile",
            "--config",
            "tiny_full",
            f"assets_dir={assets}",
            f"output_dir={tmp_path}",
            "adaptive_batching.memory_budget=1MiB",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert last_line(result).startswith("profile error: micro batch 1 does not fit the memory budget of 0.00 GiB")


def test_the_profile_command_takes_a_stock_name(tmp_path: Path) -> None:
    """torchtune's ``llama3_2/1B_lora_single_device`` resolves; on this machine it stops at what is not here (a
    GPU, then the tokenizer file), before any model is built, in one line that names the key."""
    stock = ["profile", "--config", "llama3_2/1B_lora_single_device", f"output_dir={tmp_path}"]
    result = run_command("cli", stock, cwd=tmp_path)
    assert result.returncode == 2
    assert (
        last_line(result)
        == "config error: config key 'device' = 'cuda' is not available on this machine; available: cpu"
    )
    result = run_command("cli", [*stock, "device=cpu", "dtype=fp32"], cwd=tmp_path)
    assert result.returncode == 2
    assert last_line(result) == (
        "config error: config key 'tokenizer.path' = "
        "'/tmp/Llama-3.2-1B-Instruct/original/tokenizer.model': no such file"
    )
