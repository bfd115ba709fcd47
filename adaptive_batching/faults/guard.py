"""Surviving an out-of-memory error inside a training step.

A step that runs out of memory is abandoned on every rank and run again on the same samples,
each micro batch cut into smaller pieces with more accumulation: the global batch, the learning
rate and the trajectory stay what they were. Ranks agree through a collective flag, exchanged at
sync points placed before each of FSDP's collectives, so a rank whose peer failed stops at its
next sync point instead of waiting in an all-gather or reduce-scatter its peer will never join.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.autograd.variable import Variable
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from adaptive_batching.errors import PeerOutOfMemory
from adaptive_batching.faults.oom import is_out_of_memory
from adaptive_batching.runtime.distributed import ParallelInfo

OK, OUT_OF_MEMORY = 0, 1


def split_for(micro_batch: int, cap: int | None) -> int:
    """Pieces each planned micro batch is cut into so that no forward sees more than ``cap`` samples."""
    if cap is None or micro_batch <= cap:
        return 1
    return -(-micro_batch // cap)


def piece_size(micro_batch: int, split: int) -> int:
    """The largest piece of a micro batch cut into ``split``."""
    return -(-micro_batch // split)


def smaller_cap(piece: int) -> int | None:
    """The micro batch to fall back to after ``piece`` samples ran out of memory: half, rounded up.

    None when ``piece`` is already 1: there is nothing smaller to try.
    """
    return None if piece <= 1 else (piece + 1) // 2


def larger_cap(cap: int, planned: int) -> int | None:
    """The cap to try when growing back after clean steps: double, or no cap once that covers ``planned``."""
    return None if 2 * cap >= planned else 2 * cap


@dataclass(frozen=True)
class StepCounts:
    """The optimizer's per-parameter step counters (Adam-family state), to tell whether a failed step changed
    anything. A counter held in a tensor is taken by identity and version (bumped on the host by every in-place
    update, wherever the tensor lives), never by value: taking them before every optimizer step costs no device
    work and no host sync (docs/benchmarks.md, 'What a step of ours does beyond stock's'). A counter held as a number
    is taken by value."""

    counters: tuple[Any, ...]

    def same_as(self, other: StepCounts) -> bool:
        return self.counters == other.counters


def optimizer_step_counts(optimizer: torch.optim.Optimizer) -> StepCounts:
    steps = (state["step"] for state in optimizer.state.values() if "step" in state)
    return StepCounts(tuple((id(s), s._version) if isinstance(s, torch.Tensor) else s for s in steps))


class StepGuard:
    """Runs a step's forward and backward so that an OOM on any rank abandons it on every rank.

    In one process it only catches the error. With several ranks it adds sync points to the FSDP
    modules (before each all-gather and reduce-scatter); each exchange is one small all-reduce
    and a host sync. They are attached only inside a *window*, while the micro batch is unproven:
    during profiling and for ``guard_steps`` optimizer steps after every start, resume and change
    of micro batch (:meth:`open_window`). Outside a window the hooks are removed, so a step makes
    no extra collective, and an OOM there is left to the job's restart (see ``restart.py``).
    """

    def __init__(self, parallel: ParallelInfo, device: torch.device) -> None:
        self.parallel = parallel
        self.device = device
        self._armed = False
        self._handles: list[RemovableHandle] = []
        self._root: nn.Module | None = None  # the outermost FSDPModule
        self._model: nn.Module | None = None
        self.window = 0  # optimizer steps left in the current window
        self.last_error = ""
        self._final_sync_queued = False

    @property
    def armed(self) -> bool:
        """True while a step runs under :meth:`run`."""
        return self._armed

    @property
    def synced(self) -> bool:
        return self.parallel.is_distributed and bool(self._handles)

    @property
    def protecting(self) -> bool:
        """Whether an OOM in a step now is recovered in place: always in one process, inside a window with ranks."""
        return not self.parallel.is_distributed or bool(self._handles)

    def install(self, model: nn.Module) -> None:
        """Guard ``model``; its sync points are attached while a window is open (never in one process)."""
        self._model = model
        self._root = next((m for m in model.modules() if isinstance(m, FSDPModule)), None)

    def attach(self) -> None:
        """Add the sync points to every FSDP module (idempotent; nothing in a single process)."""
        if not self.parallel.is_distributed or self._handles or self._model is None:
            return
        for module in self._model.modules():
            if not isinstance(module, FSDPModule):
                continue
            # Before FSDP's own pre-forward (its all-gather): prepend.
            self._handles.append(module.register_forward_pre_hook(self._before_forward, prepend=True))
            # After FSDP's pre-forward wrapped the inputs: their gradient hook runs before its reduce-scatter.
            self._handles.append(module.register_forward_pre_hook(self._hook_inputs, with_kwargs=True))
            # Before FSDP's post-forward registers its pre-backward all-gather on the outputs.
            self._handles.append(module.register_forward_hook(self._hook_outputs, prepend=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def open_window(self, steps: int) -> None:
        """Guard the next ``steps`` optimizer steps (0: remove the sync points now)."""
        self.window = steps
        if steps > 0:
            self.attach()
        else:
            self.remove()

    def step_done(self) -> None:
        """One optimizer step finished; the last one of a window removes the sync points."""
        if self.window > 0:
            self.window -= 1
            if self.window == 0:
                self.remove()

    def run(self, step: Callable[[], None]) -> int:
        """Run ``step``; return OK, or OUT_OF_MEMORY when it ran out of memory on any rank.

        Other errors propagate. After OUT_OF_MEMORY the step's partial state is undone by the
        caller (:meth:`abandon`).
        """
        status = OK
        self._armed = True
        self._final_sync_queued = False
        try:
            step()
        except Exception as error:  # noqa: BLE001 - only OOMs are handled, the rest re-raised
            if not is_out_of_memory(error):
                self._armed = False
                raise
            status = OUT_OF_MEMORY
            self.last_error = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        finally:
            self._armed = False
        worst = self.agree(status)
        if worst != OK and status == OK:
            self.last_error = "another rank ran out of memory"
        return worst

    def agree(self, status: int) -> int:
        """The worst status over ranks, once every rank has left the step."""
        if not self.synced:
            return status
        while True:
            worst, unfinished = self._exchange(status, finished=True)
            if not unfinished:
                return worst

    def sync_point(self) -> None:
        """Raise :class:`PeerOutOfMemory` if another rank has run out of memory in this step."""
        if not (self._armed and self.synced):
            return
        worst, _ = self._exchange(OK, finished=False)
        if worst != OK:
            raise PeerOutOfMemory(f"rank {self.parallel.rank}: another rank ran out of memory in this step")

    def abandon(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Drop a failed step's gradients and FSDP's half-done state (unsharded parameters, hooks)."""
        optimizer.zero_grad(set_to_none=True)
        root = self._root if self._root is not None else model
        if not isinstance(root, FSDPModule):
            return
        root.reset_iter_state()
        # reset_iter_state keeps gradients that autograd left on unsharded parameters whose
        # reduce-scatter never ran (the root's, when backward stopped early); the retry would add them in.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    for fsdp_param in group.fsdp_params:
                        unsharded = getattr(fsdp_param, "_unsharded_param", None)
                        if unsharded is not None:
                            unsharded.grad = None
                        fsdp_param.unsharded_accumulated_grad = None

    def _exchange(self, status: int, *, finished: bool) -> tuple[int, bool]:
        flags = torch.tensor([status, 0 if finished else 1], dtype=torch.int32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        worst, unfinished = flags.tolist()
        return int(worst), bool(unfinished)

    # ------------------------------------------------------------------ hooks
    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _before_forward(self, module: nn.Module, args: tuple) -> None:
        if not self._in_backward():
            self.sync_point()

    # One sync per module per backward, at the first of its tensors' gradients ("any"): how many
    # tensors a module returns can differ between ranks (chunked logits of a 1-token batch), and
    # every rank must make the same sequence of exchanges.
    def _hook_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._armed and torch.is_grad_enabled() and not self._in_backward():
            tensors = _grad_tensors((args, kwargs))
            if tensors:
                register_multi_grad_hook(tensors, self._sync_in_backward, mode="any")

    def _hook_outputs(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._armed and torch.is_grad_enabled() and not self._in_backward():
            tensors = _grad_tensors(output)
            if not tensors:
                return
            register_multi_grad_hook(tensors, self._sync_in_backward, mode="any")
            if module is self._root:
                register_multi_grad_hook(tensors, self._queue_final_sync, mode="any")

    def _sync_in_backward(self, grad: torch.Tensor) -> None:
        self.sync_point()

    def _queue_final_sync(self, grad: torch.Tensor) -> None:
        # Queued before FSDP queues its end-of-backward reduce-scatter of the root's parameters, so it runs first.
        if not self._final_sync_queued:
            self._final_sync_queued = True
            Variable._execution_engine.queue_callback(self._final_sync)

    def _final_sync(self) -> None:
        self._final_sync_queued = False
        self.sync_point()


def _grad_tensors(tree: object) -> list[torch.Tensor]:
    """Tensors needing a gradient in a nest of tuples, lists and dicts."""
    found: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return found
