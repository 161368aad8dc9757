"""``logbus groups``: list, describe and reset-offsets against a real cluster (real Ray, no mocks).

Like tests/api/test_cli.py, every command runs in-process through
``logbus.cli.main`` against the test session's Ray and the ``bus`` fixture's
controller. Offsets are committed by real consumers: a consumer with a manual
assignment commits as a non-member (allowed while the group has no members),
and a subscribed consumer polling in a thread of its own makes a group active.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest

import logbus
from logbus import TopicPartition
from logbus.cli import GROUPS_DESCRIBE_HEADERS, GROUPS_MEMBERS_HEADERS, GROUPS_PLAN_HEADERS, GROUPS_RESET_HEADERS, main
from tests.api.cli_helpers import Result, cli  # noqa: F401 (cli is a fixture)
from tests.conftest import wait_for

PER_PARTITION = 50
DRY_RUN_NOTE = "Dry run: nothing was changed. Add --execute to set these offsets.\n"


def rows(result: Result, headers: list[str]) -> list[list[str]]:
    """The rows of the first table of ``result``; checks its header line."""
    lines = result.lines
    assert lines[0].split() == headers, lines
    found = []
    for line in lines[1:]:
        if not line.strip():
            break
        found.append(line.split())
    return found


def section(result: Result, title: str) -> list[list[str]]:
    """The rows of the table after the line ``title`` (header line included)."""
    lines = result.lines
    start = lines.index(title)
    found = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        found.append(line.split())
    return found


def produce_stamped(bus, topic: str, partitions: int, base_ms: int) -> None:
    """PER_PARTITION records per partition; record i has timestamp base_ms + i seconds."""
    with logbus.Producer(bus, linger_ms=5) as producer:
        futures = [
            producer.send(topic, b"v%d" % i, partition=p, timestamp_ms=base_ms + i * 1000)
            for p in range(partitions)
            for i in range(PER_PARTITION)
        ]
    for future in futures:
        future.result()


def commit_as_non_member(bus, group: str, offsets: dict[TopicPartition, int]) -> None:
    consumer = logbus.Consumer(bus, group_id=group, enable_auto_commit=False)
    consumer.assign(list(offsets))
    commit_retrying(consumer, offsets)
    consumer.close()


def commit_retrying(consumer, offsets=None, timeout_s: float = 30.0) -> None:
    """commit(), again after retriable errors: the first commit of a cluster creates __consumer_offsets, and
    its new leader refuses writes (NotLeaderError, "lease expired") until its first lease renewal."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return consumer.commit(offsets)
        except logbus.LogbusError as error:
            if not error.retriable or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# --- no Ray needed -----------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["groups"], ["groups", "list"], ["groups", "describe"], ["groups", "reset-offsets"]])
