"""QLoRA: NF4 base weights (torchao) through the profiler, training, saving, resuming and ``estimate``, on
the tiny Llama at dims NF4 can quantize (``tiny-assets --model tiny_qlora``, ``configs/tiny_qlora.yaml``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from config_edits import CONFIGS
from recipe_runs import check, losses, read_metrics, tune_run
from safetensors.torch import load_file
from torch._subclasses.fake_tensor import FakeTensorMode
from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
from torchtune import config, training
from torchtune.models.convert_weights import tune_to_peft_adapter_weights
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from adaptive_batching.assets.models import TINY_QLORA_ARGS, write_model_assets
from adaptive_batching.config.loading import load_config
from adaptive_batching.config.trace_inputs import trace_inputs
from adaptive_batching.estimate.fake_steps import build_fake
from adaptive_batching.profiling.max_micro_batch import preserved_training_state
from adaptive_batching.runtime import nf4
from adaptive_batching.runtime.memory import current_bytes, live_tensor_bytes
from adaptive_batching.training.recipe_table import method_and_objective

CPU = torch.device("cpu")


def nf4_layout_bytes(elements: int) -> int:
    """NF4's layout: 4 bits a weight, an int8 scaler per block of 64, an fp32 factor per 256 scalers, an fp32
    mean and the 16 fp32 NF4 values."""
    return elements // 2 + elements // 64 + 4 * (elements // (64 * 256)) + 4 + 16 * 4


def qlora_model() -> torch.nn.Module:
    cfg = load_config(str(CONFIGS / "tiny_qlora.yaml"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = config.instantiate(cfg.model)
    set_trainable_params(model, get_adapter_params(model))
    return model


def test_an_nf4_weight_is_counted_by_the_bytes_it_holds() -> None:
    weight = to_nf4(torch.randn(768, 256))
    assert nf4.nf4_bytes(weight) == nf4_layout_bytes(768 * 256)  # 4.1 bits a weight, not 32
    model = qlora_model()
    quantized = [p for p in model.parameters() if isinstance(p, NF4Tensor)]
    assert len(quantized) == 2 * 7  # q, k, v, output and the 3 MLP projections of both layers
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, NF4Tensor))
    dense += sum(b.numel() * b.element_size() for b in model.buffers())
    assert live_tensor_bytes(model) == dense + sum(nf4_layout_bytes(p.numel()) for p in quantized)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_nf4_weights_load_into_a_model_with_or_without_activation_checkpointing(checkpointing: bool) -> None:
    """torchtune's stock QLoRA configs turn on activation checkpointing: the quantized weights' names are those
    ``load_state_dict`` reports missing inside the wrapper, so only the adapters are left missing."""
    from torchtune import modules

    checkpoint = {
        k: v.get_original_weight() if isinstance(v, NF4Tensor) else v
        for k, v in qlora_model().state_dict().items()
        if "lora_" not in k
    }
    model = qlora_model()
    if checkpointing:
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    rest, quantized = nf4.quantize_into(model, checkpoint, CPU)
    result = model.load_state_dict(rest, strict=False)
    left = {k.replace("_checkpoint_wrapped_module.", "") for k in set(result.missing_keys) - quantized}
    assert len(quantized) == 2 * 7 and left and all("lora_" in k for k in left)
    assert not result.unexpected_keys


def test_estimate_counts_fake_nf4_weights_at_their_real_bytes() -> None:
    """The model ``estimate`` builds on fake tensors holds what the real one holds (within 1%)."""
    cfg = load_config(str(CONFIGS / "tiny_qlora.yaml"))
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model, _, _ = build_fake(trace_inputs(cfg), method_and_objective(cfg, profiled=False)[0], torch.float32, fake)
    assert all(isinstance(p, NF4Tensor) for n, p in model.named_parameters() if n.endswith("w1.weight"))
    with fake:
        counted = current_bytes(CPU, model)
    assert counted == pytest.approx(live_tensor_bytes(qlora_model()), rel=0.01)


def test_the_profilers_restore_leaves_adapters_and_nf4_weights_bit_for_bit() -> None:
    model = qlora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    base = {n: p.quantized_data.clone() for n, p in model.named_parameters() if isinstance(p, NF4Tensor)}
    with preserved_training_state(model, optimizer):
        for _ in range(2):
            model(torch.randint(0, 1280, (2, 16))).sum().backward()
            optimizer.step()
        assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert all(torch.equal(p.quantized_data, base[n]) for n, p in model.named_parameters() if isinstance(p, NF4Tensor))
    assert optimizer.state_dict()["state"] == {}


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def qlora_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_assets(tmp_path_factory.mktemp("qlora-assets"), "tiny_qlora", num_samples=300).tiny.root


def qlora_run(assets: Path, out: Path, *overrides: str, nproc: int | None = None) -> str:
    result = check(
        tune_run(
            "adaptive_lora_finetune",
            "tiny_qlora",
            [
                f"assets_dir={assets}",
                f"output_dir={out}",
                "max_steps_per_epoch=2",
                "adaptive_batching.memory_budget=128MiB",
                *overrides,
            ],
            cwd=out.parent,
            nproc=nproc,
        )
    )
    return result.stdout + result.stderr


# Two steps an epoch of the config's global batch 16 over the first 32 samples, cut to 64 tokens: the profile's
# search stops at the 32 samples (or sooner, at the budget), so its trials stay small.
ONE_PROCESS = ("dataset.split=train[:32]", "tokenizer.max_seq_len=64")


@pytest.fixture(scope="module")
def one_process(qlora_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Profile and 2 steps, saved; resumed for 2 more; and the same 4 steps without a stop, at the micro batch
    of the first run's profile (read from a copy of its cache: the profile is not measured twice)."""
    root = tmp_path_factory.mktemp("qlora")
    first = qlora_run(qlora_assets, root / "run", "epochs=1", *ONE_PROCESS)
    resumed = qlora_run(qlora_assets, root / "run", "epochs=2", "resume_from_checkpoint=True", *ONE_PROCESS)
    (root / "whole").mkdir()
    shutil.copytree(root / "run" / "profile_cache", root / "whole" / "profile_cache")
    whole = qlora_run(qlora_assets, root / "whole", "epochs=2", *ONE_PROCESS)
    return {"root": root, "first": first, "resumed": resumed, "whole": whole}


