"""Config resolution for the recipes: an existing file path first, then a shipped config by name.

torchtune's ``tune run`` passes ``--config`` through unchanged for recipes that are not built in,
so the recipes resolve it themselves before handing over to torchtune's own parser, which keeps
``key=value`` and ``~key`` overrides exactly as torchtune has them.
"""

from __future__ import annotations

import functools
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from omegaconf import DictConfig
from torchtune import config as tune_config

from adaptive_batching.config.settings import ConfigError
from adaptive_batching.errors import OutOfMemoryStop

RECIPES = ("adaptive_full_finetune", "adaptive_lora_finetune")


def shipped_configs_dir() -> Path:
    """The folder holding the configs installed with the package."""
    return Path(str(resources.files("adaptive_batching.configs")))


def shipped_config_names() -> list[str]:
    """Names of the shipped configs, without the ``.yaml`` suffix."""
    return sorted(p.stem for p in shipped_configs_dir().glob("*.yaml"))


def resolve_config(name: str) -> Path:
    """Return the config file that ``name`` means: an existing path, else a shipped config.

    ``llama3_8b`` and ``llama3_8b.yaml`` both name the shipped ``llama3_8b.yaml``.
    """
    path = Path(name).expanduser()
    if path.is_file():
        return path
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    shipped = shipped_configs_dir() / f"{stem}.yaml"
    if "/" not in stem and shipped.is_file():
        return shipped
    raise FileNotFoundError(
        f"--config {name!r}: no such file (looked in {Path.cwd()}) and no shipped config of that "
        f"name. Shipped configs: {', '.join(shipped_config_names())}"
    )


def resolve_config_argument(argv: Sequence[str]) -> list[str]:
    """Rewrite the ``--config`` value in ``argv`` to the file it resolves to."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            out[i + 1] = str(resolve_config(out[i + 1]))
        elif arg.startswith("--config="):
            out[i] = "--config=" + str(resolve_config(arg.split("=", 1)[1]))
    return out


def load_config(name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """A config as the recipes see it: resolved by :func:`resolve_config`, with torchtune's overrides."""
    from argparse import Namespace

    from omegaconf import OmegaConf
    from torchtune.config._utils import _merge_yaml_and_cli_args

    yaml = OmegaConf.to_container(OmegaConf.load(resolve_config(name)), resolve=False)
    return _merge_yaml_and_cli_args(Namespace(**yaml), list(overrides))


def optional_component(node: Any) -> Optional[DictConfig]:
    """``node`` unless it is switched off: null, or a node whose ``_component_`` is null.

    torchtune rewrites the override ``key=null`` on a component node to ``key._component_: null``,
    and ``~key`` cannot remove a component node, so both spellings mean "off".
    """
    if node is None:
        return None
    if isinstance(node, DictConfig) and "_component_" in node and node._component_ is None:
        return None
    return node


_GIVEN_ARGV: list[str] = []


def given_argv() -> list[str]:
    """The program's arguments as its command line gave them, before :func:`parse` resolved ``--config``."""
    return list(_GIVEN_ARGV or sys.argv)


def parse(recipe_main: Callable[[DictConfig], Any]) -> Callable[[], Any]:
    """Like ``torchtune.config.parse``, with ``--config`` resolved by :func:`resolve_config`
    and a config error, or an out-of-memory stop, reported in one line instead of a traceback."""

    @functools.wraps(recipe_main)
    def checked(cfg: DictConfig) -> Any:
        try:
            return recipe_main(cfg)
        except ConfigError as err:
            sys.exit(f"config error: {err}")
        except OutOfMemoryStop as err:
            sys.exit(f"out of memory: {err}")

    @functools.wraps(recipe_main)
    def wrapper() -> Any:
        _GIVEN_ARGV[:] = sys.argv
        try:
            sys.argv = resolve_config_argument(sys.argv)
        except FileNotFoundError as err:
            sys.exit(f"error: {err}")
        return tune_config.parse(checked)()

    return wrapper
