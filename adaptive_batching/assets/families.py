"""Tiny offline models of torchtune's other families: Qwen 2.5, Gemma 2, Phi-3 and Mistral.

Each is built by torchtune's own component builder at tiny sizes, randomly initialised from a seed, and
written as its Hugging Face checkpoint (``config.json`` + ``model.safetensors``, through the family's own
``tune_to_hf``) so that ``FullModelHFCheckpointer`` loads it with the family's ``model_type``; next to it,
a tiny tokenizer in the family's own format, loaded by the family's own torchtune tokenizer. They train on
the tiny alpaca data (``tiny.py``), which ``write_family_assets`` writes beside them. What each family
brings that the tiny Llama does not: Qwen 2.5 ties the output projection to the embedding and has biases
in q, k and v; Gemma 2 ties too, caps logits softly and alternates sliding-window layers; Phi-3 fuses q, k,
v and the MLP's gate and up projections in its checkpoint; Mistral reads a sentencepiece tokenizer with a
chat template.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_save
from torchtune.models import convert_weights
from torchtune.models.gemma2 import gemma2
from torchtune.models.gemma2._convert_weights import gemma2_tune_to_hf
from torchtune.models.mistral import mistral
from torchtune.models.phi3 import phi3
from torchtune.models.phi3._convert_weights import phi3_tune_to_hf
from torchtune.models.phi3._tokenizer import PHI3_SPECIAL_TOKENS
from torchtune.models.qwen2 import qwen2
from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf
from torchtune.models.qwen2_5._tokenizer import QWEN2_5_SPECIAL_TOKENS

from adaptive_batching.assets.tiny import DEFAULT_TINY_DIR, write_tiny_assets
from adaptive_batching.assets.tiny_tokenizer import NUM_MERGEABLE_RANKS, train_bpe, training_texts
from adaptive_batching.assets.tokenizers import qwen2_files, sentencepiece_model, special_tokens_file
from adaptive_batching.runtime.files import write_atomically

SPM_VOCAB = 1024  # sentencepiece pieces of the Gemma, Phi-3 and Mistral tokenizers
COMMON = {"num_layers": 2, "num_heads": 4, "embed_dim": 64, "intermediate_dim": 192, "max_seq_len": 512}


@dataclass(frozen=True)
class Family:
    """One family's tiny model: torchtune's builder and its arguments, the checkpointer's ``model_type``,
    the HF names and ``config.json`` (``to_hf``, ``hf_config``), and the tokenizer's files and builder."""

    name: str
    builder: Callable[..., torch.nn.Module]
    args: dict[str, Any]
    model_type: str
    to_hf: Callable[[dict[str, torch.Tensor], Mapping[str, Any]], dict[str, torch.Tensor]]
    hf_config: dict[str, Any]
    tokenizer: str  # "qwen2" (vocab.json + merges.txt) or "sentencepiece" (tokenizer.model)
    specials: tuple[str, ...] = ()  # written to special_tokens.json at ids after the trained vocabulary

    @property
    def tied(self) -> bool:
        """Whether the output projection is the embedding (no ``output.weight`` of its own)."""
        return bool(self.args.get("tie_word_embeddings", self.builder is gemma2))


def _heads(args: Mapping[str, Any]) -> dict[str, int]:
    return {"num_heads": args["num_heads"], "num_kv_heads": args["num_kv_heads"], "dim": args["embed_dim"]}


