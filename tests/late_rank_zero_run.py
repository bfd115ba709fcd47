"""Run a recipe as ``tune run`` would, with rank zero starting ``SECONDS`` after the other ranks.

    python -m torch.distributed.run --nproc_per_node N late_rank_zero_run.py SECONDS RECIPE_MODULE --config CONFIG ...

A rank zero that is slower than the others to reach an error (it reads, logs and writes what they do not) is what
lost a config error's line under torchrun: the other ranks exited first and the agent ended rank zero.
"""

from __future__ import annotations

import importlib
import os
import sys
import time


def main() -> None:
    seconds, module_name, *argv = sys.argv[1:]
    if os.environ.get("RANK", "0") == "0":
        time.sleep(float(seconds))
    sys.argv = [module_name, *argv]
    importlib.import_module(module_name).recipe_main()


if __name__ == "__main__":
    main()
