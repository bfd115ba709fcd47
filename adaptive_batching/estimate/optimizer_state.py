"""Optimizers for fake training steps: the config's own, or a stand-in where the real one cannot run there.

``bitsandbytes`` optimizers cannot step on fake tensors (their 8-bit step reads values: a data-dependent
``aten._local_scalar_dense``), and ``bitsandbytes`` may not be installed at all. Their state is simple and
documented by their ``init_state`` (bitsandbytes 0.50), so :class:`BitsAndBytesStandIn` creates the same
state tensors, at the same shapes and dtypes, without importing ``bitsandbytes``; the estimate is then the
same whether it is installed or not. Per parameter, for each moment (two for Adam/AdamW, one for Lion):

* 8-bit (``*8bit``, or ``optim_bits=8``) and at least ``min_8bit_size`` (4096) values: a ``uint8`` tensor
  of the parameter's shape and a ``float32`` absmax per 256-value block. The 256-entry quantile map of each
  moment (``float32``) is one tensor per optimizer, shared by all its parameters.
* 32-bit, or a parameter under ``min_8bit_size``: a ``float32`` tensor of the parameter's shape.
* ``max_unorm > 0``: one more ``float32`` value.

The step itself runs bitsandbytes' fused kernels in place (no temporaries), so the stand-in's step only
creates missing state. Paged optimizers (``Paged*``) put the moments of parameters of at least 100,000
values in CUDA unified memory (``get_state_buffer``): resident on the GPU unless the driver evicts them
under memory pressure. The estimate counts them as device memory, the honest default, and reports how much
of the state is paged (:meth:`BitsAndBytesStandIn.paged_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from adaptive_batching.core.nodes import building
from adaptive_batching.errors import ConfigError

BNB_PREFIX = "bitsandbytes.optim."
BLOCK_SIZE = 256  # values per absmax block (bitsandbytes' blockwise 8-bit state)
QMAP_SIZE = 256  # entries of a moment's quantile map
MIN_PAGED_NUMEL = 100_000  # smaller parameters' state is never paged (bitsandbytes' get_state_buffer)
MOMENTS = {"Adam": 2, "AdamW": 2, "Lion": 1}
# The keyword arguments bitsandbytes 0.50's Adam/AdamW/Lion classes take (their hyperparameters only change
# values, never the state's size, except the three that the stand-in reads).
ACCEPTED = {
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "optim_bits",
    "args",
    "min_8bit_size",
    "percentile_clipping",
    "block_wise",
    "max_unorm",
    "is_paged",
    "skip_zeros",
}


def stand_in_spec(component: str) -> tuple[int, int | None, bool] | None:
    """``(moments, forced bits or None, paged)`` for a bitsandbytes optimizer the stand-in models, else None.

    ``bitsandbytes.optim.PagedAdamW8bit`` (and ``bitsandbytes.optim.adamw.PagedAdamW8bit``) is (2, 8, True).
    """
    if not component.startswith(BNB_PREFIX):
        return None
    name = component.rsplit(".", 1)[-1]
    paged = name.startswith("Paged")
    base = name.removeprefix("Paged")
    bits: int | None = None
    for suffix, forced in (("8bit", 8), ("32bit", 32)):
        if base.endswith(suffix):
            base, bits = base.removesuffix(suffix), forced
    if base not in MOMENTS:
        return None
    return MOMENTS[base], bits, paged


def supported_stand_ins() -> list[str]:
    """The bitsandbytes optimizer names the stand-in counts, for messages and docs."""
    return [f"{paged}{base}{bits}" for base in MOMENTS for paged in ("", "Paged") for bits in ("", "8bit", "32bit")]


class BitsAndBytesStandIn(torch.optim.Optimizer):
    """A bitsandbytes optimizer's state at its real shapes and dtypes, for fake steps (see the module docstring).

    ``component`` is the config's ``optimizer._component_``; stepping creates the state of every parameter
    with a gradient that has none yet, and changes nothing else.
    """

    def __init__(
        self,
        params: Iterable[Any],
        component: str,
        moments: int,
        bits: int,
        paged: bool,
        min_8bit_size: int = 4096,
        max_unorm: float = 0.0,
        **hyperparameters: Any,
    ) -> None:
        super().__init__(params, {"lr": hyperparameters.get("lr", 1e-3)})
        self.component = component
        self.moments = moments
        self.bits = bits
        self.paged = paged
        self.min_8bit_size = min_8bit_size
        self.max_unorm = max_unorm
        self.qmaps: list[torch.Tensor] = []

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        state: dict[str, Any] = {"step": 0}
        if self.bits == 8 and param.numel() >= self.min_8bit_size:
            if not self.qmaps:
                self.qmaps = [
                    torch.empty(QMAP_SIZE, dtype=torch.float32, device=param.device) for _ in range(self.moments)
                ]
            blocks = -(-param.numel() // BLOCK_SIZE)
            for i in range(1, self.moments + 1):
                state[f"state{i}"] = torch.empty_like(param, dtype=torch.uint8)
                state[f"qmap{i}"] = self.qmaps[i - 1]
                state[f"absmax{i}"] = torch.empty(blocks, dtype=torch.float32, device=param.device)
        else:
            for i in range(1, self.moments + 1):
                state[f"state{i}"] = torch.empty_like(param, dtype=torch.float32)
        if self.max_unorm > 0.0:
            state["unorm_vec"] = torch.empty(1, dtype=torch.float32, device=param.device)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # torch's overloads; no closure here
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param not in self.state or not self.state[param]:
                    self.state[param] = self._state_of(param)
                self.state[param]["step"] += 1

    def paged_bytes(self) -> int:
        """Bytes of state in CUDA unified memory: the moments of parameters of at least 100,000 values."""
        if not self.paged:
            return 0
        total = 0
        for param, state in self.state.items():
            if param.numel() >= MIN_PAGED_NUMEL:
                total += sum(
                    state[f"state{i}"].numel() * state[f"state{i}"].element_size()
                    for i in range(1, self.moments + 1)
                    if f"state{i}" in state
                )
        return total


def paged_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of optimizer state in CUDA unified (paged) memory over ``optimizers``."""
    return sum(o.paged_bytes() for o in optimizers if isinstance(o, BitsAndBytesStandIn))


