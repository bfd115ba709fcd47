"""Deterministic, offline tiny assets for a Llama-3-architecture model.

The project must train end-to-end on a CPU without any model or dataset hub, so
this module writes everything a torchtune recipe needs from a single seed:

* a randomly initialised tiny ``llama3`` checkpoint in Hugging Face layout
  (``config.json`` + ``model.safetensors``) loadable by
  ``torchtune.training.FullModelHFCheckpointer`` with ``model_type="LLAMA3"``;
* a smaller tiny student of the same layout, tokenizer and vocabulary, which the tiny model
  teaches in knowledge distillation (``configs/tiny_kd.yaml``);
* a tiny byte-level BPE tokenizer in tiktoken format plus a HF-style special
  tokens file, loadable by ``torchtune.models.llama3.llama3_tokenizer``;
* a synthetic alpaca-format JSON dataset whose token lengths have a long tail,
  so that length-aware batching has something to work with.

Same seed, same bytes: every file is written deterministically and atomically.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_save
from torchtune.data import AlpacaToMessages
from torchtune.models.convert_weights import tune_to_hf
from torchtune.models.llama3 import Llama3Tokenizer, llama3, llama3_tokenizer
from torchtune.models.llama3._tokenizer import LLAMA3_SPECIAL_TOKENS
from torchtune.modules import TransformerDecoder

from adaptive_batching.assets.tiny_data import generate_dataset, generate_preferences
from adaptive_batching.assets.tiny_tokenizer import (
    NUM_BYTE_TOKENS,
    NUM_MERGEABLE_RANKS,
    special_tokens_json,
    tiktoken_ranks_file,
    train_bpe,
    training_texts,
)
from adaptive_batching.runtime.files import write_atomically

__all__ = [
    "NUM_BYTE_TOKENS",
    "NUM_MERGEABLE_RANKS",
    "DEFAULT_TINY_DIR",
    "TINY_MODEL_ARGS",
    "TINY_STUDENT_ARGS",
    "TinyAssetPaths",
    "build_tiny_model",
    "describe",
    "generate_dataset",
    "hf_config",
    "hf_state_dict",
    "load_tiny_tokenizer",
    "special_tokens_json",
    "tiktoken_ranks_file",
    "token_lengths",
    "train_bpe",
    "write_tiny_assets",
]

DEFAULT_TINY_DIR = "/tmp/adaptive-batching/tiny"

TINY_MODEL_ARGS: dict[str, Any] = {
    "vocab_size": 1280,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "embed_dim": 64,
    "max_seq_len": 512,
    "intermediate_dim": 192,
    "norm_eps": 1e-5,
    "rope_base": 500000.0,
}

# The student the tiny model teaches (knowledge distillation): one layer and half the width, the same vocabulary.
TINY_STUDENT_ARGS: dict[str, Any] = {
    **TINY_MODEL_ARGS,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "embed_dim": 32,
    "intermediate_dim": 96,
}

NUM_SPECIAL_TOKENS = TINY_MODEL_ARGS["vocab_size"] - NUM_MERGEABLE_RANKS


@dataclass(frozen=True)
class TinyAssetPaths:
    """Where the tiny assets live below ``root``.

    Attributes:
        root: directory holding everything below.
        model_dir: ``root/model`` with ``config.json`` and ``model.safetensors`` (HF Llama layout).
        tokenizer_path: ``root/tokenizer/tokenizer.model`` (tiktoken BPE ranks file).
        special_tokens_path: ``root/tokenizer/special_tokens.json`` (HF ``added_tokens`` format).
        dataset_path: ``root/data/alpaca_tiny.json`` (alpaca-format JSON list).
        preference_path: ``root/data/preference_tiny.json`` (chosen/rejected message lists, for DPO).
        student_dir: ``root/student``, the smaller tiny student (``TINY_STUDENT_ARGS``), same layout as model_dir.
    """

    root: Path
    model_dir: Path
    tokenizer_path: Path
    special_tokens_path: Path
    dataset_path: Path
    preference_path: Path
    student_dir: Path

    @classmethod
    def from_root(cls, root: str | Path) -> TinyAssetPaths:
        """Compute the asset paths below ``root`` without touching the filesystem."""
        root = Path(root)
        return cls(
            root=root,
            model_dir=root / "model",
            tokenizer_path=root / "tokenizer" / "tokenizer.model",
            special_tokens_path=root / "tokenizer" / "special_tokens.json",
            dataset_path=root / "data" / "alpaca_tiny.json",
            preference_path=root / "data" / "preference_tiny.json",
            student_dir=root / "student",
        )


# --------------------------------------------------------------------------- #
# Word lists for the synthetic dataset
# --------------------------------------------------------------------------- #


def load_tiny_tokenizer(paths: TinyAssetPaths, max_seq_len: int | None = None) -> Llama3Tokenizer:
    """Load the tiny tokenizer through torchtune's public ``llama3_tokenizer`` builder."""
    return llama3_tokenizer(
        path=str(paths.tokenizer_path),
        special_tokens_path=str(paths.special_tokens_path),
        max_seq_len=max_seq_len,
    )


# --------------------------------------------------------------------------- #
# Model
# --------------------------------------------------------------------------- #


