"""The profile cache: hits, misses, stale and corrupt files, atomic writes, and the memory fingerprint."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from config_edits import modified
from omegaconf import DictConfig, OmegaConf

from adaptive_batching.config.inputs import memory_setup
from adaptive_batching.config.settings import validate_config
from adaptive_batching.core.paths import cache_dir, default_cache_dir
from adaptive_batching.errors import ConfigError
from adaptive_batching.profiling import cache as profile_cache
from adaptive_batching.profiling.cache import (
    CACHE_SCHEMA,
    cache_file,
    load_profile,
    memory_fingerprint_parts,
    save_profile,
)
from adaptive_batching.profiling.settings import ProfilerSettings
from adaptive_batching.runtime.files import fingerprint

KEY = "ab" * 32
RESULT = {"micro_batch": 24, "peak_bytes": [1, 2, 3], "budget": {"bytes": 10, "source": "explicit"}}


def key_of(cfg: DictConfig, **overrides: Any) -> str:
    machine = dict(
        world_size=1,
        device=torch.device("cpu"),
        device_name="cpu",
        device_memory_bytes=2**34,
        torch_version="2.13.0",
        seq_len=256,
    )
    machine.update(overrides)
    return fingerprint(memory_fingerprint_parts(memory_setup(cfg), validate_config(cfg).profiler, **machine))


# --- load and save ------------------------------------------------------------------------------


def test_saved_profile_loads_back(tmp_path: Path) -> None:
    path = cache_file(tmp_path / "profiles", KEY)
    save_profile(path, KEY, RESULT)
    assert load_profile(path, KEY) == RESULT
    record = json.loads(path.read_text())
    assert record["schema"] == CACHE_SCHEMA and record["key"] == KEY and record["result"] == RESULT
    assert "T" in record["saved_at"]


def test_missing_profile_is_a_silent_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert load_profile(tmp_path / "nothing.json", KEY) is None
    assert caplog.records == []


def test_profile_of_another_setup_is_stale(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "p.json"
    save_profile(path, "cd" * 32, RESULT)
    with caplog.at_level(logging.WARNING, logger=profile_cache.__name__):
        assert load_profile(path, KEY) is None
    assert "stale" in caplog.text and str(path) in caplog.text


def test_profile_of_another_schema_is_stale(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"schema": CACHE_SCHEMA + 1, "key": KEY, "saved_at": "x", "result": RESULT}))
    with caplog.at_level(logging.WARNING, logger=profile_cache.__name__):
        assert load_profile(path, KEY) is None
    assert "schema" in caplog.text


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\xff\xfe garbage \x80",
        b'{"schema": 1, "key": "' + KEY.encode() + b'", "result": {"micro_',
        b"[1, 2, 3]",
        b'"a string"',
        b"",
        json.dumps({"schema": CACHE_SCHEMA, "key": KEY, "result": [24]}).encode(),
    ],
)
def test_corrupt_profile_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger=profile_cache.__name__):
        assert load_profile(path, KEY) is None
    assert any(r.levelno == logging.WARNING and str(path) in r.getMessage() for r in caplog.records)


def test_save_creates_directories_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "p.json"
    save_profile(path, KEY, RESULT)
    save_profile(path, KEY, {"micro_batch": 32})
    assert os.listdir(path.parent) == ["p.json"]
    assert load_profile(path, KEY) == {"micro_batch": 32}


def test_a_failed_save_keeps_the_old_profile_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "p.json"
    save_profile(path, KEY, RESULT)

    def crash(src: str, dst: str) -> None:
        raise OSError("disk went away")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk went away"):
        save_profile(path, KEY, {"micro_batch": 1})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["p.json"]
    assert load_profile(path, KEY) == RESULT


def test_a_result_that_is_not_json_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises((TypeError, ValueError)):
        save_profile(tmp_path / "p.json", KEY, {"model": object()})
    with pytest.raises(ValueError):
        save_profile(tmp_path / "p.json", KEY, {"peak": float("nan")})
    assert os.listdir(tmp_path) == []


# --- where --------------------------------------------------------------------------------------


def test_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "adaptive-batching" / "profiles"
    assert cache_file(None, KEY) == tmp_path / "xdg" / "adaptive-batching" / "profiles" / f"{KEY[:16]}.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "adaptive-batching" / "profiles"
    assert cache_file("~/profiles", KEY) == tmp_path / "home" / "profiles" / f"{KEY[:16]}.json"
    assert cache_file(str(tmp_path), KEY) == tmp_path / f"{KEY[:16]}.json"


# --- fingerprint --------------------------------------------------------------------------------


def test_fingerprint_ignores_key_order() -> None:
    a = {"model": {"embed_dim": 64, "num_layers": 2}, "dtype": "bf16", "world_size": 2}
    b = {"world_size": 2, "dtype": "bf16", "model": {"num_layers": 2, "embed_dim": 64}}
    assert fingerprint(a) == fingerprint(b)
    assert len(fingerprint(a)) == 64 and int(fingerprint(a), 16) >= 0
    assert fingerprint(a) != fingerprint({**a, "world_size": 4})


def test_fingerprint_parts_are_plain_json(base_cfg: DictConfig) -> None:
    parts = memory_fingerprint_parts(
        memory_setup(base_cfg),
        validate_config(base_cfg).profiler,
        world_size=1,
        device=torch.device("cpu"),
        device_name="cpu",
        device_memory_bytes=2**34,
        torch_version="2.13.0",
        seq_len=1450,
    )
    assert json.loads(json.dumps(parts)) == parts
    assert parts["model"]["embed_dim"] == 64 and parts["worst_case_seq_len"] == 1450
    assert parts["optimizer"] == {"_component_": "torch.optim.AdamW"}


def test_fingerprint_is_stable_for_the_same_config(base_cfg: DictConfig) -> None:
    assert key_of(base_cfg) == key_of(modified(base_cfg, {}))


@pytest.mark.parametrize(
    "updates",
    [
        {"model.embed_dim": 128},
        {"model.num_layers": 3},
        {"model._component_": "torchtune.models.llama3.lora_llama3"},
        {"dtype": "bf16"},
        {"dataset.packed": True},
        {"enable_activation_checkpointing": True},
        {"compile": True},
        {"fsdp_cpu_offload": True},
        {"optimizer._component_": "torch.optim.SGD"},
        {"loss._component_": "torch.nn.CrossEntropyLoss"},  # one torchtune 0.6.1 imports
        {"adaptive_batching.memory_fraction": 0.8},
        {"adaptive_batching.memory_budget": "12GiB"},
        {"adaptive_batching.search_tolerance": 0.03},
    ],
)
def test_fingerprint_changes_with_what_changes_memory(base_cfg: DictConfig, updates: dict[str, Any]) -> None:
    assert key_of(modified(base_cfg, updates)) != key_of(base_cfg)


@pytest.mark.parametrize(
    "machine",
    [
        {"world_size": 2},
        {"device": torch.device("cuda", 0)},
        {"device_name": "NVIDIA H100"},
        {"device_memory_bytes": 2**35},
        {"torch_version": "2.14.0"},
        {"seq_len": 1450},
    ],
)
def test_fingerprint_changes_with_the_machine_and_the_worst_case_length(
    base_cfg: DictConfig, machine: dict[str, Any]
) -> None:
    assert key_of(base_cfg, **machine) != key_of(base_cfg)


@pytest.mark.parametrize(
    "updates",
    [
        {"optimizer.lr": 3e-4},
        {"optimizer.weight_decay": 0.1},
        {"adaptive_batching.safety_margin": 0.2},
        {"adaptive_batching.round_to": "power_of_two"},
        {"adaptive_batching.reprofile": True},
        {"adaptive_batching.cache_dir": "/tmp/elsewhere"},
        {"batch_size": 64},
        {"epochs": 9},
        {"seed": 7},
        {"adaptive_batching.memory_fraction": 0.9},
        {"adaptive_batching.search_tolerance": 0.01},
        {"enable_activation_checkpointing": False},
    ],
)
def test_fingerprint_ignores_what_does_not_change_memory(base_cfg: DictConfig, updates: dict[str, Any]) -> None:
    assert key_of(modified(base_cfg, updates)) == key_of(base_cfg)


def test_equivalent_budget_settings_fingerprint_alike(base_cfg: DictConfig) -> None:
    as_text = modified(base_cfg, {"adaptive_batching.memory_budget": "1GiB", "adaptive_batching.memory_fraction": 1})
    as_number = modified(base_cfg, {"adaptive_batching.memory_budget": 2**30, "adaptive_batching.memory_fraction": 1.0})
    assert key_of(as_text) == key_of(as_number)


def test_configs_without_optional_keys_still_fingerprint() -> None:
    minimal = OmegaConf.create({"model": {"_component_": "m", "embed_dim": 8}, "adaptive_batching": None})
    parts = memory_fingerprint_parts(
        memory_setup(minimal),
        ProfilerSettings(),
        world_size=1,
        device=torch.device("cpu"),
        device_name="cpu",
        device_memory_bytes=1,
        torch_version="x",
        seq_len=8,
    )
    assert parts["dtype"] == "fp32" and parts["compile"] is False and parts["worst_case_seq_len"] == 8
    assert parts["adaptive_batching.memory_fraction"] == 0.9 and parts["adaptive_batching.memory_budget"] is None
    assert parts["adaptive_batching.search_tolerance"] == 0.01
    assert isinstance(fingerprint(parts), str)


def test_a_dataset_list_is_packed_when_all_are_and_a_mix_is_an_error(base_cfg: DictConfig) -> None:
    def packed(datasets: list[dict[str, Any]]) -> bool:
        cfg = modified(base_cfg, {"dataset": datasets})
        return memory_fingerprint_parts(
            memory_setup(cfg),
            ProfilerSettings(),
            world_size=1,
            device=torch.device("cpu"),
            device_name="cpu",
            device_memory_bytes=1,
            torch_version="x",
            seq_len=8,
        )["dataset.packed"]

    assert packed([{"_component_": "a", "packed": True}, {"_component_": "b", "packed": True}]) is True
    assert packed([{"_component_": "a"}, {"_component_": "b", "packed": False}]) is False
    with pytest.raises(ConfigError, match="config key 'dataset' mixes packed and unpacked data sets"):
        packed([{"_component_": "a", "packed": True}, {"_component_": "b"}])


def test_the_configured_cache_dir_is_expanded_and_null_is_the_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One rule for the profile cache, the sample-length cache and ``estimate`` (core.paths.cache_dir)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir("~/profiles") == tmp_path / "profiles"
    assert cache_dir(None) == default_cache_dir()
    assert cache_file("~/profiles", "abcdef" * 4).parent == tmp_path / "profiles"
