"""What the fine-tuning recipes promise, for ``adaptive_lora_dpo`` (issue 37.3), on the tiny preference pairs.

Four recipe runs, shared by the tests (benchmarks/faulty_run.py injects the faults and records the pairs of each step):
- one process, the batch growing every 3 steps with an out-of-memory error injected at step 7: uninterrupted
  (``straight``), and the same run stopped by SIGTERM after step 5 then resumed (``chain``);
- two ranks under torchrun with a token budget, killed inside its second save and restarted by torchrun.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from recipe_runs import read_metrics
from test_oom_recovery import faulty_run, ok
from test_preemption import logged_steps, stopped

from adaptive_batching.faults.checkpoints import MARKER, run_status

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DPO = {"recipe": "adaptive_lora_dpo", "config": "tiny_lora_dpo"}
PAIRS = 32
# Micro batch 2, doubled every 3 steps (2, 4, 8, ...); short pairs and no LR schedule, so each step's LR is the
# config's times the square root of its global batch over the config's (2): the rule for AdamW. The 256 MiB budget
# holds far more than 16 pairs of 64 tokens, so the profiled memory cap never decides the batch.
GROWING = (
    f"dataset.split=train[:{PAIRS}]",
    "tokenizer.max_seq_len=64",
    "batch_size=2",
    "lr_scheduler=null",
    "adaptive_batching.growth_interval=3 steps",
    "batch_increase_function.factor=2",
    "batch_increase_function._component_=adaptive_batching.growth.geometric",
    "adaptive_batching.memory_budget=256MiB",
    "save_every_n_steps=4",
)
BASE_LR, REFERENCE_BATCH = 5e-4, 2
OOM_AT_7 = {"phase": "forward", "from_step": 7, "to_step": 7, "above": 4}  # step 7 runs at micro batch 8
STOP_AT = 5  # mid-epoch 1, between two growths and before the out-of-memory error
EXACT = (
    "loss",
    "lr",
    "gradient_accumulation_steps",
    "global_batch_size",
    "micro_batch_size",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "log_probs/chosen",
    "log_probs/rejected",
    "logits/chosen",
    "logits/rejected",
)


def recorded(runs: Path, name: str, rank: int = 0, restart: int = 0) -> list[dict[str, Any]]:
    """The steps faulty_run recorded for ``name`` (on ``rank``, in torchrun's ``restart``): step, epoch and the
    dataset indices of the pairs trained on."""
    return json.loads((runs / f"{name}-rank{rank}{f'-restart{restart}' if restart else ''}.json").read_text())


def assert_every_pair_once_per_epoch(steps: list[dict[str, Any]], pairs: int) -> None:
    for epoch in (0, 1):
        counts = Counter(i for step in steps if step["epoch"] == epoch for i in step["samples"])
        assert sorted(counts) == list(range(pairs)) and set(counts.values()) == {1}, epoch


@pytest.fixture(scope="module")
def chain(assets: Path, runs: Path) -> dict[str, Any]:
    """The uninterrupted run; the same run stopped by SIGTERM after step 5 (its checkpoint folder read at once);
    and its resume. Each first run profiles into a cache of its own (the out-of-memory error writes its cap there)."""

    def run(name: str, fault: dict, *more: str) -> Any:
        return faulty_run(
            runs, name, fault, assets, *GROWING, f"adaptive_batching.cache_dir={runs / name}-cache", *more, **DPO
        )

    straight = ok(run("straight", OOM_AT_7))
    first = run("chain", {**OOM_AT_7, "signal": "SIGTERM", "signal_at": STOP_AT})
    folder = runs / "chain" / "epoch_0"
    saved = {
        "marker": json.loads((folder / MARKER).read_text()),
        "status": run_status(runs / "chain"),
        "hidden": sorted(p.name for p in (runs / "chain").iterdir() if p.name.startswith(".incomplete")),
    }
    resumed = ok(
        faulty_run(
            runs,
            "resumed",
            OOM_AT_7,
            assets,
            *GROWING,
            f"output_dir={runs / 'chain'}",
            f"adaptive_batching.cache_dir={runs / 'chain'}-cache",
            "resume_from_checkpoint=True",
            **DPO,
        )
    )
    return {"straight": straight, "first": first, "saved": saved, "resumed": resumed}


@pytest.mark.e2e
def test_the_batch_of_pairs_grows_every_3_steps_and_the_lr_follows_the_sqrt_rule(chain: dict, runs: Path) -> None:
    output = chain["straight"]
    assert "Growth period 1 (every 3 steps) after optimizer step 3: micro batch 2 -> 4" in output
    assert "Growth period 2 (every 3 steps) after optimizer step 6: micro batch 4 -> 8" in output
    rows, steps = read_metrics(runs / "straight" / "logs"), recorded(runs, "straight")
    assert [row["global_batch_size"] for row in rows[:7]] == [2, 2, 2, 4, 4, 4, 8]
    assert [row["global_batch_size"] for row in rows] == [len(step["samples"]) for step in steps]
    assert_every_pair_once_per_epoch(steps, PAIRS)
    for row in rows:  # an epoch's last step may hold fewer pairs: its LR is the planned batch's
        planned = row["micro_batch_size"] * row["gradient_accumulation_steps"]
        assert row["lr"] == pytest.approx(BASE_LR * math.sqrt(planned / REFERENCE_BATCH), rel=1e-12), row["step"]
    assert rows[3]["lr"] > rows[2]["lr"] and rows[6]["lr"] > rows[5]["lr"]


@pytest.mark.e2e
def test_an_oom_at_micro_batch_8_retries_the_same_pairs_in_halves_under_the_same_global_batch_and_lr(
    chain: dict, runs: Path
) -> None:
    assert (
        "Out of memory at micro batch 8 in step 7 of epoch 1 (optimizer step 7) (injected: forward out of "
        "memory (rank 0)): running the same 8 samples again as micro batch 4 x accumulation 2 x 1 rank(s); global "
        "batch 8 and LR unchanged; micro batch capped at 4 for the rest of the run" in chain["straight"]
    )
    rows = read_metrics(runs / "straight" / "logs")
    assert [row["micro_batch_size"] for row in rows[:7]] == [2, 2, 2, 4, 4, 4, 4]
    assert (rows[6]["gradient_accumulation_steps"], rows[6]["global_batch_size"]) == (2, 8)
    assert rows[6]["lr"] == pytest.approx(BASE_LR * math.sqrt(8 / REFERENCE_BATCH), rel=1e-12)
    assert all(row["micro_batch_size"] <= 4 for row in rows[6:])  # the cap holds, growth goes on by accumulation
    assert max(row["global_batch_size"] for row in rows) > 8
    assert "Rank 0: finished at optimizer step" in chain["straight"]


@pytest.mark.e2e
def test_a_stop_signal_mid_epoch_saves_one_complete_checkpoint_and_exits_75(chain: dict) -> None:
    assert stopped(chain["first"], "SIGTERM") == STOP_AT
    output = chain["first"].stdout + chain["first"].stderr
    assert f"Saved the checkpoint of step {STOP_AT} of epoch 1 (optimizer step {STOP_AT})" in output
    saved = chain["saved"]
    assert saved["marker"]["complete"] is True and saved["marker"]["global_step"] == STOP_AT
    assert saved["hidden"] == [] and saved["status"].startswith("resumable"), saved


@pytest.mark.e2e
def test_the_resumed_run_trains_every_step_once_with_the_uninterrupted_losses_and_rewards_bit_for_bit(
    chain: dict, runs: Path
) -> None:
    assert f"Resuming at step {STOP_AT} of epoch 1 (optimizer step {STOP_AT})" in chain["resumed"]
    assert "Out of memory at micro batch 8 in step 7 of epoch 1" in chain["resumed"]  # met again after the resume
    assert logged_steps(runs / "chain" / "logs") == [row["step"] for row in read_metrics(runs / "straight" / "logs")]
    straight, resumed = read_metrics(runs / "straight" / "logs"), read_metrics(runs / "chain" / "logs")
    exact = lambda rows: [{key: row[key] for key in EXACT} for row in rows]  # noqa: E731
    assert exact(resumed) == exact(straight)
    before = [step for step in recorded(runs, "chain") if step["step"] <= STOP_AT]
    assert before + recorded(runs, "resumed") == recorded(runs, "straight")  # the same pairs in every step


# ---------------------------------------------------------------- two ranks, a token budget, a restart
TWO_PAIRS, BUDGET = 24, 1024
TWO_RANKS = (f"dataset.split=train[:{TWO_PAIRS}]", f"adaptive_batching.max_tokens={BUDGET}", "save_every_n_steps=2")


@pytest.fixture(scope="module")
def restarted(assets: Path, runs: Path) -> str:
    """2 ranks, micro batches of at most 1024 padded tokens, one per rank and step (saves after steps 2, 4, 6 and
    8): killed inside its second save, restarted once by torchrun, which resumes from the step-2 checkpoint."""
    return ok(
        faulty_run(
            runs,
            "two",
            {"kill_in_save": 2},
            assets,
            *TWO_RANKS,
            nproc=2,
            timeout=400,
            launcher=["--max-restarts=1"],
            **DPO,
        )
    )


def logged_by_file(log_dir: Path) -> list[dict[int, dict[str, str]]]:
    """Each log file's steps and their metrics as written (a torchrun restart writes a file of its own)."""
    files = sorted(log_dir.glob("log_*.txt"), key=lambda path: path.stat().st_mtime)
    return [
        {
            int(step): dict(item.split(":", 1) for item in fields.split())
            for step, fields in re.findall(r"^Step (\d+) \| (.*)$", path.read_text(), flags=re.M)
        }
        for path in files
    ]


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_two_ranks_killed_inside_a_save_restart_from_the_last_complete_checkpoint_and_exit_cleanly(
    restarted: str, runs: Path
) -> None:
    deleted = r"Deleting \S+/\.incomplete-epoch_0-\d+, a save that a kill interrupted"
    assert re.search(deleted, restarted), restarted[-3000:]
    assert re.search(r"torchrun restart 1 of job \S+: resuming from \S+/epoch_0 \(optimizer step 2\)", restarted)
    finished = re.findall(r"Rank (\d): finished at optimizer step (\d+)", restarted)
    assert sorted(rank for rank, _ in finished) == ["0", "1"] and len({step for _, step in finished}) == 1
    assert run_status(runs / "two").startswith("finished")
    assert not [p for p in (runs / "two").iterdir() if p.name.startswith((".incomplete", ".old"))]
    steps = []
    for rank in (0, 1):
        steps += [s for s in recorded(runs, "two", rank) if s["step"] <= 2] + recorded(runs, "two", rank, restart=1)
    assert_every_pair_once_per_epoch(steps, TWO_PAIRS)
    first, again = logged_by_file(runs / "two" / "logs")
    twice = sorted(set(first) & set(again))
    assert twice and min(twice) == 3  # the steps after the checkpoint, trained again after the restart
    for step in twice:
        assert {k: v for k, v in first[step].items() if k != "tokens_per_second_per_gpu"} == {
            k: v for k, v in again[step].items() if k != "tokens_per_second_per_gpu"
        }, step


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_a_token_budget_bounds_the_padded_tokens_of_each_micro_batch_of_pairs_both_sequences(
    restarted: str, runs: Path, assets: Path
) -> None:
    """Each rank's micro batch of each step (accumulation 1), as the run recorded it, collated as training collates
    it: chosen and rejected answers padded to the longest sequence of the micro batch, within the budget."""
    from torchtune import config

    from adaptive_batching.config.loading import load_config
    from adaptive_batching.training.objectives import PairCollate

    cfg = load_config("tiny_lora_dpo", [f"assets_dir={assets}", f"dataset.split=train[:{TWO_PAIRS}]"])
    tokenizer = config.instantiate(cfg.tokenizer)
    dataset, collate = config.instantiate(cfg.dataset, tokenizer), PairCollate(tokenizer.pad_id)
    micro_batches = [
        step["samples"]
        for rank in (0, 1)
        for restart in (0, 1)
        for step in recorded(runs, "two", rank, restart)
        if step["samples"]
    ]
    padded = [collate([dataset[i] for i in micro])["tokens"].numel() for micro in micro_batches]
    assert max(padded) <= BUDGET, padded
    assert len({len(micro) for micro in micro_batches}) > 1  # the budget, not a count, sets each micro batch
    assert max(padded) > BUDGET // 2  # filled: counted as one sequence, a pair would let twice as many in
    assert {row["max_tokens"] for row in read_metrics(runs / "two" / "logs")} == {BUDGET}
