"""NF4 weights (QLoRA): torchao's ``NF4Tensor``, 4-bit data plus double-quantized scalers.

An NF4 tensor is a tensor subclass with no ordinary storage: its bytes are those of its inner tensors
(``quantized_data``, ``quantized_scalers``, ``quantization_factor``, ``scaler_mean``, ``nf4``), read
through ``__tensor_flatten__``. torchtune's QLoRA builders (``quantize_base=True``) create the frozen base
weights as NF4 at construction; a model built on the meta device has NF4 weights whose inner tensors are
still on meta, so they are quantized here from the checkpoint's dense weights, as torchtune's distributed
loader does for a sharded model.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4

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


def has_nf4(model: nn.Module) -> bool:
    return any(local_nf4(param) is not None for param in model.parameters())


def quantize_into(model: nn.Module, state_dict: Mapping[str, torch.Tensor],
                  device: torch.device) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Quantize ``state_dict``'s weights of the model's NF4 parameters into new NF4 parameters on ``device``
    (same block sizes and dtype); return the rest of the state dict and the keys quantized."""
    rest = dict(state_dict)
    quantized: set[str] = set()
    for name, param in list(model.named_parameters()):
        key = name.replace(_WRAPPER, "")
        if not isinstance(param, NF4Tensor) or key not in rest:
            continue
        dense = rest.pop(key).to(device=device, dtype=param.dtype)
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        weight = to_nf4(dense, block_size=param.block_size, scaler_block_size=param.scaler_block_size)
        setattr(module, attr, nn.Parameter(weight, requires_grad=False))
        quantized.add(key)
    return rest, quantized


def quantize_empty(model: nn.Module) -> int:
    """Give every NF4 parameter of a model built on the meta device (``to_empty`` leaves their inner tensors
    there) new, uninitialised NF4 storage; under ``FakeTensorMode`` it is fake, with the real NF4 layout.
    Returns how many were replaced."""
    replaced = 0
    for name, param in list(model.named_parameters()):
        if isinstance(param, NF4Tensor):
            module_name, _, attr = name.rpartition(".")
            dense = torch.empty(param.shape, dtype=param.dtype)
            weight = to_nf4(dense, block_size=param.block_size, scaler_block_size=param.scaler_block_size)
            setattr(model.get_submodule(module_name), attr, nn.Parameter(weight, requires_grad=False))
            replaced += 1
    return replaced
