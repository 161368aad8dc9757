"""``logbus status``: nodes, topics, partition health and the biggest group lags on one screen."""

from __future__ import annotations

import argparse
import json
import sys

from logbus.cli._common import configs, connected, dash, ids, refusals, table
from logbus.errors import LogbusError, UnknownTopicError

STATUS_LAGS_SHOWN = 10


def _status(bus) -> dict:
    """Everything `logbus status` shows, as plain data (the --json output)."""
    from logbus.actors.remote import get

    nodes = bus.admin.nodes()
    topics, under, offline = [], [], []
    for name in bus.admin.list_topics():
        try:
            described = bus.admin.describe_topic(name)
        except UnknownTopicError:
            continue  # deleted since it was listed
        for p in described.partitions:
            row = {"topic": name, "partition": p.partition, "leader": p.leader, "replicas": list(p.replicas), "isr": list(p.isr)}
            if p.leader is None:
                offline.append(row)
            elif len(p.isr) < len(p.replicas):
                under.append(row)
        topics.append({
            "topic": name, "partitions": len(described.partitions),
            "replication_factor": len(described.partitions[0].replicas) if described.partitions else 0,
            "records": sum(max(0, p.high_watermark - max(0, p.log_start_offset)) for p in described.partitions),
            "config": described.config,
        })
    lags = []
    for group_id, _, _ in bus.admin.list_groups():
        try:
            described = bus.admin.describe_group(group_id)
        except LogbusError:
            continue
        lags += [{"group": group_id, "topic": r["topic"], "partition": r["partition"], "lag": r["lag"]} for r in described["offsets"] if r["lag"] is not None]
    lags.sort(key=lambda r: -r["lag"])
    calls = get(bus.controller.call_counts.remote())
    return {
        "namespace": bus.namespace, "data_dir": bus.data_dir, "nodes": nodes, "topics": topics,
        "under_replicated_partitions": under, "offline_partitions": offline,
        "group_lags": lags[:STATUS_LAGS_SHOWN], "controller_calls": calls,
    }


def _short_node_id(node_id: str) -> str:
    """A host's node id whole (``node-`` and 16 hex digits), a Ray node id's first 16 hex digits."""
    return node_id if node_id.startswith("node-") else node_id[:16]


def _mib(value) -> str:
    return "-" if value is None else f"{value / (1 << 20):.1f}"


def cmd_status(args) -> int:
    """One screen: nodes (replicas, leaders, bytes, memory per replica, limit), topics, under-replicated and
    offline partitions, and the biggest consumer-group lags. --json prints the same as one JSON object."""
    with connected(args) as bus:
        status = _status(bus)
    if args.json:
        sys.stdout.write(json.dumps(status, indent=1, sort_keys=True) + "\n")
        return 0
    nodes = status["nodes"]
    out = [
        f"logbus: namespace {status['namespace']}, data dir {status['data_dir']}\n",
        f"Nodes: {sum(1 for n in nodes if not n.get('refused'))} ({sum(1 for n in nodes if n['alive'])} alive), "
        f"{sum(n['replicas'] for n in nodes)} replicas; MaxReplicas is max.replicas.per.node\n",
        table(
            ["NodeID", "Alive", "Replicas", "Leaders", "MaxReplicas", "Bytes", "MiBPerReplica", "Draining"],
            [[_short_node_id(n["node_id"]), "yes" if n["alive"] else "no", n["replicas"], n["leaders"], dash(n["max_replicas"]),
              n.get("bytes", 0), _mib(n.get("memory_per_replica_bytes")), "yes" if n.get("draining") else "no"]
             for n in nodes if not n.get("refused")],
        ),
        refusals(nodes),
        f"\nTopics: {len(status['topics'])}\n",
    ]
    if status["topics"]:
        out.append(table(["Topic", "Partitions", "ReplicationFactor", "Records", "Configs"],
                          [[t["topic"], t["partitions"], t["replication_factor"], t["records"], configs(t["config"])] for t in status["topics"]]))
    for title, rows in (("Under-replicated partitions", status["under_replicated_partitions"]), ("Offline partitions", status["offline_partitions"])):
        out.append(f"\n{title}: {len(rows) or 'none'}\n")
        if rows:
            out.append(table(["Topic", "Partition", "Leader", "Replicas", "Isr"],
                              [[r["topic"], r["partition"], dash(r["leader"]), ids(r["replicas"]), ids(r["isr"])] for r in rows]))
    lags = status["group_lags"]
    out.append(f"\nBiggest group lags: {'none' if not lags else ''}\n")
    if lags:
        out.append(table(["Group", "Topic", "Partition", "Lag"], [[r["group"], r["topic"], r["partition"], r["lag"]] for r in lags]))
    sys.stdout.write("".join(out))
    return 0


def register(commands, common: argparse.ArgumentParser) -> None:
    """Add ``status`` to the ``logbus`` parser's ``commands``."""
    status = commands.add_parser("status", parents=[common], help="nodes, topics, partition health and group lags at a glance", description=cmd_status.__doc__)
    status.add_argument("--json", action="store_true", help="print the status as one JSON object")
    status.set_defaults(func=cmd_status, parser=status)
