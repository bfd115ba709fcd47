"""Config resolution for the recipes: an existing file path first, then a shipped config by name.

torchtune's ``tune run`` passes ``--config`` through unchanged for recipes that are not built in,
so the recipes resolve it themselves before handing over to torchtune's own parser, which keeps
``key=value`` and ``~key`` overrides exactly as torchtune has them.
"""

from __future__ import annotations

import difflib
import functools
import os
import sys
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adaptive_batching.core.packages import require_supported_torch
from adaptive_batching.errors import ConfigError, ConfigNotFound, OutOfMemoryStop, Preempted, ProfileError

if TYPE_CHECKING:
    from omegaconf import DictConfig

RECIPES = (
    "adaptive_full_finetune",
    "adaptive_lora_finetune",
    "adaptive_lora_dpo",
    "adaptive_full_dpo",
    "adaptive_knowledge_distillation",
)


def shipped_configs_dir() -> Path:
    """The folder holding the configs installed with the package."""
    return Path(str(resources.files("adaptive_batching.configs")))


def shipped_config_names() -> list[str]:
    """Names of the shipped configs, without the ``.yaml`` suffix."""
    return sorted(p.stem for p in shipped_configs_dir().glob("*.yaml"))


# The torchtune recipes whose configs ours can run (the others train or evaluate in other ways).
FINETUNE_RECIPES = (
    "full_finetune_single_device",
    "full_finetune_distributed",
    "lora_finetune_single_device",
    "lora_finetune_distributed",
)


def stock_configs(recipes: Sequence[str] | None = None) -> dict[str, Path]:
    """torchtune's own configs by the names ``tune run`` takes (``llama3_1/8B_full``), from its registry;
    those of ``recipes`` only when given."""
    import torchtune
    from torchtune._recipe_registry import get_all_recipes

    root = Path(torchtune.__file__).parent.parent / "recipes" / "configs"
    return {
        config.name: root / config.file_path
        for recipe in get_all_recipes()
        if recipes is None or recipe.name in recipes
        for config in recipe.configs
    }


def resolve_config(name: str) -> Path:
    """Return the config file that ``name`` means: an existing path, else a config by name (see
    :func:`named_config`)."""
    path = Path(name).expanduser()
    return path if path.is_file() else named_config(name)


