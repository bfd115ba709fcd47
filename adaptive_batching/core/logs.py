"""The run's log: torchtune's logger, spoken on rank zero.

Every part logs its lines here instead of receiving a callable: one rank speaks for the run (the others would
repeat its lines), through torchtune's own logger, so the lines read like torchtune's.

The trainer draws a progress bar (tqdm) on stderr, a line without its newline that tqdm redraws in place. A log
line written there as it is would land in the middle of the bar, so every line of this module (the logger's and
:func:`say_line`'s) is written as ``tqdm.write`` writes: under tqdm's lock, the open bars cleared first and drawn
again after it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from torchtune import utils
from tqdm import tqdm


@contextmanager
def beside_progress_bars(stream: IO[str]) -> Iterator[None]:
    """Write to ``stream`` inside this block as ``tqdm.write`` does: with tqdm's open bars cleared and redrawn after,
    under its lock (none open: a plain write, and no lock is made)."""
    if not getattr(tqdm, "_instances", None):
        yield
        return
    with tqdm.external_write_mode(file=stream):
        yield


class _BesideProgressBars(logging.StreamHandler):
    """torchtune's stream handler, writing each record :func:`beside_progress_bars`. One made for stderr writes to
    the stderr of the moment, as ``print(..., file=sys.stderr)`` and the progress bar do: a process that replaces
    ``sys.stderr`` after the import (a harness, a fork) still has its bar cleared by the same stream."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        super().__init__(stream)
        self.follows_stderr = stream is None or stream is sys.stderr or stream is sys.__stderr__

    def emit(self, record: logging.LogRecord) -> None:
        if self.follows_stderr:
            self.stream = sys.stderr
        with beside_progress_bars(self.stream):
            super().emit(record)


def _beside_progress_bars(logger: logging.Logger) -> logging.Logger:
    """``logger`` with its plain stream handlers (torchtune's ``get_logger`` adds one) writing beside the bars."""
    for handler in list(logger.handlers):
        if type(handler) is logging.StreamHandler:
            replacement: Any = _BesideProgressBars(handler.stream)
            replacement.setLevel(handler.level)
            replacement.setFormatter(handler.formatter)
            logger.removeHandler(handler)
            logger.addHandler(replacement)
    return logger


log = _beside_progress_bars(utils.get_logger("INFO"))
"""torchtune's logger (``torchtune.utils._logging``), at INFO; for a line every rank says (``log.info``)."""


def info(message: str) -> None:
    """Log ``message`` at INFO on rank zero only (on the one process when no process group is set up)."""
    utils.log_rank_zero(log, message)


def warning(message: str) -> None:
    """Log ``message`` as a warning on rank zero only."""
    utils.log_rank_zero(log, message, level=logging.WARNING)


def say_line(text: str) -> None:
    """Write ``text`` and its newline to stderr in one write: under ``python -u`` (how torchrun starts each rank)
    ``print`` writes the text and the newline apart, and two ranks' lines could run into one. Beside the progress
    bar, as the log's lines."""
    with beside_progress_bars(sys.stderr):
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
