"""adaptive-batching: automatic and adaptive batch sizes for torchtune fine-tuning.

Importing the package silences, one by one, the warnings torch and torchtune print on the default install that no
user of this project can act on, so that every entry point (our recipes under ``tune run``, ``adaptive-batching``,
the benchmarks) starts without them. Each filter names the message, the category and the module that warns; any
other warning still shows. A warning about something real is not filtered: the code that causes it says it once,
in its own words.
"""

import warnings

__version__ = "0.1.0"

# torchtune's RMSNorm upcasts its input to float32 on purpose and keeps a bf16 scale; torch then runs its unfused
# rms_norm, which gives the same numbers. Printed at the first forward of every bf16 config (`estimate` on a stock
# config; a bf16 run on a GPU), about torchtune's code, not the user's config.
warnings.filterwarnings(
    "ignore", message="Mismatch dtype between input and weight", category=UserWarning, module=r"torch\.nn\.functional"
)
