"""The trainer's building blocks, in-process and without a training run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset
from torchtune.models.llama3 import lora_llama3

from adaptive_batching.assets.tiny import TINY_MODEL_ARGS
from adaptive_batching.batching.data import build_dataloader
from adaptive_batching.batching.shape import BatchShape
from adaptive_batching.core.nodes import optional_component
from adaptive_batching.errors import ConfigError
from adaptive_batching.faults.checkpoints import resume_config
from adaptive_batching.runtime.distributed import ParallelInfo
from adaptive_batching.runtime.memory import peak_memory_gb, release_memory
from adaptive_batching.training.model import full_state_dict


class Numbers(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def epoch_order(seed: int, epoch: int, parallel: ParallelInfo = ParallelInfo(), micro_batch: int = 4) -> list[int]:
    loader = build_dataloader(
        Numbers(64),
        micro_batch=micro_batch,
        accumulation=1,
        collate_fn=lambda b: b,
        parallel=parallel,
        shuffle=True,
        seed=seed,
        epoch=epoch,
        max_steps=None,
    )
    return [i for batch in loader for i in batch]


def test_sampler_order_follows_the_seed_and_the_epoch() -> None:
    assert epoch_order(1, 0) == epoch_order(1, 0)
    assert epoch_order(1, 0) != epoch_order(2, 0)
    assert epoch_order(1, 0) != epoch_order(1, 1)
    assert sorted(epoch_order(1, 0)) == list(range(64))


def test_two_ranks_split_the_epoch_without_overlap() -> None:
    ranks = [epoch_order(7, 0, ParallelInfo(world_size=2, rank=r)) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 32
    assert sorted(ranks[0] + ranks[1]) == list(range(64))


def test_lora_checkpoint_entries_leave_the_live_model_untouched() -> None:
    """Merging LoRA for a save must not write into the training weights (``.cpu()`` aliases on CPU)."""
    from adaptive_batching.training.methods import LoRAFinetune

    cfg = OmegaConf.create(dict(lora_attn_modules=["q_proj", "v_proj"], lora_rank=4, lora_alpha=8))
    model = lora_llama3(["q_proj", "v_proj"], lora_rank=4, lora_alpha=8, **TINY_MODEL_ARGS)
    for name, param in model.named_parameters():
        if "lora_b" in name:
            torch.nn.init.normal_(param)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    method = LoRAFinetune(cfg, save_adapter_weights_only=False)
    method.configure(model)
    entries = method.checkpoint_entries(full_state_dict(model, ParallelInfo(), torch.device("cpu")))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    merged = entries["model"]["layers.0.attn.q_proj.weight"]
    assert not torch.equal(merged, before["layers.0.attn.q_proj.weight"])
    assert set(entries["adapter"]) == {k for k in before if "lora" in k}


def test_resume_without_a_saved_epoch_says_so(tmp_path: Path) -> None:
    cfg = OmegaConf.create(dict(output_dir=str(tmp_path), checkpoint_files=["model.safetensors"]))
    with pytest.raises(FileNotFoundError, match="resume_from_checkpoint=True"):
        resume_config(cfg)


def test_batch_shape() -> None:
    shape = BatchShape(micro_batch=4, accumulation=3, ranks=2)
    assert shape.global_batch == 24
    assert "global batch 24" in shape.describe()
    with pytest.raises(ValueError, match="micro_batch"):
        BatchShape(micro_batch=0)


def test_optional_component_treats_a_null_component_as_off() -> None:
    assert optional_component(None) is None
    assert optional_component(OmegaConf.create({"_component_": None, "num_warmup_steps": 3})) is None
    node = OmegaConf.create({"_component_": "a.b", "x": 1})
    assert optional_component(node) is node


def test_memory_helpers_are_safe_on_cpu() -> None:
    assert peak_memory_gb(torch.device("cpu")) is None
    release_memory(torch.device("cpu"))


def test_the_library_never_imports_the_recipes() -> None:
    """The recipes compose the library; a library module importing a recipe would make a cycle."""
    import ast

    import adaptive_batching

    recipe_modules = ("adaptive_full_finetune", "adaptive_lora_finetune", "recipes")
    offenders = []
    for path in Path(adaptive_batching.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.name}: {name}" for name in names if name.split(".")[0] in recipe_modules]
    assert offenders == []


@pytest.mark.parametrize(
    "global_batch, ranks, cap, shape, note",
    [
        (32, 1, 83, (32, 1), "covers it"),
        (64, 2, 8, (8, 4), "divide evenly"),
        (96, 1, 40, (32, 3), "largest divisor under it"),
        (26, 2, 5, (1, 13), "largest divisor under it"),  # 13 per rank is prime
    ],
)
def test_keeping_the_global_batch_takes_the_largest_even_micro_batch_that_fits(
    global_batch: int, ranks: int, cap: int, shape: tuple[int, int], note: str
) -> None:
    from adaptive_batching.batching.shape import shape_keeping_global_batch

    got, why = shape_keeping_global_batch(global_batch, ranks, cap)
    assert (got.micro_batch, got.accumulation, got.ranks) == (*shape, ranks)
    assert got.global_batch == global_batch and got.micro_batch <= cap and note in why


def test_a_lora_model_with_activation_checkpointing_loads_base_weights() -> None:
    """Activation checkpointing wraps the layers after the adapter is found: the adapter's missing keys then carry
    the wrapper's name and must still count as the adapter (they once stopped every LoRA run with it on)."""
    from torchtune import training
    from torchtune.models.llama3 import llama3

    from adaptive_batching.training.methods import LoRAFinetune
    from adaptive_batching.training.model import ModelOptions, build_model

    lora = dict(lora_attn_modules=["q_proj", "v_proj"], lora_rank=4, lora_alpha=8)
    cfg = OmegaConf.create({"_component_": "torchtune.models.llama3.lora_llama3", **lora, **TINY_MODEL_ARGS})
    base = llama3(**TINY_MODEL_ARGS).state_dict()
    method = LoRAFinetune(cfg, save_adapter_weights_only=False)
    model = build_model(
        cfg,
        method,
        {training.MODEL_KEY: base},
        device=torch.device("cpu"),
        dtype=torch.float32,
        parallel=ParallelInfo(),
        options=ModelOptions(activation_checkpointing=True),
    )
    wrapped = [name for name, _ in model.named_parameters() if "_checkpoint_wrapped_module" in name]
    assert wrapped and any("lora_a" in name for name in wrapped)
    loaded = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in model.state_dict().items()}
    assert all(torch.equal(loaded[k], v) for k, v in base.items())
    with pytest.raises(ConfigError, match="does not match the LoRA model"):
        build_model(
            cfg,
            LoRAFinetune(cfg, save_adapter_weights_only=False),
            {training.MODEL_KEY: {k: v for k, v in base.items() if "q_proj" not in k}},
            device=torch.device("cpu"),
            dtype=torch.float32,
            parallel=ParallelInfo(),
            options=ModelOptions(activation_checkpointing=True),
        )
