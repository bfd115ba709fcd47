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
    from adaptive_batching.training.methods import method_for
    from adaptive_batching.training.trainer import Trainer

    cfg = load_config(config_name, overrides)
    trainer = Trainer(cfg, validate_config(cfg), method_for(cfg))
    trainer.setup()
    limit = virtual_size_bytes() + int(room_mib) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    result = trainer.profile()
    trainer.train(trainer.make_plan(result))
    print(
        json.dumps(
            {
                "profile": result.to_dict(),
                "trained_steps": trainer.global_step,
                "micro_batch": trainer.feed.batch.micro_batch,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
