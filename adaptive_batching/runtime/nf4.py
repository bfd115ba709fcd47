"""NF4 weights (QLoRA): torchao's ``NF4Tensor``, 4-bit data plus double-quantized scalers.

An NF4 tensor is a tensor subclass with no ordinary storage: its bytes are those of its inner tensors
(``quantized_data``, ``quantized_scalers``, ``quantization_factor``, ``scaler_mean``, ``nf4``), read
through ``__tensor_flatten__``. torchtune's QLoRA builders (``quantize_base=True``) create the frozen base
weights as NF4 at construction; a model built on the meta device has NF4 weights whose inner tensors are
still on meta, so they are quantized here from the checkpoint's dense weights, as torchtune's distributed
loader does for a sharded model.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
from torchtune.modules.model_fusion import FusionLayer

_WRAPPER = "_checkpoint_wrapped_module."  # torch's checkpoint_wrapper's submodule name


def local_nf4(tensor: Any) -> NF4Tensor | None:
    """The NF4 tensor behind ``tensor`` (itself, or a DTensor's local shard), or None."""
    local = tensor.to_local() if hasattr(tensor, "to_local") and not isinstance(tensor, NF4Tensor) else tensor
    return local if isinstance(local, NF4Tensor) else None


def nf4_bytes(tensor: NF4Tensor) -> int:
    """The bytes an NF4 tensor holds: the sum of its inner tensors."""
    names, _ = tensor.__tensor_flatten__()
    return sum(_inner_bytes(getattr(tensor, name)) for name in names)


def _inner_bytes(inner: torch.Tensor) -> int:
    return inner.numel() * inner.element_size()


def quantize_into(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], device: torch.device
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Quantize ``state_dict``'s weights of the model's NF4 parameters into new NF4 parameters on ``device``
    (same block sizes and dtype); return the rest of the state dict and the names of the parameters quantized,
    as the model's ``load_state_dict`` reports them missing (inside activation checkpointing's wrapper too)."""
    rest = dict(state_dict)
    quantized: set[str] = set()
    fused = [prefix + "." for prefix, module in model.named_modules() if isinstance(module, FusionLayer)]
    for name, param in list(model.named_parameters()):
        key = _state_dict_key(name.replace(_WRAPPER, ""), fused)
        if not isinstance(param, NF4Tensor) or key not in rest:
            continue
        dense = rest.pop(key).to(device=device, dtype=param.dtype)
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        weight = to_nf4(dense, block_size=param.block_size, scaler_block_size=param.scaler_block_size)
        setattr(module, attr, nn.Parameter(weight, requires_grad=False))
        quantized.add(name)
    return rest, quantized


def _state_dict_key(name: str, fused: list[str]) -> str:
    """A parameter's key in the model's state dict: a vision decoder's ``FusionLayer`` leaves out its ``layer.``
    (torchtune's state-dict hooks), so that its weights keep the text decoder's names."""
    for prefix in fused:
        if name.startswith(prefix + "layer."):
            return prefix + name[len(prefix) + len("layer.") :]
    return name


def _empty_like(template: NF4Tensor) -> NF4Tensor:
    """A new NF4 tensor with ``template``'s layout and new, uninitialised inner tensors (no quantization)."""
    names, meta = template.__tensor_flatten__()
    inner = {attr: torch.empty_like(getattr(template, attr)) for attr in names}
    return NF4Tensor.__tensor_unflatten__(inner, meta, template.size(), template.stride())


def quantize_empty(model: nn.Module) -> int:
    """Give every NF4 parameter of a model built on the meta device (``to_empty`` leaves their inner tensors
    there) new, uninitialised NF4 storage; under ``FakeTensorMode`` it is fake, with the real NF4 layout.
    Each shape is quantized once; the other weights of that shape get its layout. Returns how many were
    replaced."""
    layouts: dict[tuple, NF4Tensor] = {}
    replaced = 0
    for name, param in list(model.named_parameters()):
        if not isinstance(param, NF4Tensor):
            continue
        key = (tuple(param.shape), param.dtype, param.block_size, param.scaler_block_size)
        if key not in layouts:
            layouts[key] = to_nf4(
                torch.empty(param.shape, dtype=param.dtype),
                block_size=param.block_size,
                scaler_block_size=param.scaler_block_size,
            )
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, nn.Parameter(_empty_like(layouts[key]), requires_grad=False))
        replaced += 1
    return replaced


_BUILDERS = ("torchtune.modules.peft.lora", "torchtune.modules.peft.dora", "torchtune.modules.low_precision.nf4_linear")


@contextlib.contextmanager
def fast_on_meta() -> Iterator[None]:
    """While a QLoRA model is built on the meta device: torchtune's layers quantize their (empty) weights to
    NF4 in their constructors, about 0.1 s a weight on meta tensors (a minute for a 70B model, which holds
    no values yet); inside this context each shape is quantized once and the other weights of that shape
    get its layout. Weights on other devices are quantized as usual."""
    modules: list[Any] = [importlib.import_module(name) for name in _BUILDERS]  # their to_nf4 is swapped below
    layouts: dict[tuple, NF4Tensor] = {}

    def quantize(tensor: torch.Tensor, block_size: int = 64, scaler_block_size: int = 256) -> NF4Tensor:
        if tensor.device.type != "meta":
            return to_nf4(tensor, block_size, scaler_block_size)
        key = (tuple(tensor.shape), tensor.dtype, block_size, scaler_block_size)
        if key not in layouts:
            layouts[key] = to_nf4(tensor, block_size, scaler_block_size)
        return _empty_like(layouts[key])

    originals = [module.to_nf4 for module in modules]
    for module in modules:
        module.to_nf4 = quantize
    try:
        yield
    finally:
        for module, original in zip(modules, originals):
            module.to_nf4 = original
