"""The trainer's public seam (``training.hooks``): each hook is called where its docstring says, in a real run.

One profiled run (two epochs of two steps, each of two micro batches, under a small memory budget) records every hook
call; the tests read the
record against the run's own outputs (its metrics log, its profile, its checkpoints). Run as a script, this file
is that run: ``python test_trainer_hooks.py RECORD_JSON RECIPE_MODULE --config CONFIG [key=value ...]``.
"""

from __future__ import annotations

import atexit
import importlib
import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
HOOKS = (
    "before_setup",
    "collate",
    "after_setup",
    "before_trial",
    "before_train",
    "before_epoch",
    "before_step",
    "before_forward",
    "after_loss",
    "after_step",
    "after_epoch",
    "after_train",
)


def record_run(record: str, module_name: str, argv: list[str]) -> None:
    """Run the recipe with hooks that note each call (and what the run looked like then) into ``record``."""
    from adaptive_batching.training import hooks

    events: list[dict[str, Any]] = []
    atexit.register(lambda: Path(record).write_text(json.dumps(events)))

    def saved(parts: Any, epoch: int) -> bool:
        return (parts.output_dir / f"epoch_{epoch}").exists()

    class Recorder(hooks.TrainerHooks):
        def before_setup(self, preemption: Any) -> None:
            events.append({"hook": "before_setup", "stop_signals": [int(n) for n in preemption.signals]})

        def collate(self, collate: Any) -> Any:
            events.append({"hook": "collate"})

            def counted(samples: list) -> Any:
                events.append({"hook": "collated", "samples": len(samples)})
                return collate(samples)

            return counted

        def after_setup(self, parts: Any) -> None:
            events.append({"hook": "after_setup", "built": parts.model is not None and parts.profiler is not None})

        def before_trial(self, micro_batch: int) -> None:
            events.append({"hook": "before_trial", "micro_batch": micro_batch})

        def before_train(self, parts: Any) -> None:
            events.append({"hook": "before_train", "scheduled": len(parts.plan.entries) > 0})

        def after_train(self, parts: Any) -> None:
            events.append({"hook": "after_train", "step": parts.progress.global_step})

        def before_epoch(self, parts: Any, epoch: int) -> None:
            events.append({"hook": "before_epoch", "epoch": epoch, "saved": saved(parts, epoch)})

        def after_epoch(self, parts: Any, epoch: int) -> None:
            events.append(
                {
                    "hook": "after_epoch",
                    "epoch": epoch,
                    "saved": saved(parts, epoch),
                    "epochs_run": parts.progress.epochs_run,
                }
            )

        def before_step(self, parts: Any, micro_batches: list) -> None:
            events.append(
                {
                    "hook": "before_step",
                    "step": parts.progress.global_step,
                    "micro_batches": len(micro_batches),
                    "samples": [len(b["tokens"]) for b in micro_batches],
                }
            )

        def before_forward(self, batch: dict) -> None:
            events.append(
                {"hook": "before_forward", "samples": len(batch["tokens"]), "device": str(batch["tokens"].device)}
            )

        def after_loss(self, loss: Any) -> None:
            events.append({"hook": "after_loss", "requires_grad": bool(loss.requires_grad)})

        def after_step(self, parts: Any, stats: Any) -> None:
            events.append({"hook": "after_step", "step": parts.progress.global_step, "loss": stats.loss})

    hooks.install(Recorder())
    sys.argv = [module_name, *argv]
    importlib.import_module(module_name).recipe_main()


