"""``logbus nodes list | drain``: the nodes that host replicas, and moving every replica off one."""

from __future__ import annotations

import argparse
import sys

from logbus.cli._common import connected, dash, int_flag, refusals, table
from logbus.errors import CliError

NODES_HEADERS = ["NodeID", "Alive", "Replicas", "Leaders", "MaxReplicas", "ReplicasDown", "Draining"]


def cmd_nodes_list(args) -> int:
    """Print every node that may host replicas: replicas, leaders, replica limit, liveness and drain state;
    then the hosts the cluster refused, and why."""
    with connected(args) as bus:
        nodes = bus.admin.nodes()
    rows = [[n["node_id"], "yes" if n["alive"] else "no", n["replicas"], n["leaders"], dash(n["max_replicas"]),
             n["replicas_down"], "yes" if n.get("draining") else "no"] for n in nodes if not n.get("refused")]
    sys.stdout.write(table(NODES_HEADERS, rows) + refusals(nodes))
    return 0


def cmd_nodes_drain(args) -> int:
    """Move every replica and leadership off a node, so it becomes idle and an autoscaler may remove it.

    The moves start at once and proceed in the background: ``logbus topics
    describe`` shows them, and ``logbus nodes list`` the node's replicas.
    """
    with connected(args) as bus:
        matches = [n["node_id"] for n in bus.admin.nodes() if n["node_id"].startswith(args.node)]
        if len(matches) != 1:
            raise CliError(f"{args.node!r} matches {len(matches)} nodes; give more of the node id")
        result = bus.admin.drain_node(matches[0], args.throttle)
    moving = result["moving"]
    sys.stdout.write(f"Draining node {matches[0]}: moving {len(moving)} partition(s)\n")
    for topic, partition in moving:
        sys.stdout.write(f"  {topic}-{partition}\n")
    return 0


def register(commands, common: argparse.ArgumentParser) -> None:
    """Add ``nodes`` and its actions to the ``logbus`` parser's ``commands``."""
    nodes = commands.add_parser("nodes", parents=[common], help="list nodes, drain a node", description="Manage the nodes that host replicas.")
    node_actions = nodes.add_subparsers(dest="action", metavar="ACTION", required=True)
    nodes_list = node_actions.add_parser("list", parents=[common], help="list nodes with replica counts", description=cmd_nodes_list.__doc__)
    nodes_list.set_defaults(func=cmd_nodes_list, parser=nodes_list)
    drain = node_actions.add_parser("drain", parents=[common], help="move every replica off a node", description=cmd_nodes_drain.__doc__)
    drain.add_argument("node", metavar="NODE", help="the node id (a unique prefix is enough)")
    drain.add_argument("--throttle", type=int_flag("--throttle", unit="bytes per second"), metavar="BYTES_PER_S", help="limit each moving replica's copy rate")
    drain.set_defaults(func=cmd_nodes_drain, parser=drain)
