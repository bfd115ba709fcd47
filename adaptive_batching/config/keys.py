"""The top-level config keys the recipes read, and what to say about the others.

torchtune accepts any top-level key, so a misspelt key (``use_max_batch_size=True``,
``save_every_n_step=5``) or a ``+key=value`` override (torchtune has no ``+`` syntax: it makes a key
literally named ``+key``) would silently ask for something that never happens. Such keys are refused
before the model loads, a misspelt one with the key it is closest to (one rule, :func:`meant_key`, for
our keys and torchtune's); keys that ask for another kind of training are refused by
``config.training_kinds``; other keys nobody reads get one warning line.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from adaptive_batching.config.training_kinds import TRAINING_KEYS
from adaptive_batching.errors import ConfigError

ADAPTIVE_KEYS = ("use_maximum_batch_size", "batch_increase_function", "lr_scaling", "adaptive_batching")

# Every top-level key the recipes, the trainer or the validation read.
RECIPE_KEYS = frozenset(
    {
        *ADAPTIVE_KEYS,
        "output_dir",
        "model",
        "tokenizer",
        "dataset",
        "collate_fn",
        "seed",
        "shuffle",
        "checkpointer",
        "resume_from_checkpoint",
        "batch_size",
        "gradient_accumulation_steps",
        "epochs",
        "max_steps_per_epoch",
        "save_every_n_steps",
        "optimizer",
        "lr_scheduler",
        "loss",
        "clip_grad_norm",
        "compile",
        "device",
        "dtype",
        "enable_activation_checkpointing",
        "metric_logger",
        "log_every_n_steps",
        "custom_sharded_layers",
        "fsdp_reshard_after_forward",
        "fsdp_cpu_offload",
        "save_adapter_weights_only",
        "cudnn_deterministic_mode",
        "log_peak_memory_stats",
        "low_cpu_ram",
        "ref_checkpointer",  # adaptive_full_dpo's reference model; the other recipes refuse it (config.training_kinds)
        "quantizer",
        "fake_quant_after_n_steps",  # QAT in the fine-tuning recipes; the others refuse them (same)
        "teacher_model",
        "teacher_checkpointer",
        "kd_loss",
        "kd_ratio",  # adaptive_knowledge_distillation's (same)
        # In torchtune's stock configs, read by no recipe of torchtune 0.6.1 either (``fsdp.cpu_offload``), or only
        # with tensor parallelism, which is refused: accepted silently, as torchtune accepts them.
        "fsdp",
        "tensor_parallel_plan",
        # Refused unless off (see settings): read, so not unknown.
        "optimizer_in_bwd",
        "enable_activation_offloading",
        "tensor_parallel_dim",
        "profiler",
    }
)

# Top-level keys torchtune 0.6.1's recipes read that change nothing these recipes train (memory, checkpoint
# writing, logging, generation, evaluation): never taken for a misspelling, ignored with the warning.
TORCHTUNE_OTHER_KEYS = frozenset(
    {
        "ac_mode",
        "ac_option",
        "enable_async_checkpointing",
        "save_every_n_epochs",
        "dataloader",
        "log_level",
        "enable_kv_cache",
        "prompt",
        "max_new_tokens",
        "temperature",
        "top_k",
        "stop_token_ids",
        "tasks",
        "limit",
        "max_seq_length",
        "include_path",
    }
)
# The keys a misspelt key may have meant: every top-level key of torchtune 0.6.1's recipes and ours.
MEANT = frozenset(RECIPE_KEYS | set(TRAINING_KEYS) | TORCHTUNE_OTHER_KEYS)

_REFERENCE = re.compile(r"\$\{\s*([A-Za-z_][A-Za-z0-9_]*)")
_CLOSENESS = 0.75


def interpolated_keys(cfg: DictConfig) -> set[str]:
    """Top-level keys other values refer to (``${assets_dir}/model``): used, though no code reads them."""
    found: set[str] = set()
    stack: list[Any] = [OmegaConf.to_container(cfg, resolve=False)]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            found.update(_REFERENCE.findall(item))
    return found


def meant_key(key: str, candidates: Iterable[str] = MEANT) -> str | None:
    """The known key that ``key`` is a near miss of (difflib's ratio >= 0.75), or None; None for a known key."""
    if key in candidates:
        return None
    matches = difflib.get_close_matches(key.lstrip("+"), list(candidates), n=1, cutoff=_CLOSENESS)
    return matches[0] if matches else None


def check_top_level_keys(cfg: DictConfig) -> list[str]:
    """Raise ConfigError for a ``+`` key or a near miss of a known key; return the other unread keys."""
    used = RECIPE_KEYS | interpolated_keys(cfg)
    unread = sorted(str(key) for key in cfg.keys() if str(key) not in used)
    for key in unread:
        if key.startswith("+"):
            written = ", ".join(f"{path.lstrip('+')}={value}" for path, value in _leaves(key, cfg[key]))
            raise ConfigError(
                f"config key '{key}' starts with '+': torchtune's overrides have no '+' syntax, so it made a key "
                f"literally named '{key}' that nothing reads; write {written} (without the '+')"
            )
        meant = meant_key(key)
        if meant in ADAPTIVE_KEYS:
            raise ConfigError(
                f"config key '{key}' is not read by the recipes; did you mean '{meant}'? "
                f"(the adaptive top-level keys: {', '.join(ADAPTIVE_KEYS)})"
            )
        if meant is not None:
            raise ConfigError(f"config key '{key}' is not read by the recipes; did you mean '{meant}'?")
    return unread


def _leaves(prefix: str, node: Any) -> list[tuple[str, Any]]:
    """``(dotted path, value)`` of every leaf under ``node``, for naming what a '+' override meant."""
    if not OmegaConf.is_dict(node):
        return [(prefix, node)]
    return [leaf for key, value in node.items() for leaf in _leaves(f"{prefix}.{key}", value)]
