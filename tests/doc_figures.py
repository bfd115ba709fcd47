"""Figures a docs page quotes from a command it names (docs/dpo.md, qat.md, distillation.md), checked against what
that command prints when a test runs it.

On CPU the profiler measures a step by the process's resident memory, so a run's figures move from run to run:
a quoted micro batch agrees with a run's within ``RELATIVE`` of it or one sample. The fit's cost of a sample moves
more, being a slope over a few small steps: the KD page's command gave 0.74 to 1.36 MiB across runs on the 2-core
machine, choosing micro batch 8 each time; a quoted cost agrees within ``PER_SAMPLE_RELATIVE``. A page that quotes
4.05 MiB where the command now gives 2.71 still fails.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
RELATIVE = 0.2
PER_SAMPLE_RELATIVE = 0.4
_FIT = re.compile(
    r"fit: peak = [\d.]+ GiB \+ ([\d.]+) MiB x micro batch; .*?largest micro batch that ran (\d+); "
    r"chosen micro batch (\d+)"
)


@dataclass(frozen=True)
class Profiled:
    """What ``adaptive-batching profile`` (or a profiled run) printed: the fit's cost of a sample and the choice."""

    per_sample_mib: float
    largest: int
    chosen: int
    cached: bool


def profiled(output: str) -> Profiled:
    """The profiler's result line of ``output`` (one run's)."""
    (fit,) = [match for match in _FIT.finditer(output)]
    return Profiled(float(fit[1]), int(fit[2]), int(fit[3]), "Profiler: using the cached profile" in output)


def page_text(page: str) -> str:
    """A docs page with its whitespace collapsed, so that a sentence matches across line breaks."""
    return " ".join((DOCS / page).read_text(encoding="utf-8").split())


def quoted(page: str, pattern: str) -> list[re.Match[str]]:
    """Every match of ``pattern`` on ``page``; a page that no longer says it fails here, not silently."""
    found = list(re.finditer(pattern, page_text(page)))
    assert found, f"docs/{page} no longer quotes {pattern!r}: update the page and its test together"
    return found


def overrides(command: str) -> list[str]:
    """The ``key=value`` overrides of a quoted ``adaptive-batching profile --config X ...`` command."""
    return [word for word in shlex.split(command) if "=" in word]


def agrees(page: float, run: float, *, samples: bool = False) -> bool:
    """A quoted figure agrees with a run's: a micro batch (``samples``) within ``RELATIVE`` of it or one sample, a
    cost of a sample in MiB within ``PER_SAMPLE_RELATIVE`` of it."""
    if samples:
        return abs(page - run) <= max(RELATIVE * run, 1)
    return abs(page - run) <= PER_SAMPLE_RELATIVE * run