def _stand_in(
    component: str, spec: tuple[int, int | None, bool], options: dict[str, Any], params: list[nn.Parameter]
) -> BitsAndBytesStandIn:
    unknown = sorted(set(options) - ACCEPTED)
    if unknown:
        raise ConfigError(
            f"config key 'optimizer.{unknown[0]}': {component} takes no such argument "
            f"(allowed: {', '.join(sorted(ACCEPTED))})"
        )
    moments, forced, paged = spec
    bits = forced if forced is not None else options.get("optim_bits", 32)
    if bits not in (8, 32):
        raise ConfigError(f"config key 'optimizer.optim_bits': {component} takes 8 or 32, got {bits!r}")
    min_8bit_size = options.get("min_8bit_size", 4096)
    if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
        raise ConfigError(f"config key 'optimizer.min_8bit_size': an integer >= 0, got {min_8bit_size!r}")
    hyper = {k: v for k, v in options.items() if k not in ("optim_bits", "min_8bit_size", "max_unorm", "is_paged")}
    return BitsAndBytesStandIn(
        params,
        component,
        moments,
        bits,
        paged or bool(options.get("is_paged", False)),
        min_8bit_size=min_8bit_size,
        max_unorm=float(options.get("max_unorm", 0.0)),
        **hyper,
    )


def fake_optimizer(node: DictConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of ``node`` (config key ``optimizer``) over ``params``, for fake steps: a
    :class:`BitsAndBytesStandIn` for the bitsandbytes optimizers it models (bitsandbytes is never imported), else the
    config's component (``fused`` dropped: there is no fused kernel for fake tensors)."""
    options = {str(k): v for k, v in node.items() if k != "fused"}
    component = str(options.get("_component_", ""))
    spec = stand_in_spec(component)
    if spec is not None:
        plain = {k: v for k, v in options.items() if k != "_component_"}
        return _stand_in(component, spec, plain, params)
    if component.startswith(BNB_PREFIX):
        raise ConfigError(
            f"config key 'optimizer._component_': {component} cannot be estimated on fake tensors; "
            f"the bitsandbytes optimizers estimate can count are "
            f"{', '.join(supported_stand_ins())}"
        )
    with building("optimizer"):
        return _instantiate(options, params)


def _instantiate(options: dict[str, Any], params: list[nn.Parameter]) -> torch.optim.Optimizer:
    from torchtune import config

    return config.instantiate(DictConfig(options), params)


def step_or_explain(component: str, step: Any) -> None:
    """Run ``step()``; an optimizer that cannot step on fake tensors becomes a one-line :class:`ConfigError`
    naming ``optimizer._component_``, not a traceback from inside it."""
    try:
        step()
    except Exception as error:  # noqa: BLE001 - any failure inside a third-party step is the component's
        first = " ".join(str(error).split())[:160]
        raise ConfigError(
            f"config key 'optimizer._component_': {component} cannot step on fake tensors "
            f"({type(error).__name__}: {first}); estimate counts torch.optim optimizers and "
            f"bitsandbytes' {', '.join(supported_stand_ins())}"
        ) from None
