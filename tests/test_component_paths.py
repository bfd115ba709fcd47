"""Every dotted path a user can copy from our configs and docs resolves, and so does each shipped growth
function's path, ``adaptive_batching.growth.<name>``, whether a page names it or not."""

from __future__ import annotations

import pydoc
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "configs").glob("*.yaml"))]
# `_component_: X`, `_component_=X`, `batch_increase_function: X` (YAML, overrides and prose alike).
NAMED = re.compile(r"(?:_component_|batch_increase_function)[\"']?\s*[:=]\s*[\"']?([A-Za-z_][\w.]*\.[A-Za-z_]\w*)")
# Users' own modules in examples, not ours to resolve.
USERS = ("my_module.", "my_growth.", "mypackage.")
# The shipped growth functions, as adaptive_batching.growth exports them.
GROWTH_FUNCTIONS = (
    "adaptive_batching.growth.geometric",
    "adaptive_batching.growth.linear_ramp",
    "adaptive_batching.growth.noise_scale",
    "adaptive_batching.growth.seesaw",
    "adaptive_batching.growth.step_increase",
)


def named_paths() -> dict[str, str]:
    """Each dotted path named in a config or a doc page, with the first file that names it."""
    found: dict[str, str] = {}
    for source in SOURCES:
        # A quoted error names a wrong path on purpose (``'torch.optim.AdamWW' does not import``).
        text = "\n".join(line for line in source.read_text().splitlines() if not line.startswith("config error:"))
        for path in NAMED.findall(text):
            if not path.startswith(USERS):
                found.setdefault(path, source.name)
    return found


def test_the_pages_and_configs_name_components() -> None:
    paths = named_paths()
    assert "adaptive_batching.growth.geometric" in paths and "torch.optim.AdamW" in paths


@pytest.mark.parametrize("path", sorted(set(named_paths()) | set(GROWTH_FUNCTIONS)))
def test_every_named_component_resolves(path: str) -> None:
    assert callable(pydoc.locate(path)), (
        f"{path} (named in {named_paths().get(path, 'adaptive_batching.growth')}) does not resolve"
    )
