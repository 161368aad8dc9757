"""Where replicas live: the nodes that may host them, the Ray node each is now, and each replica's directory.

If any live node offers the custom resource ``logbus_replica``, only such
nodes host replicas (so a cluster can keep them off its head node); otherwise
every live node does. A replica's log directory is
``{data_dir}/replica-{id}/{topic}-{partition}``: replica ids are per
partition, and a replacement replica gets a fresh id, hence a fresh directory.

Node identity. A host that joined with ``logbus join --data-dir DIR`` is the
node named by the id in ``DIR/meta.properties`` (``storage/node_identity.py``),
which it advertises as the Ray node label ``logbus.node``; ``logbus join``
also gives its Ray processes the environment variable
``LOGBUS_NODE_DATA_DIR=DIR``, which Ray's workers on that node inherit, so
the node's replicas keep their logs in DIR (``data_dir`` above is DIR) and
:func:`host_identity`, run there, can read and record the identity. A Ray
node without the label is the node named by its Ray node id, with its
replicas under the cluster's data directory (the controller's), as on one
machine, where every Ray node sees that directory. The controller maps each
node id to the Ray node carrying it now (:func:`replica_hosts`).

The autoscaler. Work that needs more nodes than the cluster has (a topic,
a drain) asks for them as pending demand: placement groups of replica
slots on distinct nodes (:func:`reserve_replica_slots`), which an
autoscaler that can add nodes with slots (:func:`autoscaler_replica_capacity`)
answers; the slots are released once the replicas' actors take them over.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from logbus.errors import NodeCapacityError
from logbus.protocol.host_map import RayNode
from logbus.storage import node_identity
from logbus.storage.names import partition_dir_name

logger = logging.getLogger(__name__)

REPLICA_NODE_RESOURCE = "logbus_replica"
# What one replica may take of a node's memory, for the default max.replicas.per.node: a replica
# process's own memory measured about 60-70 MiB (USS) here, plus room for its page cache share
# and growth (perf/bench_scale.py measures it).
REPLICA_MEMORY_BYTES = 96 << 20
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives this resource to the head node only


NODE_LABEL = "logbus.node"  # a host's logbus node id, advertised by `logbus join`
NODE_DATA_DIR_ENV = "LOGBUS_NODE_DATA_DIR"  # the host's data directory, in the environment of its Ray processes


def node_id_of(node: dict) -> str:
    """The node id of a Ray node (an entry of ``ray.nodes()``): its ``logbus.node`` label, else its Ray node id."""
    return (node.get("Labels") or {}).get(NODE_LABEL) or node["NodeID"]


def _replica_entries() -> list[dict]:
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    marked = [node for node in nodes if node.get("Resources", {}).get(REPLICA_NODE_RESOURCE)]
    return marked or nodes


def replica_hosts(max_replicas_per_node: int | None = None) -> list[RayNode]:
    """The live Ray nodes that may host replicas (see the module docstring), sorted by Ray node id; one GCS query.

    Two Ray nodes may carry one node id for a while: a host that restarted
    joins again before Ray declares its old Ray node dead. The controller
    decides which one is the node (``protocol/host_map.py``).
    """
    hosts = []
    for node in _replica_entries():
        labels = node.get("Labels") or {}
        hosts.append(RayNode(
            ray_node_id=node["NodeID"],
            node_id=node_id_of(node),
            labelled=bool(labels.get(NODE_LABEL)),
            limit=replica_limit(node, max_replicas_per_node),
            rack=next((labels[k] for k in RACK_LABELS if labels.get(k)), ""),
        ))
    return sorted(hosts, key=lambda host: host.ray_node_id)


def live_node_ids() -> list[str]:
    """The node ids of the live Ray nodes that may host replicas, sorted (see the module docstring)."""
    return sorted({host.node_id for host in replica_hosts()})


def host_identity(node_id: str, cluster_id: str) -> dict:
    """Run on a host's Ray node: its data directory and identity, checked, with ``cluster_id`` recorded on first use.

    Returns ``{"node_id", "data_dir"}``; ``data_dir`` None when the host's Ray
    processes were not given one (a Ray node labelled by other means): its
    replicas then live under the cluster's data directory. Raises
    InconsistentClusterIdError for a directory of another cluster and
    NodeIdentityError for one without this node's identity.
    """
    directory = os.environ.get(NODE_DATA_DIR_ENV)
    if not directory:
        return {"node_id": node_id, "data_dir": None}
    node_identity.adopt(directory, node_id, cluster_id)
    return {"node_id": node_id, "data_dir": os.path.abspath(directory)}


EMBEDDED_MEMORY_SHARE = 0.6  # of the machine's memory, what an embedded cluster's replicas may use


def replica_limit(node: dict, max_replicas_per_node: int | None = None) -> int:
    """How many replicas one node (an entry of ``ray.nodes()``) may hold.

    A node that advertises replica slots (the custom resource ``logbus_replica``)
    holds at most that many; otherwise what its schedulable memory (Ray's
    ``memory`` resource) holds at REPLICA_MEMORY_BYTES per replica (at least
    one). ``max_replicas_per_node`` lowers either.
    """
    resources = node.get("Resources", {})
    slots = int(resources.get(REPLICA_NODE_RESOURCE, 0))
    limit = slots if slots > 0 else max(1, int(resources.get("memory", 0) // REPLICA_MEMORY_BYTES))
    return limit if max_replicas_per_node is None else min(limit, max_replicas_per_node)


def uses_replica_slots() -> bool:
    """Whether replicas declare their demand: some node advertises ``logbus_replica`` slots. Each replica
    then asks for one slot, so Ray (and its autoscaler) sees what replicas need; a cluster whose
    nodes advertise none places replicas by node only, as Ray's CPUs do not count them."""
    return any(node.get("Alive") and node.get("Resources", {}).get(REPLICA_NODE_RESOURCE) for node in ray.nodes())


