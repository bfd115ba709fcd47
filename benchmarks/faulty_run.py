"""Run a recipe with injected faults, recording which samples each finished optimizer step trained on.

    python faulty_run.py FAULT_JSON RECORD_PREFIX RECIPE_MODULE --config CONFIG [key=value ...]

FAULT_JSON, all keys optional:
  "phase": "forward" | "backward" | "embedding_backward" | "optimizer"  where the OOM is raised
             (default none: no OOM; backward: the first thing in backward; embedding_backward: the last)
  "from_step": S     optimizer steps >= S (1-based) are affected (default 1)
  "to_step": T       ... and <= T (default: to the end)
  "above": N         forward/backward: a micro batch of more than N samples runs out of memory (default 0)
  "times": K         optimizer: the first K optimizer.step() calls from step S fail (default 1)
  "rank": R          only this rank fails (default: every rank)
  "kill_after": S    SIGKILL this process (only rank R, if given) after optimizer step S (before its
                     bookkeeping and save)
  "kill_in_save": N  SIGKILL this process inside its N-th checkpoint save, once torchtune has written
                     every file and before the save is marked complete
  "room_mib": M      no injected error: after set-up, RLIMIT_AS = the process's size + M MiB, so a
                     large enough batch raises torch's real ``DefaultCPUAllocator`` error
  "signal": NAME     send this signal (SIGTERM, SIGUSR1, ...) after optimizer step "signal_at" (only rank R,
                     if given) to this process, or to its parent (the torchrun agent) with "to": "parent", or to
                     the process whose pid is in environment variable NAME with "to": "env:NAME";
                     "again_in_save": true sends it to this process once more inside the next checkpoint save
  "signal_in": PHASE  send "signal" (as above, "to" and "rank" too) before training, as PHASE begins:
                     "token_counts" (the data set's), "profile" (its first trial step) or "compile" (the step
                     that compiles, before the profile's trials); then wait until this process has it (a signal
                     sent through a launcher arrives later); "once": true sends it in the first run of this
                     RECORD_PREFIX only (a requeued job runs clean)

The error is torch's own ``torch.OutOfMemoryError``. RECORD_PREFIX + "rank{r}.json" gets, per finished
optimizer step, the dataset indices of the samples it trained on, written at each step. Under torchrun
with ``--max-restarts``, faults hit the first attempt only, and restart N records to "rank{r}-restartN.json".
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import sys
import time
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch


def virtual_size_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> None:
    fault_json, record_prefix, module_name, *argv = sys.argv[1:]
    fault = json.loads(fault_json)
    phase = fault.get("phase", "none")
    phase = "none" if "room_mib" in fault else phase
    from_step, above = int(fault.get("from_step", 1)), int(fault.get("above", 0))
    to_step = int(fault.get("to_step", 10**9))
    only_rank = fault.get("rank")
    kill_after = fault.get("kill_after")
    optimizer_failures = [int(fault.get("times", 1))]

    from adaptive_batching.training import hooks

    rank = int(os.environ.get("RANK", 0))
    failing_rank = only_rank is None or int(only_rank) == rank
    state: dict[str, Any] = {"pending": [], "steps": [], "ids": {}, "taken": []}
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    record = f"{record_prefix}rank{rank}{f'-restart{attempt}' if attempt else ''}.json"
    with open(f"{record_prefix}rank{rank}-attempt{attempt}.start", "w") as f:
        f.write(repr(time.time()))
    with open(f"{record_prefix}rank{rank}-attempt{attempt}.pid", "w") as f:
        f.write(open("/proc/self/stat").read())  # a forked worker has the fork server's command line
    if attempt:  # faults hit the first attempt only; a torchrun restart runs clean
        phase, kill_after, fault = "none", None, {k: v for k, v in fault.items() if k != "kill_in_save"}
    signal_number = getattr(signal, fault["signal"]) if "signal_at" in fault and failing_rank else None
    sent: list[int] = []

    def oom(where: str) -> torch.OutOfMemoryError:
        return torch.OutOfMemoryError(f"injected: {where} out of memory (rank {rank})")

    class FaultHooks(hooks.TrainerHooks):
        """The faults of FAULT_JSON, through the trainer's public hooks."""

        def __init__(self) -> None:
            self.parts: Callable[[], Any] = lambda: None
            self.preemption: Any = None
            self.affected, self.send_in_profile = False, lambda: None

        def next_step_affected(self) -> bool:
            parts = self.parts()
            return failing_rank and parts is not None and from_step <= parts.progress.global_step + 1 <= to_step

        def collate(self, inner):  # type: ignore[no-untyped-def]
            ids = state["ids"]

            def collate(samples):  # type: ignore[no-untyped-def]
                # The profiler's synthetic worst-case samples are not in the dataset: not recorded.
                state["pending"].extend(ids[key] for sample in samples if (key := sample_key(sample)) in ids)
                return inner(samples)

            return collate

        def before_setup(self, preemption):  # type: ignore[no-untyped-def]
            self.preemption = preemption

        def after_setup(self, parts):  # type: ignore[no-untyped-def]
            self.parts = weakref.ref(parts)  # weak: the harness must not keep the run (and its process group) alive
            dataset, ids = parts.data.dataset, state["ids"]
            for i in range(len(dataset)):
                key = sample_key(dataset[i])
                assert key not in ids, "the test dataset must not hold two identical samples"
                ids[key] = i
            state["pending"] = []
            if phase == "embedding_backward":

                def hook_embedding(module, args, output):  # type: ignore[no-untyped-def]
                    if self.next_step_affected() and output.shape[0] > above and output.requires_grad:

                        def fail(grad):  # type: ignore[no-untyped-def]
                            raise oom("embedding backward")

                        output.register_hook(fail)

                getattr(parts.model, "decoder", parts.model).tok_embeddings.register_forward_hook(hook_embedding)
            optimizer, guard = parts.optimizer, parts.guard
            optimizer_step = optimizer.step

            def step(optimizer, *args, **kwargs):  # type: ignore[no-untyped-def]
                if phase == "optimizer" and self.next_step_affected() and optimizer_failures[0] > 0 and not guard.armed:
                    optimizer_failures[0] -= 1
                    raise oom("optimizer step")
                return optimizer_step(*args, **kwargs)

            optimizer.step = types.MethodType(step, optimizer)  # bound: LR schedulers wrap it
            if "room_mib" in fault:
                limit = virtual_size_bytes() + int(fault["room_mib"]) * 2**20
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

        def before_forward(self, batch):  # type: ignore[no-untyped-def]
            self.affected = self.next_step_affected() and batch["tokens"].shape[0] > above
            if self.affected and phase == "forward":
                raise oom("forward")

        def after_loss(self, loss):  # type: ignore[no-untyped-def]
            if self.affected and phase == "backward":

                def fail(grad):  # type: ignore[no-untyped-def]
                    raise oom("backward")

                loss.register_hook(fail)

        def before_step(self, parts, micro_batches):  # type: ignore[no-untyped-def]
            state["taken"], state["pending"] = state["pending"], []

        def after_step(self, parts, stats):  # type: ignore[no-untyped-def]
            if stats is None:
                return
            step = parts.progress.global_step + 1
            state["steps"].append({"step": step, "epoch": parts.progress.epochs_run, "samples": state["taken"]})
            with open(record, "w") as f:
                json.dump(state["steps"], f)
            if kill_after is not None and step == int(kill_after) and failing_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if signal_number is not None and step == int(fault["signal_at"]):
                sent.append(signal_number)
                to = fault.get("to", "self")
                os.kill(
                    os.getppid()
                    if to == "parent"
                    else int(os.environ[to[4:]])
                    if to.startswith("env:")
                    else os.getpid(),
                    signal_number,
                )

        def before_trial(self, micro_batch):  # type: ignore[no-untyped-def]
            self.send_in_profile()

    fault_hooks = FaultHooks()
    hooks.install(fault_hooks)
    if signal_number is not None and fault.get("again_in_save"):
        import adaptive_batching.faults.checkpoints as checkpoints

        write_marker = checkpoints._write_marker

        def signalled_write_marker(*args, **kwargs):  # type: ignore[no-untyped-def]
            if sent:
                os.kill(os.getpid(), signal_number)  # the scheduler's second signal, while the stop's save runs
            return write_marker(*args, **kwargs)

        checkpoints._write_marker = signalled_write_marker
    if "signal_in" in fault and failing_rank:
        fault_hooks.send_in_profile = signal_in(fault, lambda: fault_hooks.preemption, f"{record_prefix}signalled")
    if "kill_in_save" in fault:
        import adaptive_batching.faults.checkpoints as checkpointing

        write_marker, saves = checkpointing._write_marker, [0]

        def killing_write_marker(*args, **kwargs):  # type: ignore[no-untyped-def]
            saves[0] += 1
            if saves[0] == int(fault["kill_in_save"]):
                os.kill(os.getpid(), signal.SIGKILL)
            return write_marker(*args, **kwargs)

        checkpointing._write_marker = killing_write_marker
    sys.argv = [module_name, *argv]
    importlib.import_module(module_name).recipe_main()


