"""torchtune's other families through the recipes: tiny Qwen 2.5, Gemma 2, Phi-3 and Mistral models with their
own tokenizers and checkpoint formats (``tiny-assets --model NAME``, ``configs/tiny_NAME_{full,lora}.yaml``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from config_edits import stock_on_tiny
from recipe_runs import check, losses, read_metrics, tune_run
from torchtune import config, training
from torchtune.data import Message

from adaptive_batching.assets.families import FAMILIES, build_family_model, write_family_assets
from adaptive_batching.config.loading import load_config
from adaptive_batching.profiling.max_micro_batch import preserved_training_state

NAMES = list(FAMILIES)
TEXT = "Describe a quiet river in the morning, then list three colours."
# One full batch of the same 16 samples of at most 64 tokens per step, a constant LR: the loss must fall on it.
FIXED_BATCH = (
    "dataset.split=train[:16]",
    "tokenizer.max_seq_len=64",
    "shuffle=False",
    "lr_scheduler=null",
    "optimizer.lr=1e-2",
    "batch_increase_function=null",
    "adaptive_batching.keep_global_batch=True",
    "max_steps_per_epoch=null",
)


@pytest.fixture(scope="module")
def family_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("families")
    for name in NAMES:
        write_family_assets(root, name, num_samples=200)
    return root


def config_for(name: str, method: str, assets: Path):
    return load_config(f"tiny_{name}_{method}", [f"assets_dir={assets}"])


@pytest.mark.parametrize("name", NAMES)
def test_the_familys_own_tokenizer_reads_the_tiny_one(name: str, family_assets: Path) -> None:
    tokenizer = config.instantiate(config_for(name, "full", family_assets).tokenizer)
    ids = tokenizer.encode(TEXT, add_bos=False, add_eos=False)
    assert tokenizer.decode(ids) == TEXT and len(ids) < len(TEXT) // 2  # merges learned, not bytes
    assert max(ids) < FAMILIES[name].args["vocab_size"]
    messages = tokenizer.tokenize_messages([Message("user", TEXT), Message("assistant", "Blue.")])[0]
    assert max(messages) < FAMILIES[name].args["vocab_size"]  # special tokens inside the embedding too


@pytest.mark.parametrize("name", NAMES)
def test_the_checkpoint_loads_through_the_familys_checkpointer(name: str, family_assets: Path) -> None:
    cfg = config_for(name, "full", family_assets)
    checkpointer = config.instantiate(cfg.checkpointer, output_dir=str(family_assets / "out" / name))
    weights = checkpointer.load_checkpoint()[training.MODEL_KEY]
    model = config.instantiate(cfg.model)
    model.load_state_dict(weights, strict=True)
    expected = build_family_model(FAMILIES[name], seed=0).state_dict()
    assert all(torch.equal(model.state_dict()[key], value) for key, value in expected.items())


@pytest.mark.parametrize("name", ["qwen2_5", "gemma2"])
def test_a_tied_embedding_comes_through_the_profilers_restore_bit_for_bit(name: str) -> None:
    model = build_family_model(FAMILIES[name])
    tokens = torch.randint(0, 1000, (2, 12))
    logits = model(tokens).detach()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with preserved_training_state(model, optimizer):
        model(tokens).sum().backward()
        optimizer.step()
        assert not torch.equal(model.tok_embeddings.weight, before["tok_embeddings.weight"])
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    assert torch.equal(model(tokens).detach(), logits)  # the output projection is still the embedding


# Full fine-tuning runs torchtune's own config of the family (as `tune cp` copies it), pointed at the tiny model:
# its optimizer, loss, dtype (bf16), activation checkpointing and every other key as torchtune ships them.
STOCK_FULL = {
    "qwen2_5": "qwen2_5/0.5B_full_single_device",
    "gemma2": "gemma2/2B_full",
    "phi3": "phi3/mini_full",
    "mistral": "mistral/7B_full",
}
# The stock configs' batch (2 x accumulation) becomes the fixed batch of 16 samples.
STOCK_BATCH = (
    "batch_size=16",
    "gradient_accumulation_steps=1",
    "use_maximum_batch_size=True",
    "adaptive_batching.memory_budget=512MiB",
)


@pytest.fixture(scope="module")
def family_runs(family_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per family: full fine-tuning with torchtune's stock config on a fixed batch (profiler on); LoRA with our
    shipped config likewise for 2 steps, then resumed for a third."""
    root = tmp_path_factory.mktemp("family-runs")
    runs: dict = {}

    def run(method: str, config: str, out: str, *overrides: str) -> str:
        result = check(
            tune_run(
                f"adaptive_{method}_finetune",
                config,
                [f"assets_dir={family_assets}", f"output_dir={root / out}", *FIXED_BATCH, *overrides],
                cwd=root,
            )
        )
        return result.stdout + result.stderr

    def runs_of(name: str) -> dict:
        if name not in runs:
            stock = stock_on_tiny(
                STOCK_FULL[name], f"tiny_{name}_full", family_assets, root / f"{name}-full", root / f"{name}-full.yaml"
            )
            runs[name] = {
                "root": root,
                "full": run("full", str(stock), f"{name}-full", "epochs=3", *STOCK_BATCH),
                "lora": run("lora", f"tiny_{name}_lora", f"{name}-lora", "epochs=2"),
                "resumed": run("lora", f"tiny_{name}_lora", f"{name}-lora", "epochs=3", "resume_from_checkpoint=True"),
            }
        return runs[name]

    return {"of": runs_of}


@pytest.mark.e2e
@pytest.mark.parametrize("name", NAMES)
def test_full_with_the_stock_config_and_lora_profile_learn_a_fixed_batch_and_resume(
    name: str, family_runs: dict
) -> None:
    runs = family_runs["of"](name)
    root = runs["root"]
    for method in ("full", "lora"):
        assert "largest micro batch that ran" in runs[method]  # the profiler ran on this family
    full = losses(root / f"{name}-full" / "logs")
    assert len(full) == 3 and full[2] < full[0]
    assert "Resuming at the end of epoch 2 (optimizer step 2)" in runs["resumed"]
    lora = read_metrics(root / f"{name}-lora" / "logs")
    assert [row["step"] for row in lora] == [1, 2, 3]
    assert lora[2]["loss"] < lora[0]["loss"]


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_a_tied_qwen_model_trains_with_lora_at_two_ranks(family_assets: Path, tmp_path: Path) -> None:
    result = check(
        tune_run(
            "adaptive_lora_finetune",
            "tiny_qwen2_5_lora",
            [f"assets_dir={family_assets}", f"output_dir={tmp_path / 'run'}", *FIXED_BATCH, "epochs=2", "batch_size=8"],
            cwd=tmp_path,
            nproc=2,
        )
    )
    output = result.stdout + result.stderr
    assert "minimum over 2 ranks" in output and "Rank 1: finished at optimizer step 2" in output
    assert len(losses(tmp_path / "run" / "logs")) == 2
    assert (tmp_path / "run" / "epoch_1" / "adapter_model.safetensors").is_file()
