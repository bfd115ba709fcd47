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
import io
import re
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
from omegaconf import OmegaConf

from adaptive_batching import growth
from adaptive_batching.cli import build_parser, recipe_for
from adaptive_batching.config.keys import ADAPTIVE_KEYS, RECIPE_KEYS
from adaptive_batching.config.loading import RECIPES, shipped_config_names, shipped_configs_dir, stock_configs
from adaptive_batching.config.settings import KNOBS, _check_recipe_keys
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
    return [row for head, rows in tables(text) if head[:len(header)] == header for row in rows]


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
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and _reads_cfg(node.func.value) and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
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
        _check_recipe_keys(cfg)
    except ConfigError as error:
        return f"'{key}' is missing" in str(error)
    return False


def _null_passes(key: str) -> bool:
    cfg = OmegaConf.load(shipped_configs_dir() / "tiny_full.yaml")
    cfg[key] = None
    try:
        _check_recipe_keys(cfg)
    except ConfigError:
        return False
    return True


def code_keys() -> dict[str, Optional[str]]:
    """Every key the code reads -> the default the page must give (None: ``required`` or a null the checks take)."""
    keys: dict[str, Optional[str]] = {}
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
                    "required" if empty else as_yaml(parameter.default))
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
    rows = {(default_cell(row[0]), default_cell(row[1])): default_cell(row[2])
            for row in table_rows(KEYS_PAGE.read_text(encoding="utf-8"), ["`_component_`", "argument", "default"])}
    problems = [f"{function} {argument}: " + ("no row" if (function, argument) not in rows
                                               else f"the page says {rows[(function, argument)]!r}, the code {default!r}")
                for (function, argument), default in growth_arguments().items()
                if rows.get((function, argument)) != default]
    problems += [f"{function} {argument}: on the page, not an argument" for function, argument in
                 sorted(set(rows) - set(growth_arguments()))]
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


def config_problem(name: str, created: set[str]) -> Optional[str]:
    stem = name.removesuffix(".yaml")
    if ("/" not in stem and stem in shipped_config_names()) or name in stock_configs() or name in created:
        return None
    if (ROOT / name).is_file() or re.fullmatch(r"my_\w*\.yaml", Path(name).name) or PLACEHOLDER.fullmatch(name):
        return None
    return (f"config {name!r} is neither ours, torchtune's, a file of this repository or made in the same block, "
            "a user's my_*.yaml nor a placeholder")


def config_path(name: str) -> Optional[Path]:
    stem = name.removesuffix(".yaml")
    if "/" not in stem and stem in shipped_config_names():
        return shipped_configs_dir() / f"{stem}.yaml"
    return stock_configs().get(name)


def tune_run_problem(argv: list[str], created: set[str], mention: bool = False) -> Optional[str]:
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
    if recipe not in RECIPES and config not in torchtune_recipes()[recipe]:
        return f"torchtune's {recipe} has no config {config!r}"
    return None


def subcommands() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def ours_problem(argv: list[str], created: set[str], mention: bool) -> Optional[str]:
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


def doc_commands() -> Iterator[tuple[str, str, Optional[str]]]:
    """(page, command, problem) of every command on every page."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT).as_posix()
        for block in fenced_blocks(text):
            created: set[str] = set()
            for line in logical_lines(block):
                for argv in commands(line):
                    problem = (tune_run_problem(argv, created) if argv[0] == "tune"
                               else ours_problem(argv, created, mention=False))
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
    def problem(line: str) -> Optional[str]:
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
