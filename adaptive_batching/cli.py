"""The ``adaptive-batching`` console script: tiny offline assets, and listing/copying recipes and configs."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from adaptive_batching.config.loading import RECIPES, load_config, shipped_config_names, shipped_configs_dir


def _recipe_file(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"recipe module {name!r} is not installed")
    return Path(spec.origin)


def _configs_for(recipe: str) -> list[str]:
    lora = recipe == "adaptive_lora_finetune"
    return [n for n in shipped_config_names() if n.endswith("_lora") == lora]


def cmd_tiny_assets(args: argparse.Namespace) -> int:
    if args.model != "tiny":
        # A real architecture, randomly initialised, next to the tiny tokenizer and data (model_assets).
        from adaptive_batching.assets.models import describe_model_assets, write_model_assets

        paths = write_model_assets(args.output_dir, args.model, seed=args.seed, num_samples=args.num_samples)
        print(describe_model_assets(paths))
        return 0
    from adaptive_batching.assets.tiny import describe, write_tiny_assets

    paths = write_tiny_assets(args.output_dir, seed=args.seed, num_samples=args.num_samples)
    print(describe(paths))
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    print(f"{'RECIPE':<28}CONFIG")
    for recipe in RECIPES:
        configs = _configs_for(recipe)
        for i, name in enumerate(configs):
            print(f"{recipe if i == 0 else '':<28}{name}")
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    stem = args.name[: -len(".yaml")] if args.name.endswith(".yaml") else args.name
    if args.name in RECIPES:
        source = _recipe_file(args.name)
    elif stem in shipped_config_names():
        source = shipped_configs_dir() / f"{stem}.yaml"
    else:
        print(f"error: {args.name!r} is neither a recipe ({', '.join(RECIPES)}) nor a shipped config "
              f"({', '.join(shipped_config_names())})", file=sys.stderr)
        return 2
    destination = Path(args.destination)
    if destination.is_dir() or args.destination.endswith("/"):
        destination = destination / source.name
    if not destination.suffix:
        destination = destination.with_suffix(source.suffix)
    if destination.exists() and destination.resolve() == source.resolve():
        print(f"error: {destination} is the shipped file itself", file=sys.stderr)
        return 2
    if destination.exists() and not args.force:
        print(f"error: {destination} exists; pass --force to overwrite", file=sys.stderr)
        return 2
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, destination)
    print(f"Copied {source.name} to {destination}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from adaptive_batching.config.settings import ConfigError, validate_config
    from adaptive_batching.profiling.report import format_table, write_json
    from adaptive_batching.training.methods import method_for
    from adaptive_batching.training.trainer import Trainer

    cfg = load_config(args.config, [*args.overrides, "use_maximum_batch_size=True"])
    try:
        settings = validate_config(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    trainer = Trainer(cfg, settings, method_for(cfg))
    try:
        trainer.setup()
        result = trainer.profile()
        if trainer.is_rank_zero:
            print(format_table(result))
            if args.json:
                print(f"JSON report: {write_json(result, Path(args.json))}")
    finally:
        trainer.close()
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from adaptive_batching.profiling.estimate import estimate_max_micro_batch
    from adaptive_batching.training.methods import method_for
    from adaptive_batching.units import parse_bytes

    try:
        device_memory = parse_bytes(args.device_memory)
    except ValueError as err:
        print(f"error: --device-memory: {err}", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)
    try:
        estimate = estimate_max_micro_batch(cfg, method_for(cfg), device_memory_bytes=device_memory,
                                            fraction=args.fraction, world_size=args.world_size,
                                            exact=args.full_trace)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(estimate.describe())
    if args.json:
        Path(args.json).write_text(json.dumps(estimate.to_dict(), indent=2, sort_keys=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from adaptive_batching.assets.models import CHOICES
    from adaptive_batching.assets.tiny import DEFAULT_TINY_DIR

    parser = argparse.ArgumentParser(prog="adaptive-batching", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("tiny-assets", help="write the offline tiny model, tokenizer and dataset")
    tiny.add_argument("--output-dir", default=DEFAULT_TINY_DIR, help=f"default: {DEFAULT_TINY_DIR}")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--num-samples", type=int, default=3000)
    tiny.add_argument("--model", choices=CHOICES, default="tiny",
                      help="tiny (default), or a real architecture randomly initialised, written as bf16 "
                           "safetensors to OUTPUT_DIR/MODEL next to the tiny tokenizer and data")
    tiny.set_defaults(func=cmd_tiny_assets)

    ls = sub.add_parser("ls", help="list the shipped recipes and configs")
    ls.set_defaults(func=cmd_ls)

    cp = sub.add_parser("cp", help="copy a shipped recipe or config to edit it")
    cp.add_argument("name", help="a recipe or config name, e.g. tiny_full or adaptive_full_finetune")
    cp.add_argument("destination", help="a file or directory")
    cp.add_argument("--force", action="store_true", help="overwrite an existing file")
    cp.set_defaults(func=cmd_cp)

    profile = sub.add_parser("profile", help="run the start-up profiler alone and print its report")
    profile.add_argument("--config", required=True, help="a config path or shipped name")
    profile.add_argument("--json", help="also write the JSON report here")
    profile.add_argument("overrides", nargs="*", help="key=value or ~key, as with tune run")
    profile.set_defaults(func=cmd_profile)

    estimate = sub.add_parser("estimate", help="predict the largest micro batch for a device you do not have")
    estimate.add_argument("--config", required=True, help="a config path or shipped name")
    estimate.add_argument("--device-memory", required=True, help="e.g. 80GiB")
    estimate.add_argument("--fraction", type=float, default=0.9, help="share of device memory to use (default 0.9)")
    estimate.add_argument("--world-size", type=int, default=1, help="ranks the model is sharded over (FSDP)")
    estimate.add_argument("--full-trace", action="store_true",
                          help="trace every layer (exact, minutes for an 8B model) instead of 3 layers extrapolated")
    estimate.add_argument("--json", help="also write the estimate as JSON here")
    estimate.add_argument("overrides", nargs="*", help="key=value or ~key, as with tune run")
    estimate.set_defaults(func=cmd_estimate)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
