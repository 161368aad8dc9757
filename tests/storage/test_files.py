"""Atomic replacement of state files: the content is whole, the old file survives a failed write."""

import os

import pytest

from logbus.storage import files


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
