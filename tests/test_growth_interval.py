"""Growth inside an epoch: the interval's parsing and periods, and its settings checks (no model needed)."""

from __future__ import annotations

import pytest
from config_edits import modified
from omegaconf import DictConfig

from adaptive_batching.batching.sampler import SamplerSpan
from adaptive_batching.batching.shape import BatchShape, EpochBatch
from adaptive_batching.config.settings import validate_config
from adaptive_batching.errors import ConfigError
from adaptive_batching.growth.interval import GrowthInterval, parse_growth_interval
from adaptive_batching.growth.planning import grow_entry, plan_batches


@pytest.mark.parametrize(
    "value, expected",
    [
        ("epoch", GrowthInterval("epoch", 1)),
        ("50 steps", GrowthInterval("steps", 50)),
        ("1 step", GrowthInterval("steps", 1)),
        ("  2000 samples ", GrowthInterval("samples", 2000)),
        ("7sample", GrowthInterval("samples", 7)),
    ],
)
def test_interval_parsing(value: str, expected: GrowthInterval) -> None:
    assert parse_growth_interval(value) == expected


@pytest.mark.parametrize("value", ["epochs", "0 steps", "-3 steps", "steps", "3 tokens", 5, None, True, "1.5 steps"])
def test_bad_intervals_name_the_key_and_the_allowed_values(base_cfg: DictConfig, value: object) -> None:
    with pytest.raises(ValueError, match="adaptive_batching.growth_interval"):
        parse_growth_interval(value)
    with pytest.raises(ConfigError, match=r"adaptive_batching.growth_interval.*'epoch', 'N steps' or 'N samples'"):
        validate_config(modified(base_cfg, {"adaptive_batching.growth_interval": value}))


def test_periods_count_steps_or_samples_from_the_start_of_the_run() -> None:
    steps, samples = GrowthInterval("steps", 3), GrowthInterval("samples", 10)
    assert [steps.period(s, 0) for s in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert [samples.period(0, n) for n in (0, 9, 10, 19, 25)] == [0, 0, 1, 1, 2]
    assert steps.describe() == "every 3 steps" and GrowthInterval().describe() == "at every epoch start"
    with pytest.raises(ValueError):
        GrowthInterval().period(1, 1)


def test_an_interval_needs_a_growth_function_and_sample_count_batching(base_cfg: DictConfig) -> None:
    with pytest.raises(ConfigError, match="growth_interval.*batch_increase_function is null"):
        validate_config(
            modified(base_cfg, {"adaptive_batching.growth_interval": "5 steps", "batch_increase_function": None})
        )
    with pytest.raises(ConfigError, match="growth_interval.*token-budget batching"):
        validate_config(
            modified(base_cfg, {"adaptive_batching.growth_interval": "5 steps", "adaptive_batching.max_tokens": 4096})
        )
    settings = validate_config(modified(base_cfg, {"adaptive_batching.growth_interval": "64 samples"}))
    assert settings.growth.growth_interval == GrowthInterval("samples", 64)
    assert settings.growth.growth_interval.spelling == "64 samples"


def test_grow_entry_is_one_step_of_the_epoch_plan() -> None:
    """A boundary inside an epoch decides the batch exactly as an epoch start does."""
    for mode in ("skip", "accumulate"):
        plan = plan_batches(
            epochs=4, start=3, accumulation=2, ranks=2, increase=lambda e, c: 4, memory_cap=9, grow_past_memory=mode
        )
        entry = plan[0]
        for epoch in range(1, 4):
            entry = grow_entry(entry, 4, epoch=epoch, accumulation=2, ranks=2, memory_cap=9, grow_past_memory=mode)
            assert entry == plan[epoch]
    capped = grow_entry(
        EpochBatch(0, 8, 0, BatchShape(8, 1, 1), "start", 9),
        4,
        epoch=0,
        accumulation=1,
        ranks=1,
        memory_cap=9,
        grow_past_memory="skip",
    )
    assert capped.shape == BatchShape(8, 1, 1) and capped.reason == "capped"


def test_a_segment_maps_epoch_steps_to_its_sampler_and_round_trips() -> None:
    segment = SamplerSpan(first_sample=24, start_step=3)
    assert segment.local(5) == 2
    assert SamplerSpan.from_state(segment.state_dict()) == segment and SamplerSpan.from_state(None) == SamplerSpan()
