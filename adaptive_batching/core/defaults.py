"""The defaults of the torchtune keys that parts in several layers read from the config, each written once here.

A part reads such a key as ``cfg.get("compile", DEFAULT_COMPILE)``; ``docs/config-keys.md`` gives the same defaults
(``tests/test_docs.py`` checks that every read of a key has one default and that the page agrees). They live in
``core`` because ``estimate`` and ``core`` read these keys too, below ``config``.
"""

from __future__ import annotations

DEFAULT_COMPILE = False
"""``compile``: whether the layers and the loss are ``torch.compile``d."""

DEFAULT_DTYPE = "fp32"
"""``dtype``: the weights' and activations' dtype (``fp32`` or ``bf16``)."""

DEFAULT_DEVICE = "cpu"
"""``device``: ``cpu`` or ``cuda`` (``cuda:<local rank>`` under torchrun)."""
