"""The optimizer of a run, and how a step's gradients reach it.

Two ways, one interface (:class:`Gradients`):

* :class:`AfterBackward` (the default): the micro batches' summed-loss gradients accumulate, then are divided
  by the step's tokens on all ranks, clipped and stepped, as torchtune's recipes do.
* :class:`InBackward` (``optimizer_in_bwd: True``, torchtune's memory saver): one optimizer per trainable
  parameter, stepped from the parameter's post-accumulate-grad hook as soon as its gradient exists, then the
  gradient is freed, so the whole set of gradients never exists at once. The loss is divided by the step's
  tokens before the backward; there is one micro batch per step (no accumulation) and no clipping.

:class:`InBackwardOptimizer` is what the rest of the run sees of the per-parameter optimizers: one
``torch.optim.Optimizer`` whose param groups are theirs (an LR set on it reaches them), whose state is theirs,
and whose ``state_dict`` is torch's usual format over all parameters (one param group per parameter), so the
checkpoints, the profiler's snapshot and FSDP's full state dict treat it like any optimizer.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import config, training

from adaptive_batching.core.nodes import building
from adaptive_batching.faults.guard import StepGuard
from adaptive_batching.runtime.distributed import ParallelInfo, all_reduce_sum

# bitsandbytes 0.50 tries, at import, to fetch a CPU 4-bit matmul kernel from the Hugging Face hub and logs a
# warning when it cannot. Only its optimizers are used here, which do not need that kernel.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")
)


class InBackwardOptimizer(torch.optim.Optimizer):
    """One optimizer per parameter (each built by ``build([param])``), stepped inside the backward.

    :meth:`register_hooks` makes each parameter's post-accumulate-grad hook step its optimizer and free the
    gradient. :meth:`step` steps the parameters whose gradient is still there (none after a backward; all of them when
    FSDP's state-dict code initialises the state with zero gradients).
    """

    def __init__(self, params: Iterable[nn.Parameter], build: Callable[[list[nn.Parameter]], torch.optim.Optimizer]):
        params = list(params)
        if not params:
            raise ValueError("optimizer_in_bwd needs at least one trainable parameter")
        self.optimizers = [build([param]) for param in params]
        self._of: dict[torch.Tensor, torch.optim.Optimizer] = dict(zip(params, self.optimizers))
        super().__init__([{"params": [param]} for param in params], dict(self.optimizers[0].defaults))
        self._share()

    def _share(self) -> None:
        """One state and the per-parameter optimizers' own param groups, seen through this optimizer."""
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for optimizer in self.optimizers:
            state.update(optimizer.state)
            optimizer.state = state
        self.state = state
        self.param_groups = [optimizer.param_groups[0] for optimizer in self.optimizers]

    def register_hooks(self) -> None:
        """The hooks hold this optimizer weakly: parameters must not keep it (and its sharded state, with the
        process group) alive after the run lets it go."""
        ref = weakref.ref(self)

        def step(param: torch.Tensor) -> None:
            optimizer = ref()
            if optimizer is not None:
                optimizer._step_one(param)

        for param in self._of:
            param.register_post_accumulate_grad_hook(step)

    def _step_one(self, param: torch.Tensor) -> None:
        optimizer = self._of[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # one of torch's overloads
        for optimizer in self.optimizers:
            if optimizer.param_groups[0]["params"][0].grad is not None:
                optimizer.step()
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by :meth:`state_dict` (one param group per parameter), each part by its own
        optimizer's ``load_state_dict`` (bitsandbytes keeps its 8-bit state's types there)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.optimizers):
            raise ValueError(
                f"the optimizer state has {len(groups)} param group(s); with optimizer_in_bwd=True there is one per "
                f"trainable parameter ({len(self.optimizers)}): resume with the optimizer_in_bwd the run was saved with"
            )
        states = state_dict["state"]
        for optimizer, group in zip(self.optimizers, groups):
            (index,) = group["params"]
            optimizer.load_state_dict(
                {"state": {0: states[index]} if index in states else {}, "param_groups": [{**group, "params": [0]}]}
            )
        self._share()


def build_optimizer(cfg: DictConfig, model: nn.Module) -> torch.optim.Optimizer:
    """``cfg.optimizer`` over the trainable parameters; with ``optimizer_in_bwd`` one per parameter, its hooks
    registered (see :class:`InBackwardOptimizer`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    with building("optimizer"):
        if not cfg.get("optimizer_in_bwd", None):
            return config.instantiate(cfg.optimizer, params)
        optimizer = InBackwardOptimizer(params, lambda one: config.instantiate(cfg.optimizer, one))
    optimizer.register_hooks()
    return optimizer


class Gradients(Protocol):
    """How a step's summed-loss gradients become an optimizer step (see the module docstring)."""

    retries_out_of_memory: bool  # whether an OOM in a step can be recovered in place (the model is unchanged)

    def backward(self, loss: torch.Tensor, tokens: torch.Tensor) -> None:
        """The backward of one micro batch's summed ``loss`` over its ``tokens`` (this rank's)."""

    def normalise(self, model: nn.Module, tokens: torch.Tensor) -> None:
        """After the step's micro batches: ``tokens`` becomes the step's tokens on all ranks, and the gradients
        (where still there) are divided by them."""


class AfterBackward:
    """Gradients accumulate over the micro batches and are normalised once, before the optimizer step."""

    retries_out_of_memory = True

    def __init__(self, guard: StepGuard, parallel: ParallelInfo) -> None:
        self.guard, self.parallel = guard, parallel

    def backward(self, loss: torch.Tensor, tokens: torch.Tensor) -> None:
        loss.backward()

    def normalise(self, model: nn.Module, tokens: torch.Tensor) -> None:
        self.guard.sync_point()
        all_reduce_sum(tokens, self.parallel)
        # FSDP averages gradients over ranks; undo that and divide by the step's tokens.
        training.scale_grads(model, self.parallel.world_size / tokens.clamp(min=1))


class InBackward:
    """The loss is divided by the step's tokens on all ranks before its backward, which steps the optimizer.

    An OOM in a step is not recovered in place: the backward may have stepped part of the model, and running
    the step in smaller pieces would need gradient accumulation."""

    retries_out_of_memory = False

    def __init__(self, optimizer: InBackwardOptimizer, guard: StepGuard, parallel: ParallelInfo) -> None:
        self.optimizer, self.guard, self.parallel = optimizer, guard, parallel
        self.total: torch.Tensor | None = None

    def backward(self, loss: torch.Tensor, tokens: torch.Tensor) -> None:
        self.guard.sync_point()
        self.total = tokens.clone()  # ``loss`` keeps ``tokens`` for its backward
        all_reduce_sum(self.total, self.parallel)
        # FSDP averages gradients over ranks; undo that and divide by the step's tokens.
        (loss * (self.parallel.world_size / self.total.clamp(min=1))).backward()

    def normalise(self, model: nn.Module, tokens: torch.Tensor) -> None:
        assert self.total is not None, "normalise follows a backward"
        tokens.copy_(self.total)


def offloading(model: nn.Module, enabled: bool | None) -> Any:
    """What wraps each forward: torchtune's activation offloading (``enable_activation_offloading``: saved
    activations go to host memory, the output projection's stay), or nothing."""
    return training.get_act_offloading_ctx_manager(model, bool(enabled))


def gradients_for(optimizer: torch.optim.Optimizer, guard: StepGuard, parallel: ParallelInfo) -> Gradients:
    return (
        InBackward(optimizer, guard, parallel)
        if isinstance(optimizer, InBackwardOptimizer)
        else AfterBackward(guard, parallel)
    )
