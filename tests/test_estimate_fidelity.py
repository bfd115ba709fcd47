"""``benchmarks/estimate_fidelity.py``'s pure parts: its section of ``docs/estimates.md`` and its rows' overrides.

The script itself traces stock configs for minutes; its figures are in ``docs/estimates.md`` with its command.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "estimate_fidelity.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("estimate_fidelity", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_the_section_is_replaced_and_the_rest_of_the_page_kept() -> None:
    fidelity = _script()
    page = "# estimates\n\n| table |\n"
    once = fidelity.replace_section(page, fidelity.SECTION + "\n\nfirst\n")
    assert once == page + "\n" + fidelity.SECTION + "\n\nfirst\n"
    assert (
        fidelity.replace_section(once, fidelity.SECTION + "\n\nsecond\n")
        == page + "\n" + fidelity.SECTION + "\n\nsecond\n"
    )


def test_every_row_names_each_key_once_and_a_real_source() -> None:
    fidelity = _script()
    assert fidelity.overrides({"a": "1", "b": "2"}, {"a": "3"}) == ["a=3", "b=2"]
    for row in fidelity.ROWS:
        keys = [o.split("=", 1)[0] for o in row.overrides]
        assert len(keys) == len(set(keys)), row.setting
        assert row.source in fidelity.SOURCES and row.measured_gib > 0 and row.micro_batch >= 1
    assert len(fidelity.ROWS) >= 8
