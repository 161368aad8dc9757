"""Shared helpers of the ``logbus`` command-line tests: run the command in-process, read its tables."""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass

import pytest

from logbus.cli import main


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return self.out.splitlines()


@pytest.fixture
def cli(bus, capsys, monkeypatch):
    """Run ``logbus ARGS`` in-process against the bus fixture's cluster; optional stdin text."""

    def run(*argv: str, stdin: str | None = None) -> Result:
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        code = main(["--namespace", bus.namespace, "--data-dir", bus.data_dir, *argv])
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return Result(code, _without_ray_notices(out), err)

    return run


def _without_ray_notices(text: str) -> str:
    """The command's output without the notices Ray's raylet sends every driver of this shared test
    session (e.g. "N PYTHON worker processes have been started"): they are not the command's."""
    return "".join(line for line in text.splitlines(keepends=True) if "\x1b[33m(raylet)" not in line and not line.startswith("(raylet)"))


def table_rows(lines: list[str], header_first: str) -> list[list[str]]:
    """The rows of the whitespace-aligned table whose header starts with ``header_first``."""
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [header_first])
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip() or line.endswith(":"):
            break
        rows.append(line.split())
    return rows
