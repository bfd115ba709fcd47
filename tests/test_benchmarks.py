"""Benchmark scripts run at their smallest size, so they do not rot as the code moves.

Each test runs the script's own command line, forked from the suite's warm server. The runs it starts are fresh
processes where the script measures something of a fresh process (its memory, its exit); where it measures steps,
losses and collectives (``recipe_vs_torchtune.py``, ``step_overhead.py``), they are forked from the script too
(``fork_python``). A script whose report several tests read runs once per module. What is checked is what the
script reports about the runs it made; its figures at this size mean nothing. ``validate_device.py``
(test_validate_device), ``chaos.py`` (test_chaos) and ``profiler_whole_process_limit.py``
(test_benchmark_limit) have tests of their own. ``profiler_vs_peers.py`` runs ours
alone (``--methods ours``): the true maximum takes about 10 fresh processes and the peers' searches minutes.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from config_edits import CONFIGS, modified
from omegaconf import OmegaConf
from recipe_runs import check, run_command

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

pytestmark = pytest.mark.e2e


def script(name: str, *args: str, cwd: Path, timeout: int = 600, fork_python: bool = False) -> str:
    result = check(
        run_command("script", [str(BENCHMARKS / name), *args], cwd=cwd, timeout=timeout, fork_python=fork_python)
    )
    return result.stdout


def test_estimate_stock_configs_full_trace(tmp_path: Path) -> None:
    # the tiny model at 4 layers (3 traced and extended, or all 4) and 8192 tokens: its fake steps are quick
    config, js = tmp_path / "tiny4.yaml", tmp_path / "full_trace.json"
    OmegaConf.save(
        modified(OmegaConf.load(CONFIGS / "tiny_full.yaml"), {"model.num_layers": 4, "model.max_seq_len": 8192}), config
    )
    out = script(
        "estimate_stock_configs.py",
        "--only",
        str(config),
        "--seq-len",
        "8192",
        "--full-trace",
        "--json",
        str(js),
        cwd=tmp_path,
    )
    (row,) = json.loads(js.read_text())["rows"]
    fast, full = row["fast"], row["full"]
    assert (fast["layers"], full["layers"]) == ("3 of 4", "4 of 4") and fast["micro_batch"] >= 1
    assert fast["micro_batch"] == full["micro_batch"] and row["max_difference"] < 1e-3
    assert {1, 2, full["micro_batch"]} <= set(row["compared"])  # the probes and the answer, measured both ways
    assert f"| `{config}` | - | 3 of 4; 4 of 4 | {fast['micro_batch']} | {full['micro_batch']} |" in out


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--only", "llama3_2/1B_lora_single_devic"],
            "error: --only: not a stock full, LoRA, QLoRA, DPO, KD or QAT config of torchtune: "
            "'llama3_2/1B_lora_single_devic' (did you mean 'llama3_2/1B_lora_single_device'?)",
        ),
        (
            ["--only", "llama3_2/1B_lora_single_device", "--markdown", "page.md"],
            "error: --markdown writes the table of every config; with --only the rows go to --json alone: drop "
            "--markdown, or --only to rewrite the page",
        ),
        (
            ["--full-trace"],
            "error: --full-trace traces every layer of the configs named by --only (minutes for an 8B "
            "model) and writes its own table: give --only NAME..., without --merge",
        ),
        (
            ["--only", "llama3_2/1B_full", "--publish"],
            "error: --publish writes --full-trace's table into docs/benchmarks.md: add --full-trace",
        ),
    ],
)
def test_estimate_stock_configs_refuses_in_one_line_before_any_estimate(
    tmp_path: Path, args: list[str], says: str
) -> None:
    js = tmp_path / "estimates.json"
    result = run_command(
        "script", [str(BENCHMARKS / "estimate_stock_configs.py"), *args, "--json", str(js)], cwd=tmp_path, timeout=120
    )
    assert result.returncode == 2 and result.stderr.strip() == says and result.stdout == ""
    assert not js.exists() and not (tmp_path / "page.md").exists()


def test_growth_runs(tmp_path: Path) -> None:
    script(
        "growth_runs.py",
        "--samples",
        "16",
        "--epochs",
        "1",
        "--seq-len",
        "64",
        "--window",
        "8",
        "--only",
        "fixed small",
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path / "out"),
        cwd=tmp_path,
    )
    assert any((tmp_path / "out").iterdir())


TOGETHER = len(os.sched_getaffinity(0)) >= 2  # --together pins each recipe to its own core


@pytest.fixture(scope="module")
def recipe_vs_torchtune(tmp_path_factory: pytest.TempPathFactory, assets: Path) -> tuple[dict, str]:
    """One run of each recipe (side by side where 2 cores allow), then ours' epoch-switch run."""
    work = tmp_path_factory.mktemp("recipe_vs_torchtune")
    js = work / "speed.json"
    out = script(
        "recipe_vs_torchtune.py",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--assets",
        str(assets),
        *(["--together"] if TOGETHER else []),
        "--json",
        str(js),
        "--workdir",
        str(work / "work"),
        cwd=work,
        fork_python=True,
    )
    return json.loads(js.read_text()), out


def test_recipe_vs_torchtune(recipe_vs_torchtune: tuple[dict, str]) -> None:
    figures, out = recipe_vs_torchtune
    assert [len(row["runs"]) for row in figures["rows"]] == [1, 1] and figures["same_computation"] is not None
    assert figures["same_computation"]["loss"]["max_rel_diff"] < 1e-4  # the same batches, the same losses
    assert "| ours: adaptive_full_finetune | 2 |" in out and "| stock: full_finetune_single_device | 2 |" in out


