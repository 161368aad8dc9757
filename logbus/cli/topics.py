"""``logbus topics create | list | describe | alter | delete`` (like kafka-topics)."""

from __future__ import annotations

import argparse
import sys

from logbus.cli._common import configs, connected, dash, ids, int_flag, table
from logbus.errors import UnknownTopicError
from logbus.protocol.cluster_metadata import PARTITIONS_MAX
from logbus.storage.names import validate_topic_name

DESCRIBE_HEADERS = ["Topic", "Partition", "Leader", "Replicas", "Isr", "LeaderEpoch", "LogStartOffset", "HighWatermark"]
REASSIGN_HEADERS = ["Topic", "Partition", "TargetNodes", "Adding", "Removing", "Copied(replica:offset/leader)", "Throttle(B/s)"]
TIER_HEADERS = ["Topic", "Partition", "TierStart", "UploadedUpTo", "Files", "RemoteBytes", "LocalBytes", "UploadLagBytes", "IcebergTable"]


def _config_items(text: str) -> list[tuple[str, str]]:
    """``k=v`` or Kafka's ``k1=v1,k2=v2``."""
    items = []
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {part!r}")
        items.append((key.strip(), value.strip()))
    return items


def cmd_topics_create(args) -> int:
    """Create a topic; its replica actors are running when this returns."""
    validate_topic_name(args.topic)
    config = dict(args.config or [])
    with connected(args) as bus:
        if args.if_not_exists and args.topic in bus.admin.list_topics():
            return 0
        bus.admin.create_topic(args.topic, partitions=args.partitions, replication_factor=args.replication_factor, config=config or None)
    print(f"Created topic {args.topic}.")
    return 0


def cmd_topics_list(args) -> int:
    """Print every topic name, one per line, sorted."""
    with connected(args) as bus:
        topics = bus.admin.list_topics()
    sys.stdout.write("".join(f"{t}\n" for t in topics))
    return 0


def _describe_rows(description) -> list[list]:
    return [
        [
            description.name,
            p.partition,
            "none" if p.leader is None else p.leader,
            ids(p.replicas),
            ids(p.isr),
            p.leader_epoch,
            p.log_start_offset,
            p.high_watermark,
        ]
        for p in description.partitions
    ]


def cmd_topics_describe(args) -> int:
    """Print each topic's summary line and a table of its partitions."""
    if args.topic is not None:
        validate_topic_name(args.topic)
    with connected(args) as bus:
        names = [args.topic] if args.topic is not None else bus.admin.list_topics()
        descriptions = []
        for name in names:
            try:
                descriptions.append(bus.admin.describe_topic(name))
            except UnknownTopicError:
                if args.topic is not None:
                    raise
                # deleted since it was listed
        reassignments = bus.admin.describe_reassignments()
        tiers = {d.name: bus.admin.describe_tier(d.name) for d in descriptions if d.config.get("remote.storage.enable") in (True, "true")}
    blocks = []
    for d in descriptions:
        replication_factor = len(d.partitions[0].replicas) if d.partitions else 0
        summary = f"Topic: {d.name}\tPartitionCount: {len(d.partitions)}\tReplicationFactor: {replication_factor}\tConfigs: {configs(d.config)}\n"
        blocks.append(summary + table(DESCRIBE_HEADERS, _describe_rows(d)))
    for name, tier in tiers.items():
        rows = [
            [name, p, dash(t and t["log_start_offset"]), dash(t and t["uploaded_up_to"]), dash(t and t["files"]),
             dash(t and t["remote_bytes"]), dash(t and t["local_bytes"]), dash(t and t["upload_lag_bytes"]),
             dash(t and t["iceberg_table"])]
            for p, t in sorted(tier.items())
        ]
        blocks.append("Remote tier:\n" + table(TIER_HEADERS, rows))
    shown = {d.name for d in descriptions}
    moving = [m for m in reassignments if m["topic"] in shown]
    if moving:
        rows = [
            [m["topic"], m["partition"], ",".join(n[:12] for n in m["target"]), ids(m["adding"]), ids(m["removing"]),
             " ".join(f"{r}:{dash(o)}/{dash(m['leader_log_end_offset'])}" for r, o in m["copied"].items()),
             dash(m["throttle_bytes_per_s"])]
            for m in moving
        ]
        blocks.append("Reassignments in progress:\n" + table(REASSIGN_HEADERS, rows))
    sys.stdout.write("\n".join(blocks))
    return 0