def test_every_groups_command_has_help(argv, capsys):
    assert main([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: logbus groups")
    assert len(out.splitlines()) > 5


def test_groups_usage_errors_exit_2_without_connecting(capsys):
    for argv in (
        ["groups"],
        ["groups", "bogus"],
        ["groups", "describe"],  # --group missing
        ["groups", "reset-offsets", "--group", "g"],  # no --to-*
        ["groups", "reset-offsets", "--group", "g", "--to-earliest", "--to-latest"],
        ["groups", "reset-offsets", "--group", "g", "--to-offset", "-1"],
        ["groups", "reset-offsets", "--group", "g", "--to-offset", "soon"],
        ["groups", "reset-offsets", "--group", "g", "--to-datetime", "yesterday"],
        ["groups", "reset-offsets", "--group", "g", "--to-earliest", "--execute", "--dry-run"],
        ["groups", "reset-offsets", "--to-earliest"],  # --group missing
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "usage: logbus groups" in err and "error:" in err, argv


# --- against the bus fixture's cluster ------------------------------------------------------------------


def test_list_describe_and_reset_offsets_of_inactive_groups(cli, bus, topic_name):
    t = topic_name
    bus.admin.create_topic(t, partitions=2)
    base_ms = (time.time_ns() // 1_000_000 // 1000 - 3600) * 1000  # an hour ago, on a whole second
    produce_stamped(bus, t, 2, base_ms)
    tp0, tp1 = TopicPartition(t, 0), TopicPartition(t, 1)
    commit_as_non_member(bus, "billing", {tp0: 10, tp1: 20})
    commit_as_non_member(bus, "audit", {tp0: 50})

    listed = cli("groups", "list")
    assert (listed.code, listed.err) == (0, "")
    assert listed.lines == ["GROUP    STATE  PROTOCOL", "audit    Empty  -", "billing  Empty  -"]

    described = cli("groups", "describe", "--group", "billing")
    assert described.code == 0
    assert described.err == "Consumer group 'billing' has no active members.\n"
    assert described.lines[0].split() == GROUPS_DESCRIBE_HEADERS
    assert rows(described, GROUPS_DESCRIBE_HEADERS) == [
        ["billing", t, "0", "10", "50", "40", "-"],
        ["billing", t, "1", "20", "50", "30", "-"],
    ]
    # Aligned columns: each value starts under its header.
    header = described.lines[0]
    for line in described.lines[1:]:
        assert line.index(" 50 ") + 1 == header.index("LOG-END-OFFSET")
    assert rows(cli("groups", "describe", "--group", "audit"), GROUPS_DESCRIBE_HEADERS) == [["audit", t, "0", "50", "50", "0", "-"]]

    detailed = cli("groups", "describe", "--group", "billing", "--members", "--state")
    assert detailed.code == 0
    assert rows(detailed, GROUPS_DESCRIBE_HEADERS) == rows(described, GROUPS_DESCRIBE_HEADERS)
    assert section(detailed, "State:") == [["GROUP", "STATE", "PROTOCOL", "GENERATION", "#MEMBERS"], ["billing", "Empty", "-", "0", "0"]]
    assert section(detailed, "Members:") == [GROUPS_MEMBERS_HEADERS]

    # Dry runs: the plan is printed, nothing changes.
    plan = cli("groups", "reset-offsets", "--group", "billing", "--to-earliest")
    assert (plan.code, plan.err) == (0, DRY_RUN_NOTE)
    assert rows(plan, GROUPS_PLAN_HEADERS) == [["billing", t, "0", "10", "0"], ["billing", t, "1", "20", "0"]]
    for flags, expected in (
        (["--to-latest"], ["50", "50"]),
        (["--to-offset", "30", "--dry-run"], ["30", "30"]),
        (["--to-offset", "999"], ["50", "50"]),  # clamped to the high watermark
        (["--to-datetime", _utc(base_ms + 10_500)], ["11", "11"]),  # first record at or after 10.5 s
        (["--to-datetime", _local(base_ms + 20_000)], ["20", "20"]),  # no zone: local time
        (["--to-datetime", _utc(base_ms + 3_600_000 * 5)], ["50", "50"]),  # after every record: the end
        (["--to-datetime", "2000-01-01T00:00:00Z"], ["0", "0"]),
    ):
        plan = cli("groups", "reset-offsets", "--group", "billing", *flags)
        assert plan.code == 0, (flags, plan.err)
        assert [row[-1] for row in rows(plan, GROUPS_PLAN_HEADERS)] == expected, flags
    audit_plan = cli("groups", "reset-offsets", "--group", "audit", "--topic", t, "--to-earliest")
    assert rows(audit_plan, GROUPS_PLAN_HEADERS) == [["audit", t, "0", "50", "0"], ["audit", t, "1", "-", "0"]]
    assert bus.admin.describe_group("billing")["offsets"][0]["current_offset"] == 10
    assert rows(cli("groups", "describe", "--group", "billing"), GROUPS_DESCRIBE_HEADERS)[1][3:6] == ["20", "50", "30"]

    # --execute: applied, and printed with the previous offsets.
    applied = cli("groups", "reset-offsets", "--group", "billing", "--to-offset", "25", "--execute")
    assert (applied.code, applied.err) == (0, "")
    assert rows(applied, GROUPS_RESET_HEADERS) == [["billing", t, "0", "10", "25"], ["billing", t, "1", "20", "25"]]
    assert [r[3:6] for r in rows(cli("groups", "describe", "--group", "billing"), GROUPS_DESCRIBE_HEADERS)] == [["25", "50", "25"], ["25", "50", "25"]]

    applied = cli("groups", "reset-offsets", "--group", "billing", "--topic", t, "--to-datetime", _utc(base_ms + 10_500), "--execute")
    assert rows(applied, GROUPS_RESET_HEADERS) == [["billing", t, "0", "25", "11"], ["billing", t, "1", "25", "11"]]
    consumer = logbus.Consumer(bus, group_id="billing")
    assert consumer.committed([tp0, tp1]) == {tp0: 11, tp1: 11}  # what a consumer of the group starts from
    consumer.close()
    assert [r[5] for r in rows(cli("groups", "describe", "--group", "billing"), GROUPS_DESCRIBE_HEADERS)] == ["39", "39"]

    # A group that does not exist yet: named topics create its offsets.
    fresh_plan = cli("groups", "reset-offsets", "--group", "fresh", "--topic", t, "--to-latest")
    assert rows(fresh_plan, GROUPS_PLAN_HEADERS) == [["fresh", t, "0", "-", "50"], ["fresh", t, "1", "-", "50"]]
    assert "fresh" not in [g for g, _, _ in bus.admin.list_groups()]
    fresh = cli("groups", "reset-offsets", "--group", "fresh", "--topic", t, "--topic", t, "--to-latest", "--execute")
    assert rows(fresh, GROUPS_RESET_HEADERS) == [["fresh", t, "0", "-", "50"], ["fresh", t, "1", "-", "50"]]
    assert cli("groups", "list").lines[1:] == ["audit    Empty  -", "billing  Empty  -", "fresh    Empty  -"]
    assert [r[3:6] for r in rows(cli("groups", "describe", "--group", "fresh"), GROUPS_DESCRIBE_HEADERS)] == [["50", "50", "0"], ["50", "50", "0"]]


def test_active_group_unknown_and_malformed_groups_are_errors(cli, bus, topic_name):
    t = topic_name
    bus.admin.create_topic(t, partitions=2)
    produce_stamped(bus, t, 2, time.time_ns() // 1_000_000 - 60_000)

    # Malformed group ids fail before anything is asked of the cluster.
    for group, message in (
        ("", "error: group id must not be empty\n"),
        ("x" * 300, "error: group id is 300 characters; the limit is 255\n"),
        ("tab\there", "error: group id 'tab\\there' has non-printable characters\n"),
    ):
        for argv in (["groups", "describe", "--group", group], ["groups", "reset-offsets", "--group", group, "--to-earliest", "--execute"]):
            result = cli(*argv)
            assert (result.code, result.out, result.err) == (1, "", message), argv

    # Unknown groups (no members, no committed offsets).
    unknown = "error: group 'nope' does not exist (no members and no committed offsets)\n"
    for argv in (
        ["groups", "describe", "--group", "nope"],
        ["groups", "reset-offsets", "--group", "nope", "--to-earliest"],
        ["groups", "reset-offsets", "--group", "nope", "--to-earliest", "--execute"],
    ):
        result = cli(*argv)
        assert (result.code, result.out, result.err) == (1, "", unknown), argv
    missing_topic = cli("groups", "reset-offsets", "--group", "nope", "--topic", "no-such-topic", "--to-earliest")
    assert missing_topic.code == 1 and missing_topic.err == "error: topic 'no-such-topic' does not exist\n"
    bad_topic = cli("groups", "reset-offsets", "--group", "nope", "--topic", "../x", "--to-earliest")
    assert bad_topic.code == 1 and bad_topic.err.startswith("error: topic name ")
    assert cli("groups", "list").lines == ["GROUP  STATE  PROTOCOL"]

    # An active group: a subscribed consumer keeps polling (and committing) in a thread of its own.
    stop, joined, failures = threading.Event(), threading.Event(), []

    def member():
        try:
            consumer = logbus.Consumer(bus, group_id="live", client_id="cli-test", session_timeout_ms=3000, heartbeat_interval_ms=300, enable_auto_commit=False)
            consumer.subscribe([t])
            try:
                while not stop.is_set():
                    if consumer.poll(timeout_ms=100):
                        commit_retrying(consumer)
                    if len(consumer.assignment()) == 2:
                        joined.set()
            finally:
                consumer.close()
        except Exception as error:  # noqa: BLE001 (reported by the test below)
            failures.append(error)
            joined.set()

    thread = threading.Thread(target=member, daemon=True)
    thread.start()
    try:
        assert joined.wait(60) and not failures, failures

        def caught_up():
            offsets = bus.admin.describe_group("live")["offsets"]
            return [r["current_offset"] for r in offsets] == [PER_PARTITION, PER_PARTITION]

        wait_for(caught_up, timeout_s=30, message="the member's commits")
        (member_id,) = [m["member_id"] for m in bus.admin.describe_group("live")["members"]]
        assert cli("groups", "list").lines == ["GROUP  STATE   PROTOCOL", "live   Stable  range"]
        described = cli("groups", "describe", "--group", "live", "--members")
        assert (described.code, described.err) == (0, "")
        assert rows(described, GROUPS_DESCRIBE_HEADERS) == [["live", t, "0", "50", "50", "0", member_id], ["live", t, "1", "50", "50", "0", member_id]]
        assert section(described, "Members:") == [GROUPS_MEMBERS_HEADERS, ["live", member_id, "-", "cli-test", "2", f"{t}(0,1)"]]

        busy = "error: group 'live' has active members; stop them before resetting its offsets\n"
        for flags in (["--to-earliest"], ["--to-earliest", "--execute"], ["--topic", t, "--to-offset", "3", "--execute"]):
            refused = cli("groups", "reset-offsets", "--group", "live", *flags)
            assert (refused.code, refused.out, refused.err) == (1, "", busy), flags
        assert [r["current_offset"] for r in bus.admin.describe_group("live")["offsets"]] == [50, 50]
    finally:
        stop.set()
        thread.join(30)
    assert not failures, failures

    # Once its member left (close() leaves at once), the group can be reset.
    assert cli("groups", "list").lines == ["GROUP  STATE  PROTOCOL", "live   Empty  -"]
    reset = cli("groups", "reset-offsets", "--group", "live", "--to-earliest", "--execute")
    assert reset.code == 0, reset.err
    assert rows(reset, GROUPS_RESET_HEADERS) == [["live", t, "0", "50", "0"], ["live", t, "1", "50", "0"]]


def _utc(ms: int) -> str:
    """ISO 8601 in UTC with a Z, e.g. 2026-11-22T09:00:10.500000Z."""
    return datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc).replace(tzinfo=None).isoformat() + "Z"


def _local(ms: int) -> str:
    """ISO 8601 in local time without a zone."""
    return datetime.datetime.fromtimestamp(ms / 1000).isoformat()