def embedded_slots(total_memory_bytes: int) -> int:
    """Replica slots for the one node of an embedded cluster, from the machine's memory."""
    return max(1, int(total_memory_bytes * EMBEDDED_MEMORY_SHARE // REPLICA_MEMORY_BYTES))


RACK_LABELS = ("logbus.rack", "ray.io/availability-zone", "zone")  # the first a node has names its rack


def node_racks() -> dict[str, str]:
    """The rack of every live node that may host replicas (by node id), from its Ray labels ("" where it has none)."""
    return {host.node_id: host.rack for host in replica_hosts()}


def node_limits(max_replicas_per_node: int | None = None) -> dict[str, int]:
    """The replica limit of every live node that may host replicas (by node id)."""
    return {host.node_id: host.limit for host in replica_hosts(max_replicas_per_node)}


def replica_directory(data_dir: str, topic: str, partition: int, replica_id: int) -> str:
    """The log directory of one replica of one partition."""
    return os.path.join(data_dir, f"replica-{replica_id}", partition_dir_name(topic, partition))


# --- the autoscaler: can the cluster grow to hold more replicas? -------------------------------------


class SlotReservation:
    """Placement groups holding replica slots until the replicas' actors take them over.

    One group per partition, of ``replication_factor`` slots on distinct nodes.
    ``placements`` is for its holder to fill: the logbus node of each slot,
    per group. :meth:`release` is idempotent: the slots go back once the new
    replicas' actors exist (pending on them), or when the work is abandoned.
    """

    def __init__(self, groups: list, replication_factor: int) -> None:
        self.groups = groups
        self.replication_factor = replication_factor
        self.placements: list[list[str]] = []

    def ray_nodes(self) -> list[list[str]]:
        """The Ray node of each slot, per group (the groups are ready)."""
        return [
            [placement_group_table(g)["bundles_to_node_id"][i] for i in range(self.replication_factor)] for g in self.groups
        ]

    def release(self) -> None:
        groups, self.groups = self.groups, []
        for group in groups:
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 (already gone)
                pass


async def reserve_replica_slots(what: str, partitions: int, replication_factor: int, timeout_s: float) -> SlotReservation:
    """Pending demand the autoscaler answers: one placement group per partition, each of
    ``replication_factor`` replica slots on distinct nodes (STRICT_SPREAD). Returns once all are
    held; NodeCapacityError naming what is missing (and nothing held) if the autoscaler does not
    provide them within ``timeout_s``. ``what`` names the work that needs them, in the log and the error."""
    groups = [
        placement_group([{REPLICA_NODE_RESOURCE: 1}] * replication_factor, strategy="STRICT_SPREAD", name=f"logbus:{uuid.uuid4().hex[:12]}")
        for _ in range(partitions)
    ]
    reservation = SlotReservation(groups, replication_factor)
    logger.info("%s needs %d replicas on %d distinct nodes each: waiting up to %.0f s for the autoscaler",
                what, partitions * replication_factor, replication_factor, timeout_s)
    ready = [asyncio.wrap_future(g.ready().future()) for g in groups]
    try:
        await asyncio.wait_for(asyncio.gather(*ready), timeout_s)
    except asyncio.TimeoutError:
        reservation.release()
        done = sum(1 for f in ready if f.done() and not f.cancelled() and f.exception() is None)
        raise NodeCapacityError(
            f"{what}: the autoscaler did not provide {partitions * replication_factor} replica slots "
            f"({REPLICA_NODE_RESOURCE}) on {replication_factor} distinct nodes per partition within {timeout_s:.0f} s "
            f"({done} of {partitions} partitions placed); add nodes with replica slots or raise the autoscaler's max_workers"
        ) from None
    except BaseException:
        reservation.release()
        raise
    return reservation


def autoscaler_replica_capacity() -> int:
    """How many nodes with replica slots the cluster's autoscaler may run (0: none, or no autoscaler).

    Ray has no public query for "is an autoscaler running, and what can it
    add". Every head node runs a monitor; only a monitor started with an
    autoscaling config can add nodes, and it says so on its command line
    (``--autoscaling-config=PATH``, Ray's v1 monitor, which the status in
    GCS names by pid). Its node types say which nodes offer
    ``logbus_replica`` slots and how many of each it may start. The config
    is read on the head's host, where the controller runs. Anything that
    cannot be read counts as no autoscaler: a request that needs more nodes
    then fails at once instead of waiting for nodes that will not come.
    """
    import json  # noqa: PLC0415 (rarely needed)

    import yaml  # noqa: PLC0415 (Ray's own dependency; only for the autoscaler's config)
    from ray.experimental.internal_kv import _internal_kv_get  # noqa: PLC0415

    try:
        raw = _internal_kv_get("__autoscaling_status")
        if not raw:
            return 0
        pid = json.loads(raw)["monitor_pid"]
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            args = file.read().split(b"\0")
        flag = b"--autoscaling-config="
        path = next(a[len(flag):] for a in args if a.startswith(flag))
        with open(path) as file:
            config = yaml.safe_load(file)
    except (OSError, ValueError, KeyError, StopIteration, TypeError, yaml.YAMLError):
        return 0
    # An upper bound: the node types' max_workers, whether or not some run already (nodes do not
    # say which type started them); placement groups then find out what really fits.
    return sum(
        max(0, int(node_type.get("max_workers", 0)))
        for node_type in (config.get("available_node_types") or {}).values()
        if (node_type.get("resources") or {}).get(REPLICA_NODE_RESOURCE, 0) >= 1
    )
