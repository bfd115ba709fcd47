"""The packages a run needs beyond its own: the torch releases it supports, checked before any model loads (by
the recipes' ``config.loading.parse`` and the ``adaptive-batching`` command); and the optional packages a config's
components may need, and how to install each, the one table the config checks (``config.components``, before any
model loads) and the building of a node (``core.nodes.building``) use."""

from __future__ import annotations

import re
from importlib import metadata

from adaptive_batching.errors import ConfigError

# The torch releases that have run: the whole suite on 2.13 (CPU build), on 2.14.1 and on 2.14.0 with torchvision 0.29.1
# (PyPI's CUDA builds, on a CPU; 2.14.0 is what CI installs), the GPU check on 2.11 (CUDA; compile there not yet rerun
# since its fix). pyproject.toml's pin says the same (tests/test_torch_range.py).
TORCH_FIRST, TORCH_BELOW = (2, 11), (2, 15)
TORCH_REQUIREMENT = f"torch>={TORCH_FIRST[0]}.{TORCH_FIRST[1]},<{TORCH_BELOW[0]}.{TORCH_BELOW[1]}"


def installed_torch() -> str | None:
    """The installed torch's version, read from its metadata without importing it; None if none is installed."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def unsupported_torch(version: str | None) -> str | None:
    """Why torch ``version`` cannot run this package, in one line; None if it can (or if none is installed)."""
    release = re.match(r"(\d+)\.(\d+)", version or "")
    if version is None or (release and TORCH_FIRST <= (int(release[1]), int(release[2])) < TORCH_BELOW):
        return None
    install = f'pip install "{TORCH_REQUIREMENT}"'
    return f"torch {version} is installed; adaptive-batching supports {TORCH_REQUIREMENT}: {install}"


def require_supported_torch() -> None:
    """Raise :class:`ConfigError` with one line if the installed torch is outside :data:`TORCH_REQUIREMENT`."""
    message = unsupported_torch(installed_torch())
    if message is not None:
        raise ConfigError(message)


# Optional packages a component may need: import name -> how to install it.
PIP: dict[str, str] = {
    "bitsandbytes": 'pip install "adaptive-batching[bnb]"',
    "wandb": "pip install wandb",
    "comet_ml": "pip install comet_ml",
    "mlflow": "pip install mlflow",
    "tensorboard": "pip install tensorboard",
    "torchvision": "pip install torchvision",  # torchtune's vision models import it
}
# Components that import their package only when built (torchtune's loggers, in their constructors):
# component -> package. A component of an optional package itself (``bitsandbytes.optim.PagedAdamW8bit``) needs
# that package.
NEEDS: dict[str, str] = {
    "torchtune.training.metric_logging.WandBLogger": "wandb",
    "torchtune.training.metric_logging.CometLogger": "comet_ml",
    "torchtune.training.metric_logging.MLFlowLogger": "mlflow",
    "torchtune.training.metric_logging.TensorBoardLogger": "tensorboard",
}


def needed_package(component: str) -> str | None:
    """The optional package (a key of :data:`PIP`) that ``component`` needs, else None."""
    root = component.split(".", 1)[0]
    return NEEDS.get(component) or (root if root in PIP else None)


def package_of(error: BaseException) -> str | None:
    """The optional package whose absence ``error`` (or the error it was raised from) is, else None."""
    for cause in (error, error.__cause__):
        name = str(getattr(cause, "name", None) or "") if isinstance(cause, ImportError) else ""
        if name.split(".", 1)[0] in PIP:
            return name.split(".", 1)[0]
    return None
