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


# The nodes that point a config at a tiny model, its tokenizer, checkpoint and data.
TINY_NODES = ("model", "tokenizer", "dataset")
TINY_CHECKPOINTER_KEYS = ("checkpoint_dir", "checkpoint_files", "model_type")


def stock_on_tiny(stock: str, tiny: str, assets: Path, output_dir: Path, destination: Path) -> Path:
    """torchtune's stock config ``stock`` (a name ``tune cp`` takes) as a user edits a copy of it: the model,
    tokenizer, data set and checkpoint of our shipped config ``tiny`` (same family and method), everything
    else (optimizer, loss, dtype, activation checkpointing, batch, every other key) as torchtune ships it.
    Written to ``destination``, for ``tune run RECIPE --config destination``."""
    from adaptive_batching.config.loading import FINETUNE_RECIPES, stock_configs

    cfg = OmegaConf.load(stock_configs(FINETUNE_RECIPES)[stock])
    ours = OmegaConf.load(CONFIGS / f"{tiny}.yaml")
    for node in TINY_NODES:
        cfg[node] = ours[node]
    checkpointer = OmegaConf.to_container(ours.checkpointer, resolve=False)
    for key in TINY_CHECKPOINTER_KEYS:
        cfg.checkpointer[key] = checkpointer[key]
    cfg.assets_dir = str(assets)
    cfg.output_dir = str(output_dir)
    cfg.device = "cpu"
    OmegaConf.save(cfg, destination)
    return destination


def setting(settings: Any, name: str) -> Any:
    """The typed value of ``adaptive_batching.<name>`` in validated settings: its section's field."""
    from adaptive_batching.config.settings import ELASTIC, KNOBS

    section = KNOBS[name].section
    return settings.elastic if section == ELASTIC else getattr(getattr(settings, section), name)


def typed(name: str, value: Any) -> Any:
    """``adaptive_batching.<name>``'s config value as its section holds it."""
    from adaptive_batching.batching.elastic import ElasticSpec
    from adaptive_batching.growth.interval import parse_growth_interval

    if name == "growth_interval":
        return parse_growth_interval(value)
    if name == "elastic":
        return None if value is None else ElasticSpec.from_config(value)
    return tuple(value) if name == "stop_signals" else value
