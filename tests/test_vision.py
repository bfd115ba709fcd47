"""Llama 3.2 Vision: every promise of the text recipes holds for the tiny vision model (docs/vision.md).

The checks of a vision config (one line each, before any model loads), the worst case (the longest text with the
most images a sample holds, each of the most tiles), and real runs of the shipped tiny vision configs and of the stock
vision configs by name, pointed at the tiny assets: profile and growth with its LR scaling, an out-of-memory error
mid-epoch, a preemption and its exact resume, two ranks. Texts are cut to 48 tokens: the model trains in bf16 (the
transform's tiles are bf16), which a CPU runs slowly.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from recipe_runs import losses, read_metrics, run_command, tune_run
from test_oom_recovery import faulty_run, ok
from test_preemption import stopped

from adaptive_batching.assets.tiny_vision import TILE, TinyVisionPaths, tiny_llama3_2_vision
from adaptive_batching.batching.sequence_lengths import measure_samples
from adaptive_batching.cli import main
from adaptive_batching.config.loading import resolve_config
from adaptive_batching.config.settings import validate_config
from adaptive_batching.config.vision import TILED_COLLATE, ImageGeometry
from adaptive_batching.core.loss import summed_token_loss
from adaptive_batching.errors import ConfigError
from adaptive_batching.training.objectives import VisionFinetune
from adaptive_batching.training.recipe_table import method_and_objective

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHORT = ("tokenizer.max_seq_len=48",)
SAMPLES = 16  # 4 steps of 4
FIXED = ("use_maximum_batch_size=False", "batch_increase_function=null", f"dataset.split=train[:{SAMPLES}]")
GEOMETRY = ImageGeometry(tile_size=TILE, patch_size=14, max_num_tiles=4)


def tiny_config(name: str = "tiny_vision_full", **changes: object) -> object:
    cfg = OmegaConf.load(CONFIGS / f"{name}.yaml")
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


# ------------------------------------------------------------------ the checks, one line each
@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "collate_fn",
            "torchtune.data.padded_collate_sft",
            "config key 'collate_fn' = 'torchtune.data.padded_collate_sft': a vision model's samples carry image "
            f"tiles: set collate_fn={TILED_COLLATE}",
        ),
        (
            "dtype",
            "fp32",
            "config key 'dtype' = 'fp32': torchtune's vision transform makes bf16 image tiles, which only a bf16 "
            "model takes: set dtype=bf16",
        ),
        ("dataset.packed", True, "config key 'dataset.packed' = True: torchtune does not pack vision samples"),
        ("adaptive_batching.max_tokens", 512, "config key 'adaptive_batching.max_tokens': a token budget counts text"),
        ("model.image_size", 112, "config key 'model.image_size' = 112 differs from the transform's tiles of 56"),
        (
            "tokenizer._component_",
            "torchtune.models.llama3.llama3_tokenizer",
            "config key 'tokenizer._component_' = 'torchtune.models.llama3.llama3_tokenizer': a vision model's samples"
            " need torchtune's Llama 3.2 Vision transform",
        ),
        (
            "model._component_",
            "torchtune.models.llama3.llama3",
            "config key 'model._component_' = 'torchtune.models.llama3.llama3' is not a Llama 3.2 Vision model",
        ),
    ],
)
def test_a_vision_config_that_cannot_train_is_refused_in_one_line(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        validate_config(tiny_config(**{key: value}), "adaptive_full_finetune")
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize("recipe", ["adaptive_lora_dpo", "adaptive_full_dpo", "adaptive_knowledge_distillation"])
def test_the_recipes_of_other_objectives_refuse_a_vision_model_naming_those_that_train_it(recipe: str) -> None:
    with pytest.raises(ConfigError) as error:
        validate_config(tiny_config("tiny_vision_lora"), recipe)
    assert str(error.value) == (
        "config key 'model._component_' = 'adaptive_batching.assets.tiny_vision.lora_tiny_llama3_2_vision' is a "
        f"vision model, which {recipe} does not train: use adaptive_full_finetune or adaptive_lora_finetune"
    )


@pytest.mark.parametrize(
    "name, recipe, tiles",
    [
        ("llama3_2_vision/11B_full_single_device", "adaptive_full_finetune", 560),
        ("llama3_2_vision/11B_lora", "adaptive_lora_finetune", 560),
        ("llama3_2_vision/90B_qlora", "adaptive_lora_finetune", 560),
    ],
)
def test_the_stock_vision_configs_train_with_the_vision_objective_by_name(name: str, recipe: str, tiles: int) -> None:
    cfg = OmegaConf.load(resolve_config(name))
    validate_config(cfg, recipe)
    _, objective = method_and_objective(cfg, recipe, profiled=True)
    assert isinstance(objective, VisionFinetune)
    assert objective.geometry == ImageGeometry(tiles, 14, 4) and objective.geometry.tokens_per_tile == 1601


@pytest.mark.parametrize(
    "name, recipe",
    [("llama3_2_vision/90B_full", "adaptive_full_finetune"), ("llama3_2_vision/11B_qlora", "adaptive_lora_finetune")],
)
def test_cp_copies_a_stock_vision_config_and_names_the_recipe_that_runs_it(
    name: str, recipe: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["cp", name, str(tmp_path / "my_vision.yaml")]) == 0
    assert (tmp_path / "my_vision.yaml").read_text() == resolve_config(name).read_text()
    assert f"Run it with: tune run {recipe} --config {tmp_path / 'my_vision.yaml'}" in capsys.readouterr().out


# ------------------------------------------------------------------ the worst case and the empty micro batch
def collate() -> object:
    loss = torch.nn.CrossEntropyLoss()
    return VisionFinetune(GEOMETRY).collate(TILED_COLLATE, False, 0, loss)


def test_the_worst_case_gives_every_sample_the_most_images_each_of_the_most_tiles() -> None:
    objective = VisionFinetune(GEOMETRY)
    batch = objective.worst_case_batch(collate(), micro_batch=3, seq_len=20, vocab_size=1280, packed=False, images=2)
    assert batch["tokens"].shape == batch["labels"].shape == (3, 20)
    assert batch["encoder_input"]["images"].shape == (3, 2, 4, 3, TILE, TILE)
    assert batch["encoder_input"]["images"].dtype == torch.bfloat16
    assert batch["encoder_input"]["aspect_ratio"].tolist() == [[[1, 4], [1, 4]]] * 3
    assert batch["encoder_mask"].shape == (3, 20, 2 * 4 * GEOMETRY.tokens_per_tile) and batch["encoder_mask"].all()
    one = objective.worst_case_batch(collate(), micro_batch=1, seq_len=8, vocab_size=1280, packed=False)
    assert one["encoder_input"]["images"].shape == (1, 1, 4, 3, TILE, TILE)  # a text-only data set: still one


def test_an_empty_micro_batch_runs_the_encoder_and_counts_no_token() -> None:
    batch = collate()([])
    assert batch["tokens"].shape == (1, 1) and (batch["labels"] == -100).all()
    assert batch["encoder_input"]["images"].shape == (1, 1, 1, 3, TILE, TILE) and not batch["encoder_mask"].any()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tiny_llama3_2_vision().to(torch.bfloat16)
    ran: list[str] = []
    model.encoder.register_forward_hook(lambda *_: ran.append("encoder"))
    loss, tokens = summed_token_loss(model, torch.nn.CrossEntropyLoss(), batch)
    assert ran == ["encoder"] and tokens.item() == 0 and loss.item() == 0.0
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


class Samples(list):
    """A data set of vision samples with the given token counts and image counts."""

    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        super().__init__(
            {"tokens": [1] * tokens, "encoder_input": {"images": [torch.zeros(1)] * images}}
            for tokens, images in shapes
        )


def test_the_most_images_a_sample_holds_is_measured_with_the_lengths_and_cached(tmp_path: Path) -> None:
    key = {"dataset": "d", "tokenizer": "t", "data_files": "x"}
    measured = measure_samples(Samples([(5, 1), (9, 2), (3, 0)]), cache_dir=tmp_path, key_parts=key)
    assert measured.lengths == [5, 9, 3] and measured.most_images == 2
    (cache,) = tmp_path.glob("lengths-*.json")
    assert json.loads(cache.read_text())["most_images"] == 2
    again = measure_samples(Samples([(0, 0)] * 3), cache_dir=tmp_path, key_parts=key)  # same key: read, not measured
    assert again == measured
    text = measure_samples([{"tokens": [1, 2]}], cache_dir=None, key_parts=key)
    assert text.most_images == 0


# ------------------------------------------------------------------ real runs
@pytest.fixture(scope="module")
def grown(vision_assets: Path, runs: Path) -> subprocess.CompletedProcess:
    """The shipped config as it is (profiled, doubling each epoch), one step an epoch, two epochs."""
    return tune_run(
        "adaptive_full_finetune",
        "tiny_vision_full",
        [
            f"assets_dir={vision_assets}",
            f"output_dir={runs / 'grown'}",
            *SHORT,
            "max_steps_per_epoch=1",
            "adaptive_batching.memory_budget=24MiB",
        ],
        cwd=runs,
    )


@pytest.mark.e2e
def test_the_profile_sizes_for_the_longest_text_and_a_full_image_and_growth_scales_the_lr(
    grown: subprocess.CompletedProcess, runs: Path
) -> None:
    output = ok(grown)
    assert "Worst-case sample: 48 tokens and 1 image, the longest of 240 samples" in output
    chosen = int(re.search(r"chosen micro batch (\d+)", output).group(1))
    assert chosen >= 2
    switch = re.search(
        rf"Epoch switch 1 -> 2: micro batch {chosen} -> {chosen}, accumulation 1 -> 2, global batch {chosen} -> "
        rf"{2 * chosen}, LR ([0-9.e+-]+) -> ([0-9.e+-]+)",
        output,
    )
    assert switch, output[-3000:]
    assert float(switch.group(2)) / float(switch.group(1)) == pytest.approx(math.sqrt(2), rel=1e-3)
    rows = read_metrics(runs / "grown" / "logs")
    assert [(r["micro_batch_size"], r["global_batch_size"]) for r in rows] == [(chosen, chosen), (chosen, 2 * chosen)]


@pytest.fixture(scope="module")
def reference(vision_assets: Path, runs: Path) -> str:
    """Four steps of 4 samples, uninterrupted: what the faulted runs must reproduce."""
    return ok(
        faulty_run(
            runs, "whole", {}, vision_assets, *FIXED, *SHORT, "batch_size=4", "epochs=1", config="tiny_vision_full"
        )
    )


def step_samples(runs: Path, name: str) -> list[list[int]]:
    steps = []
    for record in sorted(runs.glob(f"{name}-rank*.json")):
        steps.extend(sorted(step["samples"]) for step in json.loads(record.read_text()))
    return steps


@pytest.mark.e2e
def test_an_oom_mid_epoch_runs_the_same_samples_in_halves(reference: str, vision_assets: Path, runs: Path) -> None:
    fault = {"phase": "forward", "from_step": 2, "above": 2}
    output = ok(
        faulty_run(
            runs, "oom", fault, vision_assets, *FIXED, *SHORT, "batch_size=4", "epochs=1", config="tiny_vision_full"
        )
    )
    assert re.search(
        r"Out of memory at micro batch 4 in step 2 of epoch 1 \(optimizer step 2\) .*running the same 4 samples "
        r"again as micro batch 2 x accumulation 2",
        output,
    ), output[-3000:]
    assert step_samples(runs, "oom") == step_samples(runs, "whole")
    assert sorted(s for step in step_samples(runs, "oom") for s in step) == list(range(SAMPLES))
    rows = read_metrics(runs / "oom" / "logs")
    assert [r["micro_batch_size"] for r in rows] == [4, 2, 2, 2]
    whole = losses(runs / "whole" / "logs")
    cut = losses(runs / "oom" / "logs")
    assert cut[0] == whole[0]  # before the cut: the same step
    assert cut[1:] == pytest.approx(whole[1:], rel=2e-3)  # bf16 sums in another order


@pytest.mark.e2e
def test_a_preempted_run_saves_and_resumes_with_the_uninterrupted_losses(
    reference: str, vision_assets: Path, runs: Path
) -> None:
    common = (*FIXED, *SHORT, "batch_size=4", "epochs=1", "save_every_n_steps=2")
    first = faulty_run(
        runs, "chain", {"signal": "SIGTERM", "signal_at": 2}, vision_assets, *common, config="tiny_vision_full"
    )
    assert stopped(first, "SIGTERM") == 2
    before = step_samples(runs, "chain")  # the resumed run writes its own record
    last = ok(
        faulty_run(runs, "chain", {}, vision_assets, *common, "resume_from_checkpoint=True", config="tiny_vision_full")
    )
    assert "Resuming at step 2 of epoch 1 (optimizer step 2)" in last
    assert losses(runs / "chain" / "logs") == losses(runs / "whole" / "logs")  # bit for bit
    assert before + step_samples(runs, "chain") == step_samples(runs, "whole")


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_two_ranks_train_the_same_steps_as_one(reference: str, vision_assets: Path, runs: Path) -> None:
    """Micro batch 2 on each of 2 ranks: the global batch of 4 the one-rank run trains, on the same samples."""
    ok(
        faulty_run(
            runs,
            "ranks",
            {},
            vision_assets,
            *FIXED,
            *SHORT,
            "batch_size=2",
            "epochs=1",
            "max_steps_per_epoch=2",
            config="tiny_vision_full",
            nproc=2,
        )
    )
    by_rank = [json.loads(path.read_text()) for path in sorted(runs.glob("ranks-rank*.json"))]
    assert len(by_rank) == 2
    together = [sorted(a["samples"] + b["samples"]) for a, b in zip(*by_rank)]
    assert together == step_samples(runs, "whole")[:2]
    assert losses(runs / "ranks" / "logs") == pytest.approx(losses(runs / "whole" / "logs")[:2], rel=2e-3)


# ------------------------------------------------------------------ the stock configs by name
def stock_overrides(assets: Path, builder: str, out: Path, budget: str) -> list[str]:
    """What points a stock vision config at the tiny assets (the model, the transform, the data, the weights) and
    its run at ``out``, profiled under ``budget``."""
    vision = TinyVisionPaths(assets)
    return [
        f"output_dir={out}",
        f"adaptive_batching.cache_dir={out}/cache",
        f"adaptive_batching.memory_budget={budget}",
        f"model._component_=adaptive_batching.assets.tiny_vision.{builder}",
        f"model.image_size={TILE}",
        f"tokenizer.path={assets}/tokenizer/tokenizer.model",
        f"tokenizer.special_tokens_path={assets}/tokenizer/special_tokens.json",
        f"tokenizer.image_size={TILE}",
        "tokenizer.max_seq_len=32",
        "dataset._component_=torchtune.datasets.multimodal.multimodal_chat_dataset",
        "~dataset.subset",
        "dataset.source=json",
        f"dataset.data_files={vision.dataset_path}",
        "dataset.split=train",
        "dataset.image_tag=<image>",
        f"dataset.image_dir={vision.image_dir}",
        f"checkpointer.checkpoint_dir={vision.model_dir}",
        "~checkpointer.checkpoint_files",
        "checkpointer.checkpoint_files=[model.safetensors]",
        "device=cpu",
        "max_steps_per_epoch=1",
    ]


@pytest.mark.e2e
def test_a_stock_vision_config_by_name_trains_with_one_added_line(vision_assets: Path, runs: Path) -> None:
    """``use_maximum_batch_size=True`` is the one line; the rest only points the config at the tiny assets."""
    out = runs / "by_name"
    result = tune_run(
        "adaptive_full_finetune",
        "llama3_2_vision/11B_full_single_device",
        [
            "use_maximum_batch_size=True",
            *stock_overrides(vision_assets, "tiny_llama3_2_vision", out, "14MiB"),
        ],
        cwd=runs,
    )
    output = ok(result)
    assert "Worst-case sample: 32 tokens and 1 image" in output
    chosen = int(re.search(r"chosen micro batch (\d+)", output).group(1))
    assert [r["micro_batch_size"] for r in read_metrics(out / "logs")] == [chosen]


@pytest.mark.e2e
def test_the_profile_command_takes_a_stock_vision_config_by_name(vision_assets: Path, runs: Path) -> None:
    """``adaptive-batching profile`` of the stock QLoRA config (NF4 base weights), pointed at the tiny assets."""
    out = runs / "profiled_by_name"
    result = run_command(
        "cli",
        [
            "profile",
            "--config",
            "llama3_2_vision/11B_qlora_single_device",
            f"--json={out / 'profile.json'}",
            *stock_overrides(vision_assets, "qlora_tiny_llama3_2_vision", out, "12MiB"),
        ],
        cwd=runs,
    )
    output = ok(result)
    assert "Worst-case sample: 32 tokens and 1 image" in output
    report = json.loads((out / "profile.json").read_text())
    chosen = int(re.search(r"chosen micro batch (\d+)", output).group(1))
    assert report["micro_batch"] == chosen >= 1 and report["seq_len"] == 32
    assert report["fixed_bytes"] + chosen * report["bytes_per_sample"] <= report["budget_bytes"]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "config", ["tiny_vision_qlora"]
)  # tiny_vision_lora: the same config, no NF4 (its builder: parity's)
def test_the_shipped_lora_and_qlora_vision_configs_profile_and_train(
    config: str, vision_assets: Path, runs: Path
) -> None:
    out = runs / config
    result = tune_run(
        "adaptive_lora_finetune",
        config,
        [
            f"assets_dir={vision_assets}",
            f"output_dir={out}",
            "tokenizer.max_seq_len=32",
            "epochs=1",
            "max_steps_per_epoch=1",
            "adaptive_batching.memory_budget=16MiB",
        ],
        cwd=runs,
    )
    output = ok(result)
    chosen = int(re.search(r"chosen micro batch (\d+)", output).group(1))
    assert [r["micro_batch_size"] for r in read_metrics(out / "logs")] == [chosen]
    adapter = torch.load(out / "epoch_0" / "adapter_model.pt", weights_only=True)
    assert adapter and all("lora" in key for key in adapter)  # the adapters of the encoder and the fusion layers
    assert {key.split(".")[0] for key in adapter} == {"encoder", "decoder"}
