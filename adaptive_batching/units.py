"""Memory sizes as people write them: ``12GiB``, ``500MB`` or a plain number of bytes."""

from __future__ import annotations

import math
import re
from typing import Any

GIB = 1024**3
_BYTES_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: Any) -> int:
    """``12GiB``, ``500MB``, ``1.5GiB`` or a plain number of bytes, as an int."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a memory size")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = _BYTES_PATTERN.match(str(value))
        if not match:
            raise ValueError(f"{value!r} is not a memory size like '12GiB', '500MB' or 1073741824")
        number = float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()]
    if not math.isfinite(number) or number < 1:
        raise ValueError(f"{value!r} is not a positive, finite memory size")
    return int(number)
