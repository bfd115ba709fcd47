"""benchmarks/common.py's report: a benchmark's printed report, written between its markers on a docs page."""

from __future__ import annotations

from pathlib import Path

import pytest
from common import report  # the benchmarks folder is on sys.path (conftest.py)

PAGE = "# Page\n\nabove\n\n<!-- table: speed -->\nold figures\n<!-- /table: speed -->\n\nbelow\n"


def test_a_report_is_printed_and_published_as_markdown_between_its_markers(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "page.md").write_text(PAGE)
    with report("speed", "page.md", docs=tmp_path):
        print("2 runs:")
        print("| a | b |\n|---|---|\n| 1 | 2 |")
        print("ratio 1.5x")
    printed = capsys.readouterr().out
    assert "2 runs:\n| a | b |" in printed and "written to" in printed
    text = (tmp_path / "page.md").read_text()
    assert "old figures" not in text and text.startswith("# Page\n\nabove\n") and text.endswith("\n\nbelow\n")
    body = text[text.index("<!-- table: speed -->"):text.index("<!-- /table: speed -->")]
    # a line right under a table would be read as one of its rows: each line outside a table is a paragraph
    assert "2 runs:\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\nratio 1.5x\n" in body and "Measured by `" in body


def test_without_a_name_the_report_is_only_printed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "page.md").write_text(PAGE)
    with report(None, "page.md", docs=tmp_path):
        print("| a |")
    assert capsys.readouterr().out == "\n| a |\n"
    assert (tmp_path / "page.md").read_text() == PAGE


def test_two_commands_reads_what_the_demo_did_and_the_tests_passed_from_their_logs() -> None:
    from two_commands import demo_summary, passed

    log = ("fit: ...; chosen micro batch 88; 6 trial steps in 1.5 s; samples of 256 tokens\n"
           "Epoch 1/3: micro batch 88 x accumulation 1 x 1 rank(s) = global batch 88, LR 0.000e+00\n"
           "Epoch switch 1 -> 2: micro batch 88 -> 88, accumulation 1 -> 2, global batch 88 -> 176, LR 2e-3\n"
           "Epoch switch 2 -> 3: micro batch 88 -> 88, accumulation 2 -> 4, global batch 176 -> 352, LR 3e-3\n"
           "Rank 0: finished at optimizer step 15, micro batch 88, last loss 5.01\n")
    assert demo_summary(log) == ("profile: 6 trial steps in 1.5 s, micro batch 88; "
                                 "15 optimizer steps at global batch 88, 176, 352")
    assert demo_summary("nothing") == "its log did not say"
    assert passed("1 failed, 12 passed in 3s\n==== 1834 passed, 2 skipped in 580.1s ====") == 1834
    assert passed("no tests ran") is None
