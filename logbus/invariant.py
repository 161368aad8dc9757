"""Invariant checks where state changes: a broken invariant is a bug in logbus, and it crashes loudly.

``check`` raises AssertionError, but unlike an ``assert`` statement it is not
removed by ``python -O``: the rules it guards (a high watermark that never
moves back, one owner per partition, ...) are what keeps acknowledged records
safe.
"""

from __future__ import annotations


def check(condition: bool, message: str) -> None:
    """Raise AssertionError(``message``) unless ``condition`` holds."""
    if not condition:
        raise AssertionError(message)
