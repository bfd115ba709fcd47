"""Argument checks shared by the library's pure functions."""

from __future__ import annotations

from typing import Any


def check_int(where: str, name: str, value: Any, minimum: int | None = None) -> int:
    """``value`` as an int (bool excluded), at least ``minimum``; else a ValueError naming ``where`` and ``name``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return value
