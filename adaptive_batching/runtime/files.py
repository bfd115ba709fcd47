"""Files the library writes and reads back: whole or not at all, and caches that are never an error.

Every file the library writes (profile and length caches, reports, checkpoints' markers, tiny assets) goes
through :func:`write_atomically`: a temporary file in the same folder, flushed to disk, then renamed over the
target, so a reader (another rank, a resumed run) sees the old file or the new one, never a mix, and a crash
leaves no half-written file behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

Content = bytes | str | Callable[[Path], None]


def write_atomically(path: Path, content: Content) -> None:
    """Write ``content`` (bytes, text, or a function that writes the file at the path it is given) to
    ``path``, all or nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as handle:
            if not callable(content):
                handle.write(content.encode("utf-8") if isinstance(content, str) else content)
        if callable(content):
            content(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # what open() would have given it (mkstemp makes it private)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable where the platform allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_json_cache(path: Path, what: str) -> Any | None:
    """A cache file's JSON content, or None when absent, unreadable or not JSON (the latter two logged as
    ``what``): a bad cache is never an error, the cached thing is simply made again."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        log.warning("ignoring unreadable %s %s: %s", what, path, error)
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        log.warning("ignoring corrupt %s %s: not JSON (%s)", what, path, error)
        return None


def fingerprint(parts: Mapping[str, Any]) -> str:
    """sha256 (hex) of ``parts`` as canonical JSON: key order does not matter, values do."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
