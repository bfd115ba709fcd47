"""Deterministic, offline tiny assets for Llama 3.2 Vision, beside the text ones (:mod:`.tiny`).

* builders of a tiny Llama 3.2 Vision model (full, LoRA, QLoRA), made as torchtune's 11B and 90B builders make
  theirs (``llama3_2_vision_encoder`` and ``llama3_2_vision_decoder`` joined by ``DeepFusionModel``): a CLIP encoder
  of 2 layers of width 128 on 56-pixel tiles of 14-pixel patches, up to 4 tiles an image, and a decoder of 2 layers
  of width 128 with a cross-attention layer before each (128: torchao's NF4 needs 16384 elements a weight, QLoRA's);
* its checkpoint in Hugging Face's Mllama layout (``config.json`` + ``model.safetensors``), its tanh gates open (a
  trained model's are; torchtune builds them closed, where the images change nothing), which
  ``FullModelHFCheckpointer`` with ``model_type: LLAMA3_VISION`` loads, as it loads the stock configs' weights;
* small generated images of 1 to 4 tiles and a multimodal data set of conversations about them, in the ShareGPT
  layout of torchtune's ``multimodal_chat_dataset`` (LLaVA's): each sample an image and a question and answer.

torchtune's vision modules import torchvision: this module does too (:func:`vision_available` says whether it can).
"""

from __future__ import annotations

import importlib.util
import io
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_save

from adaptive_batching.runtime.files import write_atomically

