"""Where the project keeps files between runs."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/adaptive-batching/profiles``, else ``~/.cache/adaptive-batching/profiles``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "adaptive-batching" / "profiles"