def build_tiny_model(seed: int = 0, args: dict[str, Any] = TINY_MODEL_ARGS) -> TransformerDecoder:
    """Build ``llama3(**args)`` (the tiny model, or ``TINY_STUDENT_ARGS``) initialised from ``seed`` without
    touching global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return llama3(**args)


def hf_config(args: dict[str, Any] = TINY_MODEL_ARGS) -> dict[str, Any]:
    """HF ``config.json`` for the tiny model (or ``args``); FullModelHFCheckpointer reads its head/dim fields."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "bos_token_id": NUM_MERGEABLE_RANKS + list(LLAMA3_SPECIAL_TOKENS).index("<|begin_of_text|>"),
        "eos_token_id": NUM_MERGEABLE_RANKS + list(LLAMA3_SPECIAL_TOKENS).index("<|end_of_text|>"),
        "head_dim": args["embed_dim"] // args["num_heads"],
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
        "rope_scaling": None,
        "rope_theta": args["rope_base"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": args["vocab_size"],
    }


def hf_state_dict(model: TransformerDecoder, args: dict[str, Any] = TINY_MODEL_ARGS) -> dict[str, torch.Tensor]:
    """The model's weights (built from ``args``) converted to HF Llama names and q/k layout, contiguous for
    safetensors."""
    converted = tune_to_hf(
        model.state_dict(),
        num_heads=args["num_heads"],
        num_kv_heads=args["num_kv_heads"],
        dim=args["embed_dim"],
    )
    return {name: tensor.detach().contiguous() for name, tensor in converted.items()}


# --------------------------------------------------------------------------- #
# Writing
# --------------------------------------------------------------------------- #


def _json_bytes(obj: Any) -> bytes:
    """Canonical JSON encoding (sorted keys, ASCII, fixed indent) so equal data gives equal bytes."""
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=True) + "\n").encode("ascii")


def write_tiny_assets(
    output_dir: str | Path = DEFAULT_TINY_DIR, seed: int = 0, num_samples: int = 3000
) -> TinyAssetPaths:
    """Write the tiny model, its smaller student, tokenizer, dataset and preference pairs under ``output_dir`` and
    return their paths.

    Deterministic in ``seed`` (byte-identical files), idempotent (rewrites overwrite),
    and every file is replaced atomically.
    """
    paths = TinyAssetPaths.from_root(output_dir)

    records = generate_dataset(seed=seed, num_samples=num_samples)
    write_atomically(paths.dataset_path, _json_bytes(records))
    write_atomically(paths.preference_path, _json_bytes(generate_preferences(records, seed)))

    tokens = train_bpe(training_texts(records))
    write_atomically(paths.tokenizer_path, tiktoken_ranks_file(tokens))
    write_atomically(paths.special_tokens_path, _json_bytes(special_tokens_json()))

    model = build_tiny_model(seed)
    write_atomically(paths.model_dir / "model.safetensors", safetensors_save(hf_state_dict(model)))
    write_atomically(paths.model_dir / "config.json", _json_bytes(hf_config()))
    student = build_tiny_model(seed + 1, TINY_STUDENT_ARGS)
    write_atomically(
        paths.student_dir / "model.safetensors", safetensors_save(hf_state_dict(student, TINY_STUDENT_ARGS))
    )
    write_atomically(paths.student_dir / "config.json", _json_bytes(hf_config(TINY_STUDENT_ARGS)))
    return paths


# --------------------------------------------------------------------------- #
# Summary
# --------------------------------------------------------------------------- #


def token_lengths(paths: TinyAssetPaths) -> list[int]:
    """Untruncated token count of every dataset sample as torchtune's alpaca pipeline tokenizes it."""
    tokenizer = load_tiny_tokenizer(paths)
    to_messages = AlpacaToMessages()
    records = json.loads(paths.dataset_path.read_text())
    return [len(tokenizer.tokenize_messages(to_messages(r)["messages"])[0]) for r in records]


def _percentile(sorted_values: Sequence[int], fraction: float) -> int:
    """Nearest-rank percentile of already-sorted values."""
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


def describe(paths: TinyAssetPaths) -> str:
    """Short human summary: files with sizes, sample count and token-length percentiles."""
    files = [
        paths.model_dir / "config.json",
        paths.model_dir / "model.safetensors",
        paths.tokenizer_path,
        paths.special_tokens_path,
        paths.dataset_path,
        paths.preference_path,
        paths.student_dir / "config.json",
        paths.student_dir / "model.safetensors",
    ]
    lengths = sorted(token_lengths(paths))
    max_seq_len = TINY_MODEL_ARGS["max_seq_len"]
    over = sum(length > max_seq_len for length in lengths)
    out = io.StringIO()
    out.write(f"tiny assets in {paths.root}\n")
    for file in files:
        out.write(f"  {file.relative_to(paths.root)}: {file.stat().st_size:,} bytes\n")
    out.write(f"samples: {len(lengths)}\n")
    out.write(
        f"tokens per sample: p50={_percentile(lengths, 0.5)} p95={_percentile(lengths, 0.95)} "
        f"max={lengths[-1]}; >{max_seq_len}: {over} ({over / len(lengths):.1%})\n"
    )
    return out.getvalue()
