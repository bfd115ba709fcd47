"""Every repository path and every module of ours that a docs page, the README or a docstring names exists.

A page or a docstring that names ``benchmarks/step_counters.py`` after that script was deleted sends the next reader
looking for nothing. Paths are written relative to the repository root (``benchmarks/chaos.py``,
``adaptive_batching/training/trainer.py``); modules dotted (``adaptive_batching.assets.tiny``). A dotted name whose
second part is a key of ``adaptive_batching:`` in the YAML (``adaptive_batching.memory_budget``) is a config key,
not a module; so is one set on the command line (``adaptive_batching.x=1``). A path with a placeholder
(``validation-<device>.json``, ``chaos-OBJECTIVE.json``) is a template.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from adaptive_batching.config.settings import KNOBS

ROOT = Path(__file__).resolve().parent.parent
TOP_FOLDERS = ("adaptive_batching", "benchmarks", "configs", "docs", "recipes", "tests", ".ci")
PATH = re.compile(
    r"(?<![\w/.-])((?:{})/[\w./<>{{}},-]*[\w>}}])".format("|".join(re.escape(folder) for folder in TOP_FOLDERS))
)
MODULE = re.compile(r"(?<![\w.])adaptive_batching(?:\.\w+)+(?![\w=])")
THIS = "tests/test_repo_paths.py"
TEMPLATE = re.compile(r"[<{]|\b[A-Z]{3,}\b|[-_][A-Z]{3,}")  # <device>, {full,lora}, chaos-OBJECTIVE, tiny_NAME
SOURCES = ("adaptive_batching", "recipes", "benchmarks", "tests")


def _texts() -> dict[str, str]:
    """Every file whose words name paths: the README, the docs pages, the Makefile, CI, and our Python sources."""
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / ".ci" / "run", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in SOURCES:
        files += sorted((ROOT / folder).rglob("*.py"))
        files += sorted((ROOT / folder).rglob("*.sh"))
    return {str(file.relative_to(ROOT)): file.read_text() for file in files}


TEXTS = _texts()


def _named_paths() -> dict[str, set[str]]:
    """Each repository path named anywhere, and the files that name it."""
    named: dict[str, set[str]] = {}
    for where, text in TEXTS.items():
        for path in PATH.findall(text):
            if where == THIS or TEMPLATE.search(path):
                continue  # this file's own examples; a template such as ``validation-<device>.json``
            named.setdefault(path.rstrip("."), set()).add(where)
    return named


def _is_module(name: str) -> bool:
    """Whether ``name`` (``adaptive_batching.a.b``) is an importable module, or an attribute of one."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ModuleNotFoundError:
            continue
        target = importlib.import_module(module)
        for attribute in parts[end:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def test_paths_are_found_where_they_are_written() -> None:
    """The scan finds the paths this file's own docstring names, so an empty scan cannot pass by finding nothing."""
    named = _named_paths()
    assert "docs/profiler.md" in named and "benchmarks/validate_device.py" in named
    assert len(named) > 50


def test_every_named_path_exists() -> None:
    missing = {path: sorted(where) for path, where in _named_paths().items() if not (ROOT / path).exists()}
    assert not missing, f"named but not in the repository: {missing}"


def test_every_named_module_of_ours_exists() -> None:
    missing: dict[str, set[str]] = {}
    for where, text in TEXTS.items():
        if where.startswith("tests/"):
            continue  # tests name misspelt config keys on purpose (``adaptive_batching.memory_budgett``)
        for name in MODULE.findall(text):
            if name.split(".")[1] in KNOBS:
                continue
            if not _is_module(name):
                missing.setdefault(name, set()).add(where)
    assert not missing, f"named but no such module or attribute: {missing}"


@pytest.mark.parametrize("stale", ["benchmarks/no_such_script.py", "adaptive_batching.no_such_module.thing"])
def test_a_stale_name_is_caught(stale: str) -> None:
    """The two patterns match a name of the kind that went stale before, and the checks reject it."""
    if "/" in stale:
        assert PATH.findall(f"see ``{stale}``") == [stale]
        assert not (ROOT / stale).exists()
    else:
        assert MODULE.findall(f"see ``{stale}``") == [stale]
        assert not _is_module(stale)
