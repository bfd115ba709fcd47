"""Every error the library raises on purpose, in one place."""


class ConfigError(ValueError):
    """A config value is wrong; the message names the key and what is allowed."""


class ProfileError(RuntimeError):
    """Even the smallest micro batch does not fit the memory budget."""


class OutOfMemoryStop(RuntimeError):
    """Even a micro batch of one sample runs out of memory: training cannot go on."""


class PeerOutOfMemory(RuntimeError):
    """Another rank ran out of memory in this step; this rank abandons the step with it."""


class UnguardedOutOfMemory(RuntimeError):
    """An OOM in a step outside a guard window (several ranks): the others cannot be told in place."""


class StepNotRetried(RuntimeError):
    """An OOM in a step that cannot be run again in smaller pieces (``optimizer_in_bwd``: no accumulation, and
    the backward may have stepped part of the model)."""


class ConfigNotFound(FileNotFoundError):
    """``--config`` names neither a file, nor a shipped config, nor one of torchtune's."""


class Preempted(Exception):
    """The run stopped on a scheduler's signal after saving where it was (exit code 75). Every rank raises it at
    the same place, having said its ``stopped: ...`` line."""
