"""Making renames durable: a file's bytes and the directory entry that names it.

``os.replace`` is atomic, but after a power or node loss only what was fsynced is certain: a
rename whose directory was not fsynced may be undone. Every writer that publishes a file by
renaming it, then forgets the source of its bytes (a queue row deleted, a temporary removed),
fsyncs the directory first.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and every directory, so a rename publishes durable bytes."""
    # os.walk skips a directory it cannot read; a publish must fail instead of renaming unsynced bytes
    for dirpath, _dirs, files in os.walk(path, onerror=_raise):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _raise(exc: OSError) -> None:
    raise exc
