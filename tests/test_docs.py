"""The documentation against the code (fast: no model is built, nothing is trained).

1. **Config keys.** Every config key the code reads is on ``docs/config-keys.md``, in a table row whose first
   cell names it in backticks and whose second cell is its default. The keys come from the code, never from a
   list in this file: the top-level keys the recipes read (``config.keys.RECIPE_KEYS`` and ``ADAPTIVE_KEYS``),
   every ``cfg.get("key", default)`` in ``adaptive_batching/`` and ``recipes/`` (found in the source with
   ``ast``), the knobs under ``adaptive_batching:`` (``config.settings.KNOBS``, with their defaults) and the
   keyword arguments of the shipped growth functions (``adaptive_batching.growth.__all__``). The default cell
   must read:

   - ``required`` for a key whose absence ``config.settings`` refuses;
   - otherwise the code's default as YAML writes it (``null``, ``false``, ``0.9``, ``[SIGTERM, SIGUSR1]``);
     every ``cfg.get`` of one key must agree on that default;
   - for a key read without a default (``cfg.output_dir``) or accepted and never read (``fsdp``): ``required``,
     or ``null`` when a config with the key set to null passes the recipe-key checks.

   A row naming a key the code does not read fails too (a stale row).

2. **Commands.** Every ``tune run`` and ``adaptive-batching`` command in ``README.md`` and ``docs/*.md`` is
   real. Commands are taken from fenced code blocks (any language; ``\\`` continues a line, ``#`` starts a
   comment) and from inline code spans; a command starts a line or follows ``&&``, ``||``, ``;``, ``|``, ``&``
   or ``(``, after any ``VAR=value``, ``time`` or ``nice``; the program may be a path (``.venv/bin/tune``).

   - ``tune run``: torchrun's options before the recipe are skipped (``--opt value``, ``--opt=value``,
     ``--standalone``); the recipe must be ours (``adaptive_full_finetune``, ``adaptive_lora_finetune``) or one
     in torchtune's registry, and ``--config`` must be given. One of our recipes must be the one that runs the
     config (LoRA configs: ``adaptive_lora_finetune``), as ``adaptive-batching cp`` says; torchtune's recipe must
     list the config in its registry.
   - ``adaptive-batching ...``: parsed by the real parser (``cli.build_parser()``), so the subcommand, its options
     and their choices are checked; usage notation ``[--opt VALUE]`` is dropped first.
   - A config (``--config X``; the source of ``adaptive-batching cp X DEST``) is real when it is one of ours by
     name, with or without ``.yaml`` (``adaptive-batching ls``); torchtune's by its registry name
     (``llama3_1/8B_full``); a file in this repository (``configs/tiny_full.yaml``); a file the same code block
     created (the destination of an ``adaptive-batching cp`` before it); a user's own file, which the docs always
     name ``my_*.yaml`` (in any folder); or a placeholder in capitals (``CFG``) in a usage line.
   - An inline span of the program and at most a subcommand (``tune run``, ``adaptive-batching profile``), or of
     ``tune run`` with launcher options and no recipe (``tune run --nproc_per_node``), is a mention, not a
     command: only an ``adaptive-batching`` subcommand is checked.

3. **Links.** Every relative link and image in ``README.md`` and ``docs/*.md`` (outside code) points to a file
   that exists, and a ``#anchor`` to a heading of the target (GitHub's heading ids).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from adaptive_batching import growth
from adaptive_batching.cli import build_parser, recipe_for
from adaptive_batching.config.checks import check_recipe_keys
from adaptive_batching.config.keys import ADAPTIVE_KEYS, RECIPE_KEYS
from adaptive_batching.config.loading import RECIPES, shipped_config_names, shipped_configs_dir, stock_configs
from adaptive_batching.config.settings import KNOBS
from adaptive_batching.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
KEYS_PAGE = DOCS / "config-keys.md"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
SECTION = "adaptive_batching"


# ---------------------------------------------------------------------------------------------------------
# Markdown


def fenced_blocks(text: str) -> list[str]:
    """The contents of the fenced code blocks of a page."""
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)


def prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)


def inline_spans(text: str) -> list[str]:
    """The inline code spans of a page outside its code blocks; a span may run over a line break."""
    spans = re.findall(r"`([^`]+)`", prose(text))
    return [" ".join(span.split()) for span in spans if "\n\n" not in span]


def table_cells(line: str) -> list[str]:
    """The cells of a table row; a ``|`` inside backticks does not split."""
    cells, cell, in_code = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
    cells.append(cell.strip())
    return cells


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every table of a page: its header cells and its rows."""
    found: list[tuple[list[str], list[list[str]]]] = []
    previous_was_row = False
    for line in text.splitlines():
        is_row = line.lstrip().startswith("|")
        if is_row:
            cells = table_cells(line)
            if not previous_was_row:
                found.append((cells, []))
            elif not all(re.fullmatch(r":?-+:?", cell) for cell in cells):
                found[-1][1].append(cells)
        previous_was_row = is_row
    return found


def table_rows(text: str, header: list[str]) -> list[list[str]]:
    """The rows of the tables whose header starts with ``header``."""
    return [row for head, rows in tables(text) if head[: len(header)] == header for row in rows]


def as_yaml(value: Any) -> str:
    """A default as the page writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(as_yaml(v) for v in value) + "]"
    return str(value)


def default_cell(cell: str) -> str:
    """The default a cell gives: its first code span, else its text."""
    code = re.search(r"`([^`]+)`", cell)
    return code.group(1) if code else cell.strip()


# ---------------------------------------------------------------------------------------------------------
# 1. Config keys


def _module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = relative.parts[1:] if relative.parts[0] == "recipes" else relative.parts
    return ".".join(parts).removesuffix(".__init__")


def _reads_cfg(node: ast.AST) -> bool:
    """``cfg`` or ``self.cfg`` / ``context.cfg``: the run's top-level config."""
    return (isinstance(node, ast.Name) and node.id == "cfg") or (isinstance(node, ast.Attribute) and node.attr == "cfg")


