"""Llama 3.2 Vision configs: whether a config trains a vision model, the image tiles its transform cuts, and the
checks a vision config gets, in one line each before any model loads.

A vision sample is a text and its images; torchtune's Llama 3.2 Vision transform (the config's ``tokenizer``) cuts
each image into up to ``max_num_tiles`` square tiles of ``tile_size`` pixels, and
``padded_collate_tiled_images_and_mask`` pads a micro batch's images to its most tiles. The geometry is read from
the config, not from a built transform, so that ``estimate`` (which loads no tokenizer file) knows it too.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from adaptive_batching.batching.data import DEFAULT_COLLATE
from adaptive_batching.core.defaults import DEFAULT_DTYPE
from adaptive_batching.core.nodes import plain
from adaptive_batching.errors import ConfigError

TILED_COLLATE = "torchtune.data.padded_collate_tiled_images_and_mask"
VISION_MODEL = "llama3_2_vision"  # in the name of every Llama 3.2 Vision builder, torchtune's and the tiny ones
# torchtune's Llama 3.2 Vision transforms: the builder (patch size and most tiles fixed) and the class.
BUILDER, CLASS = "llama3_2_vision_transform", "Llama3VisionTransform"
VISION_RECIPES = ("adaptive_full_finetune", "adaptive_lora_finetune")


@dataclass(frozen=True)
class ImageGeometry:
    """How the transform cuts an image: square tiles of ``tile_size`` pixels, ``patch_size``-pixel patches, at most
    ``max_num_tiles`` tiles an image."""

    tile_size: int
    patch_size: int
    max_num_tiles: int

    @property
    def tokens_per_tile(self) -> int:
        """Encoder tokens a tile makes: its patches and a class token."""
        return (self.tile_size // self.patch_size) ** 2 + 1

    def describe(self) -> str:
        return (
            f"up to {self.max_num_tiles} tiles an image of {self.tile_size} pixels, {self.tokens_per_tile} encoder "
            f"tokens a tile"
        )


def _component(cfg: DictConfig, key: str) -> str:
    return str(OmegaConf.select(cfg, f"{key}._component_", default="") or "")


def is_vision(cfg: DictConfig) -> bool:
    """Whether the config trains a Llama 3.2 Vision model: its model builder, its transform or its collate says so."""
    collate = plain(cfg.get("collate_fn", DEFAULT_COLLATE))
    transform = _component(cfg, "tokenizer").rsplit(".", 1)[-1]
    return VISION_MODEL in _component(cfg, "model") or transform in (BUILDER, CLASS) or collate == TILED_COLLATE


def image_geometry(cfg: DictConfig) -> ImageGeometry:
    """The tiles of the config's vision transform (config key ``tokenizer``)."""
    node, name = cfg.tokenizer, _component(cfg, "tokenizer")
    if name.endswith("." + BUILDER):
        return ImageGeometry(int(node.get("image_size", 560)), 14, 4)
    if name.endswith("." + CLASS):
        return ImageGeometry(int(node.tile_size), int(node.patch_size), int(node.get("max_num_tiles", 4)))
    raise ConfigError(
        f"config key 'tokenizer._component_' = '{name}': a vision model's samples need torchtune's Llama 3.2 Vision "
        f"transform, which cuts images into tiles: torchtune.models.llama3_2_vision.{BUILDER} or {CLASS}"
    )


def check_vision(cfg: DictConfig, recipe: str, token_budget: bool) -> ImageGeometry | None:
    """The image geometry of a vision config (None for a text one), after checking that the recipe trains vision
    models and that the config's transform, collate, model, data and dtype agree (one line each)."""
    if not is_vision(cfg):
        return None
    model = _component(cfg, "model")
    if recipe not in VISION_RECIPES:
        raise ConfigError(
            f"config key 'model._component_' = '{model}' is a vision model, which {recipe} does not train: "
            f"use {' or '.join(VISION_RECIPES)}"
        )
    geometry = image_geometry(cfg)
    collate = plain(cfg.get("collate_fn", DEFAULT_COLLATE))
    if collate != TILED_COLLATE:
        raise ConfigError(
            f"config key 'collate_fn' = {collate!r}: a vision model's samples carry image tiles: "
            f"set collate_fn={TILED_COLLATE}"
        )
    if VISION_MODEL not in model:
        raise ConfigError(
            f"config key 'model._component_' = '{model}' is not a Llama 3.2 Vision model, and config key "
            f"'collate_fn' gives it images: use a llama3_2_vision builder or a text collate"
        )
    image_size = OmegaConf.select(cfg, "model.image_size", default=None)
    if image_size is not None and int(image_size) != geometry.tile_size:
        raise ConfigError(
            f"config key 'model.image_size' = {image_size} differs from the transform's tiles of "
            f"{geometry.tile_size} pixels (config key 'tokenizer'): set both to the same size"
        )
    if OmegaConf.select(cfg, "dataset.packed", default=False):
        raise ConfigError("config key 'dataset.packed' = True: torchtune does not pack vision samples: set it False")
    dtype = plain(cfg.get("dtype", DEFAULT_DTYPE))
    if dtype != "bf16":
        raise ConfigError(
            f"config key 'dtype' = '{dtype}': torchtune's vision transform makes bf16 image tiles, which only a "
            f"bf16 model takes: set dtype=bf16"
        )
    if token_budget:
        raise ConfigError(
            "config key 'adaptive_batching.max_tokens': a token budget counts text tokens, and a vision sample also "
            f"costs its image tiles ({geometry.describe()}) in the encoder and the cross-attention: "
            "batch vision samples by count (remove max_tokens)"
        )
    return geometry
