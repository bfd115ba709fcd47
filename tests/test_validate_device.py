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
# Every phase, so every check runs here once (the token, OOM and preemption phases take the full/ac_off profile).
# LoRA and checkpointing run the same code of this script with other configs: the command's own CPU run covers them
# (docs/validation.md), and LoRA with checkpointing has a test of its own (test_components). The fresh-process truth
# run for full fine-tuning (the script's code for every row: QLoRA's fresh processes ran in the command's own CPU run,
# docs/validation.md, and run on the GPU); every other row is the profile and the steps at its chosen micro batch,
# the GPU run's rows on the tiny configs.
TRUTH = ("full/ac_off",)
# Full DPO and full QAT are left out here: the script runs them as it runs LoRA DPO and LoRA QAT, on other configs,
# whose overrides test_every_settings_overrides_pass_the_config_check checks (the GPU run has their rows).
ROWS = (
    "qlora/ac_off",
    "lora_dpo/ac_off",
    "kd/ac_off",
    "qat_lora/ac_off",
    "bwd/ac_off",
)
# Compiled LoRA (the GPU run's lora/ac_off/compile) is the compiled full row's code on another config: left out here.
SETTINGS = (*TRUTH, "full/ac_off/compile", *ROWS, "offload/ac_on")  # offloading: CUDA only, marked so
STEPS = 2  # the first step at the chosen size, then one with the optimizer state in place (tokens/s from it)
TRIALS = 2  # the largest size the profile ran, then one step of the gallop: the bracket's machinery, cheaply
# The compile phase with aot_eager (torchtune reads TORCH_COMPILE_BACKEND): the phase's profile and steps of a
# compiled model, without inductor's C++ build (about 30 s of CPU here from a cold cache). Inductor's own recipe run
# is test_recipes.py's test_compile_matches_eager, its losses against eager; the GPU run uses inductor.
COMPILE_BACKEND = "aot_eager"
# Half the script's CPU budget (and a sixth of its compile budget): micro batches of about 10 samples (QLoRA 4,
# compiled 23), so every step, trial and fresh process trains a fraction of the samples; the fixed batch of the
# stock run (4) still fits. A tenth of its long samples and a sixth of its token-phase samples: the largest trial,
# 2 steps of 12, takes 24.
BUDGET, COMPILE_BUDGET, LONG_SAMPLES, TOKEN_SAMPLES = "24MiB", "24MiB", 100, 40

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def validation(assets: Path, runs: Path) -> dict:
    out = runs / "validation.json"
    check(
        run_command(
            "script",
            [
                str(SCRIPT),
                "--workdir",
                str(runs / "work"),
                "--assets",
                str(assets),
                "--json",
                str(out),
                "--settings",
                ",".join(SETTINGS),
                "--steps",
                str(STEPS),
                "--truth",
                ",".join(TRUTH),
                "--no-stock-compile",
                "--max-trials",
                str(TRIALS),
                "--budget",
                BUDGET,
                "--compile-budget",
                COMPILE_BUDGET,
                "--token-samples",
                str(TOKEN_SAMPLES),
                "--long-samples",
                str(LONG_SAMPLES),
            ],
            cwd=runs,
            env=dict(os.environ, TORCH_COMPILE_BACKEND=COMPILE_BACKEND),
            timeout=900,
        )
    )
    return json.loads(out.read_text())


def test_the_runs_are_single_threaded_by_default(validation: dict) -> None:
    assert validation["meta"]["threads"] == 1


@pytest.mark.parametrize("key", TRUTH)
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
    if key == "full/ac_off":  # our recipe at torchtune's batch too (qlora has no such run)
        stock = entry["stock"]
        assert stock["batch"] == 4 and stock["micro_batch"] == 4 and stock["ran"] == STEPS
        assert stock["tokens_per_second"] > 0
    else:
        assert "stock" not in entry


@pytest.mark.parametrize("key", ROWS)
def test_every_recipe_and_saver_trains_at_its_chosen_micro_batch(validation: dict, key: str) -> None:
    """DPO (LoRA and full), KD, QAT (LoRA and full), optimizer_in_bwd with PagedAdamW8bit: each profiled, then every
    step at the chosen micro batch without an out-of-memory error or allocator retry."""
    entry = validation["settings"][key]
    assert "error" not in entry, entry.get("error")
    profile, steps = entry["profile"], entry["steps"]
    assert 1 <= profile["micro_batch"] <= profile["max_micro_batch"]
    assert steps["exit_code"] == 0 and steps["ran"] == STEPS and steps["oom_errors"] == 0
    assert steps["alloc_retries"] == 0 and steps["micro_batch"] == profile["micro_batch"]
    assert 0 < steps["max_peak_bytes"] and steps["logged_tokens_per_second"] > 0
    assert "true_max" not in entry and "estimate" not in entry  # the truth only where --truth says
    if key == "bwd/ac_off":  # the row says what a CPU cannot show
        assert "PagedAdamW8bit" in entry["cuda_only"] and "PagedAdamW8bit" in " ".join(entry["overrides"])


