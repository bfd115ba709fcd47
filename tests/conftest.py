"""Fixtures shared by the test files."""

from __future__ import annotations

import pytest
from omegaconf import DictConfig, OmegaConf

from config_edits import CONFIGS


@pytest.fixture(scope="module")
def base_cfg() -> DictConfig:
    """The shipped tiny full config, as loaded from its file."""
    return OmegaConf.load(CONFIGS / "tiny_full.yaml")