def test_recipe_vs_torchtune_times_the_epoch_switch(recipe_vs_torchtune: tuple[dict, str]) -> None:
    switch = recipe_vs_torchtune[0]["epoch_switch"]
    assert switch["exit_code"] == 0 and len(switch["switch_ms"]) == 2 and switch["batches"] == [8, 12, 16]


@pytest.mark.skipif(not TOGETHER, reason="--together pins each recipe to its own core")
def test_recipe_vs_torchtune_together(recipe_vs_torchtune: tuple[dict, str]) -> None:
    figures, out = recipe_vs_torchtune
    assert figures["settings"]["together"]
    assert len(figures["window_overlaps"]) == len(figures["pair_ratios"]) == len(figures["pair_step_ratios"]) == 1
    assert "measured windows of each pair overlap" in out and "the pairs' medians" in out


def test_recipe_vs_torchtune_dpo(tmp_path: Path, assets: Path) -> None:
    js = tmp_path / "dpo.json"
    out = script(
        "recipe_vs_torchtune.py",
        "--objective",
        "dpo",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--no-switch",
        "--assets",
        str(assets),
        "--json",
        str(js),
        "--workdir",
        str(tmp_path / "work"),
        cwd=tmp_path,
        fork_python=True,
    )
    figures = json.loads(js.read_text())
    # the adapters drawn from one generator in both: stock's losses bit for bit
    assert figures["same_computation"]["loss"] == {
        "steps": 2,
        "max_abs_diff": 0.0,
        "max_rel_diff": 0.0,
        "first_rel_diff": 0.0,
    }
    assert "| ours: adaptive_lora_dpo | 1 |" in out and "| stock: lora_dpo_single_device | 1 |" in out
    assert "save_adapter_weights_only" not in figures["dropped_keys"]  # stock's LoRA recipe reads it
    assert figures["cpu_ratio"] > 0 and len(figures["pair_cpu_ratios"]) == 1 and "and CPU time: " in out


def test_recipe_vs_torchtune_kd(tmp_path: Path, assets: Path) -> None:
    js = tmp_path / "kd.json"
    out = script(
        "recipe_vs_torchtune.py",
        "--objective",
        "kd",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--no-switch",
        "--assets",
        str(assets),
        "--json",
        str(js),
        "--workdir",
        str(tmp_path / "work"),
        cwd=tmp_path,
        fork_python=True,
    )
    figures = json.loads(js.read_text())
    # stock divides its gradients by the tokens again: step 1, before any update, is float32-equal, step 2 close
    loss = figures["same_computation"]["loss"]
    assert loss["steps"] == 2 and loss["first_rel_diff"] < 1e-6 and loss["max_rel_diff"] < 1e-4
    assert "| ours: adaptive_knowledge_distillation | 1 |" in out
    assert "| stock: knowledge_distillation_single_device | 1 |" in out and "the same computation)" in out
    assert {"teacher_model", "kd_loss", "kd_ratio"}.isdisjoint(figures["dropped_keys"])  # stock reads them
    assert figures["cpu_ratio"] > 0


@pytest.mark.multiprocess
def test_step_overhead(tmp_path: Path, assets: Path) -> None:
    js = tmp_path / "overhead.json"
    script(
        "step_overhead.py",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--settings",
        "none,stop",
        "--assets",
        str(assets),
        "--json",
        str(js),
        cwd=tmp_path,
        fork_python=True,
    )
    figures = json.loads(js.read_text())
    assert set(figures["speeds"]) == {"none", "stop"}
    assert figures["collectives"]["stop"][0] == figures["collectives"]["none"][0] + 1  # the stop agreement's one


@pytest.mark.multiprocess
def test_clean_exits(tmp_path: Path) -> None:
    js = tmp_path / "exits.json"
    script("clean_exits.py", "--runs", "1", "--settings", "saves", "--json", str(js), cwd=tmp_path)
    (record,) = json.loads(js.read_text())
    assert record["setting"] == "saves" and record["exit"] == 0 and record["unclean"] is None


def test_largest_fit_doubles_then_bisects_within_its_trials() -> None:
    """The search of the fresh-process maximum (benchmarks/common.py), which the runs below try once each."""
    spec = importlib.util.spec_from_file_location("bench_common", BENCHMARKS / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    assert common.largest_fit(lambda size: size <= 37, 16) == (
        37,
        38,
        ["16", "32", "64x", "48x", "40x", "36", "38x", "37"],
    )
    assert common.largest_fit(lambda size: size <= 37, 16, trials=2) == (32, None, ["16", "32"])
    assert common.largest_fit(lambda size: False, 8) == (0, 1, ["8x", "4x", "2x", "1x"])


def test_profiler_vs_peers(tmp_path: Path) -> None:
    js = tmp_path / "peers.json"
    script(
        "profiler_vs_peers.py",
        "--methods",
        "ours",
        "--room",
        "0.3",
        "--seq-len",
        "32",
        "--epoch-time-cap",
        "1",
        "--json",
        str(js),
        cwd=tmp_path,
    )
    ours = json.loads(js.read_text())["rows"][0]
    assert ours["method"].startswith("ours") and ours["found"] >= 1 and ours["trial_steps"] >= 1


def test_noise_scale_accuracy(tmp_path: Path) -> None:
    out = script("noise_scale_accuracy.py", "--seeds", "1", cwd=tmp_path)
    assert "2 gloo ranks" in out and "Over 1 seeds" in out
