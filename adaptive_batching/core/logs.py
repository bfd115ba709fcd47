"""The run's log: torchtune's logger, spoken on rank zero.

Every part logs its lines here instead of receiving a callable: one rank speaks for the run (the others would
repeat its lines), through torchtune's own logger, so the lines read like torchtune's.
"""

from __future__ import annotations

import logging
import sys

from torchtune import utils

log = utils.get_logger("INFO")
"""torchtune's logger (``torchtune.utils._logging``), at INFO; for a line every rank says (``log.info``)."""


def info(message: str) -> None:
    """Log ``message`` at INFO on rank zero only (on the one process when no process group is set up)."""
    utils.log_rank_zero(log, message)


def warning(message: str) -> None:
    """Log ``message`` as a warning on rank zero only."""
    utils.log_rank_zero(log, message, level=logging.WARNING)


def say_line(text: str) -> None:
    """Write ``text`` and its newline to stderr in one write: under ``python -u`` (how torchrun starts each rank)
    ``print`` writes the text and the newline apart, and two ranks' lines could run into one."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
