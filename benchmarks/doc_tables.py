"""Benchmarks write their own tables into the docs, between markers, with the command, date, commit and machine.

A page holds ``<!-- table: NAME -->`` and ``<!-- /table: NAME -->``; :func:`publish` replaces what is between
them. A figure in the docs is then always the last output of the command printed above it.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def machine() -> str:
    """The machine in a few words: cores and processor, and the GPU when one is used."""
    import torch

    cores = os.cpu_count() or 0
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, {cores} CPU cores"
    return f"{cores} CPU cores ({platform.machine()}), no GPU"


def commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+changes" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def command_line() -> str:
    """The command that is running, as a user would type it from the repository's root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return " ".join(["python", str(shown), *sys.argv[1:]])


def markdown_of(text: str) -> str:
    """A benchmark's printed report as markdown: its tables kept whole, every other line a paragraph of its own
    (a line right under a table would otherwise be read as one of its rows)."""
    blocks: list[str] = []
    for line in text.strip().splitlines():
        if line.startswith("|") and blocks and blocks[-1].startswith("|"):
            blocks[-1] += "\n" + line
        elif line.strip():
            blocks.append(line)
    return "\n\n".join(blocks)


def publish(page: str, name: str, body: str, *, docs: Path = DOCS) -> Path:
    """Put ``body`` (markdown) with a line naming the command, date, commit and machine between the markers of
    ``name`` on ``docs/page``. The markers must exist: a table is placed by hand once, then only rewritten."""
    path = docs / page
    text = path.read_text(encoding="utf-8")
    pattern = re.compile(rf"(<!-- table: {re.escape(name)} -->\n).*?(<!-- /table: {re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path} has no markers <!-- table: {name} --> ... <!-- /table: {name} -->")
    stamp = f"`{command_line()}`, {datetime.date.today().isoformat()}, commit {commit()}, {machine()}"
    block = f"Measured by {stamp}:\n\n{body.rstrip()}\n"
    path.write_text(pattern.sub(lambda m: m.group(1) + block + m.group(2), text, count=1), encoding="utf-8")
    return path


@contextlib.contextmanager
def report(name: Optional[str], page: str = "benchmarks.md", *, docs: Path = DOCS) -> Iterator[None]:
    """What the block prints is the benchmark's report: printed once it is complete, and with a ``name`` (the
    benchmark's ``--publish``) also written as markdown between that table's markers on ``docs/page``."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        yield
    print(f"\n{text.getvalue()}", end="")
    if name is not None:
        print(f"written to {publish(page, name, markdown_of(text.getvalue()), docs=docs)}")