def signal_in(fault: dict, preemption: Callable[[], Any], once_file: str) -> Callable[[], None]:
    """Send ``fault["signal"]`` as the phase ``fault["signal_in"]`` begins (see the module docstring): the token
    counts and the compile step are met in the library's functions; for the profile's first trial step, the
    returned callable sends it (the hooks call it before each trial step; it sends once)."""
    import adaptive_batching.batching.worst_case as worst_case
    import adaptive_batching.profiling.profiler as profiling_run
    from adaptive_batching.faults.preemption import run_pending_handlers

    number, to, phase = getattr(signal, fault["signal"]), fault.get("to", "self"), fault["signal_in"]
    if phase not in ("token_counts", "profile", "compile"):
        raise ValueError(f"signal_in: {phase!r} is not token_counts, profile or compile")
    if fault.get("once") and os.path.exists(once_file):
        return lambda: None

    sent: list[int] = []

    def send() -> None:
        if sent:
            return
        sent.append(number)
        if fault.get("once"):
            open(once_file, "w").close()
        target = os.getppid() if to == "parent" else int(os.environ[to[4:]]) if to.startswith("env:") else os.getpid()
        os.kill(target, number)
        stops, deadline = preemption(), time.monotonic() + 120
        while stops.received is None and time.monotonic() < deadline:
            run_pending_handlers()
            time.sleep(0.01)
        assert stops.received is not None, f"{fault['signal']} sent to {to} never reached this process"

    def sending(function):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            send()
            return function(*args, **kwargs)

        return call

    if phase == "token_counts":
        worst_case.measure_samples = sending(worst_case.measure_samples)
    elif phase == "compile":
        profiling_run._compile_first = sending(profiling_run._compile_first)
    return send if phase == "profile" else lambda: None


def sample_key(sample: dict) -> tuple:
    """A data set sample's tokens (a preference pair's two sequences), to find it by."""
    if "tokens" in sample:
        return tuple(sample["tokens"])
    return tuple(sample["chosen_input_ids"]), tuple(sample["rejected_input_ids"])


if __name__ == "__main__":
    main()
