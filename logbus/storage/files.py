"""Durable replacement of small state files: the one way logbus persists metadata, checkpoints and state.

A crash (or power loss, with the fsyncs) at any point leaves either the old
file or the new one, never a mix or an empty file: the new content is written
to a temporary file beside the target, fsynced, renamed over the target, and
the directory is fsynced so that the rename itself is durable.

Failures. Until the rename, a failed write (a full disk, an I/O error) leaves
the old file as it was and removes the temporary file (a disk that filled up
is not left fuller). Once the rename is done, the new content is what every
reader, and the recovery after a process crash, sees; only a failed sync of
the directory can still fail the write, and then a power loss may bring the
old file back. Callers that keep the content in memory as well take it after
:func:`replace_file` and before :func:`sync_directory` (see
``PartitionLog._write_state``), so memory always matches what is on disk.
"""

from __future__ import annotations

import os

TEMPORARY_SUFFIX = ".tmp"


def write_atomically(path: str, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` durably (write a temporary file, fsync, rename, fsync the directory).

    Raises OSError (or TypeError for data that is neither str nor bytes); see
    the module docstring for what is on disk then.
    """
    replace_file(path, data)
    sync_directory(os.path.dirname(path) or ".")


def replace_file(path: str, data: str | bytes) -> None:
    """Write ``data`` to a temporary file, fsync it and rename it over ``path``.

    On any failure the temporary file is removed and ``path`` keeps its old
    content (or stays absent); the rename is not yet durable until the
    directory is synced (:func:`sync_directory`).
    """
    temporary = path + TEMPORARY_SUFFIX
    try:
        with open(temporary, "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass  # absent, or the disk refuses even this: the next write replaces it
        raise


def sync_directory(directory: str) -> None:
    """fsync a directory, so that the renames, creations and deletions in it are durable."""
    sync_path(directory)


def sync_path(path: str) -> None:
    """fsync a file or directory by its path (a file another writer, pyarrow's say, wrote and closed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
