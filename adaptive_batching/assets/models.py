"""Offline assets for a real architecture: a randomly initialised Llama 3.2 1B checkpoint in HF format.

Validating the profiler on a GPU needs a model of realistic size, and this project cannot assume a
model hub. This module builds the model through torchtune's own builder
(``torchtune.models.llama3_2.llama3_2`` with the arguments of ``llama3_2_1b``), initialised from a
seed, and writes it as the shipped ``llama3_2_1b`` configs expect a download to look:

* ``ROOT/llama3_2_1b/model.safetensors``: bf16 weights under HF Llama key names
  (``torchtune.models.convert_weights.tune_to_hf``), the embedding tied to the output as in the
  real model (no ``lm_head.weight``), loadable by ``FullModelHFCheckpointer`` with
  ``model_type: LLAMA3_2``;
* ``ROOT/llama3_2_1b/config.json``: the HF fields the checkpointer reads.

The tokenizer and the data set are the tiny ones (``tiny_assets``), written to the same ``ROOT``:
their 1280 ids fit the 1B model's vocabulary of 128256, which is kept so the embedding, the output
projection and the loss have the real model's size. :func:`recipe_overrides` gives the ``key=value``
overrides that point the shipped configs at these files. The weights are random, so losses say
nothing about quality; memory and speed are those of the real model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torchtune import training
from torchtune.models.convert_weights import tune_to_hf
from torchtune.models.llama3 import llama3
from torchtune.models.llama3._tokenizer import LLAMA3_SPECIAL_TOKENS
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules import TransformerDecoder

from adaptive_batching.assets.tiny import (
    DEFAULT_TINY_DIR,
    NUM_MERGEABLE_RANKS,
    TINY_MODEL_ARGS,
    TinyAssetPaths,
    describe,
    write_tiny_assets,
)
from adaptive_batching.runtime.files import write_atomically

__all__ = [
    "MODELS",
    "ModelAssetPaths",
    "build_random_model",
    "hf_config",
    "hf_state_dict",
    "model_args",
    "recipe_overrides",
    "write_model_assets",
    "describe_model_assets",
]

# The arguments torchtune's llama3_2_1b() passes to llama3_2() (checked against it in the tests).
LLAMA3_2_1B_ARGS: dict[str, Any] = {
    "vocab_size": 128_256,
    "num_layers": 16,
    "num_heads": 32,
    "num_kv_heads": 8,
    "embed_dim": 2048,
    "max_seq_len": 131072,
    "intermediate_dim": 8192,
    "attn_dropout": 0.0,
    "norm_eps": 1e-5,
    "rope_base": 500_000,
    "scale_factor": 32,
    "tie_word_embeddings": True,
}

# The tiny Llama 3 at dims NF4 can quantize: every quantized weight's element count a multiple of 64 x 256
# (embed 256, intermediate 768, 2 KV heads of 64), for QLoRA on CPU (``configs/tiny_qlora.yaml``).
TINY_QLORA_ARGS: dict[str, Any] = {
    "vocab_size": 1280,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 256,
    "max_seq_len": 2048,
    "intermediate_dim": 768,
    "norm_eps": 1e-5,
    "rope_base": 500_000.0,
}

MODELS: dict[str, dict[str, Any]] = {
    "llama3_2_1b": {
        "builder": llama3_2,
        "args": LLAMA3_2_1B_ARGS,
        "model_type": "LLAMA3_2",
        "dtype": "bfloat16",
        "configs": ("llama3_2_1b", "llama3_2_1b_lora"),
    },
    "tiny_qlora": {
        "builder": llama3,
        "args": TINY_QLORA_ARGS,
        "model_type": "LLAMA3",
        "dtype": "float32",
        "configs": ("tiny_qlora",),
    },
}
CHOICES = ("tiny", *MODELS)
TOKENIZER_VOCAB = TINY_MODEL_ARGS["vocab_size"]  # ids the tiny tokenizer can produce: 0 .. 1279


@dataclass(frozen=True)
class ModelAssetPaths:
    """A model's folder next to the tiny tokenizer and data it is trained with."""

    tiny: TinyAssetPaths
    name: str
    model_dir: Path

    @classmethod
    def from_root(cls, root: str | Path, name: str) -> ModelAssetPaths:
        tiny = TinyAssetPaths.from_root(root)
        return cls(tiny=tiny, name=name, model_dir=tiny.root / name)


