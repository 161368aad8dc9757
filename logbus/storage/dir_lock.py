"""One owner per directory: an exclusive ``fcntl`` lock held for the owner's lifetime, with a note saying who it is.

Two processes that both believe they own a partition's files lose
acknowledged records: each appends at what it thinks is the log end, and one
overwrites the other. So the controller holds the lock of its data
directory, and every replica the lock of its own directory, for as long as
the process lives. The kernel releases a lock when its process dies, however
it dies, so a lock left by a dead process is never stale: the next owner
simply takes it. A note beside the lock (written by the owner, read by
anyone) says who holds it and, for the controller, how to reach its cluster.

Locks are ``flock`` locks on a file of their own: they conflict between any
two open file descriptions, even within one process, and are not inherited
past ``exec``. They work on local file systems; a data directory on a
network file system that ignores ``flock`` is not protected.
"""

from __future__ import annotations

import fcntl
import json
import os
import time

from logbus.storage.files import write_atomically

POLL_S = 0.05


class DirectoryLock:
    """The exclusive lock file at ``path`` and its owner's note at ``path + '.json'``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.note_path = path + ".json"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lock if no one holds it; True if this object holds it now."""
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def acquire(self, timeout_s: float) -> bool:
        """Take the lock, waiting up to ``timeout_s`` for its holder to let go; True if taken."""
        deadline = time.monotonic() + timeout_s
        while not self.try_acquire():
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor releases the lock

    def is_held_elsewhere(self) -> bool:
        """Whether another open file description (another process, or another object here) holds the lock."""
        if self._fd is not None:
            return False
        if not os.path.exists(self.path):
            return False
        if self.try_acquire():
            self.release()
            return False
        return True

    def write_note(self, note: dict) -> None:
        """As the holder: say who holds the lock (pid and whatever helps others reach or name it)."""
        write_atomically(self.note_path, json.dumps({"pid": os.getpid(), **note}, sort_keys=True))

    def read_note(self) -> dict | None:
        """The holder's note, or None if there is none (or it is unreadable)."""
        try:
            with open(self.note_path) as file:
                note = json.load(file)
        except (OSError, ValueError):
            return None
        return note if isinstance(note, dict) else None

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
