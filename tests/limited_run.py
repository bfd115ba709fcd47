"""Run a recipe under a real address-space limit set after set-up (a child process of the tests).

    python limited_run.py ROOM_MIB CONFIG [key=value ...]

Set-up (imports, model, data) runs unlimited; then RLIMIT_AS is set to the process's virtual size
plus ROOM_MIB, so a large enough batch raises torch's real ``DefaultCPUAllocator`` error. Prints
one JSON line with the profile and the training outcome.
"""

from __future__ import annotations

import json
import resource
import sys


def virtual_size_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> int:
    room_mib, config_name, *overrides = sys.argv[1:]
    from adaptive_batching.config.loading import load_config
    from adaptive_batching.config.settings import validate_config
    from adaptive_batching.training.hooks import TrainerHooks
    from adaptive_batching.training.recipe_table import method_and_objective
    from adaptive_batching.training.trainer import Trainer

    class Limit(TrainerHooks):
        """The address-space limit, set once the run is set up (before its profile)."""

        def after_setup(self, parts: object) -> None:
            limit = virtual_size_bytes() + int(room_mib) * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    cfg = load_config(config_name, overrides)
    settings = validate_config(cfg)
    method, objective = method_and_objective(cfg, profiled=settings.needs_profile)
    with Trainer.build(cfg, settings, method, objective, hooks=Limit()) as trainer:
        trainer.train()
    result = trainer.parts.profiler.result
    assert result is not None
    print(
        json.dumps(
            {
                "profile": result.to_dict(),
                "trained_steps": trainer.parts.progress.global_step,
                "micro_batch": trainer.parts.feed.batch.micro_batch,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
