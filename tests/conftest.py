"""Fixtures shared by the test files."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Callable

import pytest
from config_edits import CONFIGS
from omegaconf import DictConfig, OmegaConf

from adaptive_batching.assets.tiny import write_tiny_assets
from adaptive_batching.core import logs

# The benchmark scripts some tests load import their sibling ``common.py`` (as ``python benchmarks/x.py`` finds it).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


# The slowest files, slowest first (a suite's per-file times, ``make test``'s --durations), started before the rest:
# ``--dist loadfile --no-loadscope-reorder`` hands whole files to the workers in collection order, so a long file
# never starts last while the other worker idles. A stale order costs minutes, never a test.
SLOW_FILES = ("test_benchmarks.py", "test_profile_recipe.py", "test_stock_configs.py", "test_oom_recovery.py",
              "test_estimate_kd_qat.py", "test_validate_device.py", "test_estimate_savers.py", "test_qlora.py",
              "test_compile.py", "test_two_nodes.py", "test_families.py", "test_token_and_elastic_recipe.py",
              "test_first_hour.py", "test_estimate_dpo.py", "test_chaos.py", "test_memory_savers_recipe.py",
              "test_recipes.py", "test_kd.py", "test_preemption.py", "test_schedule_recipe.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of SLOW_FILES first, in that order; the others after them, each file's tests in their order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))


@pytest.fixture(scope="module")
def base_cfg() -> DictConfig:
    """The shipped tiny full config, as loaded from its file."""
    return OmegaConf.load(CONFIGS / "tiny_full.yaml")


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline tiny model, tokenizer and data, written once per test session (per xdist worker); read only."""
    return write_tiny_assets(tmp_path_factory.mktemp("assets")).root


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder a test module's recipe runs share."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture
def said(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The lines the run's log (``adaptive_batching.core.logs``) has said so far in this test: ``said()``."""
    caplog.set_level(logging.INFO, logger=logs.log.name)
    return lambda: [record.getMessage() for record in caplog.records if record.name == logs.log.name]