@pytest.mark.e2e
def test_qlora_profiles_trains_saves_and_resumes_exactly(one_process: dict) -> None:
    root, first, resumed = one_process["root"], one_process["first"], one_process["resumed"]
    assert "largest micro batch that ran" in first and "Keeping the config's global batch 16" in first
    assert "Resuming at the end of epoch 1 (optimizer step 2)" in resumed
    assert "Profiler: using the profile saved in the checkpoint" in resumed
    assert "Profiler: using the cached profile" in one_process["whole"]
    steps = read_metrics(root / "run" / "logs")
    assert [row["step"] for row in steps] == [1, 2, 3, 4]
    assert losses(root / "run" / "logs") == losses(root / "whole" / "logs")  # bit for bit across the stop


@pytest.mark.e2e
def test_the_saved_adapter_loads_back_through_torchtunes_checkpointer_and_peft_format(
    one_process: dict, qlora_assets: Path
) -> None:
    """torchtune 0.6.1 loads an adapter when it resumes: paths relative to the run's folder."""
    run = one_process["root"] / "run"
    folder = run / "epoch_1"
    checkpointer = training.FullModelHFCheckpointer(
        checkpoint_dir=str(qlora_assets / "tiny_qlora"),
        checkpoint_files=["model.safetensors"],
        adapter_checkpoint="epoch_1/adapter_model.pt",
        recipe_checkpoint="epoch_1/recipe_state.pt",
        output_dir=str(run),
        model_type="LLAMA3",
        should_load_recipe_state=True,
    )
    loaded = checkpointer.load_checkpoint()
    model = qlora_model()
    model.load_state_dict(loaded[training.MODEL_KEY], strict=False)
    missing = model.load_state_dict(loaded[training.ADAPTER_KEY], strict=False).missing_keys
    assert not [key for key in missing if "lora" in key]  # every adapter weight came from the checkpoint
    adapter = loaded[training.ADAPTER_KEY]
    peft = load_file(folder / "adapter_model.safetensors")
    expected = tune_to_peft_adapter_weights(
        adapter,
        num_heads=TINY_QLORA_ARGS["num_heads"],
        num_kv_heads=TINY_QLORA_ARGS["num_kv_heads"],
        dim=TINY_QLORA_ARGS["embed_dim"],
    )
    assert peft.keys() == expected.keys() and all(torch.equal(peft[k], expected[k]) for k in peft)
    assert (folder / "adapter_config.json").is_file()


# Two steps an epoch at 2 ranks, the config's batch on each: the first 64 samples, cut to 64 tokens (small trials).
TWO_RANKS = ("dataset.split=train[:64]", "tokenizer.max_seq_len=64")


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_qlora_at_two_ranks_profiles_trains_saves_and_resumes(qlora_assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = qlora_run(qlora_assets, out, "epochs=1", *TWO_RANKS, nproc=2)
    assert "minimum over 2 ranks" in first and "Rank 1: finished at optimizer step 2" in first
    resumed = qlora_run(qlora_assets, out, "epochs=2", "resume_from_checkpoint=True", *TWO_RANKS, nproc=2)
    assert "Resuming at the end of epoch 1 (optimizer step 2)" in resumed
    assert "Rank 1: finished at optimizer step 4" in resumed
    assert [row["step"] for row in read_metrics(out / "logs")] == [1, 2, 3, 4]