FAMILIES: dict[str, Family] = {
    "qwen2_5": Family(
        "qwen2_5",
        qwen2,
        {
            **COMMON,
            "vocab_size": 1088,
            "num_kv_heads": 2,
            "tie_word_embeddings": True,
            "rope_base": 1_000_000.0,
            "norm_eps": 1e-6,
        },
        "QWEN2",
        lambda sd, a: qwen2_tune_to_hf(sd, **_heads(a), tie_word_embeddings=True),
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True},
        "qwen2",
        tuple(QWEN2_5_SPECIAL_TOKENS),
    ),
    "gemma2": Family(
        "gemma2",
        gemma2,
        {
            **COMMON,
            "vocab_size": SPM_VOCAB,
            "num_kv_heads": 2,
            "head_dim": 16,
            "sliding_window_size": 64,
            "query_pre_attn_scalar": 16,
        },
        "GEMMA2",
        lambda sd, a: gemma2_tune_to_hf(sd, **_heads(a), head_dim=a["head_dim"]),
        {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 16, "tie_word_embeddings": True},
        "sentencepiece",
    ),
    "phi3": Family(
        "phi3",
        phi3,
        {**COMMON, "vocab_size": 1088, "num_kv_heads": 4},
        "PHI3_MINI",
        lambda sd, a: phi3_tune_to_hf(sd),
        {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "tie_word_embeddings": False},
        "sentencepiece",
        tuple(PHI3_SPECIAL_TOKENS),
    ),
    "mistral": Family(
        "mistral",
        mistral,
        {**COMMON, "vocab_size": SPM_VOCAB, "num_kv_heads": 2},
        "MISTRAL",
        lambda sd, a: convert_weights.tune_to_hf(sd, **_heads(a)),
        {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "tie_word_embeddings": False},
        "sentencepiece",
    ),
}


@dataclass(frozen=True)
class FamilyAssetPaths:
    """``root/<family>/``: the checkpoint and the tokenizer; ``root/data``: the tiny data set."""

    root: Path
    family: str

    @property
    def folder(self) -> Path:
        return self.root / self.family

    @property
    def dataset(self) -> Path:
        return self.root / "data" / "alpaca_tiny.json"


def build_family_model(family: Family, seed: int = 0) -> torch.nn.Module:
    """The family's tiny model in fp32 on CPU, initialised from ``seed`` without touching the global RNG. The
    embedding is drawn at std 0.02, as HF initialises these models: a tied output projection at
    ``nn.Embedding``'s std 1 would make logits of about 8 and a first loss of about 50."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = family.builder(**family.args)
        torch.nn.init.normal_(model.get_parameter("tok_embeddings.weight"), std=0.02)
    return model


def hf_config(family: Family) -> dict[str, Any]:
    """The ``config.json`` fields torchtune's checkpointer reads (and HF would), at the tiny sizes."""
    a = family.args
    return {
        **family.hf_config,
        "hidden_size": a["embed_dim"],
        "intermediate_size": a["intermediate_dim"],
        "num_attention_heads": a["num_heads"],
        "num_key_value_heads": a["num_kv_heads"],
        "num_hidden_layers": a["num_layers"],
        "max_position_embeddings": a["max_seq_len"],
        "vocab_size": a["vocab_size"],
        "torch_dtype": "float32",
    }


def _json(data: Any) -> bytes:
    return (json.dumps(data, sort_keys=True, indent=2) + "\n").encode("ascii")


def write_family_assets(
    output_dir: str | Path = DEFAULT_TINY_DIR, name: str = "qwen2_5", *, seed: int = 0, num_samples: int = 3000
) -> FamilyAssetPaths:
    """Write the tiny data (and Llama tokenizer and model) under ``output_dir`` and ``name``'s checkpoint and
    tokenizer in ``output_dir/name``. Deterministic in ``seed``; every file replaced atomically."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}")
    family = FAMILIES[name]
    tiny = write_tiny_assets(output_dir, seed=seed, num_samples=num_samples)
    paths = FamilyAssetPaths(tiny.root, name)
    records = json.loads(tiny.dataset_path.read_text())
    texts = list(training_texts(records))
    if family.tokenizer == "qwen2":
        vocab, merges = qwen2_files(train_bpe(texts))
        write_atomically(paths.folder / "vocab.json", vocab)
        write_atomically(paths.folder / "merges.txt", merges)
        first_special = NUM_MERGEABLE_RANKS
    else:
        write_atomically(paths.folder / "tokenizer.model", sentencepiece_model(texts, SPM_VOCAB))
        first_special = SPM_VOCAB
    if family.specials:
        write_atomically(paths.folder / "special_tokens.json", special_tokens_file(family.specials, first_special))
    model = build_family_model(family, seed)
    state = {k: v.detach().contiguous() for k, v in family.to_hf(model.state_dict(), family.args).items()}
    write_atomically(paths.folder / "model.safetensors", safetensors_save(state))
    write_atomically(paths.folder / "config.json", _json(hf_config(family)))
    return paths
