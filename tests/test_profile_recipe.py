"""The start-up profiler inside the recipes: report, cache, no trace, real OOMs, ranks, and the CLI."""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_runs import FIXED_BATCH_SIZE, TUNE, check, losses, read_metrics, run_command, tune_run

from adaptive_batching.config.settings import KNOBS
from adaptive_batching.runtime.memory import RESTARTED_ENV

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent
SHORT = ("epochs=1", "max_steps_per_epoch=1")
# Samples cut to 64 tokens and a small budget keep every trial and step small (a micro batch of about 20 samples
# of 64 tokens, where the config's 256 tokens and 512MiB make it about 90 samples of 256).
SEQ = "tokenizer.max_seq_len=64"
BUDGET_MIB = 24
BUDGET = f"adaptive_batching.memory_budget={BUDGET_MIB}MiB"
TOLERANCE = KNOBS["search_tolerance"].default  # the search stops within it of the largest that ran


def profiled(assets: Path, out: Path, *overrides: str, nproc: int | None = None) -> tuple[str, dict]:
    result = check(
        tune_run(
            "adaptive_full_finetune",
            "tiny_full",
            [f"assets_dir={assets}", f"output_dir={out}", *overrides],
            cwd=out.parent,
            nproc=nproc,
        )
    )
    return result.stdout + result.stderr, json.loads((out / "profile" / "profile.json").read_text())


SAME_LR = ("lr_scaling=none", "lr_scheduler=null")


@pytest.fixture(scope="module")
def profiled_run(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict]:
    """One profiled run shared by the report, no-trace and cache tests: 3 steps at the profiled micro batch."""
    out = tmp_path_factory.mktemp("profiled") / "run"
    output, report = profiled(assets, out, SEQ, BUDGET, "epochs=1", "max_steps_per_epoch=3", *SAME_LR)
    return out, output, report


def test_profile_reports_and_trains_at_the_chosen_micro_batch(profiled_run: tuple[Path, str, dict]) -> None:
    out, output, report = profiled_run
    for key in ("max_micro_batch", "micro_batch", "trial_steps", "seconds", "trials", "budget_bytes"):
        assert key in report
    assert report["micro_batch"] == int(report["max_micro_batch"] * 0.95)
    assert report["trial_steps"] == len(report["trials"])
    # Verification costs about two steps each time the estimate's error (this run's own) doubles past the tolerance.
    verify = [t for t in report["trials"] if t["phase"] == "verify"]
    error = abs(report["estimate"] / report["max_micro_batch"] - 1)
    assert len(verify) <= 2 + 2 * math.ceil(math.log2(max(1.0, error / TOLERANCE)))
    assert not report["from_cache"]
    # The largest micro batch that ran fits the budget; one just above it did not.
    ok = [t for t in report["trials"] if t["ok"]]
    assert max(t["micro_batch"] for t in ok) == report["max_micro_batch"]
    budget = BUDGET_MIB * 2**20
    assert report["budget_bytes"] == budget and all(t["peak_bytes"] <= budget for t in ok)
    assert any(
        not t["ok"] and t["micro_batch"] <= report["max_micro_batch"] * (1 + TOLERANCE) + 1 for t in report["trials"]
    )
    assert "phase   micro batch  peak GiB  fits  seconds" in output
    assert (out / "profile" / "profile.png").stat().st_size > 10_000
    # The run forked its plot child from the test's fork server (forkserver.ALWAYS_FORKED); the command the recipe
    # runs, in a new interpreter as a user's run starts it, draws the same report.
    redrawn = out.parent / "redrawn.png"
    subprocess.run(
        [sys.executable, "-m", "adaptive_batching.profiling.plot", str(out / "profile" / "profile.json"), str(redrawn)],
        check=True,
        timeout=120,
    )
    assert redrawn.stat().st_size > 10_000
    rows = read_metrics(out / "logs")
    assert [r["micro_batch_size"] for r in rows] == [report["micro_batch"]] * 3


def test_cache_hit_reprofile_stale_and_corrupt(
    profiled_run: tuple[Path, str, dict], tmp_path: Path, assets: Path
) -> None:
    first_out, _, first = profiled_run
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(first_out / "profile_cache", out / "profile_cache")
    output, hit = profiled(assets, out, SEQ, BUDGET, *SHORT, "adaptive_batching.safety_margin=0.2")
    assert hit["from_cache"] and "using the cached profile" in output
    assert hit["max_micro_batch"] == first["max_micro_batch"]
    assert hit["micro_batch"] == int(first["max_micro_batch"] * 0.8)  # the margin is applied anew
    _, again = profiled(assets, out, SEQ, BUDGET, *SHORT, "adaptive_batching.reprofile=True")
    assert not again["from_cache"]
    _, stale = profiled(assets, out, BUDGET, *SHORT, "tokenizer.max_seq_len=32")  # another fingerprint
    assert not stale["from_cache"] and stale["seq_len"] == 32
    for cached in (out / "profile_cache").glob("*.json"):
        cached.write_text("{not json")
    output, corrupt = profiled(assets, out, SEQ, BUDGET, *SHORT)
    assert not corrupt["from_cache"] and "corrupt" in output.lower()


def test_profiling_leaves_no_trace(profiled_run: tuple[Path, str, dict], assets: Path, tmp_path: Path) -> None:
    """A profiled run trains exactly like an unprofiled run at the same micro batch (same LR)."""
    out, _, report = profiled_run
    plain = tmp_path / "plain"
    check(
        tune_run(
            "adaptive_full_finetune",
            "tiny_full",
            [
                f"assets_dir={assets}",
                f"output_dir={plain}",
                *FIXED_BATCH_SIZE,
                *SAME_LR,
                SEQ,
                f"batch_size={report['micro_batch']}",
                "epochs=1",
                "max_steps_per_epoch=3",
            ],
            cwd=tmp_path,
        )
    )
    assert losses(out / "logs") == losses(plain / "logs")


