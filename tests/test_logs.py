"""The run's log beside the trainer's progress bar (core/logs.py): a log line or a stop line never lands inside the
bar, on any stream the bar shares (the recipe runs' output: test_qat's and test_preemption's)."""

from __future__ import annotations

import io
import logging

import pytest
from progress_lines import lines_inside_a_bar, screen_lines
from tqdm import tqdm

from adaptive_batching.core import logs


def _bar_with_lines_between(stream: io.StringIO, say) -> None:  # type: ignore[no-untyped-def]
    bar = tqdm(total=4, file=stream, desc="epoch 1/1", mininterval=0, ncols=80)
    bar.update(1)
    say("Step 1: fake quantization on")
    bar.update(1)
    bar.set_postfix_str("global batch 2 loss 7.2875")
    say("stopped: SIGTERM received by the end of optimizer step 2")
    bar.close()


def _logged_beside_a_bar(name: str, make_handler) -> str:  # type: ignore[no-untyped-def]
    """What a logger with the handler ``make_handler(stream)`` writes to the stream beside a progress bar."""
    stream = io.StringIO()
    handler = make_handler(stream)
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        _bar_with_lines_between(stream, logger.info)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_a_log_line_is_written_with_the_bar_cleared_and_the_bar_drawn_again_after() -> None:
    text = _logged_beside_a_bar("test_logs.beside_bars", logs._BesideProgressBars)
    lines = screen_lines(text)
    assert (
        "Step 1: fake quantization on" in lines and "stopped: SIGTERM received by the end of optimizer step 2" in lines
    )
    assert lines_inside_a_bar(text) == []
    assert [line for line in lines if line][-1].startswith("epoch 1/1:  50%|")  # the bar goes on after each line


def test_a_plain_stream_handler_writes_into_the_bar_which_the_check_sees() -> None:
    """Without the fix (torchtune's own handler) the line lands inside the bar: the check can fail."""
    text = _logged_beside_a_bar("test_logs.plain", logging.StreamHandler)
    assert len(lines_inside_a_bar(text)) == 2


def test_say_line_clears_the_bar_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    bar = tqdm(total=2, file=sys.stderr, desc="epoch 1/1", mininterval=0, ncols=80)
    bar.update(1)
    logs.say_line("stopped: SIGTERM received by the end of optimizer step 1")
    bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    assert "stopped: SIGTERM received by the end of optimizer step 1" in screen_lines(err)
    assert lines_inside_a_bar(err) == []


def test_the_run_logger_writes_beside_the_bars() -> None:
    """torchtune's logger, as every part logs through it, has its stream handler replaced, not doubled."""
    streams = [handler for handler in logs.log.handlers if isinstance(handler, logging.StreamHandler)]
    assert len(streams) == 1 and type(streams[0]) is logs._BesideProgressBars


def test_a_handler_made_for_stderr_writes_to_the_stderr_of_the_moment(capsys: pytest.CaptureFixture[str]) -> None:
    """torchtune's handler is made at import, on the stderr of then; a process that replaces ``sys.stderr`` later
    (the test fork server, a harness) has its lines and its bar on the new one, the bar cleared for each line."""
    import sys

    handler = logs._BesideProgressBars(sys.__stderr__)
    logger = logging.getLogger("test_logs.moment")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        _bar_with_lines_between(sys.stderr, logger.info)  # type: ignore[arg-type]
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert "Step 1: fake quantization on" in screen_lines(err) and lines_inside_a_bar(err) == []
