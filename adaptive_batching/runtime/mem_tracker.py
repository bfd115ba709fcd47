"""torch's ``MemTracker``, usable on models with frozen parameters (LoRA).

``MemTracker`` puts a gradient hook on every parameter of a module the first time the module
runs, and torch refuses a hook on a tensor that does not require gradients, so tracking a LoRA
model (frozen base weights) raised before the first op. Frozen parameters never get a gradient,
so this tracker simply marks them as already hooked; everything it counts is unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker


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
