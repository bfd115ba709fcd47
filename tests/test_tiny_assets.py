"""Tests for the offline tiny Llama-3 assets (model, tokenizer, dataset)."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import pytest
import torch
from torchtune.data import AlpacaToMessages
from torchtune.datasets import alpaca_dataset
from torchtune.models.llama3 import llama3
from torchtune.models.llama3._tokenizer import LLAMA3_SPECIAL_TOKENS
from torchtune.training import FullModelHFCheckpointer

from adaptive_batching.assets.tiny import (
    DEFAULT_TINY_DIR,
    TINY_MODEL_ARGS,
    TINY_STUDENT_ARGS,
    TinyAssetPaths,
    build_tiny_model,
    describe,
    load_tiny_tokenizer,
    token_lengths,
    train_bpe,
    write_tiny_assets,
)

SEED = 0
NUM_SAMPLES = 3000


def _file_bytes(root: Path) -> dict[str, bytes]:
    """Relative path -> content for every file below ``root``."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> TinyAssetPaths:
    return write_tiny_assets(tmp_path_factory.mktemp("tiny"), seed=SEED, num_samples=NUM_SAMPLES)


@pytest.fixture(scope="module")
def unpacked_lengths(assets: TinyAssetPaths, tmp_path_factory: pytest.TempPathFactory) -> list[int]:
    tokenizer = load_tiny_tokenizer(assets)
    ds = alpaca_dataset(
        tokenizer,
        source="json",
        data_files=str(assets.dataset_path),
        split="train",
        packed=False,
        cache_dir=str(tmp_path_factory.mktemp("hf_cache")),
    )
    assert len(ds) == NUM_SAMPLES
    lengths = []
    for i in range(len(ds)):
        tokens = ds[i]["tokens"]
        assert max(tokens) < TINY_MODEL_ARGS["vocab_size"]
        lengths.append(len(tokens))
    return lengths


def test_paths_layout(assets: TinyAssetPaths) -> None:
    assert assets == TinyAssetPaths.from_root(assets.root)
    assert DEFAULT_TINY_DIR == "/tmp/adaptive-batching/tiny"
    assert sorted(_file_bytes(assets.root)) == [
        "data/alpaca_tiny.json",
        "data/preference_tiny.json",
        "model/config.json",
        "model/model.safetensors",
        "student/config.json",
        "student/model.safetensors",
        "tokenizer/special_tokens.json",
        "tokenizer/tokenizer.model",
    ]


def test_deterministic_and_idempotent(assets: TinyAssetPaths, tmp_path: Path) -> None:
    again = write_tiny_assets(tmp_path / "again", seed=SEED, num_samples=NUM_SAMPLES)
    expected = _file_bytes(assets.root)
    assert _file_bytes(again.root) == expected

    (again.dataset_path).write_text("garbage")
    write_tiny_assets(again.root, seed=SEED, num_samples=NUM_SAMPLES)
    assert _file_bytes(again.root) == expected

    other = write_tiny_assets(tmp_path / "other", seed=SEED + 1, num_samples=NUM_SAMPLES)
    assert other.dataset_path.read_bytes() != assets.dataset_path.read_bytes()


