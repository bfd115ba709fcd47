"""Editing copies of the shipped configs in tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DELETE = object()


def modified(base: DictConfig, updates: dict[str, Any]) -> DictConfig:
    """A copy of ``base`` with dotted keys set (or removed with DELETE); ``base`` is untouched."""
    cfg = OmegaConf.create(OmegaConf.to_container(base, resolve=False))
    for key, value in updates.items():
        if value is DELETE:
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            del node[leaf]
        else:
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    return cfg
