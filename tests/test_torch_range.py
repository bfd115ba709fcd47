"""The torch releases the package supports: what pyproject.toml pins and the README says, and one line at start, from
a recipe or the ``adaptive-batching`` command, for a torch outside them (before any model loads)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

from adaptive_batching import cli
from adaptive_batching.config.loading import parse
from adaptive_batching.core import packages
from adaptive_batching.runtime import memory

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_and_the_readme_name_the_range_the_check_holds() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in dependencies if d.startswith("torch") and d[5:6] in "<>=!~ "] == [packages.TORCH_REQUIREMENT]
    assert f"`{packages.TORCH_REQUIREMENT}`" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.1", "2.14.1+cu130"])
def test_a_torch_in_the_range_is_supported(version: str) -> None:
    assert packages.unsupported_torch(version) is None


@pytest.mark.parametrize("version", ["2.10.0", "2.6.0+cu124", "2.15.0", "2.15.0.dev20260101", "3.0.0"])
def test_a_torch_outside_the_range_gets_one_line(version: str) -> None:
    message = packages.unsupported_torch(version)
    assert message == (
        f"torch {version} is installed; adaptive-batching supports {packages.TORCH_REQUIREMENT}: "
        f'pip install "{packages.TORCH_REQUIREMENT}"'
    )


def test_the_installed_torch_is_read_without_importing_it() -> None:
    import torch

    installed = packages.installed_torch()
    assert installed is not None and installed.split("+")[0] == str(torch.__version__).split("+")[0]  # PyPI's: no +cu
    assert packages.unsupported_torch(packages.installed_torch()) is None  # the suite runs on a supported torch


def test_the_command_says_one_line_before_it_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(packages, "installed_torch", lambda: "2.15.0")
    ran: list[Any] = []
    monkeypatch.setattr(cli, "cmd_ls", ran.append)
    assert cli.main(["ls"]) == 2
    assert ran == []
    assert capsys.readouterr().err == f"config error: {packages.unsupported_torch('2.15.0')}\n"


def test_a_recipe_says_one_line_before_it_loads_anything(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(packages, "installed_torch", lambda: "2.10.0")
    monkeypatch.setattr(memory, "freeze_long_lived_objects", lambda: None)
    monkeypatch.setattr(sys, "argv", ["x", "--config", "tiny_full"])
    ran: list[Any] = []
    with pytest.raises(SystemExit) as info:
        parse(ran.append)()
    assert info.value.code == 1 and ran == []
    assert capsys.readouterr().err == f"config error: {packages.unsupported_torch('2.10.0')}\n"
