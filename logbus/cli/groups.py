"""``logbus groups list | describe | reset-offsets`` (like kafka-consumer-groups)."""

from __future__ import annotations

import argparse
import sys
import time

from logbus.cli._common import connected, dash, err, int_flag, table
from logbus.errors import UnknownTopicError
from logbus.retry import retry_until
from logbus.storage.names import validate_topic_name

GROUPS_LIST_HEADERS = ["GROUP", "STATE", "PROTOCOL"]
GROUPS_DESCRIBE_HEADERS = ["GROUP", "TOPIC", "PARTITION", "CURRENT-OFFSET", "LOG-END-OFFSET", "LAG", "CONSUMER-ID"]
GROUPS_MEMBERS_HEADERS = ["GROUP", "CONSUMER-ID", "GROUP-INSTANCE-ID", "CLIENT-ID", "#PARTITIONS", "ASSIGNMENT"]
GROUPS_PLAN_HEADERS = ["GROUP", "TOPIC", "PARTITION", "CURRENT-OFFSET", "NEW-OFFSET"]
GROUPS_RESET_HEADERS = ["GROUP", "TOPIC", "PARTITION", "PREVIOUS-OFFSET", "NEW-OFFSET"]
RETRY_TIMEOUT_S = 30.0  # reset-offsets retries retriable errors (leader elections) this long


def _datetime(text: str):
    """ISO 8601 (``2026-11-22T10:00:00``, ``...Z``, ``...+02:00``); without a zone: local time, as Kafka does."""
    import datetime

    try:
        return datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an ISO 8601 date-time such as 2026-11-22T10:00:00Z, not {text!r}") from None


def _assignment_text(partitions) -> str:
    """Kafka's form: ``topic(0,1),other(2)``."""
    by_topic: dict[str, list[int]] = {}
    for topic, partition in partitions:
        by_topic.setdefault(topic, []).append(partition)
    return ",".join(f"{t}({','.join(str(p) for p in sorted(ps))})" for t, ps in sorted(by_topic.items())) or "-"


def cmd_groups_list(args) -> int:
    """Print every consumer group (with members or committed offsets): GROUP, STATE, PROTOCOL."""
    with connected(args) as bus:
        groups = bus.admin.list_groups()
    sys.stdout.write(table(GROUPS_LIST_HEADERS, [[g, state, dash(protocol)] for g, state, protocol in groups]))
    return 0


def cmd_groups_describe(args) -> int:
    """Print a group's committed offsets, log end offsets, lag and owners per partition (like kafka-consumer-groups --describe)."""
    from logbus.protocol.group_coordinator import validate_group_id

    group = validate_group_id(args.group)
    with connected(args) as bus:
        described = bus.admin.describe_group(group)
    rows = [
        [group, r["topic"], r["partition"], dash(r["current_offset"]), dash(r["log_end_offset"]), dash(r["lag"]), dash(r["consumer_id"])]
        for r in described["offsets"]
    ]
    # Like Kafka: a member without partitions still gets a row.
    listed = {r["consumer_id"] for r in described["offsets"]}
    rows += [[group, "-", "-", "-", "-", "-", m["member_id"]] for m in described["members"] if m["member_id"] not in listed]
    if not described["members"]:
        err(f"Consumer group '{group}' has no active members.")
    elif described["state"] != "Stable":
        err(f"Warning: consumer group '{group}' is rebalancing (state {described['state']}).")
    out = [table(GROUPS_DESCRIBE_HEADERS, rows)]
    if args.state:
        out.append("\nState:\n")
        out.append(
            table(
                ["GROUP", "STATE", "PROTOCOL", "GENERATION", "#MEMBERS"],
                [[group, described["state"], dash(described["protocol"]), described["generation"], len(described["members"])]],
            )
        )
    if args.members:
        out.append("\nMembers:\n")
        out.append(
            table(
                GROUPS_MEMBERS_HEADERS,
                [
                    [group, m["member_id"], dash(m["group_instance_id"]), m["client_id"], len(m["assignment"]), _assignment_text(m["assignment"])]
                    for m in described["members"]
                ],
            )
        )
    sys.stdout.write("".join(out))
    return 0


