"""Fixtures shared by the test files."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch._inductor.config as inductor_config
from config_edits import CONFIGS
from omegaconf import DictConfig, OmegaConf

from adaptive_batching.assets.tiny import write_tiny_assets
from adaptive_batching.core import logs

# Inductor on CPU, in every test and every run they start: scalar C++ kernels. What the suite checks of a compiled
# step (its graphs, what it saves for the backward, its losses against eager) does not depend on the CPU's vector
# kernels, which take about half as long again to build from a cold cache (test_compiled_fake.py: 56 s of CPU, 38 s
# without). TORCHINDUCTOR_VEC_ISA_OK=1 tests them. Inductor read its environment when torch was imported above: this
# process is told directly, the processes it starts by the environment.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
inductor_config.cpp.vec_isa_ok = os.environ["TORCHINDUCTOR_VEC_ISA_OK"] == "1"


# The files that take longest, longest first (seconds of one worker, measured with --durations=0 on the 2-core
# machine): `make test` runs them before the others (--no-loadscope-reorder keeps this order; xdist's own puts the files
# with the most tests first), so that the two workers, given a file at a time, finish together.
LONGEST_FIRST = (
    "test_benchmarks.py",
    "test_validate_device.py",
    "test_profile_recipe.py",
    "test_oom_recovery.py",
    "test_stock_configs.py",
    "test_estimate_savers.py",
    "test_preemption.py",
    "test_vision.py",
    "test_estimate_kd_qat.py",
    "test_token_and_elastic_recipe.py",
    "test_first_hour.py",
    "test_chaos.py",
    "test_benchmark_limit.py",
    "test_checkpointing.py",
    "test_two_nodes.py",
    "test_qlora.py",
    "test_recipes.py",
    "test_families.py",
    "test_estimate_dpo.py",
    "test_memory_savers_recipe.py",
    "test_compile.py",
    "test_schedule_recipe.py",
    "test_estimate_vision.py",
    "test_qat.py",
    "test_kd.py",
    "test_config_error_ranks.py",
    "test_dpo_faults.py",
    "test_glibc_restart.py",
    "test_vision_parity.py",
    "test_stop_before_save.py",
    "test_dpo.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (:data:`LONGEST_FIRST`), the rest in their order; each file's tests in theirs."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module")
def base_cfg() -> DictConfig:
    """The shipped tiny full config, as loaded from its file."""
    return OmegaConf.load(CONFIGS / "tiny_full.yaml")


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline tiny model, tokenizer and data, written once per test session (per xdist worker); read only."""
    return write_tiny_assets(tmp_path_factory.mktemp("assets")).root


@pytest.fixture(scope="session")
def vision_assets(assets: Path) -> Path:
    """The tiny Llama 3.2 Vision model, images and data, written below the tiny assets (whose tokenizer they use)."""
    from adaptive_batching.assets.tiny_vision import write_tiny_vision_assets

    return write_tiny_vision_assets(assets).root


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder a test module's recipe runs share."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture
def said(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The lines the run's log (``adaptive_batching.core.logs``) has said so far in this test: ``said()``."""
    caplog.set_level(logging.INFO, logger=logs.log.name)
    return lambda: [record.getMessage() for record in caplog.records if record.name == logs.log.name]
