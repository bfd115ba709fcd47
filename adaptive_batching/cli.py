"""The ``adaptive-batching`` console script: tiny offline assets, listing and copying recipes and configs, and
the profiler, the batch plan and the estimate without training."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from adaptive_batching.config.loading import (
    RECIPES,
    leave_cleanly,
    load_config,
    named_config,
    shipped_config_names,
    shipped_configs_dir,
)
from adaptive_batching.core.packages import require_supported_torch
from adaptive_batching.errors import ConfigError, ConfigNotFound, OutOfMemoryStop, Preempted, ProfileError
from adaptive_batching.runtime.files import write_atomically


class UsageError(Exception):
    """A command's argument is wrong."""


class _Parser(argparse.ArgumentParser):
    """An argument parser that may add its arguments only when it first parses or prints them (``add_arguments``):
    the tiny-assets choices live in modules that import torch and torchtune, which the other commands need not."""

    def __init__(
        self, *args: Any, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._add_arguments = add_arguments

    def _complete(self) -> None:
        add, self._add_arguments = self._add_arguments, None
        if add is not None:
            add(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._complete()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._complete()
        return super().format_usage()

    def format_help(self) -> str:
        self._complete()
        return super().format_help()


def _recipe_file(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"recipe module {name!r} is not installed")
    return Path(spec.origin)


def recipe_for(config: Path) -> str:
    """The recipe that runs a config (see :func:`~adaptive_batching.config.training_kinds.recipe_for_model`)."""
    from omegaconf import DictConfig, OmegaConf

    from adaptive_batching.config.training_kinds import recipe_for_model

    cfg = OmegaConf.load(config)
    assert isinstance(cfg, DictConfig), f"{config}: a config file is a mapping of keys"
    return recipe_for_model(cfg)


# What the tiny assets run: a recipe and a shipped config for each recipe, and QAT (``adaptive-batching
# tiny-assets`` prints them as its ``run:`` lines).
TINY_RUNS = (
    ("adaptive_full_finetune", "tiny_full"),
    ("adaptive_lora_finetune", "tiny_lora"),
    ("adaptive_lora_dpo", "tiny_lora_dpo"),
    ("adaptive_full_dpo", "tiny_full_dpo"),
    ("adaptive_knowledge_distillation", "tiny_kd"),
    ("adaptive_lora_finetune", "tiny_qat_lora"),
)
# The tiny Llama 3.2 Vision model's (written when torchvision, which torchtune's vision modules import, is installed).
VISION_RUNS = (
    ("adaptive_full_finetune", "tiny_vision_full"),
    ("adaptive_lora_finetune", "tiny_vision_lora"),
    ("adaptive_lora_finetune", "tiny_vision_qlora"),
)

# torchtune's configs that each recipe runs by name, a few of each kind (``ls`` prints them; a test checks each
# against torchtune's registry and the recipe that runs it). Static text: ``ls`` does not import torchtune.
STOCK_EXAMPLES = {
    "adaptive_full_finetune": ("llama3_1/8B_full", "llama3/8B_qat_full"),
    "adaptive_lora_finetune": ("llama3_1/8B_lora", "llama3_1/8B_qlora_single_device", "llama3_2/1B_qat_lora"),
    "adaptive_lora_dpo": ("llama3_1/8B_lora_dpo_single_device",),
    "adaptive_full_dpo": ("llama3_1/8B_full_dpo",),
    "adaptive_knowledge_distillation": ("qwen2/1.5_to_0.5B_KD_lora_single_device",),
}


def cmd_tiny_assets(args: argparse.Namespace) -> int:
    from adaptive_batching.assets.families import FAMILIES, write_family_assets

    if args.model in FAMILIES:
        paths = write_family_assets(args.output_dir, args.model, seed=args.seed, num_samples=args.num_samples)
        print(f"tiny {args.model} model and tokenizer in {paths.folder}, the tiny data in {paths.dataset}")
        for method in ("full", "lora"):
            print(
                f"run: tune run adaptive_{method}_finetune --config tiny_{args.model}_{method} assets_dir={paths.root}"
            )
        return 0
    if args.model != "tiny":
        # A real architecture, randomly initialised, next to the tiny tokenizer and data (model_assets).
        from adaptive_batching.assets.models import describe_model_assets, write_model_assets

        model_paths = write_model_assets(args.output_dir, args.model, seed=args.seed, num_samples=args.num_samples)
        print(describe_model_assets(model_paths))
        return 0
    from adaptive_batching.assets.tiny import DEFAULT_TINY_DIR, describe, write_tiny_assets

    tiny_paths = write_tiny_assets(args.output_dir, seed=args.seed, num_samples=args.num_samples)
    print(describe(tiny_paths), end="")
    where = (
        "" if Path(args.output_dir).resolve() == Path(DEFAULT_TINY_DIR).resolve() else f" assets_dir={tiny_paths.root}"
    )
    runs = list(TINY_RUNS)
    from adaptive_batching.assets.tiny_vision import vision_available, write_tiny_vision_assets

    if vision_available():
        vision = write_tiny_vision_assets(args.output_dir, seed=args.seed)
        print(f"vision: the tiny Llama 3.2 Vision model in {vision.model_dir}, images in {vision.image_dir}")
        runs += VISION_RUNS
    else:
        print("vision: not written: torchtune's vision modules need torchvision (pip install torchvision)")
    for recipe, config in runs:
        print(f"run: tune run {recipe} --config {config}{where}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    width = max(len(recipe) for recipe in RECIPES) + 2
    print(f"{'RECIPE':<{width}}CONFIG")
    by_recipe: dict[str, list[str]] = {recipe: [] for recipe in RECIPES}
    for name in shipped_config_names():
        by_recipe[recipe_for(shipped_configs_dir() / f"{name}.yaml")].append(name)
    for recipe, configs in by_recipe.items():
        for i, name in enumerate(configs):
            print(f"{recipe if i == 0 else '':<{width}}{name}")
    print(
        "\nAlso torchtune's own configs by their names (`tune ls`): full, LoRA, QLoRA, QAT, DPO and distillation, "
        "each run by the recipe that trains it, e.g."
    )
    for recipe, examples in STOCK_EXAMPLES.items():
        print(f"{recipe:<{width}}{', '.join(examples)}")
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    if args.name in RECIPES:
        source = _recipe_file(args.name)
    else:
        source = named_config(args.name)
    destination = Path(args.destination)
    if destination.is_dir() or args.destination.endswith("/"):
        destination = destination / source.name
    if not destination.suffix:
        destination = destination.with_suffix(source.suffix)
    if destination.exists() and destination.resolve() == source.resolve():
        raise UsageError(f"{destination} is the shipped file itself")
    if destination.exists() and not args.force:
        raise UsageError(f"{destination} exists; pass --force to overwrite")
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, destination)
    print(f"Copied {args.name} to {destination}")
    if args.name not in RECIPES:
        print(f"Run it with: tune run {recipe_for(destination)} --config {destination}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from adaptive_batching.config.settings import validate_config
    from adaptive_batching.profiling.report import write_json
    from adaptive_batching.runtime.memory import freeze_long_lived_objects
    from adaptive_batching.training.parts import set_up
    from adaptive_batching.training.recipe_table import method_and_objective

    cfg = load_config(args.config, [*args.overrides, "use_maximum_batch_size=True"])
    freeze_long_lived_objects()
    settings = validate_config(cfg)
    method, objective = method_and_objective(cfg, profiled=settings.needs_profile)  # the config's recipe's
    with set_up(cfg, settings, method, objective) as parts:
        result = parts.profiler.find(parts.trial_step)  # logs its table (rank 0)
        if parts.is_rank_zero and args.json:
            print(f"JSON report: {write_json(result, Path(args.json))}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Set up, profile (or read the profile cache) and print the batch plan, without training a step."""
    from adaptive_batching.config.settings import validate_config
    from adaptive_batching.runtime.memory import freeze_long_lived_objects
    from adaptive_batching.training.recipe_table import method_and_objective
    from adaptive_batching.training.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    freeze_long_lived_objects()
    settings = validate_config(cfg)
    method, objective = method_and_objective(cfg, profiled=settings.needs_profile)  # the config's recipe's
    with Trainer.build(cfg, settings, method, objective):
        pass  # the build logs the plan
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print what a run's output folder holds: finished, resumable (and from where), stopped or none."""
    from adaptive_batching.faults.checkpoints import run_status

    print(run_status(Path(args.output_dir)))
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from adaptive_batching.batching import worst_case
    from adaptive_batching.config.inputs import worst_case_of
    from adaptive_batching.config.training_kinds import check_training_kind
    from adaptive_batching.estimate.prediction import estimate_max_micro_batch
    from adaptive_batching.training.recipe_table import traced_parts
    from adaptive_batching.units import parse_bytes

    try:
        device_memory = parse_bytes(args.device_memory)
    except ValueError as err:
        raise UsageError(f"--device-memory: {err}") from None
    if args.seq_len is not None and args.seq_len < 1:
        raise UsageError(f"--seq-len must be an integer >= 1, got {args.seq_len}")
    cfg = load_config(args.config, args.overrides)
    check_training_kind(cfg)  # keys no recipe of ours trains with: refused as the recipe refuses them, before tracing
    inputs, method, objective = traced_parts(cfg)  # checked as the recipe checks them
    cache = OmegaConf.select(cfg, "adaptive_batching.cache_dir", default=None)
    worst = worst_case.WorstCase(args.seq_len, "--seq-len") if args.seq_len else worst_case_of(cfg, cache)
    inputs = dataclasses.replace(inputs, images=worst.images)  # a vision data set's most images a sample (0: unread)
    try:
        estimate = estimate_max_micro_batch(
            inputs,
            method,
            objective,
            device_memory_bytes=device_memory,
            fraction=args.fraction,
            world_size=args.world_size,
            exact=args.full_trace,
            seq_len=worst.tokens,
            seq_len_source=worst.source,
        )
    except ConfigError:
        raise  # a config key's fault, reported as such by main()
    except ValueError as err:
        raise UsageError(str(err)) from None
    print(estimate.describe())
    if args.json:
        write_atomically(Path(args.json), json.dumps(estimate.to_dict(), indent=2, sort_keys=True) + "\n")
    return 0


def _tiny_assets_arguments(tiny: argparse.ArgumentParser) -> None:
    from adaptive_batching.assets.families import FAMILIES
    from adaptive_batching.assets.models import CHOICES
    from adaptive_batching.assets.tiny import DEFAULT_TINY_DIR

    tiny.add_argument("--output-dir", default=DEFAULT_TINY_DIR, help=f"default: {DEFAULT_TINY_DIR}")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--num-samples", type=int, default=3000)
    tiny.add_argument(
        "--model",
        choices=(*CHOICES, *FAMILIES),
        default="tiny",
        help="tiny (the tiny Llama, default); tiny_qlora (the tiny Llama at dims NF4 can quantize); "
        f"{', '.join(FAMILIES)} (tiny models of those families, with their own tokenizers); or "
        "llama3_2_1b (the real size, randomly initialised); written to OUTPUT_DIR/MODEL next to "
        "the tiny data",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaptive-batching", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    tiny = sub.add_parser(
        "tiny-assets", help="write the offline tiny model, tokenizer and dataset", add_arguments=_tiny_assets_arguments
    )
    tiny.set_defaults(func=cmd_tiny_assets)

    ls = sub.add_parser("ls", help="list the shipped recipes and configs")
    ls.set_defaults(func=cmd_ls)

    cp = sub.add_parser("cp", help="copy a shipped recipe or config to edit it")
    cp.add_argument("name", help="a recipe or config name, e.g. tiny_full or adaptive_full_finetune")
    cp.add_argument("destination", help="a file or directory")
    cp.add_argument("--force", action="store_true", help="overwrite an existing file")
    cp.set_defaults(func=cmd_cp)

    profile = sub.add_parser("profile", help="run the start-up profiler alone and print its report")
    profile.add_argument("--config", required=True, help="a config path, shipped name or torchtune config name")
    profile.add_argument("--json", help="also write the JSON report here")
    profile.add_argument("overrides", nargs="*", help="key=value or ~key, as with tune run")
    profile.set_defaults(func=cmd_profile)

    plan = sub.add_parser("plan", help="set up, profile and log the batch plan of a config, without training")
    plan.add_argument("--config", required=True, help="a config path, shipped name or torchtune config name")
    plan.add_argument("overrides", nargs="*", help="key=value or ~key, as with tune run")
    plan.set_defaults(func=cmd_plan)

    status = sub.add_parser(
        "status",
        help="say whether a run's output folder is finished, resumable, or stopped "
        "before its first checkpoint (job scripts)",
    )
    status.add_argument("output_dir", help="the run's output_dir")
    status.set_defaults(func=cmd_status)

    estimate = sub.add_parser("estimate", help="predict the largest micro batch for a device you do not have")
    estimate.add_argument("--config", required=True, help="a config path, shipped name or torchtune config name")
    estimate.add_argument("--device-memory", required=True, help="e.g. 80GiB")
    estimate.add_argument("--fraction", type=float, default=0.9, help="share of device memory to use (default 0.9)")
    estimate.add_argument("--world-size", type=int, default=1, help="ranks the model is sharded over (FSDP)")
    estimate.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens in the worst-case sample; default: the longest sample of the config's data "
        "after truncation, when the tokenizer and data can be read here",
    )
    estimate.add_argument(
        "--full-trace",
        action="store_true",
        help="trace every layer (exact, minutes for an 8B model) instead of 3 layers extrapolated",
    )
    estimate.add_argument("--json", help="also write the estimate as JSON here")
    estimate.add_argument("overrides", nargs="*", help="key=value or ~key, as with tune run")
    estimate.set_defaults(func=cmd_estimate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; an error that is the user's (an argument, a config, a budget nothing fits in) is one line
    on stderr, never a traceback: exit code 2 for a wrong argument or config, 1 when the run could not go on."""
    args = build_parser().parse_args(argv)
    try:
        require_supported_torch()
        code = args.func(args)
    except (UsageError, ConfigNotFound) as error:
        code = _fail(f"error: {error}", 2)
    except ConfigError as error:
        code = _fail(f"config error: {error}", 2)
    except ProfileError as error:
        code = _fail(f"profile error: {error}", 1)
    except OutOfMemoryStop as error:
        code = _fail(f"out of memory: {error}", 1)
    except Preempted:  # each rank has said where it stopped (Preemption.stop)
        from adaptive_batching.faults.preemption import EXIT_CODE as PREEMPTED_EXIT_CODE

        code = PREEMPTED_EXIT_CODE
    if "adaptive_batching.runtime.distributed" in sys.modules:  # else no process group was made
        leave_cleanly()  # outside the handlers: no traceback holds the run's objects
    return code


def _fail(message: str, code: int) -> int:
    print(message, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
