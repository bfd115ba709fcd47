"""Every ``_component_`` that does not import is one line before any model loads: the key, the component, and the
``pip install`` where one is known (``core.packages``); a misspelt name gets the closest one its module has."""

from __future__ import annotations

import importlib.util

import pytest
from config_edits import modified
from omegaconf import DictConfig, OmegaConf
from torchtune import config as tune_config

from adaptive_batching.config.components import components
from adaptive_batching.config.settings import validate_config
from adaptive_batching.core.nodes import building
from adaptive_batching.core.packages import NEEDS, PIP
from adaptive_batching.errors import ConfigError

LOGGERS = "torchtune.training.metric_logging."


def without(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """As if ``package`` were not installed, whatever this machine has."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))


@pytest.mark.parametrize(
    "logger, package, install",
    [
        ("WandBLogger", "wandb", "pip install wandb"),
        ("CometLogger", "comet_ml", "pip install comet_ml"),
        ("MLFlowLogger", "mlflow", "pip install mlflow"),
        ("TensorBoardLogger", "tensorboard", "pip install tensorboard"),
    ],
)
def test_a_logger_whose_package_is_missing_is_one_line_with_its_pip_install(
    base_cfg: DictConfig, monkeypatch: pytest.MonkeyPatch, logger: str, package: str, install: str
) -> None:
    """The logger classes import; their package is imported only when they are built, so the table knows it."""
    assert NEEDS[LOGGERS + logger] == package and PIP[package] == install
    without(monkeypatch, package)
    with pytest.raises(ConfigError) as error:
        validate_config(modified(base_cfg, {"metric_logger._component_": LOGGERS + logger}))
    assert str(error.value) == (
        f"config key 'metric_logger._component_' = '{LOGGERS}{logger}' needs {package}, "
        f"which is not installed: {install}"
    )


def test_wandb_comet_and_mlflow_are_not_installed_here() -> None:
    """What the lines above stand for on this install (the test extra has none of them)."""
    assert [importlib.util.find_spec(p) for p in ("wandb", "comet_ml", "mlflow")] == [None, None, None]


@pytest.mark.parametrize(
    "key, component, line",
    [
        (
            "model._component_",
            "torchtune.models.llama3.llama3x",
            "does not import: torchtune.models.llama3 has no 'llama3x'; did you mean 'torchtune.models.llama3.llama3'?",
        ),
        (
            "optimizer._component_",
            "torch.optim.AdamWW",
            "does not import: torch.optim has no 'AdamWW'; did you mean 'torch.optim.AdamW'?",
        ),
        (
            "dataset._component_",
            "torchtune.dataset.alpaca_dataset",
            "does not import: torchtune has no 'dataset'; did you mean 'torchtune.datasets'?",
        ),
        (
            "loss._component_",
            "no_such_package.Loss",
            "does not import: ModuleNotFoundError: No module named 'no_such_package'",
        ),
        ("optimizer._component_", "wandb.Optimizer", "needs wandb, which is not installed: pip install wandb"),
    ],
)
def test_a_component_that_does_not_import_is_one_line(
    base_cfg: DictConfig, monkeypatch: pytest.MonkeyPatch, key: str, component: str, line: str
) -> None:
    without(monkeypatch, "wandb")
    with pytest.raises(ConfigError) as error:
        validate_config(modified(base_cfg, {key: component}))
    assert str(error.value) == f"config key '{key}' = '{component}' {line}"


def test_nested_and_listed_components_are_checked_and_switched_off_ones_skipped(base_cfg: DictConfig) -> None:
    cfg = modified(
        base_cfg,
        {
            "dataset": [
                OmegaConf.to_container(base_cfg.dataset),
                {"_component_": "torchtune.datasets.alpaca_datasett"},
            ],
            "lr_scheduler": None,
            "metric_logger": {"_component_": None},
        },
    )
    found = dict((key, path) for key, path in components(cfg))
    assert found["dataset[1]._component_"] == "torchtune.datasets.alpaca_datasett"
    assert not any(key.startswith(("lr_scheduler", "metric_logger")) for key in found)
    with pytest.raises(
        ConfigError,
        match=r"^config key 'dataset\[1\]._component_' = "
        r"'torchtune.datasets.alpaca_datasett' does not import: torchtune.datasets "
        r"has no 'alpaca_datasett'; did you mean "
        r"'torchtune.datasets.alpaca_dataset'\?$",
    ):
        validate_config(cfg)


def test_a_missing_package_met_while_building_is_one_line_too() -> None:
    """The fallback for a component the table does not know: the ImportError a constructor raises."""
    with pytest.raises(ConfigError) as error, building("metric_logger"):
        tune_config.instantiate(OmegaConf.create({"_component_": LOGGERS + "WandBLogger"}))
    line = str(error.value)
    assert line.startswith("config key 'metric_logger': ImportError: ``wandb`` package not found.")
    assert line.endswith(" (pip install wandb)") and "\n" not in line