@pytest.mark.parametrize("budget", ["null", "2GiB"])
def test_real_out_of_memory_under_an_address_space_limit(budget: str, assets: Path, tmp_path: Path) -> None:
    """200 MiB of address space after set-up. With no budget the profiler reads the limit itself;
    with a budget far above it, real ``DefaultCPUAllocator`` errors stop the trials. Either way the
    micro batch it chooses then trains under the same limit."""
    result = run_command(
        "script",
        [
            str(HERE / "limited_run.py"),
            "200",
            "tiny_full",
            f"assets_dir={assets}",
            f"output_dir={tmp_path / 'run'}",
            f"adaptive_batching.memory_budget={budget}",
            "adaptive_batching.memory_fraction=1.0",
            "epochs=1",
            "max_steps_per_epoch=2",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    report = summary["profile"]
    trials = report["trials"]
    largest = report["max_micro_batch"]
    ran = {t["micro_batch"] for t in trials if t["ok"]}
    refused = [t["micro_batch"] for t in trials if not t["ok"]]
    # The answer is bracketed by this run's own trials: it ran within the budget, and the smallest
    # refused micro batch above it is within the search tolerance plus one sample.
    assert largest in ran and largest > 4
    assert all(t["peak_bytes"] <= report["budget_bytes"] for t in trials if t["ok"])
    above = [b for b in refused if b > largest]
    assert above and min(above) <= math.ceil(largest * (1 + TOLERANCE)) + 1
    if budget == "null":
        assert "address-space limit" in report["budget_source"]
        # Verification from the run's own linear estimate: about two steps per doubling of its error past the tolerance.
        verify = [t for t in trials if t["phase"] == "verify"]
        error = abs(report["estimate"] / largest - 1)
        assert len(verify) <= 2 + 2 * math.ceil(math.log2(max(1.0, error / TOLERANCE))) and error < 0.25
    else:
        assert any(t["peak_bytes"] is None for t in trials), "expected real OOMs"
    assert summary["trained_steps"] == 2 and summary["micro_batch"] == report["micro_batch"]


@pytest.mark.parametrize("ranks", [pytest.param(2, marks=pytest.mark.multiprocess)])
def test_under_ulimit_v_the_recipe_starts_again_with_glibc_pinned_from_its_start(
    ranks: int, assets: Path, tmp_path: Path
) -> None:
    """A user's ``ulimit -v`` and ``tune run``, as a shell starts it (not forked from the test's server,
    whose command line is another program's): the recipe runs its own command again once per rank (each
    torchrun worker before it joins the process group), with ``GLIBC_TUNABLES`` set, then profiles and trains.
    At 2 ranks, both train at the micro batch of the one profile, whose budget is the minimum over the ranks. (One
    rank, ``tune run`` alone under a limit: test_benchmark_limit's runs, each a profiled ``tune run`` under a
    whole-process limit that starts again as here; its command line: test_glibc_restart.)"""
    launcher = ["--nproc_per_node", str(ranks)] if ranks > 1 else []
    command = [
        TUNE,
        "run",
        *launcher,
        "adaptive_full_finetune",
        "--config",
        "tiny_full",
        f"assets_dir={assets}",
        f"output_dir={tmp_path / 'run'}",
        *SHORT,
        "adaptive_batching.memory_budget=96MiB",
        "dataset.split=train[:16]",
        SEQ,
    ]  # the profile's search stops at the 16 samples: short trials
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", RESTARTED_ENV)}
    result = subprocess.run(
        ["bash", "-c", f"ulimit -v {16 * 2**20} && exec {shlex.join(command)}"],
        cwd=tmp_path,
        env={**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert output.count("this process starts again with GLIBC_TUNABLES=") == ranks
    assert output.count("glibc pinned from process start by GLIBC_TUNABLES") == 1  # rank 0 logs set-up
    assert "glibc set to return freed" not in output
    assert output.index("starts again") < output.index("pinned from process start") < output.index("finished at")
    assert output.count("finished at optimizer step 1") == ranks
    report = json.loads((tmp_path / "run" / "profile" / "profile.json").read_text())
    finals = [
        line.split("micro batch ")[1].split(",")[0]
        for line in output.splitlines()
        if "finished at optimizer step" in line
    ]
    assert finals == [str(report["micro_batch"])] * ranks
    assert ("minimum over 2 ranks" in report["budget_source"]) == (ranks == 2)


def test_profile_and_estimate_commands(assets: Path, tmp_path: Path) -> None:
    """``estimate`` (fake tensors, no real memory) against ``profile`` (real steps), same 512MiB budget."""
    common = [f"assets_dir={assets}", f"output_dir={tmp_path / 'run'}"]
    profile = run_command(
        "cli", ["profile", "--config", "tiny_full", "--json", str(tmp_path / "p.json"), *common], cwd=tmp_path
    )
    assert profile.returncode == 0, profile.stderr[-3000:]
    assert (profile.stdout + profile.stderr).count("largest micro batch that ran") == 1  # the table, once
    real = json.loads((tmp_path / "p.json").read_text())["max_micro_batch"]
    estimate = run_command(
        "cli",
        [
            "estimate",
            "--config",
            "tiny_full",
            "--device-memory",
            "512MiB",
            "--fraction",
            "1.0",
            "--json",
            str(tmp_path / "e.json"),
            *common,
        ],
        cwd=tmp_path,
    )
    assert estimate.returncode == 0, estimate.stderr[-3000:]
    predicted = json.loads((tmp_path / "e.json").read_text())["max_micro_batch"]
    assert abs(predicted - real) <= 0.05 * real, (predicted, real)
