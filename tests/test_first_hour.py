"""What a new user runs first, as the README and docs show it, at its smallest size: ``adaptive-batching
estimate`` (on a bf16 config), ``profile``, the demo (``tune run adaptive_full_finetune --config tiny_full``) and
the LoRA and QLoRA starts, and those of DPO (LoRA and full), KD and QAT, print no warning (QAT LoRA at 2 ranks too); and
the demo's metrics follow the condition docs/growth.md states for
``gradient_noise_scale``.

The profile and the demo share one output folder and budget: the demo reads the profile the command cached.
``adaptive-batching plan`` is checked by test_cli's plan test, on its own run.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from recipe_runs import check, read_metrics, run_command, tune_run

from adaptive_batching.assets.models import write_model_assets

pytestmark = pytest.mark.e2e

SMALL = ("adaptive_batching.memory_budget=96MiB",)  # the demo's 512 MiB makes every step 5x dearer
# One step; the profile's search stops at the 16 samples of 64 tokens.
ONE_STEP = (
    "epochs=1",
    "max_steps_per_epoch=1",
    "adaptive_batching.memory_budget=64MiB",
    "dataset.split=train[:16]",
    "tokenizer.max_seq_len=64",
)
WARNING = re.compile(r"warn", re.IGNORECASE)


def warning_lines(result: subprocess.CompletedProcess) -> list[str]:
    """Every line of stdout and stderr that says "warn" in any case (Python's ``UserWarning: ...``, a logger's
    ``WARNING``, a ``warnings.warn`` of torch or torchtune)."""
    return [line for line in (result.stdout + result.stderr).splitlines() if WARNING.search(line)]


@pytest.fixture(scope="module")
def demo(assets: Path, runs: Path) -> dict[str, subprocess.CompletedProcess]:
    """``adaptive-batching profile --config tiny_full``, then the demo in the same folder (its cached profile)."""
    common = [f"assets_dir={assets}", f"output_dir={runs / 'demo'}", *SMALL]
    profile = check(run_command("cli", ["profile", "--config", "tiny_full", *common], cwd=runs))
    run = check(tune_run("adaptive_full_finetune", "tiny_full", common, cwd=runs))
    return {"profile": profile, "demo": run}


@pytest.mark.parametrize("command", ["profile", "demo"])
def test_the_profile_and_the_demo_print_no_warning(demo: dict[str, subprocess.CompletedProcess], command: str) -> None:
    assert "chosen micro batch" in demo[command].stdout + demo[command].stderr
    assert warning_lines(demo[command]) == []


def test_the_noise_scale_appears_from_the_10th_step_with_2_or_more_micro_batches(
    demo: dict[str, subprocess.CompletedProcess], runs: Path
) -> None:
    """docs/growth.md#the-gradient-noise-scale: logged at every step from the 10th measured step (2 or more micro
    batches) on. The demo accumulates from epoch 2 on, so steps 1-5 are not measured and the 10th is step 15."""
    rows = read_metrics(runs / "demo" / "logs")
    measured = [int(r["step"]) for r in rows if r["gradient_accumulation_steps"] >= 2]
    assert [int(r["step"]) for r in rows] == list(range(1, 16)) and measured == list(range(6, 16))
    tenth = measured[9]
    assert [int(r["step"]) for r in rows if "gradient_noise_scale" in r] == [tenth] == [15]


def test_the_demo_logs_in_the_order_and_with_the_metrics_the_logs_page_gives(
    demo: dict[str, subprocess.CompletedProcess], runs: Path
) -> None:
    """docs/logs-and-metrics.md: the log's lines in its order, and the metrics table's conditions (``grad_norm``
    with ``clip_grad_norm``; ``max_tokens`` only with token budgets; no device memory figures on CPU)."""
    log = demo["demo"].stdout + demo["demo"].stderr
    in_order = [
        "Batch plan (micro batch",
        "Epoch 1/3: micro batch",
        "epoch 1/3",
        "Saved the checkpoint of epoch 1 (optimizer step 5) to ",
        "Epoch switch 1 -> 2: micro batch",
        "Epoch switch 2 -> 3: micro batch",
        "Saved the checkpoint of epoch 3 (optimizer step 15)",
        "Rank 0: finished at optimizer step 15, micro batch",
    ]
    places = [log.find(line) for line in in_order]
    assert -1 not in places and places == sorted(places), dict(zip(in_order, places))
    for row in read_metrics(runs / "demo" / "logs"):
        assert {
            "loss",
            "lr",
            "micro_batch_size",
            "gradient_accumulation_steps",
            "global_batch_size",
            "tokens_per_second_per_gpu",
            "grad_norm",
        } <= set(row)
        assert not {"max_tokens", "peak_memory_gb", "peak_memory_active", "peak_memory_reserved"} & set(row)


@pytest.mark.parametrize("config", ["tiny_full", "tiny_lora"])
def test_estimate_on_a_bf16_config_prints_no_warning(config: str, assets: Path, tmp_path: Path) -> None:
    """torchtune's RMSNorm with bf16 weights made torch warn at the first fake forward (README: ``estimate
    --config llama3_1/8B_full``; every stock config is bf16): the same model code at its smallest size."""
    result = check(
        run_command(
            "cli",
            [
                "estimate",
                "--config",
                config,
                "--device-memory",
                "256MiB",
                "--world-size",
                "2",
                "--seq-len",
                "64",
                f"assets_dir={assets}",
                "dtype=bf16",
            ],
            cwd=tmp_path,
        )
    )
    assert "predicted largest micro batch" in result.stdout and warning_lines(result) == []


@pytest.fixture(scope="module")
def qlora_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_assets(tmp_path_factory.mktemp("qlora-assets"), "tiny_qlora", num_samples=100).tiny.root


@pytest.mark.parametrize("config", ["tiny_lora", "tiny_qlora"])
def test_the_lora_and_qlora_starts_print_no_warning(
    config: str, assets: Path, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    root = request.getfixturevalue("qlora_assets") if config == "tiny_qlora" else assets
    result = check(
        tune_run(
            "adaptive_lora_finetune",
            config,
            [f"assets_dir={root}", f"output_dir={tmp_path / 'run'}", *ONE_STEP],
            cwd=tmp_path,
        )
    )
    assert "finished at optimizer step 1" in result.stdout + result.stderr
    assert warning_lines(result) == []


# The other objectives' tiny configs, each by its recipe (QAT: LoRA with a quantizer), profiled: one step of 16
# samples, the whole epoch one global batch (accumulation 1).
OBJECTIVES = {
    "tiny_lora_dpo": "adaptive_lora_dpo",
    "tiny_full_dpo": "adaptive_full_dpo",
    "tiny_kd": "adaptive_knowledge_distillation",
    "tiny_qat_lora": "adaptive_lora_finetune",
}
PROFILED = ("use_maximum_batch_size=True", "gradient_accumulation_steps=1")


@pytest.mark.parametrize("config", sorted(OBJECTIVES))
def test_the_dpo_kd_and_qat_starts_print_no_warning(config: str, assets: Path, tmp_path: Path) -> None:
    result = check(
        tune_run(
            OBJECTIVES[config],
            config,
            [f"assets_dir={assets}", f"output_dir={tmp_path / 'run'}", *ONE_STEP, *PROFILED],
            cwd=tmp_path,
        )
    )
    output = result.stdout + result.stderr
    assert "chosen micro batch" in output and "finished at optimizer step 1" in output
    assert warning_lines(result) == []


@pytest.mark.multiprocess
def test_a_two_rank_lora_start_prints_no_warning(assets: Path, tmp_path: Path) -> None:
    """At 2 ranks the adapters are DTensors: their random start on a CPU mesh made torch warn once per rank
    (``DTensor random operators may not have complete support on cpu device mesh``). QAT LoRA: the adapters and
    the fake quantizers sharded; KD's student and full DPO at 2 ranks: test_kd's and test_full_dpo's 2-rank runs."""
    result = check(
        tune_run(
            "adaptive_lora_finetune",
            "tiny_qat_lora",
            [f"assets_dir={assets}", f"output_dir={tmp_path / 'run'}", *ONE_STEP, *PROFILED],
            cwd=tmp_path,
            nproc=2,
        )
    )
    output = result.stdout + result.stderr
    assert "chosen micro batch" in output and output.count("finished at optimizer step 1") == 2
    assert warning_lines(result) == []


def test_the_wandb_logger_without_wandb_is_one_line(assets: Path, tmp_path: Path) -> None:
    """README's Weights & Biases command as written, where wandb is not installed: one line with the pip install,
    before the model loads (no traceback)."""
    if __import__("importlib.util").util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    result = tune_run(
        "adaptive_full_finetune",
        "tiny_full",
        [
            "metric_logger._component_=torchtune.training.metric_logging.WandBLogger",
            "metric_logger.project=my-project",
            f"assets_dir={assets}",
            f"output_dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
    )
    said = [line for line in result.stderr.splitlines() if "wandb" in line]
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(said) == 1 and "pip install wandb" in said[0], result.stderr[-2000:]


def test_warning_lines_finds_torch_and_logger_warnings() -> None:
    said = subprocess.CompletedProcess(
        [],
        0,
        stdout="ok\n",
        stderr=(
            "/x/functional.py:3006: UserWarning: Mismatch dtype between input and weight\n"
            "WARNING:torchtune.utils._logging:something\nEpoch 1/3: micro batch 88\n"
        ),
    )
    assert warning_lines(said) == [
        "/x/functional.py:3006: UserWarning: Mismatch dtype between input and weight",
        "WARNING:torchtune.utils._logging:something",
    ]
