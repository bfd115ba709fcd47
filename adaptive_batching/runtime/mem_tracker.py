"""torch's ``MemTracker``, usable on models with frozen parameters (LoRA).

``MemTracker`` puts a gradient hook on every parameter of a module the first time the module
runs, and torch refuses a hook on a tensor that does not require gradients, so tracking a LoRA
model (frozen base weights) raised before the first op. Frozen parameters never get a gradient,
so this tracker simply marks them as already hooked; everything it counts is unchanged.

``MemTracker`` also refuses a second forward of the root module in one tracked span (it takes it for the next
iteration); a DPO step runs the model twice, the reference (the same model with its adapters off) and then the
policy, so this tracker starts the root's statistics again instead. The memory it counts is unaffected.

After every op ``MemTracker`` also updates the peak of each module it has seen, a cost per op that grows with the
number of modules (most of a full trace's time on fake tensors); nothing here reads those, so this tracker keeps
the per-device peak alone (``get_tracker_snapshot("peak")``), updated as ``MemTracker`` updates it.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from torch import nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker


class _NoHook:
    """Stands in for the hook handles of a frozen parameter; ``MemTracker`` removes them on exit."""

    def remove(self) -> None:
        pass


class FrozenAwareMemTracker(MemTracker):
    """``MemTracker`` that installs gradient hooks only on parameters that require gradients."""

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> Any:
        for param in module.parameters():
            if not param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                self._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        root = set(self._mod_tracker.parents) - {name} == {"Global"}
        if root and module in self.memory_tracking and not self._mod_tracker.is_bw:
            del self.memory_tracking[module]  # a second forward of the model in the same step (DPO's reference)
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = deepcopy(snapshot)
