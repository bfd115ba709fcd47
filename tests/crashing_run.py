"""Run a recipe that dies, as a kill would leave it, once it has finished a given optimizer step.

    python crashing_run.py STEP RECIPE_MODULE --config CONFIG [key=value ...]

The process exits with status 17 through ``os._exit`` (no clean-up, no flush of anything the
recipe did not write itself) right after optimizer step STEP; otherwise it runs the recipe as
``tune run`` would.
"""

from __future__ import annotations

import importlib
import os
import sys


def main() -> None:
    crash_after, module_name, *argv = sys.argv[1:]
    from adaptive_batching.training import hooks

    class Crash(hooks.TrainerHooks):
        def before_step(self, parts, micro_batches):  # type: ignore[no-untyped-def]
            if parts.progress.global_step == int(crash_after):
                os._exit(17)

    hooks.install(Crash())
    sys.argv = [module_name, *argv]
    importlib.import_module(module_name).recipe_main()


if __name__ == "__main__":
    main()
