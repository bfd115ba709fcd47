"""The Llama 3.2 1B asset writer: the real model's HF keys and shapes (on the meta device, no memory),
and a shrunk copy written, loaded by torchtune's checkpointer and the recipe's model builder."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torchtune.models.llama3_2 import llama3_2, llama3_2_1b
from torchtune.training import FullModelHFCheckpointer

from adaptive_batching.assets.models import (
    ModelAssetPaths,
    build_random_model,
    hf_config,
    hf_state_dict,
    model_args,
    recipe_overrides,
    write_model_assets,
)
from adaptive_batching.assets.tiny import load_tiny_tokenizer
from adaptive_batching.cli import main as cli_main
from adaptive_batching.config.loading import load_config

SHRUNK = {"num_layers": 1, "embed_dim": 64, "num_heads": 4, "num_kv_heads": 2, "intermediate_dim": 128}


def test_the_1b_arguments_are_torchtunes_llama3_2_1b() -> None:
    with torch.device("meta"):
        reference = llama3_2_1b().state_dict()
    ours = build_random_model(model_args("llama3_2_1b"), device="meta").state_dict()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in reference.items()}
    assert all(v.dtype == torch.bfloat16 for v in ours.values())


def test_the_1b_checkpoint_has_the_hf_llama_keys_and_shapes() -> None:
    args = model_args("llama3_2_1b")
    hf = hf_state_dict(build_random_model(args, device="meta"), args)
    per_layer = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    ]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{name}.weight" for i in range(16) for name in per_layer}
    assert set(hf) == expected  # tied: no lm_head.weight, as in the real Llama 3.2 1B files
    assert hf["model.embed_tokens.weight"].shape == (128256, 2048)
    assert hf["model.layers.0.self_attn.k_proj.weight"].shape == (8 * 64, 2048)
    assert hf["model.layers.0.mlp.gate_proj.weight"].shape == (8192, 2048)
    config = hf_config(args)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 8, 64)
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 128256


def test_a_shrunk_copy_loads_through_the_checkpointer_and_the_builder(tmp_path) -> None:
    paths = write_model_assets(tmp_path, overrides=SHRUNK, num_samples=50)
    assert paths == ModelAssetPaths.from_root(tmp_path, "llama3_2_1b")
    with safe_open(str(paths.model_dir / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    checkpointer = FullModelHFCheckpointer(
        checkpoint_dir=str(paths.model_dir),
        checkpoint_files=["model.safetensors"],
        model_type="LLAMA3_2",
        output_dir=str(tmp_path / "out"),
    )
    loaded = checkpointer.load_checkpoint()["model"]
    args = model_args("llama3_2_1b", SHRUNK)
    model = llama3_2(**args)
    model.load_state_dict(loaded, strict=True)
    expected = build_random_model(args, seed=0).state_dict()
    assert set(loaded) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(loaded[key].to(tensor.dtype), tensor), key  # the q/k permutation round-trips
    assert json.loads((paths.model_dir / "config.json").read_text())["num_hidden_layers"] == 1
    # The tiny tokenizer's ids all index the embedding.
    tokenizer = load_tiny_tokenizer(paths.tiny)
    assert tokenizer.vocab_size <= args["vocab_size"]
    assert max(tokenizer.encode("A quiet river <|eot_id|>", add_bos=True, add_eos=True)) < args["vocab_size"]


def test_the_overrides_point_the_shipped_configs_at_the_assets(tmp_path) -> None:
    paths = ModelAssetPaths.from_root(tmp_path, "llama3_2_1b")
    for name in ("llama3_2_1b", "llama3_2_1b_lora"):
        cfg = load_config(name, recipe_overrides(paths, max_seq_len=512))
        assert cfg.checkpointer.checkpoint_dir == str(paths.model_dir)
        assert cfg.checkpointer.model_type == "LLAMA3_2"
        assert cfg.tokenizer.special_tokens_path == str(paths.tiny.special_tokens_path)
        assert cfg.tokenizer.max_seq_len == 512
        assert cfg.dataset._component_ == "torchtune.datasets.alpaca_dataset"
        assert cfg.dataset.data_files == str(paths.tiny.dataset_path)


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="vocab_size 1000 is below"):
        model_args("llama3_2_1b", {"vocab_size": 1000})
    with pytest.raises(ValueError, match="unknown model argument"):
        model_args("llama3_2_1b", {"layers": 2})
    with pytest.raises(ValueError, match="unknown model 'llama9'"):
        model_args("llama9")


def test_the_cli_names_the_bad_model_option(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        cli_main(["tiny-assets", "--model", "llama9"])
    assert stop.value.code == 2
    assert "--model" in capsys.readouterr().err
