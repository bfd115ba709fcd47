"""adaptive-batching: automatic and adaptive batch sizes for torchtune fine-tuning."""

__version__ = "0.1.0"