def model_args(name: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The builder arguments of ``name``, with ``overrides`` (a shrunk copy for tests) applied."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    args = dict(MODELS[name]["args"])
    unknown = sorted(set(overrides or {}) - set(args))
    if unknown:
        raise ValueError(f"unknown model argument(s) {unknown} for {name}; known: {sorted(args)}")
    args.update(overrides or {})
    if args["vocab_size"] < TOKENIZER_VOCAB:
        raise ValueError(
            f"vocab_size {args['vocab_size']} is below the tiny tokenizer's {TOKENIZER_VOCAB} ids: "
            "token ids would index past the embedding"
        )
    return args


def build_random_model(
    args: Mapping[str, Any],
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    builder: Any = llama3_2,
) -> TransformerDecoder:
    """``builder(**args)`` in ``dtype`` on ``device`` (``meta`` for shapes only), initialised from ``seed``
    without touching the global RNG state."""
    with torch.random.fork_rng(devices=[]), training.set_default_dtype(dtype), torch.device(device):
        torch.manual_seed(seed)
        return builder(**args)


def _head_dim(args: Mapping[str, Any]) -> int:
    return args["embed_dim"] // args["num_heads"]


def hf_state_dict(model: TransformerDecoder, args: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The weights under HF Llama names and q/k layout, contiguous (safetensors needs that)."""
    converted = tune_to_hf(
        model.state_dict(),
        num_heads=args["num_heads"],
        num_kv_heads=args["num_kv_heads"],
        dim=args["embed_dim"],
        head_dim=_head_dim(args),
    )
    return {name: tensor.detach().contiguous() for name, tensor in converted.items()}


def hf_config(args: Mapping[str, Any], dtype: str = "bfloat16") -> dict[str, Any]:
    """HF ``config.json``; FullModelHFCheckpointer reads the head counts, hidden size and head_dim."""
    specials = list(LLAMA3_SPECIAL_TOKENS)
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "bos_token_id": NUM_MERGEABLE_RANKS + specials.index("<|begin_of_text|>"),
        "eos_token_id": NUM_MERGEABLE_RANKS + specials.index("<|end_of_text|>"),
        "head_dim": _head_dim(args),
        "hidden_act": "silu",
        "hidden_size": args["embed_dim"],
        "intermediate_size": args["intermediate_dim"],
        "max_position_embeddings": args["max_seq_len"],
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": args["num_heads"],
        "num_hidden_layers": args["num_layers"],
        "num_key_value_heads": args["num_kv_heads"],
        "rms_norm_eps": args["norm_eps"],
        "rope_scaling": None
        if "scale_factor" not in args
        else {
            "factor": float(args["scale_factor"]),
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": float(args["rope_base"]),
        "tie_word_embeddings": bool(args.get("tie_word_embeddings", False)),
        "torch_dtype": dtype,
        "vocab_size": args["vocab_size"],
    }


def write_model_assets(
    output_dir: str | Path = DEFAULT_TINY_DIR,
    model: str = "llama3_2_1b",
    *,
    seed: int = 0,
    num_samples: int = 3000,
    overrides: Mapping[str, Any] | None = None,
) -> ModelAssetPaths:
    """Write the tiny tokenizer and data under ``output_dir`` and ``model``'s checkpoint (in its ``dtype``) in
    ``output_dir/model``; ``overrides`` change builder arguments (tests write a shrunk copy)."""
    args, entry = model_args(model, overrides), MODELS[model]
    write_tiny_assets(output_dir, seed=seed, num_samples=num_samples)
    paths = ModelAssetPaths.from_root(output_dir, model)
    built = build_random_model(args, seed=seed, dtype=getattr(torch, entry["dtype"]), builder=entry["builder"])
    state = hf_state_dict(built, args)
    write_atomically(
        paths.model_dir / "model.safetensors", lambda tmp: save_file(state, tmp, metadata={"format": "pt"})
    )
    config = json.dumps(hf_config(args, entry["dtype"]), sort_keys=True, indent=2) + "\n"
    write_atomically(paths.model_dir / "config.json", config)
    return paths


def recipe_overrides(paths: ModelAssetPaths, max_seq_len: int | None = None) -> list[str]:
    """``key=value`` overrides that point the shipped ``llama3_2_1b`` / ``llama3_2_1b_lora`` configs at
    these files: the checkpoint, the tiny tokenizer and the tiny alpaca data (both configs)."""
    tiny = paths.tiny
    out = [
        f"checkpointer.checkpoint_dir={paths.model_dir}",
        f"tokenizer.path={tiny.tokenizer_path}",
        f"tokenizer.special_tokens_path={tiny.special_tokens_path}",
        "dataset._component_=torchtune.datasets.alpaca_dataset",
        "dataset.source=json",
        f"dataset.data_files={tiny.dataset_path}",
        "dataset.split=train",
    ]
    if max_seq_len is not None:
        out.append(f"tokenizer.max_seq_len={max_seq_len}")
    return out


def describe_model_assets(paths: ModelAssetPaths) -> str:
    """The tiny assets' summary, the model's files with sizes, and how to run the shipped configs on them."""
    lines = [describe(paths.tiny).rstrip("\n"), f"{paths.name} in {paths.model_dir}"]
    for file in ("config.json", "model.safetensors"):
        lines.append(f"  {file}: {(paths.model_dir / file).stat().st_size:,} bytes")
    overrides = " ".join(recipe_overrides(paths, max_seq_len=2048))
    for config in MODELS[paths.name]["configs"]:
        recipe = "adaptive_lora_finetune" if config.endswith("lora") else "adaptive_full_finetune"
        lines.append(f"run: tune run {recipe} --config {config} {overrides}")
    return "\n".join(lines) + "\n"
