"""BoundedDict: a dict that never holds more than a set number of entries.

For the clients' caches, whose entries cost only a request to rebuild
(topic metadata, a topic's limits): storing a key past the bound drops the
entry stored longest ago, so a process that meets a hundred thousand topics
over its life keeps the last few thousand, not all of them. Tables whose
entries are state rather than copies (a partition's sequence numbers, its
position) bound themselves in their owners, by forgetting what is no longer
used.

Not thread-safe: owners that share one guard it with their lock.
"""

from __future__ import annotations


class BoundedDict(dict):
    """At most ``max_entries`` entries; storing a key (new or not) makes it the newest, and a new key
    past the bound drops the oldest. Only ``d[key] = value`` stores (``update``/``setdefault`` are refused)."""

    __slots__ = ("max_entries",)

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"a BoundedDict holds at least one entry, not {max_entries}")
        super().__init__()
        self.max_entries = max_entries

    def __setitem__(self, key, value) -> None:
        if key in self:
            super().__delitem__(key)  # stored again: the newest
        elif len(self) >= self.max_entries:
            super().__delitem__(next(iter(self)))
        super().__setitem__(key, value)

    def update(self, *args, **kwargs):  # noqa: D102
        raise TypeError("BoundedDict stores one key at a time: d[key] = value")

    setdefault = update
