"""The config checks of torchtune's single-device memory savers (``optimizer_in_bwd``, activation offloading): each
error one line naming the keys, before any model loads; the recipes' settings and ``estimate``'s inputs
(``config.trace_inputs``) read them through these. (The optional packages their optimizers come from are checked
with every other component's, in ``config.components``.)"""

from __future__ import annotations

from omegaconf import DictConfig

from adaptive_batching.core.defaults import DEFAULT_DEVICE
from adaptive_batching.core.nodes import plain
from adaptive_batching.errors import ConfigError


def optimizer_in_bwd(cfg: DictConfig) -> bool:
    """Whether the config steps the optimizer inside the backward; it then cannot accumulate gradients, nor clip
    them (torchtune refuses both). The recipes and ``estimate`` check it so."""
    value = plain(cfg.get("optimizer_in_bwd", None))
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"config key 'optimizer_in_bwd' = {value!r} is invalid: expected true, false or null")
    if not value:
        return False
    key = "config key 'optimizer_in_bwd' = True"
    accumulation = plain(cfg.get("gradient_accumulation_steps", 1))
    if accumulation not in (None, 1):
        raise ConfigError(
            f"{key} steps the optimizer inside each backward, so it cannot accumulate gradients: set "
            f"gradient_accumulation_steps=1 (it is {accumulation!r}), or optimizer_in_bwd=False"
        )
    if plain(cfg.get("clip_grad_norm", None)) is not None:
        raise ConfigError(
            f"{key} steps each parameter before the whole gradient exists, so it cannot clip its norm: "
            "set clip_grad_norm=null, or optimizer_in_bwd=False"
        )
    return True


def check_optimizer_in_bwd(cfg: DictConfig, *, grow_past_memory: str, elastic: bool, max_tokens: bool) -> bool:
    """:func:`optimizer_in_bwd`, and nothing of ours that needs several micro batches per optimizer step with it
    (``elastic``, ``max_tokens``: whether those keys are set)."""
    if not optimizer_in_bwd(cfg):
        return False
    conflicts = (
        ("grow_past_memory", grow_past_memory == "accumulate", "grows past the memory cap by accumulating gradients"),
        ("elastic", elastic, "realises its global batch by accumulating gradients"),
        ("max_tokens", max_tokens, "runs several token-budget micro batches per optimizer step"),
    )
    for name, on, why in conflicts:
        if on:
            raise ConfigError(
                f"config keys 'adaptive_batching.{name}' = {plain(cfg.adaptive_batching[name])!r} and "
                f"'optimizer_in_bwd' = True do not go together: the first {why}, which an optimizer "
                f"stepped inside the backward cannot; change one of them"
            )
    return True


def check_activation_offloading(cfg: DictConfig, *, needs_cuda: bool = True) -> bool:
    """As torchtune's recipes: activation offloading is for CUDA (``needs_cuda``: the config's device; ``estimate``
    predicts for a device it does not have), on top of activation checkpointing. Whether it is on."""
    value = plain(cfg.get("enable_activation_offloading", None))
    if value is not None and not isinstance(value, bool):
        raise ConfigError(
            f"config key 'enable_activation_offloading' = {value!r} is invalid: expected true, false or null"
        )
    if not value:
        return False
    device = str(plain(cfg.get("device", DEFAULT_DEVICE)))
    if needs_cuda and not device.startswith("cuda"):
        raise ConfigError(
            f"config key 'enable_activation_offloading' = True needs device=cuda (device is "
            f"{device!r}); torchtune: enable_activation_offloading should only be True when training on "
            "CUDA. Set it to false"
        )
    if not plain(cfg.get("enable_activation_checkpointing", False)):
        raise ConfigError(
            "config key 'enable_activation_offloading' = True needs "
            "enable_activation_checkpointing=True, as in torchtune; set both, or it to false"
        )
    return True
