"""benchmarks/common.py's report: a benchmark's printed report, written between its markers on a docs page."""

from __future__ import annotations

from pathlib import Path

import pytest
from common import report  # benchmarks/ is on pytest's pythonpath (pyproject.toml)

PAGE = "# Page\n\nabove\n\n<!-- table: speed -->\nold figures\n<!-- /table: speed -->\n\nbelow\n"


def test_a_report_is_printed_and_published_as_markdown_between_its_markers(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "page.md").write_text(PAGE)
    with report("speed", "page.md", docs=tmp_path):
        print("2 runs:")
        print("| a | b |\n|---|---|\n| 1 | 2 |")
        print("ratio 1.5x")
    printed = capsys.readouterr().out
    assert "2 runs:\n| a | b |" in printed and "written to" in printed
    text = (tmp_path / "page.md").read_text()
    assert "old figures" not in text and text.startswith("# Page\n\nabove\n") and text.endswith("\n\nbelow\n")
    body = text[text.index("<!-- table: speed -->") : text.index("<!-- /table: speed -->")]
    # a line right under a table would be read as one of its rows: each line outside a table is a paragraph
    assert "2 runs:\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\nratio 1.5x\n" in body and "Measured by `" in body


def test_without_a_name_the_report_is_only_printed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "page.md").write_text(PAGE)
    with report(None, "page.md", docs=tmp_path):
        print("| a |")
    assert capsys.readouterr().out == "\n| a |\n"
    assert (tmp_path / "page.md").read_text() == PAGE
