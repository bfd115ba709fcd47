"""Top-level keys: near misses of ours and '+' keys are refused, other unread keys are listed."""

from __future__ import annotations

import logging

import pytest
from config_edits import CONFIGS, modified
from omegaconf import DictConfig, OmegaConf

from adaptive_batching.config.keys import check_top_level_keys, interpolated_keys, meant_key
from adaptive_batching.config.loading import load_config
from adaptive_batching.config.settings import ConfigError, validate_config


@pytest.mark.parametrize("name", ["tiny_full", "tiny_lora", "llama3_2_1b", "llama3_2_1b_lora", "llama3_8b",
                                  "llama3_8b_lora"])
def test_shipped_configs_have_no_unread_keys(name: str) -> None:
    assert check_top_level_keys(OmegaConf.load(CONFIGS / f"{name}.yaml")) == []


def test_interpolation_only_keys_are_used() -> None:
    cfg = OmegaConf.load(CONFIGS / "tiny_full.yaml")
    assert "assets_dir" in interpolated_keys(cfg) and "output_dir" in interpolated_keys(cfg)


@pytest.mark.parametrize("override, typo, meant", [
    ("use_max_batch_size=True", "use_max_batch_size", "use_maximum_batch_size"),
    ("batch_increase_fn=null", "batch_increase_fn", "batch_increase_function"),
    ("lr_scale=linear", "lr_scale", "lr_scaling"),
    ("adaptive_batch.memory_budget=1GiB", "adaptive_batch", "adaptive_batching"),
])
def test_a_near_miss_of_our_keys_is_refused_naming_the_key_meant(override: str, typo: str, meant: str) -> None:
    cfg = load_config("tiny_full", [override])
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert f"'{typo}'" in str(info.value) and f"did you mean '{meant}'" in str(info.value)


def test_a_plus_key_is_refused_naming_the_key_meant() -> None:
    """torchtune has no '+' syntax: the override made a top-level key literally named '+adaptive_batching'."""
    cfg = load_config("tiny_full", ["+adaptive_batching.keep_global_batch=True"])
    assert "+adaptive_batching" in cfg
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    assert "'+adaptive_batching'" in str(info.value) and "write adaptive_batching.keep_global_batch=True (without the '+')" in str(info.value)


def test_other_unread_keys_get_one_warning_line(base_cfg: DictConfig, caplog: pytest.LogCaptureFixture) -> None:
    cfg = modified(base_cfg, {"log_peak_memory_stats": True, "dataloader_workers": 2, "my_note": "x"})
    with caplog.at_level(logging.WARNING):
        validate_config(cfg)
    lines = [r.getMessage() for r in caplog.records if "not read by the recipes" in r.getMessage()]
    assert lines == ["config keys not read by the recipes (ignored): dataloader_workers, my_note"]


def test_distant_keys_are_not_near_misses() -> None:
    assert meant_key("log_peak_memory_stats") is None and meant_key("output_dir") is None
    assert meant_key("use_maximum_batch") == "use_maximum_batch_size"
