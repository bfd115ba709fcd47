"""Benchmark scripts run at their smallest size, so they do not rot as the code moves.

One test per script, each the script's own command line (forked from the suite's warm server; the runs it
starts are its own, fresh processes). What is checked is that it ran through and wrote its table or results;
its figures at this size mean nothing. ``validate_device.py`` (test_validate_device) and ``chaos.py``
(test_chaos) have tests of their own that check their results. Not yet here, each too slow at its smallest
size today: ``profiler_vs_peers.py`` and ``profiler_whole_process_limit.py`` (2-4 minutes), ``step_overhead.py``
and ``clean_exits.py`` (two-rank runs of fresh interpreters, 20-30 s).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from recipe_runs import check, run_command

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

pytestmark = pytest.mark.e2e


def script(name: str, *args: str, cwd: Path, timeout: int = 600) -> str:
    result = check(run_command("script", [str(BENCHMARKS / name), *args], cwd=cwd, timeout=timeout))
    return result.stdout


def test_estimate_speed(tmp_path: Path) -> None:
    out = script("estimate_speed.py", "--models", "tiny", "--methods", "fast", "--seq-len", "128",
                 "--out-dir", str(tmp_path), cwd=tmp_path)
    assert "tiny" in out


def test_estimate_stock_configs(tmp_path: Path) -> None:
    md, js = tmp_path / "estimates.md", tmp_path / "estimates.json"
    script("estimate_stock_configs.py", "--only", "llama3_2/1B_lora_single_device", "--seq-len", "256",
           "--markdown", str(md), "--json", str(js), cwd=tmp_path)
    assert "llama3_2/1B_lora_single_device" in js.read_text()


def test_growth_runs(tmp_path: Path) -> None:
    script("growth_runs.py", "--samples", "16", "--epochs", "1", "--seq-len", "64", "--window", "8", "--only", "fixed small",
           "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert any((tmp_path / "out").iterdir())


def test_recipe_vs_torchtune(tmp_path: Path) -> None:
    js = tmp_path / "speed.json"
    script("recipe_vs_torchtune.py", "--steps", "2", "--warmup", "1", "--repeats", "1", "--no-switch",
           "--json", str(js), "--workdir", str(tmp_path / "work"), cwd=tmp_path)
    assert json.loads(js.read_text())


def test_token_budget_vs_fixed(tmp_path: Path) -> None:
    out = script("token_budget_vs_fixed.py", "--samples", "40", "--repeats", "1", "--threads", "1", cwd=tmp_path)
    assert "token budget" in out
