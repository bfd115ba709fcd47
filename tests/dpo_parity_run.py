"""Run a LoRA DPO recipe, ours or torchtune's ``lora_dpo_single_device``, for the parity test (test_dpo.py).

    python tests/dpo_parity_run.py RECIPE --config CONFIG KEY=VALUE...

Two changes, the same in both recipes:
- every LoRA A matrix is drawn from one generator of its own, in the order the adapters are initialised. torchtune's
  single-device recipe initialises them while it builds the model on the device, between the random
  initialisations of the base weights (which the checkpoint then replaces); ours builds the model on the meta
  device and initialises the adapters alone, as torchtune's distributed recipes do. The global random stream
  differs, so the adapters would start from different values;
- ``ExactDiskLogger`` writes every metric as a float in full (the stock recipe logs the rewards as tensors, which
  print 4 decimals).
"""

from __future__ import annotations

import math
import runpy
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchtune.training.metric_logging import DiskLogger


class ExactDiskLogger(DiskLogger):
    """torchtune's DiskLogger, each value written as a float in full."""

    def log_dict(self, payload: dict[str, Any], step: int) -> None:
        super().log_dict({name: float(value) for name, value in payload.items()}, step)


def main() -> None:
    import torchtune
    import torchtune.modules.peft.lora as lora

    generator = torch.Generator().manual_seed(0)

    def lora_a(x: nn.Linear) -> None:
        nn.init.kaiming_uniform_(x.weight, a=math.sqrt(5), generator=generator)

    lora._lora_a_init_params = lora_a
    recipe, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    stock = Path(torchtune.__file__).parent.parent / "recipes" / f"{recipe}.py"
    if stock.is_file():
        runpy.run_path(str(stock), run_name="__main__")
    else:
        runpy.run_module(recipe, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
