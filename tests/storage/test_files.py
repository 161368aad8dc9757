"""State files: atomic replacement (whole content, the old file survives a failed write) and one owner per directory."""

import os
import subprocess
import sys

import pytest

from logbus.storage import files
from logbus.storage.dir_lock import DirectoryLock


def test_write_replaces_whole_content_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "state.json")
    files.write_atomically(path, "first")
    files.write_atomically(path, b"second, longer")
    with open(path, "rb") as file:
        assert file.read() == b"second, longer"
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_failed_write_keeps_the_old_content(tmp_path):
    path = str(tmp_path / "state.json")
    files.write_atomically(path, "old")
    with pytest.raises(TypeError):
        files.write_atomically(path, 12345)  # not str or bytes: fails before the rename
    with open(path) as file:
        assert file.read() == "old"


def test_a_missing_directory_is_an_error_and_creates_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        files.write_atomically(str(tmp_path / "absent" / "state.json"), "x")
    assert not (tmp_path / "absent").exists()


# --- one owner per directory ------------------------------------------------------------------

HOLDER = """
import sys, time
from logbus.storage.dir_lock import DirectoryLock
lock = DirectoryLock(sys.argv[1])
assert lock.try_acquire()
lock.write_note({"who": "holder"})
print("held", flush=True)
sys.stdin.readline()  # hold until told (or killed)
"""


def start_holder(path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_lock_held_by_another_process_is_refused_and_its_note_names_the_holder(tmp_path):
    path = str(tmp_path / "lock")
    holder = start_holder(path)
    try:
        lock = DirectoryLock(path)
        assert lock.is_held_elsewhere()
        assert not lock.try_acquire()
        assert not lock.acquire(timeout_s=0.2)
        assert lock.read_note() == {"pid": holder.pid, "who": "holder"}
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert lock.acquire(timeout_s=10)  # released when the holder exits
    lock.release()


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path):
    path = str(tmp_path / "lock")
    holder = start_holder(path)
    holder.kill()
    holder.wait(30)
    lock = DirectoryLock(path)
    assert not lock.is_held_elsewhere()
    assert lock.try_acquire()
    assert DirectoryLock(path).is_held_elsewhere()  # a second description in this process conflicts too
    lock.release()
