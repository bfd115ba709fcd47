"""Reading config nodes the same way everywhere: plain values, switched-off components, packed data."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from adaptive_batching.core.packages import PIP, package_of
from adaptive_batching.errors import ConfigError


def plain(value: Any) -> Any:
    """A config node as plain Python (dicts, lists, scalars), interpolations resolved; anything else as is."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def optional_component(node: Any) -> DictConfig | None:
    """``node`` unless it is switched off: null, or a node whose ``_component_`` is null.

    torchtune rewrites the override ``key=null`` on a component node to ``key._component_: null``,
    and ``~key`` cannot remove a component node, so both spellings mean "off".
    """
    if node is None:
        return None
    if isinstance(node, DictConfig) and "_component_" in node and node._component_ is None:
        return None
    return node


def packed(dataset: Any) -> bool:
    """Whether the ``dataset`` node (one data set, or a list, concatenated) is packed. torchtune's
    ``ConcatDataset`` refuses a mix of packed and unpacked data sets, so a mix is an error naming the key."""
    parts = plain(dataset)
    parts = parts if isinstance(parts, list) else [parts]
    flags = [isinstance(part, Mapping) and bool(part.get("packed", False)) for part in parts]
    if any(flags) and not all(flags):
        raise ConfigError(
            "config key 'dataset' mixes packed and unpacked data sets (packed: "
            f"{flags}); torchtune cannot concatenate them: pack all or none"
        )
    return all(flags)


def one_line(error: BaseException) -> str:
    """An error as one line: its type and its message, lines joined."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _is_config_error(error: BaseException) -> bool:
    """Errors a config node causes while it is built: a `_component_` that does not import, one whose optional
    package is missing (torchtune's loggers import theirs when built), a file that is not there, or arguments the
    component does not take (a TypeError raised at torchtune's call of the component, not inside it, which would
    be a bug with a traceback worth keeping)."""
    from torchtune.config._errors import InstantiationError

    if isinstance(error, (InstantiationError, FileNotFoundError)) or package_of(error) is not None:
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, TypeError) and bool(frames) and frames[-1].name == "_create_component"


@contextlib.contextmanager
def building(key: str) -> Iterator[None]:
    """Build the config node ``key``: an error that is the config's (see :func:`_is_config_error`) becomes a
    :class:`ConfigError` naming the key, reported in one line."""
    try:
        yield
    except Exception as error:
        if not _is_config_error(error):
            raise
        package = package_of(error)
        install = f" ({PIP[package]})" if package is not None else ""
        raise ConfigError(f"config key '{key}': {one_line(error)}{install}") from error
