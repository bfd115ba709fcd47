"""Every ``_component_`` the recipes build, imported before any model loads: one line for each that cannot be.

A component that does not import would otherwise fail when it is built, some after the model loaded, and
torchtune's loggers import their package only then (``WandBLogger`` imports ``wandb`` in its constructor), with a
traceback. Optional packages are checked by presence, never imported here (bitsandbytes is slow to import and
``estimate`` never needs it), from the one table of what each component needs (``core.packages``).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import pkgutil
import sys
from types import ModuleType
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf
from torchtune.config._utils import _get_component_from_path

from adaptive_batching.config.keys import RECIPE_KEYS
from adaptive_batching.core.nodes import one_line, optional_component
from adaptive_batching.core.packages import PIP, needed_package, package_of
from adaptive_batching.errors import ConfigError

# Read keys whose components are not built from here: ours with their own check, and a refused one's.
_NOT_BUILT = frozenset({"batch_increase_function", "profiler"})


def missing_package_line(key: str, component: str, package: str) -> str:
    """The one line for a component whose optional package is not installed."""
    return f"config key '{key}' = {component!r} needs {package}, which is not installed: {PIP[package]}"


def components(cfg: DictConfig) -> Iterator[tuple[str, str]]:
    """``(key, component path)`` of every ``_component_`` under the top-level keys the recipes build, nested ones
    and those in lists included (``dataset[1]._component_``); switched-off nodes are skipped."""
    stack: list[tuple[str, Any]] = [(str(key), cfg[key]) for key in cfg.keys()
                                    if str(key) in RECIPE_KEYS and str(key) not in _NOT_BUILT]
    while stack:
        where, node = stack.pop(0)
        if OmegaConf.is_dict(node) and optional_component(node) is not None:
            if isinstance(node.get("_component_", None), str):
                yield f"{where}._component_", node._component_
            stack.extend((f"{where}.{key}", node[key]) for key in node.keys() if key != "_component_")
        elif OmegaConf.is_list(node):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(node))


def check_components(cfg: DictConfig) -> None:
    """Raise ConfigError, in one line, for the first component whose optional package is missing (with the
    ``pip install``) or that does not import (with the name it may have meant)."""
    if os.getcwd() not in sys.path:  # as torchtune's instantiate: components of the user's own modules
        sys.path.append(os.getcwd())
    for key, component in components(cfg):
        package = needed_package(component)
        if package is not None:
            if importlib.util.find_spec(package) is None:
                raise ConfigError(missing_package_line(key, component, package))
            continue
        try:
            _get_component_from_path(component)
        except Exception as error:  # noqa: BLE001 - torchtune wraps every failure to import the path
            raise ConfigError(_import_failure(key, component, error)) from None


def _import_failure(key: str, component: str, error: BaseException) -> str:
    """The line for a component that does not import: the ``pip install`` of a known package the import missed,
    else the first name that is not there (with the closest name that is), else the import's own error."""
    cause, package = error.__cause__ or error, package_of(error)
    if package is not None:
        return missing_package_line(key, component, package)
    line = f"config key '{key}' = {component!r} does not import: "
    parts = component.split(".")
    for end in range(len(parts) - 1, 0, -1):
        try:
            owner = _get_component_from_path(".".join(parts[:end]))
        except Exception:  # noqa: BLE001 - not there either: look one level up
            continue
        names = {n for n in dir(owner) if not n.startswith("_")}
        if isinstance(owner, ModuleType):
            names |= {m.name for m in pkgutil.iter_modules(getattr(owner, "__path__", []))}
        if parts[end] in names:
            break  # it is there, but fails to import: its own error says why
        close = difflib.get_close_matches(parts[end], sorted(names), n=1, cutoff=0.75)
        where = ".".join(parts[:end])
        return line + f"{where} has no '{parts[end]}'" + (f"; did you mean '{where}.{close[0]}'?" if close else "")
    return line + one_line(cause)