def _value(node: ast.expr, module: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        if isinstance(node, ast.Name):  # a module constant (DEFAULT_COLLATE)
            return getattr(importlib.import_module(module), node.id)
        raise


@lru_cache(maxsize=1)
def code_defaults() -> dict[str, set[str]]:
    """Top-level key -> the defaults of every ``cfg.get(key, default)`` in the library and the recipes."""
    found: dict[str, set[str]] = {}
    for path in [*sorted((ROOT / "adaptive_batching").rglob("*.py")), *sorted((ROOT / "recipes").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and _reads_cfg(node.func.value)
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                continue
            default = _value(node.args[1], _module_name(path)) if len(node.args) > 1 else None
            found.setdefault(node.args[0].value, set()).add(as_yaml(default))
    return found


def _is_required(key: str) -> bool:
    """The recipe-key checks refuse a config without ``key`` (the shipped tiny config, which has every one)."""
    cfg = OmegaConf.load(shipped_configs_dir() / "tiny_full.yaml")
    if key not in cfg:
        return False
    del cfg[key]
    try:
        check_recipe_keys(cfg)
    except ConfigError as error:
        return f"'{key}' is missing" in str(error)
    return False


def _null_passes(key: str) -> bool:
    cfg = OmegaConf.load(shipped_configs_dir() / "tiny_full.yaml")
    cfg[key] = None
    try:
        check_recipe_keys(cfg)
    except ConfigError:
        return False
    return True


def code_keys() -> dict[str, str | None]:
    """Every key the code reads -> the default the page must give (None: ``required`` or a null the checks take)."""
    keys: dict[str, str | None] = {}
    defaults = code_defaults()
    for key in sorted((set(RECIPE_KEYS) | set(ADAPTIVE_KEYS) | set(defaults)) - {SECTION}):
        if _is_required(key):
            keys[key] = "required"
        elif key in defaults:
            assert len(defaults[key]) == 1, f"the code reads '{key}' with different defaults: {sorted(defaults[key])}"
            keys[key] = next(iter(defaults[key]))
        else:
            keys[key] = None
    for name, knob in KNOBS.items():
        keys[f"{SECTION}.{name}"] = as_yaml(knob.default)
    return keys


def growth_arguments() -> dict[tuple[str, str], str]:
    """(``_component_``, argument) -> default of every keyword argument of the shipped growth functions."""
    import inspect

    found = {}
    for name in growth.__all__:
        for parameter in inspect.signature(getattr(growth, name)).parameters.values():
            if parameter.kind is parameter.KEYWORD_ONLY and parameter.name != "stats":
                empty = parameter.default is inspect.Parameter.empty
                found[(f"adaptive_batching.growth.{name}", parameter.name)] = (
                    "required" if empty else as_yaml(parameter.default)
                )
    return found


def documented_keys(text: str) -> dict[str, str]:
    """Key -> default cell, from the key tables (header ``| key | default | ...``): every key in backticks in a
    row's first cell, the default in its second."""
    documented: dict[str, str] = {}
    for row in table_rows(text, ["key", "default"]):
        for key in re.findall(r"`([^`]+)`", row[0]):
            documented[key] = default_cell(row[1])
    return documented


def test_every_key_the_code_reads_is_on_the_keys_page_with_its_default() -> None:
    documented = documented_keys(KEYS_PAGE.read_text(encoding="utf-8"))
    problems = []
    for key, default in code_keys().items():
        if key not in documented:
            problems.append(f"{key}: no row")
        elif default is None:
            if documented[key] not in ("required", "null"):
                problems.append(f"{key}: read without a default, so 'required' or 'null', not {documented[key]!r}")
            elif documented[key] == "null" and not _null_passes(key):
                problems.append(f"{key}: the page says null, which the recipe-key checks refuse")
        elif documented[key] != default:
            problems.append(f"{key}: the page says {documented[key]!r}, the code {default!r}")
    stale = sorted(set(documented) - set(code_keys()))
    problems += [f"{key}: on the page, read by no code" for key in stale]
    assert not problems, "docs/config-keys.md disagrees with the code:\n" + "\n".join(problems)


def test_every_growth_function_argument_is_on_the_keys_page_with_its_default() -> None:
    rows = {
        (default_cell(row[0]), default_cell(row[1])): default_cell(row[2])
        for row in table_rows(KEYS_PAGE.read_text(encoding="utf-8"), ["`_component_`", "argument", "default"])
    }
    problems = [
        f"{function} {argument}: "
        + (
            "no row"
            if (function, argument) not in rows
            else f"the page says {rows[(function, argument)]!r}, the code {default!r}"
        )
        for (function, argument), default in growth_arguments().items()
        if rows.get((function, argument)) != default
    ]
    problems += [
        f"{function} {argument}: on the page, not an argument"
        for function, argument in sorted(set(rows) - set(growth_arguments()))
    ]
    assert not problems, "docs/config-keys.md disagrees with the growth functions:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------------------
# 2. Commands

SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")"}
PREFIXES = {"time", "nice", "exec"}
TORCHRUN_FLAGS = {"--standalone"}
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")
COMMAND = re.compile(r"(?:^|[\s;&|(])(?:\S*/)?(?:tune\s+run|adaptive-batching)(?:\s|$)")


def logical_lines(block: str) -> list[str]:
    return block.replace("\\\n", " ").splitlines()


def tokens(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:  # an unbalanced quote in a line that is not a command (a log line)
        return line.split("#", 1)[0].split()


def commands(line: str) -> Iterator[list[str]]:
    """The commands of one shell line, each from its program on."""
    if not COMMAND.search(line):
        return
    line = re.sub(r"^\s*\$\s+", "", line)  # a prompt
    line = re.sub(r"\s\[-[^\]]*\]", "", line)  # usage notation: [--opt VALUE]
    current: list[str] = []
    for token in [*tokens(line), ";"]:
        if token in SEPARATORS:
            while current and (re.match(r"[A-Za-z_][A-Za-z0-9_]*=", current[0]) or current[0] in PREFIXES):
                current.pop(0)
            if current:
                program = current[0].rsplit("/", 1)[-1]
                if program == "adaptive-batching" or (program == "tune" and current[1:2] == ["run"]):
                    yield [program, *current[1:]]
            current = []
        else:
            current.append(token)


@lru_cache(maxsize=1)
def torchtune_recipes() -> dict[str, set[str]]:
    from torchtune._recipe_registry import get_all_recipes

    return {recipe.name: {config.name for config in recipe.configs} for recipe in get_all_recipes()}


def config_problem(name: str, created: set[str]) -> str | None:
    stem = name.removesuffix(".yaml")
    if ("/" not in stem and stem in shipped_config_names()) or name in stock_configs() or name in created:
        return None
    if (ROOT / name).is_file() or re.fullmatch(r"my_\w*\.yaml", Path(name).name) or PLACEHOLDER.fullmatch(name):
        return None
    return (
        f"config {name!r} is neither ours, torchtune's, a file of this repository or made in the same block, "
        "a user's my_*.yaml nor a placeholder"
    )


def config_path(name: str) -> Path | None:
    stem = name.removesuffix(".yaml")
    if "/" not in stem and stem in shipped_config_names():
        return shipped_configs_dir() / f"{stem}.yaml"
    return stock_configs().get(name)


def tune_run_problem(argv: list[str], created: set[str], mention: bool = False) -> str | None:
    args = argv[2:]
    while args and args[0].startswith("-"):
        option = args.pop(0)
        if "=" not in option and option not in TORCHRUN_FLAGS:
            args = args[1:]
    if not args:
        return None if mention else "no recipe"
    recipe, rest = args[0], args[1:]
    if recipe not in RECIPES and recipe not in torchtune_recipes():
        return f"recipe {recipe!r} is neither ours ({', '.join(RECIPES)}) nor torchtune's"
    config = next((rest[i + 1] for i, arg in enumerate(rest[:-1]) if arg == "--config"), None)
    config = config or next((arg.split("=", 1)[1] for arg in rest if arg.startswith("--config=")), None)
    if config is None:
        return "no --config"
    problem = config_problem(config, created)
    if problem:
        return problem
    path = config_path(config)
    if recipe in RECIPES and path is not None and recipe_for(path) != recipe:
        return f"config {config!r} is run by {recipe_for(path)}, not {recipe}"
    if recipe not in RECIPES and config not in torchtune_recipes()[recipe] and config_path(config) is not None:
        return f"torchtune's {recipe} has no config {config!r}"
    return None


def subcommands() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def ours_problem(argv: list[str], created: set[str], mention: bool) -> str | None:
    if len(argv) < 2:
        return None if mention else "no subcommand"
    if argv[1] not in subcommands():
        return f"no subcommand {argv[1]!r} (there are {', '.join(sorted(subcommands()))})"
    if mention:
        return None
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = build_parser().parse_args(argv[1:])
    except SystemExit:
        return "the parser refuses it: " + stderr.getvalue().strip().splitlines()[-1]
    if args.command == "cp":
        if args.name not in RECIPES:
            problem = config_problem(args.name, set())
            if problem:
                return problem
        destination = args.destination
        if destination.endswith("/"):
            destination += f"{args.name}.yaml"
        created.add(destination if Path(destination).suffix else f"{destination}.yaml")
    elif getattr(args, "config", None) is not None:
        return config_problem(args.config, created)
    return None


def doc_commands() -> Iterator[tuple[str, str, str | None]]:
    """(page, command, problem) of every command on every page."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT).as_posix()
        for block in fenced_blocks(text):
            created: set[str] = set()
            for line in logical_lines(block):
                for argv in commands(line):
                    problem = (
                        tune_run_problem(argv, created)
                        if argv[0] == "tune"
                        else ours_problem(argv, created, mention=False)
                    )
                    yield name, shlex.join(argv), problem
        for span in inline_spans(text):
            for argv in commands(span):
                mention = len(argv) <= 2
                if argv[0] == "tune":
                    problem = tune_run_problem(argv, set(), mention=True)
                else:
                    problem = ours_problem(argv, set(), mention)
                yield name, shlex.join(argv), problem


def test_every_command_in_the_docs_names_a_real_recipe_subcommand_and_config() -> None:
    found = list(doc_commands())
    problems = [f"{page}: {command}\n    {problem}" for page, command, problem in found if problem]
    assert not problems, "commands in the docs that would not run:\n" + "\n".join(problems)
    pages = {page for page, _, _ in found}
    assert "README.md" in pages and len(found) > 20, f"too few commands found ({len(found)}): is the parser broken?"


def test_the_command_parser_catches_wrong_commands() -> None:
    """The rules above, on commands that must fail and pass."""

    def problem(line: str) -> str | None:
        argv = next(commands(line))
        return tune_run_problem(argv, set()) if argv[0] == "tune" else ours_problem(argv, set(), mention=False)

    assert problem("tune run adaptive_full_finetune --config tiny_full") is None
    assert problem("cd /tmp && tune run --nproc_per_node 2 adaptive_lora_finetune --config llama3_1/8B_lora") is None
    assert problem("tune run full_finetune_single_device --config llama3_2/1B_full_single_device") is None
    assert problem("adaptive-batching estimate --config llama3_1/8B_full --device-memory 80GiB") is None
    assert "recipe" in problem("tune run adaptive_finetune --config tiny_full")
    assert "config" in problem("tune run adaptive_full_finetune --config tiny_fulll")
    assert "run by adaptive_lora_finetune" in problem("tune run adaptive_full_finetune --config tiny_lora")
    assert "subcommand" in problem("adaptive-batching profiler --config tiny_full")
    assert "parser" in problem("adaptive-batching estimate --config tiny_full")  # --device-memory is required
    assert "parser" in problem("adaptive-batching tiny-assets --model llama9")


# ---------------------------------------------------------------------------------------------------------
# 3. Links


def heading_ids(text: str) -> set[str]:
    """GitHub's ids of a page's headings (lower case, punctuation dropped, spaces to hyphens, -1 for repeats)."""
    ids: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", prose(text), flags=re.M):
        base = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        slug, n = base, 0
        while slug in ids:
            n += 1
            slug = f"{base}-{n}"
        ids.add(slug)
    return ids


def test_every_relative_link_points_to_a_file_and_heading_that_exist() -> None:
    problems = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        without_code = re.sub(r"`[^`\n]+`", "", prose(text))
        for target in re.findall(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)", without_code):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            file = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not file.exists():
                problems.append(f"{where}: no file {file}")
            elif anchor and file.suffix == ".md" and anchor not in heading_ids(file.read_text(encoding="utf-8")):
                problems.append(f"{where}: no heading #{anchor} in {file.name}")
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_readme_starts_with_the_two_commands_and_stays_short() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = fenced_blocks(text)[0]
    assert text.index("```") < text.index("\n## "), "the two commands come before the first section"
    assert re.search(r"^make demo\b", first, flags=re.M) and re.search(r"^make test\b", first, flags=re.M)
    assert len(text.splitlines()) <= 250


@pytest.mark.parametrize("target", ["demo", "test"])
def test_the_two_readme_commands_are_makefile_targets(target: str) -> None:
    assert re.search(rf"^{target}:", (ROOT / "Makefile").read_text(encoding="utf-8"), flags=re.M)


def test_the_readme_links_every_docs_page() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {Path(target.partition("#")[0]).name for target in re.findall(r"\]\((docs/[^)\s]+)\)", text)}
    assert {page.name for page in DOCS.glob("*.md")} <= linked


# ---------------------------------------------------------------------------------------------------------
# 4. Every command is run by a test
#
# Every command a page shows (a line of a ``bash`` block, a ``$ `` line of a plain block, a whole script, and
# inline spans that run ``tune run``, ``adaptive-batching``, ``python x.py``, ``make`` or ``pip install``) is a
# key of RUN_BY: the test that runs it (``tests/<file>.py::<function>``, a test or the fixture that makes the run)
# and how: as written, at its smallest size (what is smaller), or why it cannot run here and what runs instead.

TINY = "the tiny assets in a temporary folder"
NO_NETWORK = "not run: it installs from a package index, and the suite runs inside that install"
GPUS = "not run: 8 GPUs and the real weights; here the same recipe and config checks on the tiny model"
PUBLISH = "at its smallest size, without --publish (writing between a page's markers is test_doc_tables')"
RUN_BY: dict[str, tuple[str, str]] = {
    # README.md
    "make demo": (
        "tests/test_first_hour.py::demo",
        "its last step, the demo run; the install before it: "
        "test_the_two_readme_commands_are_makefile_targets checks the target",
    ),
    "make test": (
        "tests/test_docs.py::test_the_two_readme_commands_are_makefile_targets",
        "the suite itself; the target is checked to exist",
    ),
    "make test TORCH_INDEX=https://download.pytorch.org/whl/cpu": (
        "tests/test_docs.py::test_the_two_readme_commands_are_makefile_targets",
        NO_NETWORK,
    ),
    "git clone <this repository's URL> adaptive-batching && cd adaptive-batching": (
        "tests/test_docs.py::test_the_readme_starts_with_the_two_commands_and_stays_short",
        "not run: the suite runs in the clone",
    ),
    "pip install torch==2.14.0 --index-url https://download.pytorch.org/whl/cpu": (
        "tests/test_docs.py::test_every_pip_extra_a_page_installs_exists",
        NO_NETWORK,
    ),
    "pip install torch==2.14.0": ("tests/test_docs.py::test_every_pip_extra_a_page_installs_exists", NO_NETWORK),
    "pip install .": ("tests/test_docs.py::test_every_pip_extra_a_page_installs_exists", NO_NETWORK),
    "pip install wandb": ("tests/test_docs.py::test_every_pip_extra_a_page_installs_exists", NO_NETWORK),
    'pip install "adaptive-batching[bnb]"': (
        "tests/test_docs.py::test_every_pip_extra_a_page_installs_exists",
        NO_NETWORK + "; the extra is checked to exist",
    ),
    'pip install ".[bench]"': (
        "tests/test_docs.py::test_every_pip_extra_a_page_installs_exists",
        NO_NETWORK + "; the extra is checked to exist",
    ),
    "tune run adaptive_full_finetune --config llama3_1/8B_full use_maximum_batch_size=True "
    "adaptive_batching.keep_global_batch=True": (
        "tests/test_families.py::test_full_with_the_stock_config_and_lora_profile_learn_a_fixed_batch_and_resume",
        "smallest size: torchtune's stock full configs pointed at tiny weights, with "
        "use_maximum_batch_size and keep_global_batch",
    ),
    "adaptive-batching tiny-assets": ("tests/test_cli.py::test_tiny_assets", f"into {TINY}, 50 samples"),
    # docs/vision.md
    "tune run adaptive_lora_finetune --config llama3_2_vision/11B_lora_single_device use_maximum_batch_size=True": (
        "tests/test_vision.py::test_a_stock_vision_config_by_name_trains_with_one_added_line",
        "11B_full_single_device by name with that line, pointed at the tiny vision model and assets by overrides (not "
        "run: the 11B weights; 32-token texts, one step); test_the_profile_command_takes_a_stock_vision_config_by_name "
        "profiles 11B_qlora_single_device so",
    ),
    'pip install "adaptive-batching[vision]"': (
        "tests/test_docs.py::test_every_pip_extra_a_page_installs_exists",
        NO_NETWORK,
    ),
    "cd /tmp && tune run adaptive_full_finetune --config tiny_vision_full": (
        "tests/test_vision.py::grown",
        "at its smallest size: 48-token texts, one step an epoch, a 24 MiB budget, in a temporary folder",
    ),
    "cd /tmp && tune run adaptive_lora_finetune --config tiny_vision_qlora": (
        "tests/test_vision.py::test_the_shipped_lora_and_qlora_vision_configs_profile_and_train",
        "at its smallest size: 32-token texts, one step, a 16 MiB budget",
    ),
    "adaptive-batching profile --config tiny_vision_full": (
        "tests/test_vision.py::grown",
        "the profile of that run (the recipe profiles before training), at its smallest size",
    ),
    "cd /tmp && tune run adaptive_full_finetune --config tiny_full": (
        "tests/test_first_hour.py::demo",
        f"with {TINY} and a 96 MiB budget",
    ),
    "tune run adaptive_full_finetune --config tiny_full": (
        "tests/test_first_hour.py::demo",
        f"with {TINY} and a 96 MiB budget",
    ),
    "tune run adaptive_full_finetune --config tiny_full metric_logger._component_=torchtune.training."
    "metric_logging.WandBLogger metric_logger.project=my-project": (
        "tests/test_first_hour.py::test_the_wandb_logger_without_wandb_is_one_line",
        "as written (wandb is not installed here: the one line that says so)",
    ),
    "adaptive-batching profile --config tiny_full": (
        "tests/test_first_hour.py::demo",
        f"with {TINY} and a 96 MiB budget",
    ),
    "adaptive-batching plan --config tiny_full": (
        "tests/test_cli.py::test_plan_profiles_and_logs_the_plan_without_training",
        f"with {TINY}",
    ),
    "adaptive-batching estimate --config llama3_1/8B_full --device-memory 80GiB --world-size 8 --seq-len 4096": (
        "tests/test_first_hour.py::test_estimate_on_a_bf16_config_prints_no_warning",
        "smallest size: the tiny bf16 model at 2 ranks and 64 tokens (the 8B model at 2048 tokens: "
        "test_stock_configs' test_estimate_gives_each_shipped_real_model_config_a_micro_batch_on_80_gib)",
    ),
    "tune run --nproc_per_node 8 adaptive_full_finetune --config llama3_8b": (
        "tests/test_stock_configs.py::test_estimate_gives_each_shipped_real_model_config_a_micro_batch_on_80_gib",
        GPUS + " (its estimate on 80 GiB; 2 ranks: test_recipes' test_two_processes_match_one_process_with_"
        "accumulation)",
    ),
    "tune run --nproc_per_node 8 --max-restarts 3 adaptive_lora_finetune --config llama3_8b_lora "
    "save_every_n_steps=200": (
        "tests/test_chaos.py::test_a_fault_then_resume_trains_every_step_once_with_the_uninterrupted_losses",
        GPUS + " (2 gloo ranks with --max-restarts and a save every few steps)",
    ),
    # docs/qat.md
    "tune run adaptive_lora_finetune --config tiny_qat_lora": (
        "tests/test_qat.py::chain",
        f"with {TINY}, 40 samples, a 256 MiB budget, through "
        "benchmarks/faulty_run.py (growth, an injected OOM, SIGTERM and a resume)",
    ),
    "tune run adaptive_lora_finetune --config llama3_2/1B_qat_lora use_maximum_batch_size=True": (
        "tests/test_qat.py::test_the_stock_qat_configs_validate_by_name_for_our_recipe_with_their_quantizer",
        "validated by name; the 1B weights are not on the test machine (a tune cp copy on the tiny model is "
        "profiled: test_a_tune_cp_copy_of_the_stock_1b_qat_lora_config_profiles_fake_quantized_steps)",
    ),
    "tune cp quantization my_quantization.yaml": (
        "tests/test_qat.py::test_tune_run_quantize_converts_the_qat_checkpoint_to_int8_weights_with_the_same_quantizer",
        "as written, in the QAT run's folder, then pointed at its checkpoint",
    ),
    "tune run quantize --config my_quantization.yaml": (
        "tests/test_qat.py::test_tune_run_quantize_converts_the_qat_checkpoint_to_int8_weights_with_the_same_quantizer",
        f"on the full QAT run's checkpoint of {TINY}",
    ),
    **{
        f"adaptive-batching profile --config my_qat.yaml {extra}adaptive_batching.memory_budget=8MiB "
        "tokenizer.max_seq_len=64": (
            "tests/test_qat.py::stock_copy",
            "as written, on a tune cp copy of "
            f"llama3_2/1B_qat_lora pointed at {TINY}; test_the_qat_pages_figures_are_what_its_"
            "commands_print checks the page's table against them",
        )
        for extra in (
            "quantizer.groupsize=32 ",
            "quantizer=null ",
            "quantizer.groupsize=32 fake_quant_after_n_steps=100 ",
        )
    },
    # docs/dpo.md
    **{
        f"adaptive-batching profile --config {config} adaptive_batching.memory_budget=32MiB tokenizer.max_seq_len=64": (
            "tests/test_dpo.py::dpo_figures",
            f"as written, with {TINY}; test_the_dpo_pages_profile_figures_are_what_its_"
            "commands_print checks the page's figures against it",
        )
        for config in ("tiny_lora_dpo", "tiny_full_dpo")
    },
    "tune run adaptive_lora_dpo --config tiny_lora_dpo": (
        "tests/test_dpo.py::test_a_profiled_dpo_run_trains_at_the_largest_micro_batch_of_pairs_that_fits",
        f"with {TINY}, one step, profiled as the page's figure (32 MiB, 64 tokens: its cached profile)",
    ),
    "tune run adaptive_lora_dpo --config llama3_1/8B_lora_dpo_single_device use_maximum_batch_size=True": (
        "tests/test_dpo.py::test_the_stock_lora_dpo_configs_validate_by_name_for_adaptive_lora_dpo",
        "validated by name, with the override; the 8B weights are not on the test machine",
    ),
    "tune run adaptive_full_dpo --config tiny_full_dpo": (
        "tests/test_full_dpo.py::parity_runs",
        f"with {TINY}, 4 steps, shuffle off, through tests/full_dpo_parity_run.py (killed at step 2 and resumed)",
    ),
    "tune run --nproc_per_node 2 adaptive_full_dpo --config tiny_full_dpo use_maximum_batch_size=True": (
        "tests/test_full_dpo.py::test_two_ranks_profile_with_the_reference_sharded_and_train",
        f"with {TINY}, a 128 MiB budget, 2 steps",
    ),
    # docs/distillation.md
    "adaptive-batching profile --config my_kd.yaml adaptive_batching.memory_budget=16MiB tokenizer.max_seq_len=64": (
        "tests/test_kd.py::kd_figure",
        f"as written, on a tune cp copy of qwen2/1.5_to_0.5B_KD_lora_single_device pointed "
        f"at {TINY}; test_the_pages_profile_figures_are_what_its_command_prints checks "
        "the page's figures against it",
    ),
    "tune run adaptive_knowledge_distillation --config tiny_kd": (
        "tests/test_kd.py::parity",
        f"with {TINY}, 4 steps, shuffle off, through tests/kd_parity_run.py (stopped by SIGTERM at step 2 and resumed)",
    ),
    "tune run adaptive_knowledge_distillation --config qwen2/1.5_to_0.5B_KD_lora_single_device "
    "use_maximum_batch_size=True": (
        "tests/test_kd.py::test_the_stock_kd_configs_validate_by_name_for_adaptive_knowledge_distillation",
        "validated by name, with the override; the Qwen2 weights are not on the test machine",
    ),
    "adaptive-batching cp qwen2/1.5_to_0.5B_KD_lora_distributed my_kd.yaml": (
        "tests/test_kd.py::test_tune_cp_copies_a_stock_kd_config_and_ours_names_the_recipe",
        "as written",
    ),
    "tune run --nproc_per_node 2 adaptive_knowledge_distillation --config my_kd.yaml use_maximum_batch_size=True": (
        "tests/test_kd.py::test_two_ranks_profile_a_stock_kd_copy_with_the_teacher_sharded_and_exit_cleanly",
        f"a tune cp copy of llama3_2/8B_to_1B_KD_lora_distributed pointed at {TINY}, a 96 MiB budget, 2 steps",
    ),
    "tune run --nproc_per_node 8 adaptive_full_dpo --config llama3_1/8B_full_dpo use_maximum_batch_size=True": (
        "tests/test_full_dpo.py::test_the_stock_full_dpo_config_validates_by_name_for_adaptive_full_dpo",
        GPUS + " (2 ranks: test_two_ranks_profile_with_the_reference_sharded_and_train)",
    ),
    "tune run adaptive_lora_finetune --config tiny_lora": (
        "tests/test_first_hour.py::test_the_lora_and_qlora_starts_print_no_warning",
        f"smallest size: {TINY}, one step",
    ),
    "tune run --nproc_per_node 2 adaptive_full_finetune --config tiny_full": (
        "tests/test_recipes.py::test_two_processes_match_one_process_with_accumulation",
        f"with {TINY}, fixed batch",
    ),
    "adaptive-batching ls": ("tests/test_cli.py::test_ls_lists_recipes_and_their_configs", "as written"),
    "adaptive-batching cp tiny_full my_run.yaml": (
        "tests/test_cli.py::test_cp_refuses_to_overwrite_without_force",
        "as written, to out.yaml",
    ),
    "tune run adaptive_full_finetune --config my_run.yaml": (
        "tests/test_config_resolution.py::test_recipe_fails_at_validation",
        "a copied config, my_run.yaml, run from its folder (with a misspelt key, refused)",
    ),
    "adaptive-batching tiny-assets --model gemma2": (
        "tests/test_families.py::family_assets",
        "write_family_assets, which the option calls, for each family",
    ),
    # docs/benchmarks.md
    "adaptive-batching tiny-assets --output-dir /tmp/gb/assets": (
        "tests/test_cli.py::test_tiny_assets",
        f"into {TINY}",
    ),
    "python benchmarks/estimate_stock_configs.py --only llama3_2/1B_full llama3/8B_full --seq-len 8192 --full-trace "
    "--publish": (
        "tests/test_benchmarks.py::test_estimate_stock_configs_full_trace",
        PUBLISH + "; a 4-layer tiny config file in place of the two stock configs",
    ),
    "python benchmarks/estimate_stock_configs.py --seq-len 2048": (
        "tests/test_benchmarks.py::test_estimate_stock_configs_full_trace",
        "smallest size: --only a 4-layer tiny config file (its fast row beside the full trace's); the stock configs' "
        "estimates: test_stock_configs and test_estimate_vision",
    ),
    "python benchmarks/growth_runs.py --assets /tmp/gb/assets --work /tmp/gb/full": (
        "tests/test_benchmarks.py::test_growth_runs",
        "smallest size: 16 samples, one strategy",
    ),
    "python benchmarks/growth_runs.py --from-json benchmarks/results/growth_runs.json --publish": (
        "tests/test_benchmarks.py::test_growth_runs",
        "the analysis the runs end with (test_growth_runs.py: its parts)",
    ),
    "python benchmarks/growth_runs.py --from-json benchmarks/results/growth_runs.json --publish --out /tmp/gr": (
        "tests/test_benchmarks.py::test_growth_runs",
        "the analysis the runs end with (test_growth_runs.py: its parts)",
    ),
    "python benchmarks/noise_scale_accuracy.py --publish": (
        "tests/test_benchmarks.py::test_noise_scale_accuracy",
        "smallest size: 1 seed",
    ),
    "python benchmarks/profiler_vs_peers.py --json benchmarks/results/profiler_vs_peers.json --publish": (
        "tests/test_benchmarks.py::test_profiler_vs_peers",
        "smallest size: ours alone (the peers' searches take minutes)",
    ),
    **{
        f"python benchmarks/profiler_whole_process_limit.py --limit-gib 3.5 --start 128 --repeats 3 {extra} "
        "--publish": (
            "tests/test_benchmark_limit.py::test_profiler_whole_process_limit",
            "smallest size: 1 repeat, the python launcher",
        )
        for extra in ("--tolerance 0.01", "--optimizer-in-bwd")
    },
    "python benchmarks/profiler_whole_process_limit.py --objective dpo --limit-gib 3.5 --start 64 --repeats 3 "
    "--publish": (
        "tests/test_benchmark_limit.py::test_profiler_whole_process_limit",
        "not run at --objective dpo (25 s of fresh processes the suite has no room for): the same script runs for "
        "finetune, and DPO's profile is test_dpo's",
    ),
    "python benchmarks/profiler_whole_process_limit.py --objective kd --limit-gib 3.5 --start 64 --repeats 3 "
    "--publish": (
        "tests/test_benchmark_limit.py::test_profiler_whole_process_limit",
        "not run at --objective kd (23 s of fresh processes the suite has no room for since the vision tests): the "
        "same script runs for finetune, and KD's profile with its teacher resident is test_kd's",
    ),
    "python benchmarks/recipe_vs_torchtune.py --objective kd --repeats 20 --steps 40 --no-switch --publish": (
        "tests/test_benchmarks.py::test_recipe_vs_torchtune_kd",
        "smallest size: 2 steps, 1 repeat",
    ),
    "python benchmarks/recipe_vs_torchtune.py --repeats 12 --steps 100 --publish": (
        "tests/test_benchmarks.py::test_recipe_vs_torchtune",
        "smallest size: 2 steps, 1 repeat",
    ),
    "python benchmarks/recipe_vs_torchtune.py --compile --warmup 20 --repeats 10 --steps 150 --no-switch --together "
    "--publish": ("tests/test_benchmarks.py::test_recipe_vs_torchtune_together", "smallest size: 2 steps, 1 repeat"),
    "python benchmarks/recipe_vs_torchtune.py --objective dpo --repeats 20 --steps 25 --no-switch --publish": (
        "tests/test_benchmarks.py::test_recipe_vs_torchtune_dpo",
        "smallest size: 2 steps, 1 repeat",
    ),
    "python benchmarks/recipe_vs_torchtune.py --objective dpo --repeats 6 --steps 25 --no-switch --together "
    "--publish": (
        "tests/test_benchmarks.py::test_recipe_vs_torchtune_dpo",
        "smallest size: 2 steps, 1 repeat, one run after the other (--together: test_recipe_vs_torchtune_together)",
    ),
    **{
        f"python benchmarks/recipe_vs_torchtune.py --objective {objective} --steps 8 --warmup 2 --repeats 1 "
        "--no-switch": (
            "tests/test_vision_parity.py::parity",
            "smallest size, at vision_lora: 2 steps of 2 x 2 samples of 32 tokens, 1 repeat (vision_full's overrides: "
            "test_full_fine_tuning_changes_only_the_optimizer_that_needs_cuda)",
        )
        for objective in ("vision_full", "vision_lora")
    },
    "python benchmarks/step_overhead.py --settings none,stop,default --repeats 5 --steps 60 --publish": (
        "tests/test_benchmarks.py::test_step_overhead",
        "smallest size: 1 timed step, settings none and stop",
    ),
    "git clone <this repository's URL> /tmp/clone && cd /tmp/clone && time make demo": (
        "tests/test_first_hour.py::demo",
        "its last step, the demo run; not in a fresh clone (the suite runs in one)",
    ),
    "git clone <this repository's URL> /tmp/clone && cd /tmp/clone && time CI=true bash .ci/run": (
        "tests/test_docs.py::test_the_two_readme_commands_are_makefile_targets",
        "the suite itself; not in a fresh clone (the suite runs in one)",
    ),
    # docs/contributing.md
    "make clean": ("tests/test_docs.py::test_every_make_target_a_page_runs_exists", "the target exists"),
    "make test-fast": (
        "tests/test_docs.py::test_every_make_target_a_page_runs_exists",
        "the suite without its e2e tests; the target exists",
    ),
    "make install": ("tests/test_docs.py::test_every_make_target_a_page_runs_exists", NO_NETWORK),
    "make lint": (
        "tests/test_docs.py::test_every_make_target_a_page_runs_exists",
        "not run: CI runs it before the suite (.ci/run); the target exists",
    ),
    **{
        f"python tests/behaviour_record.py {args}": (
            "tests/test_docs.py::test_every_make_target_a_page_runs_exists",
            "not run: it records every user-visible command (minutes); a tool for a change's author",
        )
        for args in ("record /tmp/before", "record /tmp/after", "compare /tmp/before /tmp/after")
    },
    # docs/elastic.md
    "tune run --nproc_per_node N adaptive_full_finetune --config CFG resume_from_checkpoint=True": (
        "tests/test_token_and_elastic_recipe.py::test_elastic_run_resumed_on_another_world_size_keeps_the_global_batch",
        f"with {TINY}: saved at 2 ranks, resumed at 1",
    ),
    # docs/estimates.md
    "python benchmarks/estimate_fidelity.py": (
        "tests/test_estimate_fidelity.py::test_every_row_names_each_key_once_and_a_real_source",
        "not run: it traces 15 published GPU set-ups (minutes each); its rows and the page section it writes are "
        "tested",
    ),
    # docs/fault-tolerance.md
    "python benchmarks/chaos.py --runs 20 --publish": (
        "tests/test_chaos.py::reference",
        "smallest size: each fault kind once, in three two-rank runs",
    ),
    "python benchmarks/chaos.py --runs 20 --publish --json /tmp/chaos20.json": (
        "tests/test_chaos.py::reference",
        "smallest size: each fault kind once, in three two-rank runs",
    ),
    **{
        f"python benchmarks/chaos.py --objective {objectives} --runs 20 --publish": (
            "tests/test_chaos.py::test_each_objective_resumes_a_kill_with_the_uninterrupted_losses",
            "smallest size: full DPO once, an OOM then a kill, two ranks; the other objectives are the same script's, "
            "their faults test_dpo_faults', test_kd's and test_qat's",
        )
        for objectives in ("lora_dpo,full_dpo,kd,qat", "kd,qat", "full_dpo", "qat")
    },
    "python benchmarks/clean_exits.py --runs 100 --publish": (
        "tests/test_benchmarks.py::test_clean_exits",
        "smallest size: 1 run, one setting",
    ),
    "python benchmarks/clean_exits.py --mechanism": (
        "tests/test_benchmarks.py::test_clean_exits",
        "the same script; the mechanism is its own short run",
    ),
    "tune run --nnodes 2 --node_rank 0 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 "
    "adaptive_full_finetune --config llama3_8b": (
        "tests/test_two_nodes.py::nodes",
        "two nodes of one gloo rank each on this machine, tiny model",
    ),
    "srun --nodes 2 --ntasks-per-node 1 tune run --nnodes 2 --nproc_per_node 8 --rdzv_id $SLURM_JOB_ID "
    "--rdzv_backend c10d --rdzv_endpoint $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1):29500 "
    "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 adaptive_full_finetune --config llama3_8b": (
        "tests/test_two_nodes.py::nodes",
        "no SLURM here: the same tune run of two nodes, tiny model",
    ),
    "tune run --nproc_per_node N --max-restarts R adaptive_full_finetune --config CFG": (
        "tests/test_chaos.py::test_a_fault_then_resume_trains_every_step_once_with_the_uninterrupted_losses",
        f"2 ranks, {TINY}",
    ),
    # docs/memory-savers.md
    "tune run adaptive_full_finetune --config llama3_2/1B_full_single_device": (
        "tests/test_memory_savers_recipe.py::test_a_stock_memory_saver_config_profiles_learns_and_resumes_exactly",
        "smallest size: the stock config pointed at tiny weights",
    ),
    # docs/models.md
    "adaptive-batching cp NAME file.yaml": (
        "tests/test_stock_configs.py::test_cp_copies_a_stock_config_and_names_the_recipe_that_runs_it",
        "a stock name",
    ),
    "adaptive-batching tiny-assets [--output-dir /tmp/adaptive-batching/tiny] [--seed 0] [--num-samples 3000] "
    "[--model NAME]": ("tests/test_cli.py::test_tiny_assets", f"into {TINY}, 50 samples"),
    "tune download meta-llama/Llama-3.2-1B-Instruct --output-dir /tmp/Llama-3.2-1B-Instruct --ignore-patterns "
    '"original/consolidated.00.pth" --hf-token <HF_TOKEN>': (
        "tests/test_model_assets.py::test_the_overrides_point_the_shipped_configs_at_the_assets",
        "not run: the model hub and a token; the random 1B checkpoint stands in for it",
    ),
    "tune run --nproc_per_node 8 adaptive_lora_finetune --config llama3_2_1b_lora": (
        "tests/test_validate_device.py::validation",
        GPUS + " (the validation script's LoRA phase, on CPU)",
    ),
    # docs/preemption.md
    "SCRIPT #SBATCH --job-name=finetune --nodes=1 --gpus-per-node=8 --time=04:00:00": (
        "tests/test_preemption.py::test_the_documented_slurm_script_requeues_a_job_stopped_while_profiling_and_one_stopped_mid_run",
        "the page's script, with SLURM's requeue played by the test",
    ),
    "adaptive-batching status /checkpoints/run": (
        "tests/test_preemption.py::test_the_documented_slurm_script_requeues_a_job_stopped_while_profiling_and_one_stopped_mid_run",
        "run by the script, on its output folder",
    ),
    # docs/profiler.md
    "adaptive-batching estimate --config llama3_1/8B_qlora_single_device --device-memory 24GiB --seq-len 2048": (
        "tests/test_stock_configs.py::test_estimate_fits_qlora_8b_on_24_gib_with_nf4_weights_at_their_real_bytes",
        "the estimate the command makes, in the test's process",
    ),
    "adaptive-batching estimate --config tiny_full --device-memory 512MiB --fraction 1": (
        "tests/test_profile_recipe.py::test_profile_and_estimate_commands",
        f"as written, with {TINY}",
    ),
    "adaptive-batching profile --config tiny_full --json profile.json": (
        "tests/test_profile_recipe.py::test_profile_and_estimate_commands",
        f"as written, with {TINY}",
    ),
    # docs/validation.md
    'SKIP="" benchmarks/gpu_wheels.sh': (
        "tests/test_docs.py::test_every_pip_extra_a_page_installs_exists",
        "not run: it downloads wheels for a GPU machine",
    ),
    "benchmarks/gpu_wheels.sh .whl 3.12": (
        "tests/test_docs.py::test_every_pip_extra_a_page_installs_exists",
        "not run: it downloads wheels for a GPU machine",
    ),
    "python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site": (
        "tests/test_docs.py::test_every_pip_extra_a_page_installs_exists",
        "not run: a GPU machine's set-up",
    ),
    "DEADLINE=515 OUT=/tmp/out benchmarks/gpu_check.sh --steps 10 --max-trials 2 --tolerance 0.05 --long-samples 1024 "
    "--token-samples 600": (
        "tests/test_validate_device.py::test_gpu_check_skips_each_phase_it_has_no_time_for",
        "its order and deadline; the phases it calls run in tests/test_validate_device.py::validation",
    ),
    **{
        f"PART={part} DEADLINE={deadline} OUT=$OUT bash benchmarks/gpu_check.sh --steps 10 --max-trials 2 "
        "--tolerance 0.05 --long-samples 1024": (
            "tests/test_validate_device.py::test_gpu_check_skips_each_phase_it_has_no_time_for",
            "its parts, lanes and deadline; their phases run in tests/test_validate_device.py::validation",
        )
        for part, deadline in ((1, 450), (2, 230))
    },
    "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True": (
        "tests/test_validate_device.py::validation",
        "a setting for the GPU runs, not a run",
    ),
    "adaptive-batching tiny-assets --model llama3_2_1b": (
        "tests/test_model_assets.py::test_a_shrunk_copy_loads_through_the_checkpointer_and_the_builder",
        "write_model_assets, which the option calls, at a shrunk size",
    ),
    **{
        command: (
            "tests/test_validate_device.py::validation",
            "smallest size on CPU: 3 steps, 2 trials, a few settings, 120 token samples",
        )
        for command in (
            "python benchmarks/validate_device.py",
            "time .venv/bin/python benchmarks/validate_device.py",
            "python benchmarks/validate_device.py --phase full",
            "python benchmarks/validate_device.py --workdir /tmp/regen",
            "python benchmarks/validate_device.py --workdir /tmp/regen --phase assets,estimate,oom",
            "python benchmarks/validate_device.py --phase assets",
            "python benchmarks/validate_device.py --phase lora",
            "python benchmarks/validate_device.py --phase qlora",
            "python benchmarks/validate_device.py --phase estimate,tokens,compile",
        )
    },
    "python benchmarks/validate_device.py --table": (
        "tests/test_validate_device.py::test_the_table_has_a_row_per_setting",
        "as written, on the fixture's JSON",
    ),
}

RUNS_A_PROGRAM = re.compile(r"(?:\S*/)?(?:python3? \S+\.py|tune run \S|adaptive-batching \S|make \S|pip install)")


def shown_commands() -> dict[str, set[str]]:
    """Command -> the pages that show it (see section 4's comment for what counts)."""
    found: dict[str, set[str]] = {}
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT).as_posix()
        for lang, body in re.findall(r"^```([^\n]*)\n(.*?)^```", text, flags=re.M | re.S):
            lang = lang.strip()
            if lang not in ("bash", "sh", "shell", "console", ""):
                continue
            if body.startswith("#!"):
                found.setdefault("SCRIPT " + body.splitlines()[1], set()).add(name)
                continue
            for line in logical_lines(body):
                if lang == "" and not line.startswith("$ "):
                    continue  # a plain block is output, except its prompt lines
                line = " ".join(re.sub(r"\s+#.*$", "", line.removeprefix("$ ")).split())
                if line and not line.startswith("#"):
                    found.setdefault(line, set()).add(name)
        for span in inline_spans(text):
            mention = any(
                tune_run_problem(argv, set()) == "no recipe"
                if argv[0] == "tune"
                else ours_problem(argv, set(), mention=False) is not None
                for argv in commands(span)
            )
            if RUNS_A_PROGRAM.match(span) and not mention:  # not a mention (``tune run``, ``adaptive-batching plan``)
                found.setdefault(span.strip(), set()).add(name)
    return found


def _function_exists(node: str) -> bool:
    path, _, name = node.partition("::")
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def test_every_command_a_page_shows_is_run_by_a_named_test() -> None:
    shown = shown_commands()
    problems = [
        f"{', '.join(sorted(pages))}: {command}\n    not in RUN_BY: name the test that runs it"
        for command, pages in sorted(shown.items())
        if command not in RUN_BY
    ]
    problems += [f"RUN_BY: {command}\n    no page shows it (stale)" for command in sorted(set(RUN_BY) - set(shown))]
    problems += [
        f"RUN_BY: {command}\n    no function {node}"
        for command, (node, _) in sorted(RUN_BY.items())
        if not _function_exists(node)
    ]
    assert not problems, "commands in the docs without a test that runs them:\n" + "\n".join(problems)
    assert len(shown) > 80, f"too few commands found ({len(shown)}): is the extraction broken?"


def test_every_pip_extra_a_page_installs_exists() -> None:
    """``pip install ".[bench]"`` and ``pip install "adaptive-batching[bnb]"`` name extras of pyproject.toml."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {
        extra
        for command in shown_commands()
        if command.startswith("pip install")
        for extra in re.findall(r"(?:\.|adaptive-batching)\[(\w+)\]", command)
    }
    assert named and named <= extras, f"extras the docs install that pyproject.toml lacks: {sorted(named - extras)}"


def test_every_make_target_a_page_runs_exists() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = {re.match(r"make (\S+)", command).group(1) for command in shown_commands() if command.startswith("make ")}
    missing = [t for t in sorted(targets) if "=" not in t and not re.search(rf"^{re.escape(t)}:", makefile, flags=re.M)]
    assert {"demo", "test"} <= targets and not missing, f"make targets the docs run that the Makefile lacks: {missing}"


# ---------------------------------------------------------------------------------------------------------
# 5. Every error a page quotes is produced by a test
#
# A quoted error is a line of a plain fenced block, or an inline span, that starts as the code's one-line errors
# do (``config error:``, ``profile error:``, ``out of memory:``, ``stopped:``) or as a Python exception
# (``ImportError: ...``). QUOTED_BY maps the start of each to the test that produces it, and what that test checks.

# Keys whose quoted line comes from an objective's config and the run's inputs (test_config_keys: RUN_QUOTED).
RUN_INPUTS = ("teacher_checkpointer", "teacher_checkpointer.checkpoint_files", "dataset")
QUOTED = re.compile(r"(?:config error|profile error|out of memory|stopped|[A-Z]\w*Error): ")
QUOTED_BY: dict[str, tuple[str, str]] = {
    "config error: config key '": (
        "tests/test_docs.py::test_the_quoted_config_key_errors_are_the_codes_own_lines",
        "the page's line, exactly, from the override in CONFIG_ERROR_OVERRIDES",
    ),
    **{
        f"config error: config key '{key}'": (
            "tests/test_config_keys.py::test_the_keys_page_quotes_the_codes_own_lines",
            "the page's line, exactly",
        )
        for key in (
            "save_every_n_step",
            "quantizer",
            "metric_logger._component_",
            "optimizer._component_",
            "checkpointer.model_type",
            *RUN_INPUTS,
        )
    },
    "config error: config key 'adaptive_batching.elastic': global batch 8 does not split evenly": (
        "tests/test_token_and_elastic_recipe.py::test_elastic_refuses_a_world_size_it_cannot_hold_before_loading_the_model",
        "a recipe run's last line",
    ),
    "config error: ...": (
        "tests/test_errors.py::test_a_recipe_reports_a_config_or_profile_error_in_one_line",
        "one line for a bad key",
    ),
    "profile error: micro batch 1 does not fit the memory budget": (
        "tests/test_errors.py::test_the_profile_command_reports_a_profile_error_in_one_line",
        "the command's last line",
    ),
    "out of memory: a micro batch of 1 sample does not fit": (
        "tests/test_oom_recovery.py::test_when_one_sample_does_not_fit_the_run_stops_with_a_checkpoint_that_resumes",
        "a recipe run's line, with the save and the advice",
    ),
    "stopped: SIGTERM received by the end of optimizer step": (
        "tests/test_preemption.py::test_a_signal_stops_after_the_step_it_came_in_and_saves_there",
        "the stop line",
    ),
    "ImportError: No module named adaptive_full_finetune": (
        "tests/test_docs.py::test_every_command_a_page_shows_is_run_by_a_named_test",
        "not produced: torchtune's message from an environment without this project; the recipes' module names are "
        "checked by test_every_command_in_the_docs_names_a_real_recipe_subcommand_and_config",
    ),
}


def quoted_errors() -> dict[str, set[str]]:
    """Quoted error line -> the pages that quote it."""
    found: dict[str, set[str]] = {}
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT).as_posix()
        lines = [
            line.strip()
            for lang, body in re.findall(r"^```([^\n]*)\n(.*?)^```", text, flags=re.M | re.S)
            if not lang.strip()
            for line in body.splitlines()
        ]
        for quoted in [*lines, *inline_spans(text)]:
            if QUOTED.match(quoted):
                found.setdefault(quoted, set()).add(name)
    return found


def test_every_error_a_page_quotes_is_produced_by_a_named_test() -> None:
    quoted = quoted_errors()
    problems = [
        f"{', '.join(sorted(pages))}: {line}\n    not in QUOTED_BY: name the test that produces it"
        for line, pages in sorted(quoted.items())
        if not any(line.startswith(start) for start in QUOTED_BY)
    ]
    problems += [
        f"QUOTED_BY: {start}\n    no page quotes it (stale)"
        for start in QUOTED_BY
        if not any(line.startswith(start) for line in quoted)
    ]
    problems += [
        f"QUOTED_BY: {start}\n    no function {node}"
        for start, (node, _) in QUOTED_BY.items()
        if not _function_exists(node)
    ]
    assert not problems, "errors the docs quote without a test that produces them:\n" + "\n".join(problems)
    assert len(quoted) >= 8, f"too few quoted errors found ({len(quoted)}): is the extraction broken?"


# The config key a quoted ``config error: config key 'K' ...`` line names -> the override that gives it on tiny_full.
# A key whose error a recipe run produces instead (RUN_ELSEWHERE: a world size the config cannot hold) has its own
# entry in QUOTED_BY.
CONFIG_ERROR_OVERRIDES: dict[str, str] = {
    "lr_scaling": "lr_scaling=cubic",
    "use_max_batch_size": "use_max_batch_size=True",
    "save_every_n_step": "save_every_n_step=5",
    "optimizer._component_": "optimizer._component_=torch.optim.AdamWW",
    "metric_logger._component_": "metric_logger._component_=torchtune.training.metric_logging.WandBLogger",
    "quantizer": "quantizer._component_=torchtune.training.quantization.Int8DynActInt4WeightQuantizer",
    "checkpointer.model_type": "checkpointer.model_type=LLAMA9",
}
RUN_ELSEWHERE = {"adaptive_batching.elastic", *RUN_INPUTS}


def test_the_quoted_config_key_errors_are_the_codes_own_lines() -> None:
    """Each quoted ``config error: config key 'K' ...`` line is what the config checks say for K's override."""
    from adaptive_batching.config.loading import load_config
    from adaptive_batching.config.settings import validate_config

    problems, checked = [], 0
    for line in quoted_errors():
        key = re.match(r"config error: config key '([^']+)'", line)
        if key is None or key.group(1) in RUN_ELSEWHERE:
            continue
        override = CONFIG_ERROR_OVERRIDES.get(key.group(1))
        if override is None:
            problems.append(f"{line}\n    no override for '{key.group(1)}' in CONFIG_ERROR_OVERRIDES")
            continue
        if key.group(1) == "metric_logger._component_" and importlib.util.find_spec("wandb") is not None:
            continue  # the line is for an install without wandb
        try:
            validate_config(load_config("tiny_full", [override]))
            said = "(no error)"
        except ConfigError as error:
            said = f"config error: {error}"
        checked += 1
        if said != line:
            problems.append(f"the page: {line}\n    the code: {said}")
    assert checked >= 2 and not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------------------
# 6. Every condition a page states about when something happens is checked by a test
#
# Conditions are prose, so they are listed by hand: (page, the statement as the page words it, whitespace
# aside) -> the test that checks it. A statement reworded on its page fails here until the table follows, so
# the test is looked at again.

CHECKED_BY: dict[tuple[str, str], str] = {
    (
        "docs/growth.md",
        "The metric is logged at every optimizer step from the 10th measured step of the run on",
    ): "tests/test_first_hour.py::test_the_noise_scale_appears_from_the_10th_step_with_2_or_more_micro_batches",
    (
        "docs/growth.md",
        "counted over all epochs and across a resume (the count is in the checkpoint)",
    ): "tests/test_noise_scale_recipe.py::test_noise_scale_growth_decides_at_the_epoch_start_and_resumes_exactly",
    (
        "docs/logs-and-metrics.md",
        "| `grad_norm` | with `clip_grad_norm` |",
    ): "tests/test_first_hour.py::test_the_demo_logs_in_the_order_and_with_the_metrics_the_logs_page_gives",
    (
        "docs/logs-and-metrics.md",
        "| `max_tokens` | with token budgets, instead of `micro_batch_size`",
    ): (
        "tests/test_token_and_elastic_recipe.py::test_token_budget_run_sees_every_sample_once_and_scales_the_lr_per_step"
    ),
    (
        "docs/logs-and-metrics.md",
        "with `log_peak_memory_stats: true`, on CUDA",
    ): "tests/test_stock_configs.py::test_log_peak_memory_stats_adds_torchtunes_memory_statistics_on_cuda_only",
    (
        "docs/logs-and-metrics.md",
        "## The log, in order",
    ): "tests/test_first_hour.py::test_the_demo_logs_in_the_order_and_with_the_metrics_the_logs_page_gives",
    (
        "README.md",
        "A later run with the same set-up reads it from a cache instead of measuring again.",
    ): "tests/test_profile_recipe.py::test_cache_hit_reprofile_stale_and_corrupt",
    (
        "README.md",
        "a restart or a preemption resumes exactly where the last checkpoint was saved",
    ): "tests/test_preemption.py::test_the_resumed_runs_train_every_step_once_with_the_uninterrupted_losses",
    (
        "README.md",
        "Continue any stopped run with `resume_from_checkpoint=True`: it resumes at the exact step, "
        "inside an epoch too.",
    ): "tests/test_preemption.py::test_the_resumed_runs_train_every_step_once_with_the_uninterrupted_losses",
    (
        "docs/fault-tolerance.md",
        "A new job (restart count 0) never resumes by itself",
    ): "tests/test_restart.py::test_a_new_job_or_another_jobs_checkpoint_is_not_resumed",
    (
        "docs/fault-tolerance.md",
        "the recipe sees `TORCHELASTIC_RESTART_COUNT` > 0 and **resumes by itself**",
    ): "tests/test_restart.py::test_a_restart_of_this_job_resumes_its_checkpoint",
}


def test_every_listed_condition_is_on_its_page_and_names_a_test() -> None:
    problems = []
    for (page, statement), node in CHECKED_BY.items():
        text = " ".join((ROOT / page).read_text(encoding="utf-8").split())
        if " ".join(statement.split()) not in text:
            problems.append(f"{page}: no longer says {statement!r}: reword it here and look at {node} again")
        if not _function_exists(node):
            problems.append(f"{page}: {statement!r}: no function {node}")
    assert not problems, "\n".join(problems)
