"""A host's logbus identity, kept in its data directory: ``meta.properties``, as Kafka keeps a broker's.

A replica belongs to a node, and a node is a host's data directory, not a
Ray node: a host whose Ray node restarts (a crash, then ``logbus join``
again) comes back as a new Ray node, with its disk and the replicas' logs on
it unchanged. So ``logbus join --data-dir DIR`` gives the host an identity
of its own the first time it starts over DIR, writes it into
``DIR/meta.properties``, and advertises it as the Ray node label
``logbus.node``; the cluster places replicas on that id and finds the Ray
node carrying it (``actors/placement.py``).

The file, in Java properties syntax as Kafka's ``meta.properties``::

    #logbus node identity: written by `logbus join`, read by the cluster; do not edit
    version=1
    node.id=node-3f9a2c1b7e4d5a60
    cluster.id=1c0e6f4b2a9d4e8f9b7a6c5d4e3f2a1b

``node.id`` is written on first start. ``cluster.id`` is absent until a
cluster first uses the node, which records its own id then
(:func:`adopt`); from then on the directory belongs to that cluster, and
another cluster refuses it (:class:`~logbus.errors.InconsistentClusterIdError`
naming both ids), as a Kafka broker refuses to join a cluster whose id is
not the one in its ``meta.properties``. Both writes replace the file
atomically (``files.write_atomically``).

A node id is ``node-`` and 16 hex digits: a valid Ray label value, and never
a Ray node id (56 hex digits), which is what identifies a node without the
label (``is_node_id``).
"""

from __future__ import annotations

import dataclasses
import os
import secrets

from logbus.errors import InconsistentClusterIdError, NodeIdentityError
from logbus.storage.files import write_atomically

META_FILE = "meta.properties"
META_VERSION = 1
NODE_ID_PREFIX = "node-"
NODE_ID_HEX_DIGITS = 16  # 64 random bits: two hosts never draw the same id
META_BYTES_MAX = 4096  # a file larger than this is not ours
HEADER = "#logbus node identity: written by `logbus join`, read by the cluster; do not edit"


@dataclasses.dataclass(frozen=True)
class NodeMeta:
    """What ``meta.properties`` holds: the node's id and, once a cluster used the node, that cluster's id."""

    node_id: str
    cluster_id: str | None = None

    def to_text(self) -> str:
        lines = [HEADER, f"version={META_VERSION}", f"node.id={self.node_id}"]
        if self.cluster_id is not None:
            lines.append(f"cluster.id={self.cluster_id}")
        return "\n".join(lines) + "\n"


def new_node_id() -> str:
    """A fresh node id (``node-`` and 16 random hex digits)."""
    return NODE_ID_PREFIX + secrets.token_hex(NODE_ID_HEX_DIGITS // 2)


def is_node_id(text: object) -> bool:
    """Whether ``text`` is a node id ``logbus join`` makes (not a Ray node id)."""
    if not isinstance(text, str) or not text.startswith(NODE_ID_PREFIX):
        return False
    digits = text[len(NODE_ID_PREFIX):]
    return len(digits) == NODE_ID_HEX_DIGITS and all(c in "0123456789abcdef" for c in digits)


def meta_path(directory: str) -> str:
    return os.path.join(directory, META_FILE)


def parse(text: str, where: str) -> NodeMeta:
    """A ``meta.properties`` text as a NodeMeta; NodeIdentityError naming ``where`` if it is not one."""
    fields: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(("#", "!")):
            continue
        key, equals, value = line.partition("=")
        if not equals:
            raise NodeIdentityError(f"{where}: line {number} is not key=value: {line[:80]!r}")
        fields[key.strip()] = value.strip()
    if fields.get("version") != str(META_VERSION):
        raise NodeIdentityError(f"{where}: version {fields.get('version')!r}; this logbus reads version {META_VERSION}")
    node_id = fields.get("node.id")
    if not is_node_id(node_id):
        raise NodeIdentityError(f"{where}: node.id {node_id!r} is not a logbus node id ({NODE_ID_PREFIX} and "
                                f"{NODE_ID_HEX_DIGITS} hex digits)")
    cluster_id = fields.get("cluster.id") or None
    return NodeMeta(node_id, cluster_id)


def read(directory: str) -> NodeMeta | None:
    """The identity kept in ``directory``, or None if it has none yet; NodeIdentityError if its file is damaged."""
    path = meta_path(directory)
    try:
        with open(path, "rb") as file:
            raw = file.read(META_BYTES_MAX + 1)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise NodeIdentityError(f"cannot read {path}: {error}") from None
    if len(raw) > META_BYTES_MAX:
        raise NodeIdentityError(f"{path} is larger than {META_BYTES_MAX} bytes: not a logbus meta.properties")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise NodeIdentityError(f"{path} is not text: not a logbus meta.properties") from None
    return parse(text, path)


def load_or_create(directory: str) -> tuple[NodeMeta, bool]:
    """The identity kept in ``directory``, written first with a new node id if it has none; and whether
    it was created now. Creates the directory if needed."""
    os.makedirs(directory, exist_ok=True)
    found = read(directory)
    if found is not None:
        return found, False
    meta = NodeMeta(new_node_id())
    write_atomically(meta_path(directory), meta.to_text())
    return meta, True


def adopt(directory: str, node_id: str, cluster_id: str) -> NodeMeta:
    """A cluster's use of the node whose identity is in ``directory``: checks it and records the cluster.

    The directory must hold the identity of ``node_id`` (the id the host
    advertises); a directory not yet used by any cluster gets ``cluster_id``
    recorded now. Raises InconsistentClusterIdError when it belongs to
    another cluster (nothing is written then), NodeIdentityError when it has
    no identity or another node's.
    """
    found = read(directory)
    if found is None:
        raise NodeIdentityError(f"{meta_path(directory)} is missing: the host advertises node {node_id} "
                                "but its data directory has no identity (was it replaced after `logbus join`?)")
    if found.node_id != node_id:
        raise NodeIdentityError(f"{meta_path(directory)} names node {found.node_id}, but the host advertises node {node_id}")
    if found.cluster_id is None:
        adopted = NodeMeta(found.node_id, cluster_id)
        write_atomically(meta_path(directory), adopted.to_text())
        return adopted
    if found.cluster_id != cluster_id:
        raise InconsistentClusterIdError(
            f"the data directory {directory} of node {node_id} belongs to logbus cluster {found.cluster_id}, "
            f"not to this cluster ({cluster_id}): its replicas' files are not this cluster's. Join the host "
            "with this cluster's data directory, or an empty one"
        )
    return found