def named_config(name: str) -> Path:
    """One of our shipped configs (``llama3_8b`` or ``llama3_8b.yaml``), else torchtune's config of that name
    (``llama3_1/8B_full``), as ``tune run`` finds it. Ours and torchtune's never share a name (torchtune's
    all hold a ``/``)."""
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    shipped = shipped_configs_dir() / f"{stem}.yaml"
    if "/" not in stem and shipped.is_file():
        return shipped
    stock = stock_configs()
    if stem in stock:
        return stock[stem]
    close = difflib.get_close_matches(
        stem, [*shipped_config_names(), *stock_configs(FINETUNE_RECIPES)], n=4, cutoff=0.6
    )
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ConfigNotFound(
        f"--config {name!r}: no such file in {Path.cwd()}, and neither a shipped config nor a torchtune config "
        f"of that name{hint} (`adaptive-batching ls` lists ours, `tune ls` torchtune's)"
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
    assert isinstance(yaml, dict), f"{name}: a config file is a mapping of keys"
    return _merge_yaml_and_cli_args(Namespace(**{str(key): value for key, value in yaml.items()}), list(overrides))


_GIVEN_ARGV: list[str] = []


def given_argv() -> list[str]:
    """The program's arguments as its command line gave them, before :func:`parse` resolved ``--config``."""
    return list(_GIVEN_ARGV or sys.argv)


def parse(recipe_main: Callable[[DictConfig], Any]) -> Callable[[], Any]:
    """Like ``torchtune.config.parse``, with ``--config`` resolved by :func:`resolve_config`
    and a config error, or an out-of-memory stop, reported in one line instead of a traceback."""
    from torchtune import config as tune_config

    from adaptive_batching.faults.preemption import EXIT_CODE as PREEMPTED_EXIT_CODE
    from adaptive_batching.runtime import memory

    @functools.wraps(recipe_main)
    def checked(cfg: DictConfig) -> Any:
        every_rank = True  # whether each rank prints the line: the same config error on every rank, once
        memory.freeze_long_lived_objects()
        try:
            require_supported_torch()
            result, message, code = recipe_main(cfg), None, 0
        except ConfigError as err:
            result, message, code, every_rank = None, f"config error: {err}", 1, False
        except OutOfMemoryStop as err:
            result, message, code = None, f"out of memory: {err}", 1
        except ProfileError as err:  # raised after the ranks agreed: the same on every rank
            result, message, code, every_rank = None, f"profile error: {err}", 1, False
        except Preempted:  # each rank has said where it stopped (Preemption.stop)
            result, message, code = None, None, PREEMPTED_EXIT_CODE
        # Said before the teardown: the first rank to exit makes torchrun end the others.
        speaks = every_rank or os.environ.get("RANK", "0") == "0"
        if message is not None and speaks:
            say_line(message)
        leave_cleanly()  # outside the handlers, so no traceback keeps the run's objects alive
        if message is not None and not speaks:
            wait_for_rank_zero(message)
        if code == 0:
            return result
        sys.exit(code)

    @functools.wraps(recipe_main)
    def wrapper() -> Any:
        _GIVEN_ARGV[:] = sys.argv
        try:
            sys.argv = resolve_config_argument(sys.argv)
        except ConfigNotFound as err:
            sys.exit(f"error: {err}")
        return tune_config.parse(checked)()

    return wrapper


RANK_ZERO_WAIT_S = 60.0
"""How long a rank other than rank zero waits, after a run-wide error that rank zero reports, before it says the
line itself (rank zero had not ended the run by then: the error was not on rank zero, or rank zero is on another
node whose agent has not stopped this one)."""


def say_line(text: str) -> None:
    """Write ``text`` and its newline to stderr in one write, flushed (``core.logs.say_line``, once torchtune is
    loaded, which it is when a recipe's error reaches :func:`parse`)."""
    from adaptive_batching.core.logs import say_line as say

    say(text)


def wait_for_rank_zero(message: str, seconds: float = RANK_ZERO_WAIT_S) -> None:
    """On a rank other than zero, after an error every rank meets and rank zero says: wait, so that rank zero's exit
    is the first failure torchrun's agent sees; the agent's SIGTERM (or a Ctrl-C, or the agent's death) then ends
    this rank at once and silently, whatever handler the run had, even a signal whose Python handler had yet to run.
    Exiting at once instead could make the agent end rank zero before its line is out. If this rank is still running
    after ``seconds`` (longer than the agent's 30 s between its SIGTERM and its SIGKILL), nobody has said the line:
    it says it, and returns."""
    import signal
    import time

    from adaptive_batching.faults.preemption import PARENT_DEATH, run_pending_handlers

    for number in (signal.SIGTERM, signal.SIGINT, PARENT_DEATH):
        if number is not None:
            signal.signal(number, _end_by_signal)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        run_pending_handlers()  # a signal another thread took waits for the main thread to look
        time.sleep(min(left, 0.1))
    say_line(message)


def _end_by_signal(number: int, frame: Any) -> None:
    """End the process by signal ``number``, its default action: no finalisation, nothing printed."""
    import signal

    signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)


def leave_cleanly() -> None:
    """End the destroyed process group's worker threads before the interpreter finalises (see
    ``runtime.distributed.release_destroyed_group``); say so in one line if some are still running."""
    from adaptive_batching.runtime.distributed import mesh_holders, release_destroyed_group

    left = release_destroyed_group()
    if left:
        print(
            f"warning: {len(left)} gloo worker thread(s) still running after the process group was destroyed "
            f"({', '.join(left)}): something still holds the group ({mesh_holders()}), and the process may abort "
            "at exit",
            file=sys.stderr,
            flush=True,
        )