def test_global_rng_untouched() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_checkpoint_round_trip(assets: TinyAssetPaths, tmp_path: Path) -> None:
    config = json.loads((assets.model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] == 16 and config["tie_word_embeddings"] is False

    checkpointer = FullModelHFCheckpointer(
        checkpoint_dir=str(assets.model_dir),
        checkpoint_files=["model.safetensors"],
        model_type="LLAMA3",
        output_dir=str(tmp_path / "out"),
    )
    state_dict = checkpointer.load_checkpoint()["model"]
    model = llama3(**TINY_MODEL_ARGS)
    model.load_state_dict(state_dict, strict=True)

    reference = build_tiny_model(seed=SEED).state_dict()
    loaded = model.state_dict()
    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name
    assert not torch.equal(loaded["output.weight"], loaded["tok_embeddings.weight"])


def test_the_student_is_a_smaller_tiny_model_with_the_same_vocabulary(assets: TinyAssetPaths, tmp_path: Path) -> None:
    """The tiny model teaches it (configs/tiny_kd.yaml): fewer layers and dimensions, the same tokenizer and vocabulary,
    its own weights in the same layout."""
    config = json.loads((assets.student_dir / "config.json").read_text())
    assert config["vocab_size"] == TINY_MODEL_ARGS["vocab_size"] == TINY_STUDENT_ARGS["vocab_size"]
    assert config["num_hidden_layers"] < TINY_MODEL_ARGS["num_layers"]
    assert config["hidden_size"] < TINY_MODEL_ARGS["embed_dim"]
    checkpointer = FullModelHFCheckpointer(
        checkpoint_dir=str(assets.student_dir),
        checkpoint_files=["model.safetensors"],
        model_type="LLAMA3",
        output_dir=str(tmp_path / "out"),
    )
    student = llama3(**TINY_STUDENT_ARGS)
    student.load_state_dict(checkpointer.load_checkpoint()["model"], strict=True)
    reference = build_tiny_model(SEED + 1, TINY_STUDENT_ARGS).state_dict()
    assert all(torch.equal(student.state_dict()[name], tensor) for name, tensor in reference.items())


def test_tokenizer(assets: TinyAssetPaths) -> None:
    tokenizer = load_tiny_tokenizer(assets)
    assert tokenizer.vocab_size == TINY_MODEL_ARGS["vocab_size"] == 1280
    assert tokenizer.base_vocab_size == 1024

    ranks = assets.tokenizer_path.read_text().splitlines()
    assert [int(line.split()[1]) for line in ranks] == list(range(1024))
    assert [base64.b64decode(line.split()[0]) for line in ranks[:256]] == [bytes([b]) for b in range(256)]

    text = "Summarise the following text.\n\nThe quiet river 42 moves gently; café ☕!"
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id == 1024
    assert ids[-1] == tokenizer.eos_id == 1025
    assert all(0 <= i < 1280 for i in ids)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode(" the river", add_bos=False, add_eos=False)) <= 2

    special = {t["content"]: t["id"] for t in json.loads(assets.special_tokens_path.read_text())["added_tokens"]}
    assert list(special) == list(LLAMA3_SPECIAL_TOKENS)
    assert list(special.values()) == list(range(1024, 1280))
    assert tokenizer.special_tokens == special
    assert special["<|begin_of_text|>"] == 1024
    assert special["<|reserved_special_token_244|>"] == 1279
    assert tokenizer.eot_id == special["<|eot_id|>"]
    assert tokenizer.pad_id == special["<|finetune_right_pad_id|>"]
    assert tokenizer.start_header_id == special["<|start_header_id|>"]
    assert tokenizer.stop_tokens == [special[t] for t in ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")]


def test_bpe_vocab_size_fixed_for_tiny_corpus() -> None:
    tokens = train_bpe(["hello world"])
    assert len(tokens) == len(set(tokens)) == 1024


def test_dataset_records(assets: TinyAssetPaths) -> None:
    records = json.loads(assets.dataset_path.read_text())
    assert len(records) == NUM_SAMPLES
    assert all(set(r) == {"instruction", "input", "output"} for r in records)
    with_input = sum(bool(r["input"]) for r in records)
    assert 0.2 * NUM_SAMPLES < with_input < 0.8 * NUM_SAMPLES


def test_length_distribution_has_long_tail(assets: TinyAssetPaths, unpacked_lengths: list[int]) -> None:
    lengths = sorted(unpacked_lengths)
    p50 = lengths[math.ceil(0.5 * len(lengths)) - 1]
    assert 20 <= lengths[0]
    assert p50 < 150
    assert lengths[-1] > TINY_MODEL_ARGS["max_seq_len"]
    assert sum(n > 300 for n in lengths) >= 0.02 * len(lengths)
    assert sorted(token_lengths(assets)) == lengths


def test_packed_dataset(assets: TinyAssetPaths, unpacked_lengths: list[int], tmp_path: Path) -> None:
    max_seq_len = TINY_MODEL_ARGS["max_seq_len"]
    tokenizer = load_tiny_tokenizer(assets, max_seq_len=max_seq_len)
    packed = alpaca_dataset(
        tokenizer,
        source="json",
        data_files=str(assets.dataset_path),
        split="train",
        packed=True,
        cache_dir=str(tmp_path / "hf_cache"),
    )
    truncated_total = sum(min(n, max_seq_len) for n in unpacked_lengths)
    assert len(packed) >= truncated_total / max_seq_len
    for i in (0, len(packed) - 1):
        pack = packed[i]
        assert pack["tokens"].shape == (max_seq_len,)
        assert int(pack["seq_lens"].sum()) == max_seq_len
        assert int(pack["tokens"].max()) < TINY_MODEL_ARGS["vocab_size"]


def test_forward_pass(assets: TinyAssetPaths) -> None:
    tokenizer = load_tiny_tokenizer(assets, max_seq_len=TINY_MODEL_ARGS["max_seq_len"])
    record = json.loads(assets.dataset_path.read_text())[0]
    tokens = tokenizer(AlpacaToMessages()(record))["tokens"]
    model = build_tiny_model(seed=SEED).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens]))
    assert logits.shape == (1, len(tokens), TINY_MODEL_ARGS["vocab_size"])
    assert torch.isfinite(logits).all()


def test_describe(assets: TinyAssetPaths) -> None:
    summary = describe(assets)
    assert f"samples: {NUM_SAMPLES}" in summary
    assert "model/model.safetensors" in summary
    assert "p50=" in summary and "p95=" in summary and "max=" in summary
