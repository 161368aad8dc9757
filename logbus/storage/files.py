"""Durable replacement of small state files: the one way logbus persists metadata, checkpoints and state.

A crash (or power loss, with the fsyncs) at any point leaves either the old
file or the new one, never a mix or an empty file: the new content is written
to a temporary file beside the target, fsynced, renamed over the target, and
the directory is fsynced so that the rename itself is durable.
"""

from __future__ import annotations

import os

TEMPORARY_SUFFIX = ".tmp"


def write_atomically(path: str, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` durably (write a temporary file, fsync, rename, fsync the directory)."""
    temporary = path + TEMPORARY_SUFFIX
    with open(temporary, "wb") as file:
        file.write(data.encode() if isinstance(data, str) else data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
