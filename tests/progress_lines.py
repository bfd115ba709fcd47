"""A run's output as a terminal shows it: a progress bar (tqdm) and the log's lines on their own lines."""

from __future__ import annotations

import re

# A tqdm bar of the trainer: "epoch 1/2:  50%|█████     | 2/4 [00:00<00:00,  4.57it/s, global batch 2 ...]".
BAR = re.compile(r"epoch \d+/\d+: +\d+%\|")


def screen_lines(output: str) -> list[str]:
    """``output`` as a terminal leaves it: each ``\\r`` goes back to the line's start and what follows overwrites
    (a bar redrawn, a bar cleared by spaces); trailing spaces dropped."""
    lines = []
    for line in output.split("\n"):
        screen = ""
        for piece in line.split("\r"):
            screen = piece + screen[len(piece) :]
        lines.append(screen.rstrip())
    return lines


def lines_inside_a_bar(output: str) -> list[str]:
    """The lines where a bar and other text share a line: a bar's line must end where the bar does (``]``), and
    hold one bar. Output read back as text has each ``\\r`` turned into a line break already, which keeps a line
    written into a bar on the bar's line all the same."""
    return [
        line
        for line in screen_lines(output)
        if BAR.search(line) and (not line.endswith("]") or len(BAR.findall(line)) > 1 or not BAR.match(line.lstrip()))
    ]