def _retrying(call, what: str, timeout_s: float = RETRY_TIMEOUT_S):
    """``call()``, called again after retriable logbus errors (a leader being elected) until ``timeout_s``."""
    return retry_until(
        time.monotonic() + timeout_s, what, lambda _left_s: call(),
        # UnknownTopicError is retriable for clients that wait for a topic to appear; not here.
        retriable=lambda error: error.retriable and not isinstance(error, UnknownTopicError),
    )


def _reset_target(args):
    if args.to_earliest:
        return "earliest"
    if args.to_latest:
        return "latest"
    if args.to_offset is not None:
        return args.to_offset
    return args.to_datetime


def _reset_plan(bus, group: str, to, topics: list[str] | None) -> tuple[dict, list[tuple]]:
    """(current committed offsets, [(tp, new offset)]) as ``Admin.reset_offsets`` would set them; changes nothing.

    Follows the controller's rules: the partitions of ``topics``, or else every
    partition the group has committed; offsets clamped to [log start, high
    watermark]; a date-time maps to the first record at or after it (the high
    watermark if there is none); a group with members cannot be reset.
    """
    import datetime

    import logbus
    from logbus import TopicPartition
    from logbus.errors import GroupNotEmptyError, InvalidGroupIdError

    try:
        described = bus.admin.describe_group(group)
    except InvalidGroupIdError:
        if not topics:
            raise  # no such group, and no topics named
        described = {"members": [], "offsets": []}  # a new group: reset creates its offsets
    if described["members"]:
        raise GroupNotEmptyError(f"group {group!r} has active members; stop them before resetting its offsets")
    current = {TopicPartition(r["topic"], r["partition"]): r["current_offset"] for r in described["offsets"] if r["current_offset"] is not None}
    if topics:
        tps = [TopicPartition(t, p) for t in topics for p in range(bus.topic_metadata(t, refresh=True).partition_count)]
    else:
        tps = sorted(current)
    if not tps:
        raise UnknownTopicError(f"group {group!r} has no committed offsets; name the topics to reset")
    consumer = logbus.Consumer(bus)
    try:
        start = consumer.beginning_offsets(tps)
        end = consumer.end_offsets(tps)
        if isinstance(to, datetime.datetime):
            ms = int(to.timestamp() * 1000)
            found = consumer.offsets_for_times({tp: ms for tp in tps})
            plan = [(tp, end[tp] if found[tp] is None else found[tp].offset) for tp in tps]
        elif to == "earliest":
            plan = [(tp, start[tp]) for tp in tps]
        elif to == "latest":
            plan = [(tp, end[tp]) for tp in tps]
        else:
            plan = [(tp, min(max(to, start[tp]), end[tp])) for tp in tps]
    finally:
        consumer.close()
    return current, plan


def cmd_groups_reset_offsets(args) -> int:
    """Show (or with --execute, apply) new committed offsets of an inactive group (like kafka-consumer-groups --reset-offsets)."""
    from logbus.protocol.group_coordinator import validate_group_id

    group = validate_group_id(args.group)
    topics = list(dict.fromkeys(args.topic)) if args.topic else None
    for topic in topics or ():
        validate_topic_name(topic)
    to = _reset_target(args)
    with connected(args) as bus:
        current, plan = _retrying(lambda: _reset_plan(bus, group, to, topics), f"planning the reset of group {group!r}")
        if args.execute:
            # Idempotent: a retry after a retriable error (the offsets topic's leader moving) commits the same offsets.
            applied = _retrying(lambda: bus.admin.reset_offsets(group, to=to, topics=topics), f"resetting the offsets of group {group!r}")
    if not args.execute:
        sys.stdout.write(table(GROUPS_PLAN_HEADERS, [[group, tp.topic, tp.partition, dash(current.get(tp)), offset] for tp, offset in plan]))
        err("Dry run: nothing was changed. Add --execute to set these offsets.")
        return 0
    from logbus import TopicPartition

    rows = [[group, tp[0], tp[1], dash(current.get(TopicPartition(*tp))), offset] for tp, offset in sorted(applied.items())]
    sys.stdout.write(table(GROUPS_RESET_HEADERS, rows))
    return 0


