"""Every ``_component_`` the recipes build, there and imported before any model loads: one line for each that is
not.

A component that does not import would otherwise fail when it is built, some after the model loaded, and
torchtune's loggers import their package only then (``WandBLogger`` imports ``wandb`` in its constructor), with a
traceback. Optional packages are checked by presence, never imported here (bitsandbytes is slow to import and
``estimate`` never needs it), from the one table of what each component needs (``core.packages``). A node the
recipes need that is missing or null (``checkpointer=null``), a null node inside one, and a checkpointer's
``model_type`` that torchtune does not know are refused too (:func:`check_nodes`): what the config says, whatever
this machine holds (the files themselves are ``config.inputs``'s).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import pkgutil
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torchtune.config._utils import _get_component_from_path

from adaptive_batching.config.keys import RECIPE_KEYS
from adaptive_batching.core.nodes import one_line, optional_component, plain
from adaptive_batching.core.packages import PIP, needed_package, package_of
from adaptive_batching.errors import ConfigError

# Read keys whose components are not built from here: ours with their own check, and a refused one's.
_NOT_BUILT = frozenset({"batch_increase_function", "profiler"})
# The nodes every recipe builds, and what each is; the others are optional (null: off) or an objective's own
# (``config.training_kinds`` requires them where its recipe needs them).
REQUIRED: dict[str, str] = {
    "model": "the model",
    "tokenizer": "the tokenizer",
    "dataset": "the data set",
    "optimizer": "the optimizer",
    "loss": "the loss",
    "checkpointer": "the checkpointer that loads the model's weights",
}


def missing_package_line(key: str, component: str, package: str) -> str:
    """The one line for a component whose optional package is not installed."""
    return f"config key '{key}' = {component!r} needs {package}, which is not installed: {PIP[package]}"


def components(cfg: DictConfig) -> Iterator[tuple[str, str]]:
    """``(key, component path)`` of every ``_component_`` under the top-level keys the recipes build, nested ones
    and those in lists included (``dataset[1]._component_``); switched-off nodes are skipped."""
    stack: list[tuple[str, Any]] = [
        (str(key), cfg[key]) for key in cfg.keys() if str(key) in RECIPE_KEYS and str(key) not in _NOT_BUILT
    ]
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


def check_nodes(cfg: DictConfig) -> None:
    """Raise ConfigError, in one line, for a node the recipes need that is missing or null, for a null node
    inside a node they build (``dataset[1]``, a list's part), and for a checkpointer's ``model_type`` that
    torchtune 0.6.1 does not know. torchtune turns the override ``key=null`` on a node into ``key._component_:
    null``, which would fail when built, some after the model loaded."""
    for key, what in REQUIRED.items():
        if key not in cfg or cfg[key] is None:
            raise ConfigError(f"config key '{key}' is missing")
        if optional_component(cfg[key]) is None:
            raise ConfigError(
                f"config key '{key}' is null: the recipes build {what} from it; give it a "
                "'_component_' as torchtune's configs do"
            )
    for key, node in _nodes(cfg):
        if optional_component(node) is None and "." in key.replace("[", "."):
            raise ConfigError(
                f"config key '{key}' is null: it is inside a node the recipes build, which builds "
                "it too; give it a '_component_' or remove it"
            )
        if _is_checkpointer(node) and "model_type" in node:
            _check_model_type(f"{key}.model_type", plain(node.model_type))


def _nodes(cfg: DictConfig) -> Iterator[tuple[str, Any]]:
    """``(key, node)`` of every component node (one with a ``_component_``, null or not) the recipes build,
    top-level ones first; a switched-off top-level node is given but not entered. Values are not resolved here
    (an interpolation is the checks' of its key)."""
    stack: list[tuple[str, Any]] = [
        (str(key), cfg._get_node(key)) for key in cfg.keys() if str(key) in RECIPE_KEYS and str(key) not in _NOT_BUILT
    ]
    while stack:
        where, node = stack.pop(0)
        if OmegaConf.is_dict(node) and "_component_" in node:
            yield where, node
            if optional_component(node) is not None:
                stack.extend((f"{where}.{key}", node._get_node(key)) for key in node.keys() if key != "_component_")
        elif OmegaConf.is_dict(node):
            stack.extend((f"{where}.{key}", node._get_node(key)) for key in node.keys())
        elif OmegaConf.is_list(node):
            items = [node._get_node(i) for i in range(len(node))]
            parts = any(OmegaConf.is_dict(item) and "_component_" in item for item in items)
            off = OmegaConf.create({"_component_": None})  # a null part of a list of nodes (``dataset: [a, null]``)
            stack.extend((f"{where}[{i}]", off if parts and item._is_none() else item) for i, item in enumerate(items))


def _is_checkpointer(node: Any) -> bool:
    """A torchtune checkpointer node (``...Checkpointer``), switched on."""
    component = optional_component(node)
    return component is not None and str(component.get("_component_", "")).endswith("Checkpointer")


def _check_model_type(key: str, value: Any) -> None:
    """``model_type`` names one of torchtune's ``ModelType`` members (it converts the weights by it)."""
    from torchtune.training.checkpointing._utils import ModelType

    if not isinstance(value, str) or value not in ModelType.__members__:
        raise ConfigError(
            f"config key '{key}' = {value!r} is invalid: expected one of torchtune's model types: "
            f"{', '.join(ModelType.__members__)}"
        )
