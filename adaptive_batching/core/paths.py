"""Where the project keeps files between runs."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/adaptive-batching/profiles``, else ``~/.cache/adaptive-batching/profiles``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "adaptive-batching" / "profiles"


def cache_dir(configured: str | Path | None) -> Path:
    """The cache folder ``adaptive_batching.cache_dir`` names (``~`` expanded), or :func:`default_cache_dir`."""
    return default_cache_dir() if configured is None else Path(configured).expanduser()