def test_cuda_only_rows_are_marked_not_missing(validation: dict, runs: Path) -> None:
    for entry in (validation["settings"]["offload/ac_on"], validation["checks"]["nccl"]):
        assert entry["skipped"].startswith("CUDA only: ") and entry["cuda_only"] and "profile" not in entry
    table = (runs / "validation.md").read_text()
    assert "| offload/ac_on | - | CUDA only: " in table and "| nccl | skipped | - | CUDA only: " in table


def test_a_planted_out_of_memory_error_is_recovered_in_place(validation: dict) -> None:
    oom = validation["checks"]["oom"]
    assert oom["ok"] and oom["exit_code"] == 0 and oom["planted"].startswith("torch.OutOfMemoryError raised")
    # Step 2 failed once at the chosen micro batch, then ran as smaller micro batches of the same samples.
    assert oom["failed_attempts"] == [{"step": 2, "micro_batches": [oom["micro_batch"]]}]
    assert len(oom["retried_micro_batches"]) >= 2 and sum(oom["retried_micro_batches"]) == oom["micro_batch"]
    assert oom["same_samples_again"] and oom["every_sample_once"] and oom["steps_trained"] == [1, 2, 3, 4]
    assert oom["oom_errors"] == 1 and oom["ran"] == 4


def test_sigusr1_saves_and_the_resumed_run_continues_bit_for_bit(validation: dict) -> None:
    preempt = validation["checks"]["preempt"]
    assert preempt["exit_codes"] == {"whole": 0, "stopped": 75, "resumed": 0}
    assert preempt["steps"] == {"whole": [1, 2, 3, 4], "stopped": [1, 2], "resumed": [3, 4]}
    assert preempt["bit_for_bit"] and preempt["max_loss_difference"] == 0 and preempt["ok"]
    assert "SIGUSR1 received by the end of optimizer step 2" in preempt["stop_line"]


def test_stock_torchtune_runs_beside_ours(validation: dict) -> None:
    """Stock full_finetune_single_device and lora_dpo_single_device at batch 4 beside our rows at their profiled
    micro batch; the figures are each recipe's logged tokens/s (no speed is asserted). Stock with compile=True, which
    the GPU run adds, is left out here (--no-stock-compile: about 13 s of CPU with aot_eager); ours compiled is in."""
    import validate_device  # benchmarks/ is on pytest's pythonpath (pyproject.toml)

    stock = validation["stock"]
    assert set(stock) == {"finetune", "dpo"}
    for objective, ours in (("finetune", "full/ac_off"), ("dpo", "lora_dpo/ac_off")):
        runs = stock[objective]["runs"]
        assert set(runs) == {"stock"} and runs["stock"]["exit_code"] == 0 and runs["stock"]["ran"] == STEPS
        assert runs["stock"]["tokens_per_second"] > 0 and runs["stock"]["micro_batch"] == 4
        beside = validate_device.ours_beside_stock(validation, objective)
        assert beside["ours"]["setting"] == ours and beside["ours"]["tokens_per_second"] > 0
        assert beside["ours"]["micro_batch"] == validation["settings"][ours]["profile"]["micro_batch"]
    assert validate_device.ours_beside_stock(validation, "finetune")["ours compile"]["setting"] == "full/ac_off/compile"


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
    assert entry["compile"] is True and "true_max" not in entry
    assert "error" not in entry, entry.get("error")
    assert 1 <= entry["profile"]["micro_batch"] <= entry["profile"]["max_micro_batch"]
    assert entry["steps"]["ran"] == STEPS and entry["steps"]["oom_errors"] == 0


def test_the_table_has_a_row_per_setting(validation: dict, runs: Path) -> None:
    table = (runs / "validation.md").read_text()
    for key in SETTINGS:
        assert f"| {key} |" in table
    for line in (
        "| token budget |",
        "| oom | ok |",
        "| preempt | ok |",
        "| finetune | stock: full_finetune_single",
        "| dpo | stock: lora_dpo_single_device",
        "| finetune | ours compile: full/ac_off/compile |",
    ):
        assert line in table
    assert "NO" not in table.split("|") and "FAILED" not in table
    import validate_device  # benchmarks/ is on pytest's pythonpath (pyproject.toml)

    assert set(validation["phases"]) == set(validate_device.PHASES)


def test_bad_options_are_named(runs: Path) -> None:
    for argv, option in (
        (["--phase", "nope"], "--phase"),
        (["--settings", "full/ac_maybe"], "--settings"),
        (["--steps", "0"], "--steps"),
        (["--tolerance", "2"], "--tolerance"),
        (["--threads", "-1"], "--threads"),
    ):
        result = run_command("script", [str(SCRIPT), *argv], cwd=runs)
        assert result.returncode == 2 and option in result.stderr, result.stderr


