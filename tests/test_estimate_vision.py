"""``adaptive-batching estimate`` of Llama 3.2 Vision (torchtune's ``DeepFusionModel``): the encoder on the image tiles,
the decoder with its cross-attention layers, what trains, and the layer extrapolation over their stacks.

The fake step's memory is checked against a real step of the tiny vision model on real tensors (torch's
``MemTracker`` counts both, so no allocator or timing enters); the profiler's figures on the same configs are in
docs/estimates.md with their command.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from config_edits import CONFIGS
from omegaconf import OmegaConf
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torchtune import config, training

from adaptive_batching.assets.tiny_vision import DECODER_ARGS, ENCODER_ARGS
from adaptive_batching.config.loading import load_config
from adaptive_batching.config.vision import ImageGeometry
from adaptive_batching.core.steps import StepMemory
from adaptive_batching.estimate.fake_steps import TraceInputs, extrapolated, full_trace
from adaptive_batching.estimate.model_stacks import (
    CLIP,
    DECODER,
    PROJECTION,
    _reading_grad_fn,
    stacks,
    text_vocab_size,
)
from adaptive_batching.estimate.prediction import predict, trace_steps
from adaptive_batching.estimate.traced_step import traced_step
from adaptive_batching.runtime.mem_tracker import FrozenAwareMemTracker
from adaptive_batching.training.objectives import VisionFinetune
from adaptive_batching.training.recipe_table import traced_parts

SEQ_LEN = 16
LARGER = 8  # a micro batch whose activations are past the gradients' plateau
MiB = 2**20
STOCK = {  # torchtune's 9 vision configs: the method, and the parts a full fine-tune trains
    "llama3_2_vision/11B_full": "full",
    "llama3_2_vision/11B_full_single_device": "full",
    "llama3_2_vision/11B_lora": "lora",
    "llama3_2_vision/11B_lora_single_device": "lora",
    "llama3_2_vision/11B_qlora": "lora",
    "llama3_2_vision/11B_qlora_single_device": "lora",
    "llama3_2_vision/90B_full": "full",
    "llama3_2_vision/90B_lora": "lora",
    "llama3_2_vision/90B_qlora": "lora",
}
PAGE = Path(__file__).resolve().parent.parent / "docs" / "estimates.md"


def deep_tiny_vision(encoder_trainable: bool = True, decoder_trainable: bool = False, fusion_trainable: bool = True):
    """The tiny vision model with stacks deep enough to extrapolate: 4 CLIP layers (hidden states before 1 and 3),
    4 projection layers, 8 decoder layers with cross-attention every 2nd (4 runs of 2)."""
    from torchtune.models.llama3_2_vision import llama3_2_vision_decoder, llama3_2_vision_encoder
    from torchtune.modules.model_fusion import DeepFusionModel

    encoder = dict(ENCODER_ARGS, clip_num_layers=4, clip_hidden_states=[1, 3], num_layers_projection=4)
    return DeepFusionModel(
        encoder=llama3_2_vision_encoder(**encoder, tile_size=56),
        decoder=llama3_2_vision_decoder(**dict(DECODER_ARGS, num_layers=8, fusion_interval=2)),
        encoder_trainable=encoder_trainable,
        decoder_trainable=decoder_trainable,
        fusion_trainable=fusion_trainable,
    )


def real_activation_bytes(cfg: Any, inputs: TraceInputs, method: Any, objective: Any, micro_batch: int) -> int:
    """The peak above the start of a real step of the config's model (real tensors, random weights), as torch's
    ``MemTracker`` counts it; the tile position embeddings' outputs read their ``grad_fn`` first, as the trace's
    (torch crashes on a hook of such a view otherwise)."""
    torch.manual_seed(0)
    with training.set_default_dtype(torch.bfloat16):
        model = config.instantiate(cfg.model)
    method.configure(model)
    from torchtune.models.clip._position_embeddings import TiledTokenPositionalEmbedding, TilePositionalEmbedding

    for module in model.modules():
        if isinstance(module, (TiledTokenPositionalEmbedding, TilePositionalEmbedding)):
            module.forward = _reading_grad_fn(module.forward)
    loss_fn = config.instantiate(cfg.loss)
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    step = traced_step(objective, inputs.collate_path, lambda frozen: nn.Identity())
    batch = step.batch(loss_fn, micro_batch, SEQ_LEN, text_vocab_size(model))
    tracker = FrozenAwareMemTracker()
    tracker.track_external(model)
    with tracker:
        start = sum(d.get("Total", 0) for d in tracker.get_tracker_snapshot("current").values())
        step.loss(model, loss_fn, batch).backward()
    return int(sum(d.get("Total", 0) for d in tracker.get_tracker_snapshot("peak").values()) - start)


def fake_steps(parts: tuple[TraceInputs, Any, Any], *micro_batches: int, exact: bool = False) -> list[StepMemory]:
    """Fake steps of ``parts`` (what ``traced_parts`` gives) at ``micro_batches``: by layer extrapolation, or
    tracing every layer."""
    inputs, method, objective = parts
    steps = (full_trace if exact else extrapolated)(
        inputs, method, torch.bfloat16, FakeTensorMode(allow_non_fake_inputs=True), SEQ_LEN, objective
    )
    return [steps.measure(micro_batch, 1) for micro_batch in micro_batches]


@pytest.fixture(scope="module")
def tiny() -> dict[str, Any]:
    """tiny_vision_full's fake steps at micro batch 1 and 2 (images of 4 tiles, the transform's most), its real steps
    at the same micro batches, and a fake step of 8 samples with images of 2 tiles."""
    cfg = load_config(str(CONFIGS / "tiny_vision_full.yaml"))
    inputs, method, objective = traced_parts(cfg)
    two_tiles = VisionFinetune(ImageGeometry(objective.geometry.tile_size, objective.geometry.patch_size, 2))
    return {
        "four": trace_steps(inputs, method, objective, seq_len=SEQ_LEN, max_probe=2),
        "two": fake_steps((inputs, method, two_tiles), LARGER)[0],
        "real": {m: real_activation_bytes(cfg, inputs, method, objective, m) for m in (1, 2)},
    }


def test_the_fake_step_holds_what_a_real_step_holds(tiny: dict[str, Any]) -> None:
    """The encoder on 4 tiles an image, the cross-attention and the frozen decoder: the traced step's peak is the
    real step's, to 2% (FusionEmbedding's stand-in, and the tile position embeddings' aspect ratios, which fake
    tensors read as 1)."""
    trace = tiny["four"]
    assert sorted(trace.probes) == [1, 2]
    for micro_batch, real in tiny["real"].items():
        assert trace.probes[micro_batch].activation_bytes == pytest.approx(real, rel=0.02), micro_batch
    per_sample = trace.probes[2].activation_bytes - trace.probes[1].activation_bytes
    assert per_sample == pytest.approx(tiny["real"][2] - tiny["real"][1], rel=0.02)


def test_a_sample_costs_more_with_more_tiles_an_image(tiny: dict[str, Any]) -> None:
    """The encoder's activations grow with the tiles of each image (and the cross-attention's keys with them): the
    same model and texts, 8 samples, 4 tiles an image against 2 (a sample costs 1.9 MB against 1.2 MB)."""
    four, two = tiny["four"].measure(LARGER, 1), tiny["two"]
    assert four.steady_bytes == two.steady_bytes  # the same model and state
    assert four.activation_bytes > 1.3 * two.activation_bytes > 0


def test_the_estimate_says_what_it_assumed_of_the_images(tiny: dict[str, Any]) -> None:
    estimate = predict(tiny["four"], device_memory_bytes=64 * MiB, verify=False)
    assert estimate.max_micro_batch > 0 and estimate.objective == "vision_finetune"
    assert estimate.vision.startswith("vision model: 2 CLIP layers, 1 projection layer, 2 decoder layers")
    assert "1 image a sample (estimate reads no image counts from the data)" in estimate.vision
    assert "vision model:" in estimate.describe() and "vision" not in estimate.to_dict()


def test_extrapolating_the_encoder_and_decoder_stacks_matches_the_full_trace() -> None:
    """3 of 4 CLIP layers, 3 of 4 projection layers and 3 of 4 runs of (decoder layer, decoder layer with
    cross-attention) traced, the middle one repeated: the same step as tracing all 16 layers."""
    cfg = load_config(str(CONFIGS / "tiny_vision_full.yaml"))
    cfg.model = OmegaConf.create({"_component_": f"{__name__}.deep_tiny_vision"})
    inputs, method, objective = traced_parts(cfg)
    steps = extrapolated(inputs, method, torch.bfloat16, FakeTensorMode(allow_non_fake_inputs=True), SEQ_LEN, objective)
    assert (steps.num_layers, steps.traced_layers) == (16, 12)
    assert "4 CLIP layers, 3 layers traced" in steps.vision
    assert "8 decoder layers (4 with cross-attention), 3 runs of 2 layers traced" in steps.vision
    fast, (exact,) = steps.measure(2, 1), fake_steps((inputs, method, objective), 2, exact=True)
    assert fast.activation_bytes > 0
    for field in ("activation_bytes", "steady_bytes", "optimizer_peak"):
        assert getattr(fast, field) == pytest.approx(getattr(exact, field), rel=0.01), field


@functools.cache
def meta_model(node: str) -> nn.Module:
    """The model of a config's ``model`` node (YAML), built once on the meta device. QLoRA's builder is LoRA's with
    NF4 base weights, which train as LoRA's do (and take seconds to make on meta): LoRA's is built for it."""
    model = OmegaConf.create(node)
    model._component_ = str(model._component_).replace(".qlora_", ".lora_")
    with torch.device("meta"):
        return config.instantiate(model)


@pytest.mark.parametrize("name", sorted(STOCK))
def test_each_stock_vision_config_trains_its_parts_and_has_its_row(name: str) -> None:
    """Built on the meta device as the estimate builds it: the stacks it extrapolates (32 CLIP layers, 8 projection
    layers, the decoder in runs of 4 with cross-attention last) and what trains (full: the encoder and the fusion
    layers, the decoder frozen, as the configs say; LoRA and QLoRA: the adapters alone). docs/estimates.md's row,
    written by benchmarks/estimate_stock_configs.py, gives a micro batch for every device."""
    cfg = load_config(name)
    inputs, method, objective = traced_parts(cfg)
    assert objective.name == "vision_finetune" and objective.geometry.tokens_per_tile == 1601
    model = meta_model(OmegaConf.to_yaml(cfg.model))
    method.configure(model)
    found = {stack.name: stack for stack in stacks(model)}
    assert [(found[k].total, found[k].period) for k in (CLIP, PROJECTION)] == [(32, 1), (8, 1)]
    assert found[DECODER].period == 4 and found[DECODER].total in (8, 20)  # 11B: 32 layers, 90B: 80
    trains = {
        part: [n for n, p in getattr(model, part).named_parameters() if p.requires_grad]
        for part in ("encoder", "decoder")
    }
    if STOCK[name] == "full":
        assert trains["encoder"] and all("fusion" in n or "cross" in n for n in trains["decoder"])
        assert any("fusion_layer" in n for n in trains["decoder"])
        assert not any(".layers.0.attn." in n for n in trains["decoder"])  # a self-attention layer: frozen
    else:
        assert trains["encoder"] and all("lora_" in n for part in trains.values() for n in part)
    row = next(line for line in PAGE.read_text().splitlines() if line.startswith(f"| `{name}` |"))
    cells = [c.strip() for c in row.split("|")[6:-2]]
    assert "not estimated" not in row and len(cells) == 6, row
    batches = [int(c.split()[0]) for c in cells]
    assert all(b >= 0 for b in batches) and max(batches) > 0 and math.isfinite(float(row.split("|")[-2])), row