def cmd_topics_delete(args) -> int:
    """Delete a topic: its replica actors stop and its files are removed."""
    validate_topic_name(args.topic)
    with connected(args) as bus:
        try:
            bus.admin.delete_topic(args.topic)
        except UnknownTopicError:
            if args.if_exists:
                return 0
            raise
    print(f"Deleted topic {args.topic}.")
    return 0


def cmd_topics_alter(args) -> int:
    """Change a topic's config overrides and/or grow its partition count."""
    validate_topic_name(args.topic)
    with connected(args) as bus:
        if args.config:
            overrides = bus.admin.alter_config(args.topic, dict(args.config))
            print(f"Updated config of topic {args.topic}: {configs(overrides)}")
        if args.partitions is not None:
            description = bus.admin.create_partitions(args.topic, args.partitions)
            print(f"Topic {args.topic} now has {len(description.partitions)} partitions.")
    return 0


def _check_alter(args) -> None:
    if not args.config and args.partitions is None:
        args.parser.error("nothing to alter: give --config KEY=VALUE and/or --partitions N")


def register(commands, common: argparse.ArgumentParser) -> None:
    """Add ``topics`` and its actions to the ``logbus`` parser's ``commands``."""
    topics = commands.add_parser("topics", parents=[common], help="create, list, describe, alter and delete topics", description="Manage topics (like kafka-topics).")
    actions = topics.add_subparsers(dest="action", metavar="ACTION", required=True)

    create = actions.add_parser("create", parents=[common], help="create a topic", description=cmd_topics_create.__doc__)
    create.add_argument("--topic", required=True, help="topic name: 1-249 characters from [a-zA-Z0-9._-]")
    create.add_argument("--partitions", type=int_flag("--partitions", 1, PARTITIONS_MAX), default=1, help="number of partitions (default: 1)")
    create.add_argument("--replication-factor", type=int_flag("--replication-factor"), default=1, help="replicas per partition, on distinct Ray nodes (default: 1)")
    create.add_argument("--config", action="extend", type=_config_items, metavar="KEY=VALUE", help="a topic config override, e.g. retention.ms=60000 (repeatable; or k1=v1,k2=v2)")
    create.add_argument("--if-not-exists", action="store_true", help="succeed quietly if the topic exists")
    create.set_defaults(func=cmd_topics_create, parser=create)

    listing = actions.add_parser("list", parents=[common], help="list topic names", description=cmd_topics_list.__doc__)
    listing.set_defaults(func=cmd_topics_list, parser=listing)

    describe = actions.add_parser(
        "describe",
        parents=[common],
        help="describe topics and their partitions",
        description=cmd_topics_describe.__doc__ + " Columns: " + ", ".join(DESCRIBE_HEADERS) + ". Leader, Replicas and Isr are replica ids.",
    )
    describe.add_argument("--topic", help="the topic to describe (default: every topic)")
    describe.set_defaults(func=cmd_topics_describe, parser=describe)

    delete = actions.add_parser("delete", parents=[common], help="delete a topic", description=cmd_topics_delete.__doc__)
    delete.add_argument("--topic", required=True, help="the topic to delete")
    delete.add_argument("--if-exists", action="store_true", help="succeed quietly if the topic does not exist")
    delete.set_defaults(func=cmd_topics_delete, parser=delete)

    alter = actions.add_parser("alter", parents=[common], help="change topic configs or partition count", description=cmd_topics_alter.__doc__)
    alter.add_argument("--topic", required=True, help="the topic to alter")
    alter.add_argument("--config", "--add-config", dest="config", action="extend", type=_config_items, metavar="KEY=VALUE", help="a config override to set (repeatable; or k1=v1,k2=v2)")
    alter.add_argument("--partitions", type=int_flag("--partitions", 1, PARTITIONS_MAX), help="grow the topic to this many partitions")
    alter.set_defaults(func=cmd_topics_alter, parser=alter, check=_check_alter)