TILE = 56  # pixels of a tile's side: 4 patches of 14
MAX_TILES = 4
ENCODER_ARGS: dict[str, Any] = {
    "patch_size": 14,
    "num_heads": 2,
    "clip_embed_dim": 128,
    "clip_num_layers": 2,
    "clip_hidden_states": [0, 1],
    "num_layers_projection": 1,
    "decoder_embed_dim": 128,
    "max_num_tiles": MAX_TILES,
    "in_channels": 3,
}
DECODER_ARGS: dict[str, Any] = {
    "vocab_size": 1280,  # the tiny tokenizer's ids (its special tokens, <|image|> among them, included)
    "num_layers": 2,
    "fusion_interval": 1,  # a cross-attention layer before every layer
    "num_special_tokens": 8,
    "num_heads": 4,
    "num_kv_heads": 4,
    "embed_dim": 128,
    "max_seq_len": 512,
    "encoder_max_seq_len": 4 * MAX_TILES * (TILE // 14) ** 2 + 4 * MAX_TILES,  # 4 images of 4 tiles, CLS included
    "rope_base": 500_000,
    "intermediate_dim": 256,
}
ASPECT_RATIOS = [(h, w) for h in range(1, MAX_TILES + 1) for w in range(1, MAX_TILES + 1) if h * w <= MAX_TILES]
IMAGE_SIDES = [(TILE, TILE), (2 * TILE, TILE), (TILE, 2 * TILE), (3 * TILE, TILE), (2 * TILE, 2 * TILE)]


def vision_available() -> bool:
    """Whether torchvision, which torchtune's vision modules import, is installed."""
    return importlib.util.find_spec("torchvision") is not None


def tiny_llama3_2_vision(
    decoder_trainable: bool = False,
    encoder_trainable: bool = True,
    fusion_trainable: bool = True,
    image_size: int = TILE,
) -> Any:
    """The tiny Llama 3.2 Vision model, with the trainable parts of ``llama3_2_vision_11b`` (same arguments)."""
    from torchtune.models.llama3_2_vision import llama3_2_vision_decoder, llama3_2_vision_encoder
    from torchtune.modules.model_fusion import DeepFusionModel

    return DeepFusionModel(
        encoder=llama3_2_vision_encoder(**ENCODER_ARGS, tile_size=image_size),
        decoder=llama3_2_vision_decoder(**DECODER_ARGS),
        encoder_trainable=encoder_trainable,
        decoder_trainable=decoder_trainable,
        fusion_trainable=fusion_trainable,
    )


def lora_tiny_llama3_2_vision(
    lora_attn_modules: list[str],
    decoder_trainable: str = "frozen",
    encoder_trainable: str = "lora",
    fusion_trainable: str = "lora",
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    image_size: int = TILE,
) -> Any:
    """The tiny model with LoRA adapters, as ``lora_llama3_2_vision_11b`` makes them (same arguments)."""
    from torchtune.models.llama3_2_vision import lora_llama3_2_vision_decoder, lora_llama3_2_vision_encoder
    from torchtune.models.llama3_2_vision._component_builders import LoRATrainable
    from torchtune.modules.model_fusion import DeepFusionModel

    kinds = {
        part: LoRATrainable(value.lower())
        for part, value in (
            ("decoder", decoder_trainable),
            ("encoder", encoder_trainable),
            ("fusion", fusion_trainable),
        )
    }
    if LoRATrainable.FULL in kinds.values():
        raise ValueError("mixed LoRA and full fine-tuning is not supported, as in lora_llama3_2_vision_11b")
    adapters: dict[str, Any] = {
        "lora_attn_modules": lora_attn_modules,
        "apply_lora_to_mlp": apply_lora_to_mlp,
        "apply_lora_to_output": apply_lora_to_output,
        "lora_rank": lora_rank,
        "lora_alpha": lora_alpha,
        "lora_dropout": lora_dropout,
        "use_dora": use_dora,
        "quantize_base": quantize_base,
    }
    fusion_lora = kinds["fusion"] == LoRATrainable.LORA
    encoder = lora_llama3_2_vision_encoder(
        encoder_lora=kinds["encoder"] == LoRATrainable.LORA,
        fusion_lora=fusion_lora,
        **ENCODER_ARGS,
        tile_size=image_size,
        **adapters,
    )
    decoder = lora_llama3_2_vision_decoder(
        decoder_lora=kinds["decoder"] == LoRATrainable.LORA, fusion_lora=fusion_lora, **DECODER_ARGS, **adapters
    )
    return DeepFusionModel(
        encoder=encoder,
        decoder=decoder,
        encoder_trainable=kinds["encoder"] != LoRATrainable.FROZEN,
        decoder_trainable=kinds["decoder"] != LoRATrainable.FROZEN,
        fusion_trainable=kinds["fusion"] != LoRATrainable.FROZEN,
    )


def qlora_tiny_llama3_2_vision(lora_attn_modules: list[str], **kwargs: Any) -> Any:
    """:func:`lora_tiny_llama3_2_vision` with its frozen base weights in NF4 (QLoRA)."""
    return lora_tiny_llama3_2_vision(lora_attn_modules, quantize_base=True, **kwargs)


OPEN_GATE = 0.5


def open_gates(model: Any) -> int:
    """Open the model's tanh gates (before each cross-attention layer and its MLP, and on the encoder's positional
    embeddings) to :data:`OPEN_GATE`, as a trained model's are: torchtune builds them at 0, where the text ignores the
    images and the LoRA adapters behind them get no gradient. Returns how many were opened."""
    from torchtune.modules import TanhGate

    gates = [
        module.scale if isinstance(module, TanhGate) else module.gate
        for module in model.modules()
        if isinstance(module, TanhGate) or isinstance(getattr(module, "gate", None), torch.nn.Parameter)
    ]
    for gate in gates:
        torch.nn.init.constant_(gate, OPEN_GATE)
    return len(gates)


def hf_config() -> dict[str, Any]:
    """The Mllama ``config.json`` fields ``FullModelHFCheckpointer`` reads to convert the tiny model's weights."""
    layers = DECODER_ARGS["num_layers"]
    return {
        "architectures": ["MllamaForConditionalGeneration"],
        "model_type": "mllama",
        "text_config": {
            "num_attention_heads": DECODER_ARGS["num_heads"],
            "num_key_value_heads": DECODER_ARGS["num_kv_heads"],
            "hidden_size": DECODER_ARGS["embed_dim"],
            "vocab_size": DECODER_ARGS["vocab_size"],
            # Hugging Face counts a cross-attention layer as a layer of its own: one before each of the decoder's.
            "cross_attention_layers": [2 * i for i in range(0, layers, DECODER_ARGS["fusion_interval"])],
            "num_hidden_layers": layers + len(range(0, layers, DECODER_ARGS["fusion_interval"])),
        },
        "vision_config": {
            "hidden_size": ENCODER_ARGS["clip_embed_dim"],
            "image_size": TILE,
            "max_num_tiles": MAX_TILES,
            "supported_aspect_ratios": [list(ratio) for ratio in ASPECT_RATIOS],
        },
        "torch_dtype": "float32",
    }


def hf_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The tiny model's weights under Mllama's names, as torchtune's checkpointer writes a vision model."""
    from torchtune.models.llama3_2_vision._convert_weights import llama3_vision_tune_to_hf

    config = hf_config()
    text, vision = config["text_config"], config["vision_config"]
    converted = llama3_vision_tune_to_hf(
        model.state_dict(),
        num_heads=text["num_attention_heads"],
        num_kv_heads=text["num_key_value_heads"],
        dim=text["hidden_size"],
        vocab_size=text["vocab_size"],
        cross_attention_layers=text["cross_attention_layers"],
        encoder_dim=vision["hidden_size"],
        tile_size=vision["image_size"],
        num_tiles=vision["max_num_tiles"],
        supported_aspect_ratios=[tuple(ratio) for ratio in vision["supported_aspect_ratios"]],
    )
    return {name: tensor.detach().contiguous() for name, tensor in converted.items()}


@dataclass(frozen=True)
class TinyVisionPaths:
    """Where the tiny vision assets live below ``root`` (the tiny assets' folder): ``vision/model`` (Mllama
    layout), ``vision/images`` and the data set ``vision/data/vision_tiny.json``."""

    root: Path

    @property
    def model_dir(self) -> Path:
        return self.root / "vision" / "model"

    @property
    def image_dir(self) -> Path:
        return self.root / "vision" / "images"

    @property
    def dataset_path(self) -> Path:
        return self.root / "vision" / "data" / "vision_tiny.json"


_SHAPES = ["square", "stripe", "ring", "cross", "dot"]
_COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]


