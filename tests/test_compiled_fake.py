"""``estimate`` with ``compile: True``: fake layers and loss keep for the backward what inductor's compiled ones keep.

What a compiled function saves for the backward is measured with ``saved_tensors_hooks`` on real CPU tensors:
the bytes of every saved storage that is not one of the module's own parameters or buffers (views of a weight
cost nothing). ``torch.compile`` with inductor on the CPU decides the saved set the same way it does on a GPU
(AOTAutograd's min-cut partition happens before any kernel is written), so it is the reference here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torchtune import training
from torchtune.models.llama3_2 import llama3_2, lora_llama3_2
from torchtune.modules.loss import CEWithChunkedOutputLoss
from torchtune.modules.peft import get_adapter_params, set_trainable_params

from adaptive_batching.estimate.compiled import (
    PartitionedLayer,
    as_compiled,
    fused_nf4_dequantization,
    partitioned_layers,
)

DIMS = dict(
    vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=128, max_seq_len=64, intermediate_dim=256
)  # NF4 needs each weight's size divisible by 64 x 256


def _qlora() -> nn.Module:
    torch.manual_seed(0)
    with training.set_default_dtype(torch.bfloat16):
        model = lora_llama3_2(
            lora_attn_modules=["q_proj", "v_proj", "output_proj"],
            apply_lora_to_mlp=True,
            lora_rank=8,
            lora_alpha=16,
            quantize_base=True,
            **DIMS,
        )
    set_trainable_params(model, get_adapter_params(model))
    return model


def _full(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    with training.set_default_dtype(dtype):
        return llama3_2(**DIMS)


def _storages(t: torch.Tensor) -> list[torch.Tensor]:
    """A tensor's plain tensors (an NF4 tensor's inner ones)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [s for name in names for s in _storages(getattr(t, name))]
    return [t]


def _saved_bytes(run: Callable[[], torch.Tensor], owned: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages ``run``'s forward saves for the backward, those of ``owned`` left out;
    the backward runs too, so that a graph compiled on the first call has its backward compiled as well."""
    mine = {s.untyped_storage().data_ptr() for t in owned for s in _storages(t)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        for s in _storages(t):
            if s.untyped_storage().data_ptr() not in mine:
                saved[s.untyped_storage().data_ptr()] = s.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    out.float().sum().backward()
    return sum(saved.values())


def _owned(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


@pytest.fixture(scope="module")
def qlora_saved() -> dict[str, int]:
    """One QLoRA layer (NF4 base weights, LoRA adapters, attention, MLP) at 2 x 32 tokens: the bytes its forward
    saves eager, compiled by inductor, and partitioned as ``estimate`` traces it (NF4 as one fused op)."""
    x = torch.randn(2, 32, DIMS["embed_dim"], dtype=torch.bfloat16, requires_grad=True)
    eager = _qlora().layers[0]
    compiled = torch.compile(_qlora().layers[0], backend="inductor")
    partitioned = _qlora()
    partitioned_layers(partitioned)
    layer = partitioned.layers[0]
    with fused_nf4_dequantization():
        fused = _saved_bytes(lambda: layer(x), _owned(layer))
    _saved_bytes(lambda: compiled(x), _owned(compiled))  # compiles
    return {
        "eager": _saved_bytes(lambda: eager(x), _owned(eager)),
        "inductor": _saved_bytes(lambda: compiled(x), _owned(compiled)),
        "partitioned": fused,
    }


def test_a_partitioned_layer_saves_what_inductor_saves(qlora_saved: dict[str, int]) -> None:
    assert qlora_saved["partitioned"] == qlora_saved["inductor"] > 0


def test_compiled_qlora_keeps_the_dequantized_weights_that_eager_recomputes(qlora_saved: dict[str, int]) -> None:
    """torchao's NF4 linear dequantizes again in its backward; compiled, the partitioner saves the bf16 weights
    instead, so the compiled layer saves more than eager: at least the layer's bf16 weights more, less what
    compiling saves elsewhere (here the activations are small next to the weights)."""
    layer = _qlora().layers[0]
    nf4_weights = sum(p.numel() for p in layer.parameters() if type(p).__name__ == "NF4Tensor")
    assert qlora_saved["inductor"] - qlora_saved["eager"] > nf4_weights  # > 2 bytes a weight, less the rest


def test_the_compiled_chunked_cross_entropy_saves_what_inductor_saves() -> None:
    """Compiled, each chunk keeps its bf16 logits, the labels and two float32 values a token (the scalar
    ``FusedCrossEntropy`` does not keep: the count of tokens, 8 bytes); eager keeps float32 logits."""
    torch.manual_seed(0)
    labels = torch.randint(0, DIMS["vocab_size"], (2, 64))

    def run(loss_fn: Any) -> Callable[[], torch.Tensor]:
        logits = torch.randn(2, 64, DIMS["vocab_size"], dtype=torch.bfloat16, requires_grad=True)
        return lambda: loss_fn([c for c in (logits * 1).chunk(loss_fn.num_output_chunks, dim=1)], labels)

    inductor = CEWithChunkedOutputLoss()
    training.compile_loss(inductor, verbose=False)
    _saved_bytes(run(inductor), [])  # compiles
    modelled, eager = CEWithChunkedOutputLoss(), CEWithChunkedOutputLoss()
    assert as_compiled(modelled)
    saved = {
        name: _saved_bytes(run(fn), [])
        for name, fn in [("inductor", inductor), ("modelled", modelled), ("eager", eager)]
    }
    assert 0 <= saved["inductor"] - saved["modelled"] <= 8
    logits = labels.numel() * DIMS["vocab_size"]
    assert saved["eager"] >= 4 * logits > saved["modelled"] + logits  # float32 logits against bf16 ones


def test_partitioned_layers_compute_what_eager_layers_compute_and_share_one_graph() -> None:
    """On real tensors the partitioned layers give the eager model's loss and each layer its own gradients;
    identical layers share one traced graph per input shape, and a new micro batch traces one more."""
    eager, partitioned = _full(), _full()
    assert partitioned_layers(partitioned) == DIMS["num_layers"]
    tokens = torch.randint(0, DIMS["vocab_size"], (2, 16))
    for model in (eager, partitioned):
        model(tokens).float().square().mean().backward()
    for (name, a), b in zip(eager.named_parameters(), partitioned.parameters()):
        assert b.grad is not None and torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name
    forward = partitioned.layers[0].forward
    assert isinstance(forward, PartitionedLayer) and len(forward.graphs) == 1
    assert partitioned.layers[1].forward.graphs is forward.graphs
    partitioned(torch.randint(0, DIMS["vocab_size"], (3, 16))).sum().backward()
    assert len(forward.graphs) == 2
    with torch.no_grad():  # no gradients: eager, nothing traced
        partitioned(tokens)
    assert len(forward.graphs) == 2
