"""Reading config nodes the same way everywhere: plain values, switched-off components, packed data."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from adaptive_batching.errors import ConfigError


def plain(value: Any) -> Any:
    """A config node as plain Python (dicts, lists, scalars), interpolations resolved; anything else as is."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def optional_component(node: Any) -> Optional[DictConfig]:
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
        raise ConfigError("config key 'dataset' mixes packed and unpacked data sets (packed: "
                          f"{flags}); torchtune cannot concatenate them: pack all or none")
    return all(flags)
