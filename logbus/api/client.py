"""connect(): join (or start) Ray, get or create the controller, and cache topic metadata."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
import ray

from logbus.actors import controller as controller_actor
from logbus.actors import ray_auth
from logbus.actors.placement import REPLICA_NODE_RESOURCE, embedded_slots
from logbus.actors.remote import CONTROL_TIMEOUT_S, get
from logbus.api.admin import Admin
from logbus.bounded_dict import BoundedDict
from logbus.options import MS_MAX, check_int
from logbus.errors import DataDirectoryInUseError, IllegalStateError, InvalidConfigError, LeaderNotAvailableError
from logbus.storage.dir_lock import DirectoryLock
from logbus.storage.log_config import LogConfig
from logbus.storage.names import validate_topic_name

if TYPE_CHECKING:
    from logbus.actors.gateway import KafkaGateway

DEFAULT_DATA_DIR = "logbus-data"
DEFAULT_NAMESPACE = "logbus"
START_LOCK_FILE = "start.lock"  # in the data directory: processes starting over it take turns
# Topics whose metadata one Bus keeps; one used again past that is asked for again (one actor call).
METADATA_CACHE_TOPICS_MAX = 4096


@dataclass(frozen=True)
class TopicMetadata:
    """What clients cache about a topic: config and per-partition leader handles."""

    name: str
    topic_id: str
    config: LogConfig
    leaders: tuple  # actor handle per partition (None while leaderless)
    leader_epochs: tuple[int, ...]

    @property
    def partition_count(self) -> int:
        return len(self.leaders)


class Bus:
    """A connection to a logbus cluster: the controller handle plus a topic metadata cache.

    The cache holds the METADATA_CACHE_TOPICS_MAX topics stored last.
    Thread-safe. Picklable: a Bus passed into a Ray task or actor reconnects
    by name there.
    """

    def __init__(self, controller, namespace: str, data_dir: str) -> None:
        self._controller = controller
        self.namespace = namespace
        self.data_dir = data_dir
        self._metadata: BoundedDict = BoundedDict(METADATA_CACHE_TOPICS_MAX)  # topic -> TopicMetadata
        self._lock = threading.Lock()
        self.admin = Admin(self)

    def __reduce__(self):
        return (_reconnect, (self.namespace, self.data_dir))

    @property
    def controller(self):
        return self._controller

    def topic_metadata(self, topic: str, refresh: bool = False) -> TopicMetadata:
        """Cached metadata of ``topic``; ``refresh`` asks the controller again."""
        validate_topic_name(topic)
        with self._lock:
            cached = self._metadata.get(topic)
        if cached is not None and not refresh:
            return cached
        return self.metadata_arrived(self.request_metadata(topic))

    def request_metadata(self, topic: str):
        """Ask the controller for ``topic``'s metadata without waiting: an ObjectRef to pass to
        :meth:`metadata_arrived` (callers that must not wait for the controller, such as a consumer's poll)."""
        validate_topic_name(topic)
        return self._controller.topic_metadata.remote(topic)

    def metadata_arrived(self, ref, timeout_s: float | None = CONTROL_TIMEOUT_S) -> TopicMetadata:
        """The metadata a :meth:`request_metadata` reply holds, now cached; raises what the controller raised."""
        raw = get(ref, timeout_s=timeout_s)
        metadata = TopicMetadata(
            raw["name"],
            raw["topic_id"],
            LogConfig.from_dict(raw["config"]),
            tuple(p["leader"] for p in raw["partitions"]),
            tuple(p["leader_epoch"] for p in raw["partitions"]),
        )
        with self._lock:
            self._metadata[metadata.name] = metadata
        return metadata

    def cached_metadata(self, topic: str) -> TopicMetadata | None:
        """The cached metadata of ``topic``, or None (never asks the controller)."""
        with self._lock:
            return self._metadata.get(topic)

    def forget(self, topic: str) -> None:
        with self._lock:
            self._metadata.pop(topic, None)

    def start_gateway(
        self,
        host: str = "127.0.0.1",
        port: int = 9092,
        *,
        all_nodes: bool = False,
        advertised_host: str | None = None,
        max_request_bytes: int | None = None,
        max_connections: int | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        ssl_cafile: str | None = None,
        sasl_mechanisms: tuple[str, ...] = (),
        allow_plaintext: bool = False,
        allow_plain_without_tls: bool = False,
    ) -> KafkaGateway:
        """Serve Kafka's wire protocol, so unmodified Kafka clients produce and consume (see README, "Kafka clients").

        Starts a gateway actor on this process's node, or with ``all_nodes``
        one on every node that hosts replicas (each advertised as a broker, so
        clients send to the node of each partition's leader), listening on
        ``host:port``: loopback unless another address is asked for. ``port``
        0 picks a free port per gateway (nodes sharing a machine need it).
        ``advertised_host`` is the address clients are told to connect to
        (default: ``host``, or the node's IP when ``host`` is a wildcard).
        Requests over ``max_request_bytes`` (default 100 MiB, Kafka's
        ``socket.request.max.bytes``) close their connection; the requests
        open at once hold at most 4 x ``max_request_bytes`` per gateway and
        2 x per connection (the next ones wait unread). A gateway
        holds at most ``max_connections`` client connections (default 4096);
        one more is closed as soon as it is accepted, and the client
        reconnects after its backoff. Calling it
        again returns the gateways already running, or raises
        IllegalStateError if they were started with other settings (stop them
        first). The gateways run until
        ``stop()`` on the returned :class:`~logbus.actors.gateway.KafkaGateway`
        (or the Ray cluster ends), whose ``bootstrap_servers`` clients take.

        Security (README, "The gateway off loopback"): ``ssl_certfile`` and
        ``ssl_keyfile`` (PEM) put TLS on the listener; ``ssl_cafile`` also
        requires client certificates signed by that CA. ``sasl_mechanisms``
        (of ``"SCRAM-SHA-512"``, ``"SCRAM-SHA-256"``, ``"PLAIN"``) makes
        clients authenticate with SASL as users made with
        ``admin.create_scram_user``; PLAIN only over TLS unless
        ``allow_plain_without_tls``. A ``host`` other than loopback without
        TLS and authentication raises InvalidConfigError unless
        ``allow_plaintext`` (then a warning is logged).
        """
        # Imported here: the gateway's dependencies (kio, cramjam) are for those who start one.
        from logbus.actors.gateway import start_gateways
        from logbus.protocol.listener_security import ListenerSecurity

        security = ListenerSecurity(ssl_certfile, ssl_keyfile, ssl_cafile, tuple(sasl_mechanisms) if isinstance(sasl_mechanisms, list) else sasl_mechanisms,
                                    allow_plaintext, allow_plain_without_tls)
        return start_gateways(
            self.namespace, self._controller, host, port,
            all_nodes=all_nodes, advertised_host=advertised_host, max_request_bytes=max_request_bytes,
            max_connections=max_connections, security=security,
        )


def _reconnect(namespace: str, data_dir: str) -> Bus:
    return connect(namespace=namespace, data_dir=data_dir)


def connect(
    address: str | None = None,
    data_dir: str | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    replica_replacement_ms: int | None = None,
    ray_init_options: dict | None = None,
    max_replicas_per_node: int | None = None,
) -> Bus:
    """Connect to logbus, starting what is missing.

    - No ``address`` and Ray not running: start a local Ray in this process
      (the embedded default), with data under ``./logbus-data`` or ``data_dir``.
      If another process already serves that data directory (an application,
      while you run the ``logbus`` command beside it), join its Ray cluster
      instead, with that cluster's Ray auth mode and token (the embedded
      cluster runs in Ray's token mode; this process's environment needs no
      RAY_AUTH_* setting for it); if that cluster cannot be joined, raise
      DataDirectoryInUseError naming the process that holds the directory.
      One data directory is only ever served by one controller.
    - ``address`` given: join that Ray cluster (``ray.init(address=...)``;
      ``"auto"`` finds a cluster started on this machine with ``ray start``).
      A cluster in Ray's token mode needs ``RAY_AUTH_MODE=token`` and its
      token (``RAY_AUTH_TOKEN_PATH`` or ``RAY_AUTH_TOKEN``) in this process's
      environment: Ray turns token mode on by itself only for clusters it
      finds on this machine.
    - Inside a Ray task or actor, or after ``ray.init``: use the running Ray.

    Gets the cluster's controller (a detached actor named in ``namespace``) or
    creates it over ``data_dir``; reconnecting later, or after the whole Ray
    cluster restarted, over the same data directory finds every topic and
    record again.

    ``replica_replacement_ms`` (used only when this call creates the
    controller): how long a replica's node must be gone before a new replica
    is placed on another node (default 60 s). ``ray_init_options``: more
    arguments for ``ray.init`` when this call starts or joins Ray (e.g.
    ``{"log_to_driver": False}``). ``max_replicas_per_node`` (used only when
    this call creates the controller): how many partition replicas one node
    may hold; by default what the node's memory holds (Ray's ``memory``
    resource at 96 MiB per replica). A topic that would exceed it on some
    node fails with NodeCapacityError and creates nothing.
    """
    if not isinstance(namespace, str) or not namespace:
        raise InvalidConfigError(f"namespace must be a non-empty str, not {namespace!r}")
    if data_dir is not None and (not isinstance(data_dir, str | os.PathLike) or not str(data_dir)):
        raise InvalidConfigError(f"data_dir must be a path (str), not {data_dir!r}")
    if address is not None and (not isinstance(address, str) or not address):
        raise InvalidConfigError(f"address must be a Ray address (str) or None, not {address!r}")
    check_int("replica_replacement_ms", replica_replacement_ms, 1, MS_MAX, none_ok=True, unit="ms")
    check_int("max_replicas_per_node", max_replicas_per_node, none_ok=True)
    if ray_init_options is not None and not isinstance(ray_init_options, dict):
        raise InvalidConfigError(f"ray_init_options must be a dict of ray.init arguments, not {ray_init_options!r}")
    requested_dir = os.path.abspath(os.fspath(data_dir) if data_dir is not None else DEFAULT_DATA_DIR)
    starting = None
    if not ray.is_initialized():
        options = dict(ray_init_options or {})
        if address is None:
            starting = _start_or_join_embedded(requested_dir, namespace, options)
        else:
            ray.init(address=address, namespace=namespace, **options)
    try:
        return _connect_controller(requested_dir, data_dir is not None, namespace, replica_replacement_ms, max_replicas_per_node)
    finally:
        if starting is not None:
            starting.release()


def _start_or_join_embedded(data_dir: str, namespace: str, options: dict) -> DirectoryLock:
    """Start an embedded Ray for ``data_dir``, or join the Ray cluster of the process that serves it.

    Returns the start-up lock, held until the controller answers, so that
    processes starting at the same time over one data directory take turns:
    the first starts the cluster, the others find its controller's owner lock
    held and join.
    """
    os.makedirs(data_dir, exist_ok=True)
    starting = DirectoryLock(os.path.join(data_dir, START_LOCK_FILE))
    if not starting.acquire(CONTROL_TIMEOUT_S):
        raise DataDirectoryInUseError(f"another process has been starting logbus over {data_dir} for {CONTROL_TIMEOUT_S:.0f} s")
    try:
        owner = DirectoryLock(os.path.join(data_dir, "controller", controller_actor.OWNER_LOCK_FILE))
        if not owner.is_held_elsewhere():
            # "local": always a new embedded Ray, never some other cluster left running on the machine.
            # Its one node advertises replica slots from the machine's memory (max.replicas.per.node).
            slots = {REPLICA_NODE_RESOURCE: embedded_slots(psutil.virtual_memory().total)}
            ray.init(**{"address": "local", "namespace": namespace, "include_dashboard": False, "log_to_driver": True,
                        "resources": slots, **options})
            return starting
        note = owner.read_note() or {}
        holder = f"pid {note.get('pid', '?')}, Ray cluster at {note.get('gcs_address', '?')}, namespace {note.get('namespace', '?')!r}"
        if note.get("namespace") != namespace:
            raise DataDirectoryInUseError(
                f"data directory {data_dir} is served by another logbus cluster ({holder}); "
                f"connect with namespace={note.get('namespace')!r} to join it, or use another data_dir"
            )
        _use_cluster_auth(note, data_dir, holder)
        try:
            ray.init(**{"log_to_driver": True, **options, "address": note["gcs_address"], "namespace": namespace})
        except Exception as error:  # noqa: BLE001 (any failure to join is reported the same way)
            raise DataDirectoryInUseError(
                f"data directory {data_dir} is held by a logbus controller ({holder}) whose Ray cluster "
                f"cannot be joined: {error}"
            ) from None
        return starting
    except BaseException:
        starting.release()
        raise


def _use_cluster_auth(note: dict, data_dir: str, holder: str) -> None:
    """Join with the auth of the cluster that serves ``data_dir``, as its controller noted it.

    Ray gives a process that joins by address no token of its own accord
    (``logbus/actors/ray_auth.py``), and the embedded default's cluster runs
    in token mode: so the joiner takes the mode and the token file from the
    note (a token of its own, in RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, wins).
    A note without them (a controller of an older logbus) gets Ray's rule for
    a cluster found on this machine: token mode if a token is found.
    """
    auth = note.get("ray_auth")
    if auth is None:
        ray_auth.use_local_cluster_rule()
        return
    ray_auth.use_auth(auth)
    if auth.get("mode") == ray_auth.TOKEN_MODE and not ray_auth.has_own_token():
        raise DataDirectoryInUseError(
            f"data directory {data_dir} is held by a logbus controller ({holder}) whose Ray cluster uses token "
            f"authentication, and its token is only in that process's environment: give this process the token "
            f"({ray_auth.TOKEN_ENV} or {ray_auth.TOKEN_PATH_ENV})"
        )


def _connect_controller(
    requested_dir: str, dir_given: bool, namespace: str, replica_replacement_ms: int | None, max_replicas_per_node: int | None
) -> "Bus":
    controller = None
    deadline = time.monotonic() + CONTROL_TIMEOUT_S
    while controller is None:
        try:
            controller = ray.get_actor(controller_actor.CONTROLLER_NAME, namespace=namespace)
        except ValueError:
            controller = controller_actor.get_or_create(namespace, requested_dir, replica_replacement_ms, max_replicas_per_node)
        try:
            actual_dir = get(controller.get_data_dir.remote())
        except DataDirectoryInUseError:
            # It found the directory owned by another live controller and touched nothing: it
            # must not linger under the controller's name.
            ray.kill(controller, no_restart=True)
            raise
        except LeaderNotAvailableError:
            if time.monotonic() > deadline:
                raise
            controller = None
            time.sleep(0.2)
    if dir_given and actual_dir != requested_dir:
        raise IllegalStateError(
            f"the logbus controller in namespace {namespace!r} serves data_dir {actual_dir}, not {requested_dir}; "
            "connect with that data_dir or another namespace"
        )
    get(controller.ping.remote())
    return Bus(controller, namespace, actual_dir)