@pytest.fixture(scope="module")
def recorded(runs: Path, assets: Path) -> dict[str, Any]:
    from recipe_runs import read_metrics, run_command

    out, record = runs / "hooks", runs / "hooks.json"
    result = run_command(
        "script",
        [
            __file__,
            str(record),
            "adaptive_full_finetune",
            "--config",
            "tiny_full",
            f"assets_dir={assets}",
            f"output_dir={out}",
            "dataset.split=train[:200]",
            "adaptive_batching.memory_budget=24MiB",
            "use_maximum_batch_size=True",
            "batch_increase_function=null",
            "epochs=2",
            "max_steps_per_epoch=2",
            "batch_size=2",
            "gradient_accumulation_steps=2",
            f"adaptive_batching.cache_dir={runs / 'cache'}",
        ],
        cwd=runs,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    profile = json.loads((out / "profile" / "profile.json").read_text())
    return {"events": json.loads(record.read_text()), "metrics": read_metrics(out / "logs"), "profile": profile}


def named(events: list[dict], hook: str) -> list[dict]:
    return [e for e in events if e["hook"] == hook]


def index_of(events: list[dict], hook: str) -> list[int]:
    return [i for i, e in enumerate(events) if e["hook"] == hook]


@pytest.mark.e2e
def test_each_hook_is_called_and_the_run_meets_them_in_the_documented_order(recorded: dict) -> None:
    events = recorded["events"]
    first = {hook: index_of(events, hook)[0] for hook in HOOKS if index_of(events, hook)}
    assert sorted(first) == sorted(HOOKS), f"never called: {sorted(set(HOOKS) - set(first))}"
    assert [named(events, h) and len(named(events, h)) for h in ("before_setup", "collate", "after_setup")] == [1, 1, 1]
    assert named(events, "after_setup")[0]["built"] is True
    assert named(events, "before_setup")[0]["stop_signals"] == [int(signal.SIGTERM), int(signal.SIGUSR1)]
    assert first["before_setup"] < first["collate"] < first["after_setup"] < first["before_trial"]
    assert max(index_of(events, "before_trial")) < first["before_train"] < first["before_epoch"]
    assert named(events, "before_train")[0]["scheduled"] is True
    assert index_of(events, "after_train") == [len(events) - 1]
    assert named(events, "after_train")[0]["step"] == len(recorded["metrics"]) == 4


@pytest.mark.e2e
def test_before_trial_comes_before_each_of_the_profilers_trial_steps_and_its_forward(recorded: dict) -> None:
    events, trials = recorded["events"], recorded["profile"]["trials"]
    assert [e["micro_batch"] for e in named(events, "before_trial")] == [t["micro_batch"] for t in trials]
    for i in index_of(events, "before_trial"):
        assert events[i + 1]["hook"] == "collated"  # the worst-case batch, through the run's collate
        assert events[i + 2] == {"hook": "before_forward", "samples": events[i]["micro_batch"], "device": "cpu"}
        assert events[i + 3] == {"hook": "after_loss", "requires_grad": True}


@pytest.mark.e2e
def test_each_step_is_seen_before_its_forwards_and_after_them_before_the_trainer_counts_it(recorded: dict) -> None:
    events, metrics = recorded["events"], recorded["metrics"]
    starts, ends = index_of(events, "before_step"), index_of(events, "after_step")
    assert len(starts) == len(ends) == len(metrics)
    for n, (start, end) in enumerate(zip(starts, ends)):
        step = events[start]
        assert step["step"] == events[end]["step"] == n  # steps done before it: the trainer counts it after
        assert events[end]["loss"] == pytest.approx(metrics[n]["loss"], rel=1e-6)  # the step the log counts as n + 1
        inside = events[start + 1 : end]
        assert [e["hook"] for e in inside] == ["before_forward", "after_loss"] * step["micro_batches"]
        assert [e["samples"] for e in inside if e["hook"] == "before_forward"] == step["samples"]
        # Its micro batches were collated by the run's (wrapped) collate just before it.
        collated = [e for e in events[ends[n - 1] + 1 if n else 0 : start] if e["hook"] == "collated"]
        assert [e["samples"] for e in collated][-step["micro_batches"] :] == step["samples"]


@pytest.mark.e2e
def test_each_epochs_hooks_wrap_its_steps_and_come_before_its_save(recorded: dict) -> None:
    events = recorded["events"]
    epochs = list(zip(index_of(events, "before_epoch"), index_of(events, "after_epoch")))
    assert [(events[a]["epoch"], events[b]["epoch"]) for a, b in epochs] == [(0, 0), (1, 1)]
    for a, b in epochs:
        assert [events[i]["hook"] for i in range(a, b + 1)].count("before_step") == 2
        assert events[a]["saved"] is False and events[b]["saved"] is False  # the epoch's save comes after
        assert events[b]["epochs_run"] == events[b]["epoch"]  # ... and so does counting it done


def test_a_trainer_takes_the_installed_hooks_unless_given_its_own() -> None:
    from adaptive_batching.training import hooks

    mine, before = hooks.TrainerHooks(), hooks.installed()
    try:
        hooks.install(mine)
        assert hooks.installed() is mine
    finally:
        hooks.install(before)
    assert type(hooks.installed()) is hooks.TrainerHooks


if __name__ == "__main__":
    record_run(sys.argv[1], sys.argv[2], sys.argv[3:])