def _png(width: int, height: int, colour: tuple[int, int, int], seed: int) -> bytes:
    """A small PNG: a colour field with noise, the same bytes for the same arguments."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 48, (height, width, 3), generator=generator, dtype=torch.int32)
    pixels = (torch.tensor(colour, dtype=torch.int32) + noise).clamp(0, 255).to(torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy(), mode="RGB").save(out, format="PNG")
    return out.getvalue()


def generate_conversations(num_samples: int, num_images: int, seed: int) -> list[dict[str, Any]]:
    """ShareGPT-layout samples (``image``, ``conversations``), each about one of the images, no two alike; the answers'
    lengths have a long tail, as the text data set's do, so the longest sample is far above the typical one."""
    rng = random.Random(seed)
    samples = []
    for index in range(num_samples):
        image = index % num_images
        shape, colour = _SHAPES[image % len(_SHAPES)], _COLOURS[image % len(_COLOURS)]
        words = max(2, int(rng.paretovariate(1.3) * 6))
        answer = " ".join(rng.choice([shape, colour, "image", "tile", "light", "edge"]) for _ in range(words))
        samples.append(
            {
                "image": f"image_{image:02d}.png",
                "conversations": [
                    {"from": "human", "value": f"<image>\nQuestion {index}: what is in picture {image}?"},
                    {"from": "gpt", "value": f"A {colour} {shape}: {answer}."},
                ],
            }
        )
    return samples


def write_tiny_vision_assets(root: str | Path, seed: int = 0, num_samples: int = 240) -> TinyVisionPaths:
    """Write the tiny vision model, its images and its data set below ``root`` (deterministic in ``seed``)."""
    paths = TinyVisionPaths(Path(root))
    colours = [(200, 40, 40), (40, 160, 60), (40, 60, 200), (220, 200, 40), (150, 60, 170), (230, 130, 30)]
    num_images = 2 * len(IMAGE_SIDES)
    for image in range(num_images):
        width, height = IMAGE_SIDES[image % len(IMAGE_SIDES)]
        png = _png(width, height, colours[image % len(colours)], seed + image)
        write_atomically(paths.image_dir / f"image_{image:02d}.png", png)
    samples = generate_conversations(num_samples, num_images, seed)
    write_atomically(paths.dataset_path, (json.dumps(samples, indent=1) + "\n").encode())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tiny_llama3_2_vision()
    open_gates(model)
    write_atomically(paths.model_dir / "model.safetensors", safetensors_save(hf_state_dict(model)))
    write_atomically(paths.model_dir / "config.json", (json.dumps(hf_config(), indent=2) + "\n").encode())
    return paths
