"""The optional packages a config's components may need, and how to install each: the one table the config
checks (``config.components``, before any model loads) and the building of a node (``core.nodes.building``) use."""

from __future__ import annotations

from typing import Optional

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


def needed_package(component: str) -> Optional[str]:
    """The optional package (a key of :data:`PIP`) that ``component`` needs, else None."""
    root = component.split(".", 1)[0]
    return NEEDS.get(component) or (root if root in PIP else None)


def package_of(error: BaseException) -> Optional[str]:
    """The optional package whose absence ``error`` (or the error it was raised from) is, else None."""
    for cause in (error, error.__cause__):
        name = str(getattr(cause, "name", None) or "") if isinstance(cause, ImportError) else ""
        if name.split(".", 1)[0] in PIP:
            return name.split(".", 1)[0]
    return None
