"""Guard rails on the batch plan: refused when larger than the data, warned when the LR jumps."""

from __future__ import annotations

import pytest

from adaptive_batching.batching.checks import ALLOW_KEY, check_plan_against_data, lr_factor_warnings
from adaptive_batching.errors import ConfigError
from adaptive_batching.growth.planning import plan_batches


def plan(start: int, accumulation: int, ranks: int = 1, epochs: int = 1):  # type: ignore[no-untyped-def]
    return plan_batches(
        epochs=epochs, start=start, accumulation=accumulation, ranks=ranks, increase=None, memory_cap=None
    )


def test_the_stock_config_profiled_on_cpu_is_refused_before_training() -> None:
    """torchtune's llama3_2/1B_lora_single_device (accumulation 8) on 3000 samples: the profiler chose 2850."""
    with pytest.raises(ConfigError) as info:
        check_plan_against_data(
            plan(2850, 8),
            dataset_size=3000,
            profiled=True,
            allow_above_data=False,
            reference_global_batch=32,
            rule="sqrt",
        )
    message = str(info.value)
    assert "global batch 22800" in message and "3000 samples" in message
    assert "use_maximum_batch_size=True, gradient_accumulation_steps" in message
    assert "LR x26.7" in message and f"{ALLOW_KEY}=True" in message


def test_a_global_batch_above_the_data_is_accepted_when_asked_for() -> None:
    check_plan_against_data(
        plan(300, 8), dataset_size=3000, profiled=True, allow_above_data=True, reference_global_batch=32, rule="sqrt"
    )


def test_a_micro_batch_above_a_ranks_samples_is_refused_even_when_allowed() -> None:
    with pytest.raises(ConfigError, match="larger than a rank's 1500 samples"):
        check_plan_against_data(
            plan(1600, 1, ranks=2),
            dataset_size=3000,
            profiled=False,
            allow_above_data=True,
            reference_global_batch=32,
            rule="sqrt",
        )


def test_a_plan_within_the_data_passes() -> None:
    check_plan_against_data(
        plan(1500, 1, ranks=2),
        dataset_size=3000,
        profiled=False,
        allow_above_data=False,
        reference_global_batch=32,
        rule="sqrt",
    )


def test_an_lr_factor_above_8_warns_with_the_factor_and_the_rule() -> None:
    assert lr_factor_warnings(plan(256, 1), reference_global_batch=32, rule="linear") == []  # x8 is not above 8
    lines = lr_factor_warnings(plan(257, 1), reference_global_batch=32, rule="linear")
    assert len(lines) == 1 and "x8.0" in lines[0] and "'linear' rule" in lines[0]
    assert lr_factor_warnings(plan(2850, 8), reference_global_batch=32, rule="sqrt")[0].startswith(
        "epoch 1: the LR is scaled x26.7 by the 'sqrt' rule"
    )
    assert lr_factor_warnings(plan(2850, 8), reference_global_batch=32, rule="none") == []


@pytest.mark.e2e
def test_the_recipe_refuses_a_profiled_global_batch_above_the_data(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The stock-config case on a small data set: the profiler's micro batch x accumulation 8 > 40 samples."""
    from recipe_runs import tune_run

    from adaptive_batching.assets.tiny import write_tiny_assets

    assets = write_tiny_assets(tmp_path_factory.mktemp("assets"), num_samples=40).root
    out = tmp_path_factory.mktemp("run")
    result = tune_run(
        "adaptive_full_finetune",
        "tiny_full",
        [
            f"assets_dir={assets}",
            f"output_dir={out}",
            "gradient_accumulation_steps=8",
            "batch_increase_function=null",
            "tokenizer.max_seq_len=64",
        ],
        cwd=out,
    )
    assert result.returncode != 0
    message = (result.stdout + result.stderr).splitlines()
    assert any(
        "larger than the epoch's 40 samples" in line
        and "gradient_accumulation_steps" in line
        and f"{ALLOW_KEY}=True" in line
        for line in message
    ), result.stderr[-3000:]
    assert not list(out.glob("epoch_*"))
