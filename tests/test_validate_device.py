"""``benchmarks/validate_device.py`` end to end on CPU (the tiny model): one shared run of every phase on two
settings (full fine-tuning and QLoRA, checkpointing off), then its JSON and Markdown checked for every check
with values that agree with each other. No figure of this machine's speed is
asserted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from recipe_runs import check, run_command

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "validate_device.py"
# Every phase, so every check runs here once (the token phase takes the full/ac_off profile). LoRA and
# checkpointing run the same code of this script with other configs: the command's own CPU run covers them
# (docs/validation.md), and LoRA with checkpointing has a test of its own (test_components). QLoRA stays: no
# other test tries its chosen micro batch in a fresh process.
SETTINGS = ("full/ac_off", "qlora/ac_off")  # QLoRA: NF4 base weights, the same checks
STEPS = 2  # the first step at the chosen size, then one with the optimizer state in place (tokens/s from it)
TRIALS = 2  # the largest size the profile ran, then one step of the gallop: the bracket's machinery, cheaply
# The compile phase with aot_eager (torchtune reads TORCH_COMPILE_BACKEND): the phase's profile and steps of a
# compiled model, without inductor's C++ build (about 30 s of CPU here from a cold cache). Inductor's own recipe run
# is test_recipes.py's test_compile_matches_eager, its losses against eager; the GPU run uses inductor.
COMPILE_BACKEND = "aot_eager"
# Half the script's CPU budget (and a sixth of its compile budget): micro batches of about 10 samples (QLoRA 4,
# compiled 23), so every step, trial and fresh process trains a fraction of the samples; the fixed batch of the
# stock run (4) still fits. Half its long and token-phase samples: the largest trial, 2 steps of 12, takes 24.
BUDGET, COMPILE_BUDGET, LONG_SAMPLES, TOKEN_SAMPLES = "24MiB", "24MiB", 200, 60

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def validation(assets: Path, runs: Path) -> dict:
    out = runs / "validation.json"
    check(run_command("script", [str(SCRIPT), "--workdir", str(runs / "work"), "--assets", str(assets),
                                 "--json", str(out), "--settings", ",".join(SETTINGS), "--steps", str(STEPS),
                                 "--max-trials", str(TRIALS), "--budget", BUDGET, "--compile-budget", COMPILE_BUDGET,
                                 "--token-samples", str(TOKEN_SAMPLES), "--long-samples", str(LONG_SAMPLES)],
                      cwd=runs, env=dict(os.environ, TORCH_COMPILE_BACKEND=COMPILE_BACKEND), timeout=900))
    return json.loads(out.read_text())


def test_the_runs_are_single_threaded_by_default(validation: dict) -> None:
    assert validation["meta"]["threads"] == 1


@pytest.mark.parametrize("key", SETTINGS)
def test_the_chosen_micro_batch_fits_fresh_processes_and_trains(validation: dict, key: str) -> None:
    entry = validation["settings"][key]
    profile, true, steps = entry["profile"], entry["true_max"], entry["steps"]
    assert 1 <= profile["micro_batch"] <= profile["max_micro_batch"]
    assert profile["budget_source"].startswith("explicit")
    # Check 2: the bracket is real (each end measured in a fresh process) and the chosen size is below it.
    by_size = {t["micro_batch"]: t for t in true["trials"]}
    assert true["largest_fit"] is not None and by_size[true["largest_fit"]]["fits"]
    assert by_size[true["largest_fit"]]["peak_bytes"] <= profile["budget_bytes"]
    if true["smallest_fail"] is not None:
        assert true["smallest_fail"] > true["largest_fit"] and not by_size[true["smallest_fail"]]["fits"]
    assert profile["micro_batch"] <= true["largest_fit"]
    assert 1 <= len(true["trials"]) <= TRIALS
    # Check 3: every step ran at the chosen micro batch, none out of memory.
    assert steps["exit_code"] == 0 and steps["ran"] == STEPS and steps["oom_errors"] == 0
    assert steps["alloc_retries"] == 0 and steps["micro_batch"] == profile["micro_batch"]
    assert steps["tokens_per_second"] > 0 and 0 < steps["max_peak_bytes"]
    # Checks 4 and 5: the estimate for the same budget, and the stock batch's speed.
    assert entry["estimate"]["max_micro_batch"] >= 1 and entry["estimate"]["budget_bytes"] == profile["budget_bytes"]
    stock = entry["stock"]
    assert stock["batch"] == 4 and stock["micro_batch"] == 4 and stock["ran"] == STEPS and stock["tokens_per_second"] > 0


def test_token_budget_against_fixed_batches(validation: dict) -> None:
    tokens = validation["token_budget"]
    fixed, budget = tokens["runs"]["fixed"], tokens["runs"]["token budget"]
    for run in (fixed, budget):
        assert run["exit_code"] == 0 and run["oom_errors"] == 0 and run["tokens_per_second"] > 0
        assert 0 <= run["waste"] < 1
    # Every sample trained once in both: the same tokens in the loss.
    assert fixed["tokens"] == budget["tokens"] > 0
    # Both take the full/ac_off profile (same model, length and budget) instead of measuring it again.
    assert fixed["profile_from_cache"] and budget["profile_from_cache"]
    assert fixed["micro_batch"] == validation["settings"]["full/ac_off"]["profile"]["micro_batch"]
    assert budget["max_tokens"] >= fixed["micro_batch"]
    assert budget["waste"] < fixed["waste"]  # similar lengths together pad less, by construction


def test_compile_runs_the_profile_and_the_steps(validation: dict) -> None:
    entry = validation["settings"]["full/ac_off/compile"]
    assert entry["compile"] is True
    assert "error" not in entry, entry.get("error")
    assert 1 <= entry["profile"]["micro_batch"] <= entry["profile"]["max_micro_batch"]
    assert entry["steps"]["ran"] == STEPS and entry["steps"]["oom_errors"] == 0


def test_the_table_has_a_row_per_setting(validation: dict, runs: Path) -> None:
    table = (runs / "validation.md").read_text()
    for key in (*SETTINGS, "full/ac_off/compile"):
        assert f"| {key} |" in table
    assert "| token budget |" in table and "NO" not in table.split("|")
    assert set(validation["phases"]) == {"assets", "full", "lora", "qlora", "estimate", "tokens", "compile"}


def test_bad_options_are_named(runs: Path) -> None:
    for argv, option in ((["--phase", "nope"], "--phase"), (["--settings", "full/ac_maybe"], "--settings"),
                         (["--steps", "0"], "--steps"), (["--tolerance", "2"], "--tolerance"),
                         (["--threads", "-1"], "--threads")):
        result = run_command("script", [str(SCRIPT), *argv], cwd=runs)
        assert result.returncode == 2 and option in result.stderr, result.stderr


@pytest.mark.parametrize("model", ["tiny", "llama3_2_1b"])
def test_every_settings_overrides_pass_the_config_check(model: str, tmp_path: Path) -> None:
    """Each setting's config with the script's overrides passes validation before a model loads. The GPU run
    (llama3_2_1b) is only seen on a GPU: its LoRA config's ``growth_interval`` once stopped both LoRA rows there."""
    import validate_device  # benchmarks/ is on sys.path (conftest.py)

    from adaptive_batching.config.loading import load_config
    from adaptive_batching.config.settings import validate_config

    args = validate_device.parse_args(["--workdir", str(tmp_path), "--model", model])
    for name, value in validate_device.DEFAULTS["cpu" if model == "tiny" else "cuda"].items():
        setattr(args, name, getattr(args, name, None) or value)
    args.json = tmp_path / "v.json"
    validation = validate_device.Validation(args, {"type": "cpu"})
    for method, ac in [pair for pairs in validate_device.SETTINGS.values() for pair in pairs]:
        overrides = validation.overrides(method, ac, tmp_path / "out")
        validate_config(load_config(validate_device.CONFIGS[model][method], overrides))


def test_gpu_check_skips_each_phase_it_has_no_time_for(tmp_path: Path) -> None:
    """``benchmarks/gpu_check.sh`` (the GPU command of docs/validation.md) past its deadline: every phase is skipped
    and named, the environment is recorded, no table is made of nothing; the phases themselves are the fixture's."""
    import subprocess
    import sys

    out = tmp_path / "out"
    env = dict(os.environ, DEADLINE="1", OUT=str(out), PY=sys.executable, NO_WHEELS="1", WORKDIR=str(tmp_path / "w"))
    result = subprocess.run(["bash", str(SCRIPT.parent / "gpu_check.sh"), "--steps", "2"], cwd=SCRIPT.parents[1],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIP")]
    assert [line.split(": ", 1)[1] for line in skipped] == [
        "--phase assets", "--phase full --settings full/ac_off", "--phase lora --settings lora/ac_off",
        "--phase qlora --settings qlora/ac_off", "--phase estimate", "--phase full --settings full/ac_on",
        "--phase tokens", "--phase lora --settings lora/ac_on", "--phase compile"]
    assert "torch" in (out / "env.txt").read_text() and not (out / "validation.json").exists()