@pytest.mark.parametrize("model", ["tiny", "llama3_2_1b"])
def test_every_settings_overrides_pass_the_config_check(model: str, tmp_path: Path) -> None:
    """Each setting's config with the script's overrides passes validation before a model loads. The GPU run
    (llama3_2_1b) is only seen on a GPU: its LoRA config's ``growth_interval`` once stopped both LoRA rows there."""
    import validate_device  # benchmarks/ is on pytest's pythonpath (pyproject.toml)

    from adaptive_batching.config.loading import load_config
    from adaptive_batching.config.settings import validate_config

    args = validate_device.parse_args(["--workdir", str(tmp_path), "--model", model])
    for name, value in validate_device.DEFAULTS["cpu" if model == "tiny" else "cuda"].items():
        setattr(args, name, getattr(args, name, None) or value)
    args.json = tmp_path / "v.json"
    validation = validate_device.Validation(args, {"type": "cpu" if model == "tiny" else "cuda"})
    for method, ac, compiled in [s for settings in validate_device.SETTINGS.values() for s in settings]:
        if method == "offload" and model == "tiny":
            continue  # CUDA only: the script skips it off CUDA (test_cuda_only_rows_are_marked_not_missing)
        overrides = validation.overrides(method, ac, tmp_path / "out", compiled=compiled)
        validate_config(load_config(validation.config(method), overrides))


@pytest.mark.parametrize("part", ["1", "2"])
def test_gpu_check_skips_each_phase_it_has_no_time_for(tmp_path: Path, part: str) -> None:
    """``benchmarks/gpu_check.sh`` (the GPU command of docs/validation.md) past its deadline: every phase of the part
    is skipped and named, by lane, the environment is recorded; the phases themselves are the fixture's."""
    import subprocess
    import sys

    out = tmp_path / "out"
    env = dict(
        os.environ, DEADLINE="1", OUT=str(out), PY=sys.executable, NO_WHEELS="1", WORKDIR=str(tmp_path / "w"), PART=part
    )
    result = subprocess.run(
        ["bash", str(SCRIPT.parent / "gpu_check.sh"), "--steps", "2"],
        cwd=SCRIPT.parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    skipped = sorted(line.split(") ", 1)[1] for line in result.stdout.splitlines() if line.startswith("SKIP"))
    expected = {
        "1": [
            "estimate: ",
            "main: --phase assets",
            "main: --phase compile",
            "main: --phase dpo --settings lora_dpo/ac_off",
            "main: --phase full --settings full/ac_off",
            "main: --phase full --settings full/ac_on",
            "main: --phase qlora",
            "main: --phase stock",
        ],
        "2": [
            "faults: --phase oom",
            "faults: --phase preempt",
            "kd: --phase dpo --settings full_dpo/ac_off",
            "kd: --phase estimate",
            "kd: --phase kd",
            "main: --phase assets",
            "memory: --phase estimate",
            "memory: --phase full --settings full/ac_on",
            "memory: --phase lora --settings lora/ac_off",
            "memory: --phase lora --settings lora/ac_on",
            "paths: --phase bwd",
            "paths: --phase nccl",
            "qat: --phase offload",
            "qat: --phase qat",
        ],
    }[part]
    assert skipped == expected
    assert "torch" in (out / "env.txt").read_text() and not (out / "validation.json").exists()


def test_lanes_merge_into_one_table() -> None:
    """gpu_check.sh's lanes each write a results file; --merge joins them: every row and check, each row with the
    fields any lane gave it (the estimate lane adds its estimate to the main lane's row), the first lane's header."""
    import validate_device  # benchmarks/ is on pytest's pythonpath (pyproject.toml)

    main = {
        "device": {"name": "gpu"},
        "meta": {"budget": None, "command": "main"},
        "phases": {"full": {"seconds": 1}},
        "settings": {"full/ac_off": {"profile": {"micro_batch": 19}}},
        "checks": {},
        "stock": {"finetune": {}},
    }
    estimate = {
        "meta": {"budget": None, "command": "estimate"},
        "phases": {"estimate": {"seconds": 2}},
        "settings": {"full/ac_off": {"profile": {"micro_batch": 19}, "estimate": {"max_micro_batch": 21}}},
    }
    lane = {"meta": {"budget": "24GiB", "command": "faults"}, "checks": {"oom": {"ok": True}}, "settings": {}}
    merged = validate_device.merge_results([main, estimate, lane])
    assert merged["settings"]["full/ac_off"] == {"profile": {"micro_batch": 19}, "estimate": {"max_micro_batch": 21}}
    assert merged["checks"] == {"oom": {"ok": True}} and set(merged["phases"]) == {"full", "estimate"}
    assert merged["device"] == {"name": "gpu"} and merged["meta"]["command"] == "main"
    assert merged["stock"] == {"finetune": {}}  # from the one lane that ran it, whichever comes last
    assert merged["meta"]["budget"] == "each row's (the budget column)" and main["meta"]["budget"] is None
    assert [p["command"] for p in merged["parts"]] == ["main", "estimate", "faults"]