def register(commands, common: argparse.ArgumentParser) -> None:
    """Add ``groups`` and its actions to the ``logbus`` parser's ``commands``."""
    groups = commands.add_parser(
        "groups", parents=[common], help="list and describe consumer groups, reset their offsets",
        description="Manage consumer groups (like kafka-consumer-groups).",
    )  # fmt: skip
    actions = groups.add_subparsers(dest="action", metavar="ACTION", required=True)

    listing = actions.add_parser(
        "list", parents=[common], help="list consumer groups",
        description=cmd_groups_list.__doc__ + " A group without members has state Empty and PROTOCOL -.",
    )  # fmt: skip
    listing.set_defaults(func=cmd_groups_list, parser=listing)

    describe = actions.add_parser(
        "describe",
        parents=[common],
        help="show a group's offsets, lag and members",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            cmd_groups_describe.__doc__ + "\n\n"
            "Columns: " + " ".join(GROUPS_DESCRIBE_HEADERS) + ". CURRENT-OFFSET is the group's committed\n"
            "offset, LOG-END-OFFSET the partition's high watermark, LAG their difference, CONSUMER-ID\n"
            "the member that owns the partition now; '-' where there is none. Partitions appear if\n"
            "the group committed them or a member owns them; a member with no partitions gets a row\n"
            "of its own. A note goes to stderr if the group has no members or is rebalancing."
        ),
    )
    describe.add_argument("--group", required=True, help="the group id")
    describe.add_argument("--members", action="store_true", help="also list the members: " + " ".join(GROUPS_MEMBERS_HEADERS))
    describe.add_argument("--state", action="store_true", help="also print the group's state, strategy, generation and member count")
    describe.set_defaults(func=cmd_groups_describe, parser=describe)

    reset = actions.add_parser(
        "reset-offsets",
        parents=[common],
        help="reset an inactive group's committed offsets",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            cmd_groups_reset_offsets.__doc__ + "\n\n"
            "Without --execute nothing changes: the plan is printed (" + " ".join(GROUPS_PLAN_HEADERS) + ").\n"
            "With --execute the offsets are committed and printed (" + " ".join(GROUPS_RESET_HEADERS) + ").\n"
            "Applies to every partition of each --topic, or else to every partition the group has\n"
            "committed. Offsets are clamped to [log start, high watermark]; --to-datetime picks the\n"
            "first record at or after that time (the high watermark if there is none). A group with\n"
            "members cannot be reset (stop its consumers first)."
        ),
    )
    reset.add_argument("--group", required=True, help="the group id")
    reset.add_argument("--topic", action="append", metavar="TOPIC", help="reset every partition of this topic (repeatable; default: the group's committed partitions)")
    target = reset.add_mutually_exclusive_group(required=True)
    target.add_argument("--to-earliest", action="store_true", help="to each partition's log start offset")
    target.add_argument("--to-latest", action="store_true", help="to each partition's high watermark")
    target.add_argument("--to-offset", type=int_flag("--to-offset", 0), metavar="N", help="to offset N (clamped to the partition's range)")
    target.add_argument("--to-datetime", type=_datetime, metavar="ISO8601", help="to the first record at or after this time, e.g. 2026-11-22T10:00:00Z (local time without a zone)")
    run = reset.add_mutually_exclusive_group()
    run.add_argument("--execute", action="store_true", help="apply the reset (default: only print the plan)")
    run.add_argument("--dry-run", action="store_true", help="only print the plan (the default)")
    reset.set_defaults(func=cmd_groups_reset_offsets, parser=reset)
