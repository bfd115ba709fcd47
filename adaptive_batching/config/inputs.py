"""What the parts need from the config besides their settings sections, read here as typed values.

A part never receives the config (docs/contributing.md): the profiler gets a
:class:`~adaptive_batching.profiling.run.ProfiledSetup`, the batching a
:class:`~adaptive_batching.batching.worst_case.LengthSource`, both built from the config by the functions below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Union

from omegaconf import DictConfig, OmegaConf

from adaptive_batching.batching.data import data_files
from adaptive_batching.batching.worst_case import LengthSource, WorstCase, measure
from adaptive_batching.core.nodes import packed, plain
from adaptive_batching.core.paths import cache_dir
from adaptive_batching.errors import ConfigError
from adaptive_batching.profiling.run import ProfiledSetup

# Optimizer arguments that change the numbers, not the state tensors kept per parameter.
_OPTIMIZER_SCALARS = ("lr", "weight_decay", "betas", "eps")


def _select(cfg: DictConfig, key: str, default: Any) -> Any:
    return plain(OmegaConf.select(cfg, key, default=default))


def memory_setup(cfg: DictConfig) -> dict[str, Any]:
    """The config's part of the profile cache's fingerprint: every key that changes the largest micro batch that
    fits, as plain JSON-able values (the learning rate and other optimizer scalars left out on purpose)."""
    optimizer = _select(cfg, "optimizer", None)
    if isinstance(optimizer, Mapping):
        optimizer = {k: v for k, v in optimizer.items() if k not in _OPTIMIZER_SCALARS}
    return {
        "model": _select(cfg, "model", None),
        "dtype": _select(cfg, "dtype", "fp32"),
        "dataset.packed": packed(cfg.get("dataset", None)),
        "optimizer": optimizer,
        "loss._component_": _select(cfg, "loss._component_", None),
        "enable_activation_checkpointing": _select(cfg, "enable_activation_checkpointing", False),
        "compile": _select(cfg, "compile", False),
        # With accumulation, gradients stay alive through the next micro batches' forward passes.
        "gradients_alive_in_forward": int(_select(cfg, "gradient_accumulation_steps", 1) or 1) > 1,
        "fsdp_cpu_offload": _select(cfg, "fsdp_cpu_offload", False),
        "custom_sharded_layers": _select(cfg, "custom_sharded_layers", None),
        # Fake quantization keeps more for the backward (QAT); absent without a quantizer, as before it was read.
        **({"quantizer": quantizer} if (quantizer := _select(cfg, "quantizer", None)) else {}),
    }


def profiled_setup(cfg: DictConfig) -> ProfiledSetup:
    """What the profiler needs from the config: its memory fingerprint, the report's folder, ``compile``."""
    return ProfiledSetup(memory=memory_setup(cfg), output_dir=Path(cfg.output_dir),
                         compile=bool(cfg.get("compile", False)))


def length_source(cfg: DictConfig, folder: Optional[Union[str, Path]]) -> LengthSource:
    """What measuring the samples' token counts needs from the config; ``folder``: ``adaptive_batching.cache_dir``
    (None: the default cache folder)."""
    return LengthSource(
        dataset=OmegaConf.to_container(cfg.dataset, resolve=True),
        tokenizer=OmegaConf.to_container(cfg.tokenizer, resolve=True),
        data_files=tuple(data_files(cfg.dataset)),
        max_seq_len=cfg.tokenizer.get("max_seq_len", None),
        cache_dir=cache_dir(folder),
    )


def worst_case_of(cfg: DictConfig, folder: Optional[Union[str, Path]]) -> WorstCase:
    """The worst case of a config's data, building its tokenizer and data set here (``estimate``, which has
    no run). A data set or tokenizer that cannot be read here (a hub data set offline, a tokenizer file
    not downloaded) is one error that says to give the length instead."""
    from torchtune import config

    from adaptive_batching.batching.data import build_dataset
    from adaptive_batching.core.nodes import one_line

    try:
        tokenizer = config.instantiate(cfg.tokenizer)
        dataset, is_packed = build_dataset(cfg.dataset, tokenizer)
    except Exception as error:  # noqa: BLE001 - whatever stops the data being read, the way out is the same
        raise ConfigError(f"the worst-case sample length comes from the data of config keys 'tokenizer' and "
                          f"'dataset', which could not be read here ({one_line(error)[:300]}); give it with "
                          f"--seq-len N (tokens in the longest sample after truncation)") from None
    return measure(dataset, length_source(cfg, folder), packed=is_packed, quiet=True)[0]
