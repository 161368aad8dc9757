"""A history of what producers, consumers and group members saw, and the checker that judges it.

A fault run records every operation as one event (a dict, one JSON line in
a history file), then checks the history once the cluster has healed.
Events, by ``kind`` (``topic`` may be left out where there is one topic):

- ``send``: a producer tried to send ``value`` (values are unique per send).
- ``ack``: the send of ``value`` was acknowledged at ``partition``, ``offset``.
- ``fail``: the send of ``value`` failed (``error``). It may have been
  written anyway (a timeout after the write), so a failed value found in
  the log is no violation; it is counted as indeterminate.
- ``poll``: ``consumer`` got ``value`` at ``partition``, ``offset``.
- ``seek``: ``consumer`` moved its position on ``partition`` to ``offset``
  (its next poll may go back).
- ``process``: ``member`` of ``group`` processed ``value`` at
  ``partition``, ``offset``.
- ``replica``: replica ``replica`` holds ``value`` at ``partition``,
  ``offset`` in its files after the run (:func:`replica_events`).
- ``leaders``: the controller said, when asked at ``asked``, that
  ``leaders`` (partition -> replica id or None) lead (information for the
  fault run's stall figures; the checker passes over it).

:func:`check` reports:

- **lost**: acknowledged, and found by no read at all (no poll, no
  processing, no replica's files);
- **duplicated**: one value at two offsets (an idempotent producer's record
  written twice);
- **two values at one offset**: an offset that two observations (an ack, a
  poll, a replica's files) give different values;
- **unseen**: acknowledged but never polled by a consumer that should have
  read everything (``complete_consumers``), though the record is in the log;
- **non-monotonic**: a consumer's polls of one partition going back or
  repeating an offset, with no seek in between;
- **phantoms**: values read that no producer sent;
- per group, how many times each acknowledged record was processed.

The checker is pure Python (no Ray, no logbus), so hand-made histories test
it; :func:`replica_records` reads a replica's files with logbus's own
``PartitionLog``, on a copy (opening a log runs recovery, which may write).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import tempfile
import threading
import time
from typing import Iterable

Position = tuple[str, int, int]  # topic, partition, offset

# Invariants a fault run must keep, whatever the faults: what check() counts as violations.
VIOLATIONS = ("lost", "duplicated", "two_values_at_offset", "non_monotonic", "phantoms", "unseen")


class History:
    """A thread-safe event log, kept in memory and, if ``path`` is given, appended to a JSON-lines file
    as it goes (a run that dies leaves its history up to that point). ``clock`` stamps each event."""

    def __init__(self, path: str | None = None, clock=time.monotonic) -> None:
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._clock = clock
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (closed by close())

    def record(self, kind: str, **fields) -> dict:
        event = {"kind": kind, "t": round(self._clock(), 6), **fields}
        with self._lock:
            self.events.append(event)
            if self._file is not None:
                self._file.write(json.dumps(event) + "\n")
        return event

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def load(path: str) -> list[dict]:
    """The events of a JSON-lines history file (a torn last line, from a process that died writing it, is skipped)."""
    events = []
    with open(path) as file:
        for line in file:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


@dataclasses.dataclass
class Report:
    """What :func:`check` found. ``violations()`` counts the broken invariants (all 0 when the run kept them)."""

    sent: int = 0
    acked: int = 0
    failed: int = 0
    lost: list[str] = dataclasses.field(default_factory=list)
    duplicated: dict[str, list[Position]] = dataclasses.field(default_factory=dict)
    two_values_at_offset: dict[Position, dict[str, list[str]]] = dataclasses.field(default_factory=dict)
    unseen: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # consumer -> acked values it never polled
    non_monotonic: list[dict] = dataclasses.field(default_factory=list)
    phantoms: list[str] = dataclasses.field(default_factory=list)
    failed_but_written: list[str] = dataclasses.field(default_factory=list)  # indeterminate sends found in the log
    unacknowledged_written: list[str] = dataclasses.field(default_factory=list)  # sends with no outcome, found in the log
    processing: dict[str, dict] = dataclasses.field(default_factory=dict)  # group -> counts

    def violations(self) -> dict[str, int]:
        return {
            "lost": len(self.lost),
            "duplicated": len(self.duplicated),
            "two_values_at_offset": len(self.two_values_at_offset),
            "non_monotonic": len(self.non_monotonic),
            "phantoms": len(self.phantoms),
            "unseen": sum(len(values) for values in self.unseen.values()),
        }

    @property
    def ok(self) -> bool:
        return not any(self.violations().values())

    def as_dict(self, examples: int = 5) -> dict:
        """A JSON-ready summary: counts, and up to ``examples`` examples of each violation."""

        def some(items):
            return list(items)[:examples]

        return {
            "sent": self.sent,
            "acked": self.acked,
            "failed": self.failed,
            "violations": self.violations(),
            "failed_but_written": len(self.failed_but_written),
            "unacknowledged_written": len(self.unacknowledged_written),
            "examples": {
                "lost": some(self.lost),
                "duplicated": {v: [list(p) for p in ps] for v, ps in some(self.duplicated.items())},
                "two_values_at_offset": [[list(p), values] for p, values in some(self.two_values_at_offset.items())],
                "unseen": {c: some(values) for c, values in self.unseen.items() if values},
                "non_monotonic": some(self.non_monotonic),
                "phantoms": some(self.phantoms),
            },
            "processing": self.processing,
        }


def _position(event: dict) -> Position:
    return (event.get("topic", ""), int(event["partition"]), int(event["offset"]))


def check(events: Iterable[dict], complete_consumers: Iterable[str] = (), idempotent: bool = True) -> Report:
    """Judge a history (see the module docstring).

    ``complete_consumers``: consumers that should have polled every
    acknowledged record (each one's misses are reported as unseen, if the
    record is in the log at all; otherwise it is lost). ``idempotent``: the
    producers promise no duplicates (else a value at two offsets is allowed).
    """
    report = Report()
    sent: set[str] = set()
    outcome: dict[str, str] = {}  # value -> "ack" | "fail"
    acked_at: dict[str, set[Position]] = collections.defaultdict(set)
    at: dict[Position, dict[str, list[str]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    read_positions: dict[str, set[Position]] = collections.defaultdict(set)  # value -> positions reads found it at
    polled: dict[str, set[str]] = collections.defaultdict(set)  # consumer -> values
    last_offset: dict[tuple[str, str, int], int] = {}  # (consumer, topic, partition) -> last polled offset
    processed: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    for event in events:
        kind = event["kind"]
        if kind == "send":
            sent.add(event["value"])
        elif kind == "ack":
            value, position = event["value"], _position(event)
            outcome[value] = "ack"
            acked_at[value].add(position)
            at[position][value].append("ack")
        elif kind == "fail":
            outcome.setdefault(event["value"], "fail")  # an ack that came first stands
        elif kind == "leaders":
            continue
        elif kind == "seek":
            last_offset.pop((event["consumer"], event.get("topic", ""), int(event["partition"])), None)
        elif kind in ("poll", "process", "replica"):
            value, position = event["value"], _position(event)
            read_positions[value].add(position)
            if kind == "poll":
                source = f"poll:{event['consumer']}"
                polled[event["consumer"]].add(value)
                stream = (event["consumer"], position[0], position[1])
                previous = last_offset.get(stream)
                if previous is not None and position[2] <= previous:
                    report.non_monotonic.append(
                        {"consumer": event["consumer"], "topic": position[0], "partition": position[1],
                         "previous": previous, "offset": position[2]}
                    )
                last_offset[stream] = position[2]
            elif kind == "process":
                source = f"process:{event['group']}:{event['member']}"
                processed[event["group"]][value] += 1
            else:
                source = f"replica:{event['replica']}"
            if source not in at[position][value]:
                at[position][value].append(source)
        else:
            raise ValueError(f"unknown event kind {kind!r}")

    acked = [value for value, result in outcome.items() if result == "ack"]
    report.sent = len(sent)
    report.acked = len(acked)
    report.failed = sum(1 for result in outcome.values() if result == "fail")
    report.lost = sorted(value for value in acked if not read_positions.get(value))
    for value in sorted(set(read_positions) | set(acked_at)):
        positions = read_positions.get(value, set()) | acked_at.get(value, set())
        if len(positions) > 1 and idempotent:
            report.duplicated[value] = sorted(positions)
    for position in sorted(at):
        if len(at[position]) > 1:
            report.two_values_at_offset[position] = {value: sources for value, sources in sorted(at[position].items())}
    for consumer in complete_consumers:
        report.unseen[consumer] = sorted(value for value in acked if read_positions.get(value) and value not in polled[consumer])
    report.phantoms = sorted(value for value in read_positions if value not in sent)
    report.failed_but_written = sorted(v for v, result in outcome.items() if result == "fail" and read_positions.get(v))
    report.unacknowledged_written = sorted(v for v in sent if v not in outcome and read_positions.get(v))
    for group, counts in sorted(processed.items()):
        histogram = collections.Counter(counts[value] for value in acked)
        report.processing[group] = {
            "records_by_times_processed": {str(times): n for times, n in sorted(histogram.items())},
            "never_processed": sorted(value for value in acked if counts[value] == 0)[:20],
            "processed_more_than_once": sorted(value for value in acked if counts[value] > 1)[:20],
        }
    return report


# --- replicas' files ---------------------------------------------------------------------------------------


def replica_records(directory: str, max_offset: int | None = None) -> list[tuple[int, bytes | None]]:
    """Every record of one replica's log below ``max_offset`` (default: its log end): [(offset, value)].

    Read with logbus's ``PartitionLog`` from a copy of the directory, so the
    replica's own files are never written (opening a log recovers it: it may
    cut a torn tail or complete a cleaning's swap).
    """
    from logbus.storage import record_batch as rb  # noqa: PLC0415 (only this helper needs logbus)
    from logbus.storage.partition_log import PartitionLog  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="replica-copy-") as scratch:
        copy = os.path.join(scratch, os.path.basename(directory.rstrip("/")))
        shutil.copytree(directory, copy)
        log = PartitionLog(copy)
        try:
            end = log.log_end_offset if max_offset is None else min(max_offset, log.log_end_offset)
            offset, records = log.log_start_offset, []
            while offset < end:
                found = log.read(offset, max_bytes=8 << 20, max_offset=end)
                if found is None:
                    break
                data, position = found.data, 0
                while position < len(data):
                    header, batch = rb.decode_records(data, position)
                    values = batch.column("value").to_pylist()
                    records += [(header.base_offset + i, v) for i, v in enumerate(values) if header.base_offset + i >= offset]
                    position += header.size_bytes
                offset = found.next_offset
            return records
        finally:
            log.close()


def replica_events(topic: str, partition: int, replica: int, records: Iterable[tuple[int, bytes | str | None]]) -> list[dict]:
    """``replica`` events for :func:`check` from :func:`replica_records`."""
    return [
        {"kind": "replica", "topic": topic, "partition": partition, "replica": replica, "offset": offset,
         "value": value.decode() if isinstance(value, bytes) else value}
        for offset, value in records
    ]


def compare_replicas(logs: dict[int, list[tuple[int, object]]], bound: int | None = None) -> dict:
    """Compare one partition's replicas record by record below ``bound`` (the high watermark; default:
    the common prefix, the lowest log end among them). Returns the offsets where they disagree and, per
    replica, the offsets below the bound it lacks."""
    if bound is None:
        bound = min((records[-1][0] + 1 if records else 0) for records in logs.values()) if logs else 0
    by_offset: dict[int, dict[object, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for replica, records in logs.items():
        for offset, value in records:
            if offset < bound:
                by_offset[offset][value].append(replica)
    disagree = {offset: dict(values) for offset, values in sorted(by_offset.items()) if len(values) > 1}
    missing = {}
    for replica, records in logs.items():
        held = {offset for offset, _ in records}
        lacking = [offset for offset in sorted(by_offset) if offset not in held]
        if lacking:
            missing[replica] = lacking
    return {"bound": bound, "disagree": disagree, "missing": missing}
