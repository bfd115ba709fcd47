"""adaptive-batching: automatic and adaptive batch sizes for torchtune fine-tuning."""

from adaptive_batching import quiet as _quiet

__version__ = "0.1.0"

_quiet.install()
