"""The ``logbus`` command line: topic admin, a console producer and consumer, consumer groups, and cluster status.

Flag spellings follow Kafka's tools (``kafka-topics``, ``kafka-console-producer``,
``kafka-console-consumer``)::

    logbus topics create --topic events --partitions 4 --replication-factor 1 --config retention.ms=86400000
    logbus topics list
    logbus topics describe [--topic events]
    logbus topics alter --topic events --config retention.ms=3600000 [--partitions 8]
    logbus topics delete --topic events
    printf 'user-1:hello\\n' | logbus produce events --key-separator :
    logbus consume events --from-beginning --max-messages 10 --format kv
    logbus groups list
    logbus groups describe --group billing --members
    logbus groups reset-offsets --group billing --topic events --to-earliest [--execute]
    logbus nodes list
    logbus nodes drain NODE_ID [--throttle 10485760]
    logbus status
    logbus gateway --port 9092 [--host 0.0.0.0 --advertised-host HOST] [--all-nodes]
        [--tls-cert PEM --tls-key PEM [--tls-ca PEM]] [--sasl-mechanism SCRAM-SHA-512 ...] [--allow-plaintext]
    logbus join --address HEAD:6379 --token-file auth_token --data-dir /var/lib/logbus [--replica-slots 32] [--rack r1]

Connecting: without ``--address`` (and without ``RAY_ADDRESS`` in the
environment) each invocation joins the cluster of the process that serves
``--data-dir`` (default ``./logbus-data``), such as an application running
beside it, or else starts an embedded local Ray, serves the command, and
shuts Ray down again; topics and records stay on disk and the next
invocation finds them there. With
``--address`` (e.g. ``auto`` or ``HOST:PORT``) the command joins that Ray
cluster and leaves it running.

Exit codes: 0 success; 1 a logbus error (``error: <message>`` on stderr, no
traceback) or an I/O error; 2 a usage error; 130 interrupted. Writing into a
closed pipe (``logbus consume ... | head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time

from logbus.errors import CliError, InvalidConfigError, InvalidPartitionError, LogbusError, OffsetOutOfRangeError, UnknownTopicError
from logbus.options import INT32_MAX, INT64_MAX, MS_MAX, check_int
from logbus.retry import retry_until
from logbus.protocol.cluster_metadata import PARTITIONS_MAX
from logbus.protocol.listener_security import SASL_MECHANISMS, ListenerSecurity
from logbus.storage.names import validate_topic_name

PROG = "logbus"
DEFAULT_DATA_DIR_HELP = "./logbus-data"
PRODUCE_CHUNK_LINES = 10_000  # lines per send_table() call
PRODUCE_CHUNK_BYTES = 4 << 20  # ... or this many bytes, whichever comes first
PROGRESS_EVERY = 100_000  # records between progress lines on stderr
POLL_MAX_RECORDS = 5_000
POLL_WAIT_MS = 500
FORMATS = ("value", "kv", "json")
JOIN_TIMEOUT_S = 300  # bound on `ray start` joining a node


# --- connecting -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _connected(args):
    """A Bus for the command; starts or joins (and afterwards leaves) Ray only if it was not running here.

    Without ``--address`` and without ``RAY_ADDRESS``, the command does what
    ``logbus.connect()`` does by default: it joins the cluster of the process
    that serves the data directory (an application running beside it), or
    starts a fresh local Ray (``address="local"``), never attaching to
    whatever cluster ``/tmp/ray/ray_current_cluster`` happens to name.
    """
    import ray

    import logbus

    started_here = not ray.is_initialized()
    address = args.address
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
    quiet = {"log_to_driver": False, "logging_level": logging.ERROR}
    try:
        yield logbus.connect(address=address, data_dir=args.data_dir, namespace=args.namespace, ray_init_options=quiet)
    finally:
        if started_here and ray.is_initialized():
            ray.shutdown()


# --- output helpers --------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list]) -> str:
    """Left-aligned columns separated by two spaces (the last column is not padded)."""
    cells = [[str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        padded = [cell.ljust(widths[i]) if i < len(row) - 1 else cell for i, cell in enumerate(row)]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines) + "\n"


def _ids(values) -> str:
    return ",".join(str(v) for v in values) if values else "-"


def _configs(config: dict) -> str:
    return ",".join(f"{k}={_config_value(v)}" for k, v in sorted(config.items()))


def _config_value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _text(data: bytes | None) -> str:
    return "null" if data is None else data.decode("utf-8", errors="replace")


def _json_text(data: bytes | None) -> str | None:
    return None if data is None else data.decode("utf-8", errors="replace")


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- argument types -----------------------------------------------------------------------------------


def _int_flag(flag: str, minimum: int = 1, maximum: int = INT64_MAX, unit: str = ""):
    """An argparse type: the flag's text as an int, checked as every client checks the option
    (logbus/options.py), so a flag and the option it sets fail with the same words."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = text  # not an int: the check names it as given
        try:
            return check_int(flag, value, minimum, maximum, unit=unit)
        except InvalidConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = flag  # argparse names the type in its own messages
    return parse


def _offset(text: str):
    if text in ("earliest", "latest"):
        return text
    try:
        return _int_flag("--offset", 0)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--offset must be 'earliest', 'latest' or an int from 0 to {INT64_MAX}, not {text!r}") from None


def _config_items(text: str) -> list[tuple[str, str]]:
    """``k=v`` or Kafka's ``k1=v1,k2=v2``."""
    items = []
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {part!r}")
        items.append((key.strip(), value.strip()))
    return items


def _header_item(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    return key, value


def _acks(text: str):
    if text in ("all", "-1"):
        return "all"
    if text in ("0", "1"):
        return int(text)
    raise argparse.ArgumentTypeError(f"acks must be 0, 1, all or -1, not {text!r}")


# --- topics -----------------------------------------------------------------------------------------------


def cmd_topics_create(args) -> int:
    """Create a topic; its replica actors are running when this returns."""
    validate_topic_name(args.topic)
    config = dict(args.config or [])
    with _connected(args) as bus:
        if args.if_not_exists and args.topic in bus.admin.list_topics():
            return 0
        bus.admin.create_topic(args.topic, partitions=args.partitions, replication_factor=args.replication_factor, config=config or None)
    print(f"Created topic {args.topic}.")
    return 0


def cmd_topics_list(args) -> int:
    """Print every topic name, one per line, sorted."""
    with _connected(args) as bus:
        topics = bus.admin.list_topics()
    sys.stdout.write("".join(f"{t}\n" for t in topics))
    return 0


def _describe_rows(description) -> list[list]:
    return [
        [
            description.name,
            p.partition,
            "none" if p.leader is None else p.leader,
            _ids(p.replicas),
            _ids(p.isr),
            p.leader_epoch,
            p.log_start_offset,
            p.high_watermark,
        ]
        for p in description.partitions
    ]


DESCRIBE_HEADERS = ["Topic", "Partition", "Leader", "Replicas", "Isr", "LeaderEpoch", "LogStartOffset", "HighWatermark"]


def cmd_topics_describe(args) -> int:
    """Print each topic's summary line and a table of its partitions."""
    if args.topic is not None:
        validate_topic_name(args.topic)
    with _connected(args) as bus:
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
    blocks = []
    for d in descriptions:
        replication_factor = len(d.partitions[0].replicas) if d.partitions else 0
        summary = f"Topic: {d.name}\tPartitionCount: {len(d.partitions)}\tReplicationFactor: {replication_factor}\tConfigs: {_configs(d.config)}\n"
        blocks.append(summary + _table(DESCRIBE_HEADERS, _describe_rows(d)))
    shown = {d.name for d in descriptions}
    moving = [m for m in reassignments if m["topic"] in shown]
    if moving:
        rows = [
            [m["topic"], m["partition"], ",".join(n[:12] for n in m["target"]), _ids(m["adding"]), _ids(m["removing"]),
             " ".join(f"{r}:{_dash(o)}/{_dash(m['leader_log_end_offset'])}" for r, o in m["copied"].items()),
             _dash(m["throttle_bytes_per_s"])]
            for m in moving
        ]
        blocks.append("Reassignments in progress:\n" + _table(REASSIGN_HEADERS, rows))
    sys.stdout.write("\n".join(blocks))
    return 0


def cmd_topics_delete(args) -> int:
    """Delete a topic: its replica actors stop and its files are removed."""
    validate_topic_name(args.topic)
    with _connected(args) as bus:
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
    with _connected(args) as bus:
        if args.config:
            overrides = bus.admin.alter_config(args.topic, dict(args.config))
            print(f"Updated config of topic {args.topic}: {_configs(overrides)}")
        if args.partitions is not None:
            description = bus.admin.create_partitions(args.topic, args.partitions)
            print(f"Topic {args.topic} now has {len(description.partitions)} partitions.")
    return 0


# --- produce ------------------------------------------------------------------------------------------------


def _lines(stream):
    """Lines of ``stream`` as bytes without their line terminator (\\n or \\r\\n)."""
    binary = getattr(stream, "buffer", None)
    for line in binary if binary is not None else stream:
        if isinstance(line, str):
            line = line.encode("utf-8", errors="surrogateescape")
        if line.endswith(b"\n"):
            line = line[:-1]
            if line.endswith(b"\r"):
                line = line[:-1]
        yield line


def cmd_produce(args) -> int:
    """Send each input line as one record (see ``logbus produce --help``)."""
    import pyarrow as pa

    import logbus
    from logbus.storage.record_batch import HEADERS_TYPE

    topic = validate_topic_name(args.topic)
    separator = None
    if args.key_separator is not None or args.parse_key:
        separator = (args.key_separator if args.key_separator is not None else "\t").encode()
    headers = list(args.header or []) or None
    encoded_headers = None if headers is None else [(k, v.encode()) for k, v in headers]
    source = open(args.file, "rb") if args.file is not None else sys.stdin  # fail before starting Ray
    try:
        with _connected(args) as bus:
            producer = logbus.Producer(bus, acks=args.acks, compression=args.compression)
            try:
                partition_count = len(producer.partitions_for(topic))
                if args.partition is not None and args.partition >= partition_count:
                    raise InvalidPartitionError(f"topic {topic!r} has partitions 0..{partition_count - 1}, not {args.partition}")
                interactive = args.file is None and _isatty(source)
                started = time.monotonic()
                futures = []
                count = 0
                next_report = PROGRESS_EVERY

                def split(line_number: int, line: bytes):
                    if separator is None:
                        return None, line
                    key, sep, value = line.partition(separator)
                    if not sep:
                        raise CliError(
                            f"no key separator {separator.decode()!r} found on line {line_number} "
                            f"(the {count} records before it were produced)"
                        )
                    return key, value

                if interactive:
                    # One record per line, delivered before the next line is read.
                    for number, line in enumerate(_lines(source), 1):
                        key, value = split(number, line)
                        producer.send(topic, value, key=key, headers=encoded_headers, partition=args.partition).result()
                        count += 1
                else:
                    keyless_partition = random.randrange(partition_count)
                    values, keys, size = [], [], 0

                    def send_chunk():
                        nonlocal keyless_partition, values, keys, size
                        if not values:
                            return
                        columns = {"value": pa.array(values, pa.binary())}
                        if separator is not None:
                            columns["key"] = pa.array(keys, pa.binary())
                        if args.partition is not None:
                            columns["partition"] = pa.array([args.partition] * len(values), pa.int32())
                        elif separator is None:
                            # Keyless lines go to one partition per chunk, moving on each chunk (sticky, like Kafka).
                            columns["partition"] = pa.array([keyless_partition] * len(values), pa.int32())
                            keyless_partition = (keyless_partition + 1) % partition_count
                        if encoded_headers is not None:
                            columns["headers"] = pa.array([encoded_headers] * len(values), HEADERS_TYPE)
                        futures.append(producer.send_table(topic, pa.table(columns)))
                        values, keys, size = [], [], 0
                        for future in [f for f in futures if f.done()]:
                            future.result()  # raises the first failure early
                            futures.remove(future)

                    for number, line in enumerate(_lines(source), 1):
                        try:
                            key, value = split(number, line)
                        except CliError:
                            send_chunk()  # the lines before the bad one are sent, as Kafka's console producer does
                            producer.flush()
                            raise
                        values.append(value)
                        keys.append(key)
                        size += len(line)
                        count += 1
                        if len(values) >= PRODUCE_CHUNK_LINES or size >= PRODUCE_CHUNK_BYTES:
                            send_chunk()
                        if count >= next_report:
                            elapsed = max(time.monotonic() - started, 1e-9)
                            _err(f"produced {count} records ({count / elapsed:,.0f} records/s)")
                            next_report += PROGRESS_EVERY
                    send_chunk()
                    producer.flush()
                    for future in futures:
                        future.result()
            finally:
                with contextlib.suppress(LogbusError):
                    producer.close(timeout_s=30)
            elapsed = time.monotonic() - started
            _err(f"produced {count} records to {topic} in {elapsed:.2f} s")
    finally:
        if source is not sys.stdin:
            source.close()
    return 0


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# --- consume ------------------------------------------------------------------------------------------------


def _formatter(fmt: str, print_offsets: bool):
    if fmt == "json":

        def line(r) -> str:
            return json.dumps(
                {
                    "topic": r.topic,
                    "partition": r.partition,
                    "offset": r.offset,
                    "timestamp": r.timestamp_ms,
                    "key": _json_text(r.key),
                    "value": _json_text(r.value),
                    "headers": None if r.headers is None else [[k, _json_text(v)] for k, v in r.headers],
                },
                ensure_ascii=False,
            ) + "\n"

        return line
    prefix = (lambda r: f"Partition:{r.partition}\tOffset:{r.offset}\t") if print_offsets else (lambda r: "")
    if fmt == "kv":
        return lambda r: f"{prefix(r)}{_text(r.key)}\t{_text(r.value)}\n"
    return lambda r: f"{prefix(r)}{_text(r.value)}\n"


def cmd_consume(args) -> int:
    """Print records of a topic (see ``logbus consume --help``)."""
    import logbus
    from logbus import TopicPartition

    topic = validate_topic_name(args.topic)
    out = sys.stdout
    line = _formatter(args.format, args.print_offsets)
    count = 0
    with _connected(args) as bus:
        reset = "earliest" if args.from_beginning or args.offset == "earliest" else "latest"
        consumer = logbus.Consumer(bus, auto_offset_reset=reset)
        try:
            partition_count = bus.topic_metadata(topic, refresh=True).partition_count
            if args.partition is not None:
                if args.partition >= partition_count:
                    raise InvalidPartitionError(f"topic {topic!r} has partitions 0..{partition_count - 1}, not {args.partition}")
                tps = [TopicPartition(topic, args.partition)]
            else:
                tps = [TopicPartition(topic, p) for p in range(partition_count)]
            consumer.assign(tps)
            if isinstance(args.offset, int):
                (tp,) = tps
                start = consumer.beginning_offsets(tps)[tp]
                end = consumer.end_offsets(tps)[tp]
                if not start <= args.offset <= end:
                    raise OffsetOutOfRangeError(f"offset {args.offset} is out of range for {topic}-{args.partition} (log start {start}, high watermark {end})")
                consumer.seek(tp, args.offset)
            elif args.from_beginning or args.offset == "earliest":
                consumer.seek_to_beginning()
            else:
                consumer.seek_to_end()
            idle_since = time.monotonic()
            try:
                while args.max_messages is None or count < args.max_messages:
                    wait_ms = POLL_WAIT_MS
                    if args.timeout_ms is not None:
                        wait_ms = max(0.0, min(wait_ms, args.timeout_ms - (time.monotonic() - idle_since) * 1000))
                    budget = POLL_MAX_RECORDS if args.max_messages is None else min(POLL_MAX_RECORDS, args.max_messages - count)
                    polled = consumer.poll(timeout_ms=wait_ms, max_records=budget)
                    if polled:
                        lines = [line(r) for tp in sorted(polled) for r in polled[tp]]
                        out.write("".join(lines))
                        out.flush()
                        count += len(lines)
                        idle_since = time.monotonic()
                    elif args.timeout_ms is not None and (time.monotonic() - idle_since) * 1000 >= args.timeout_ms:
                        break
            except KeyboardInterrupt:
                pass  # Ctrl-C is how a following consumer is stopped
        finally:
            consumer.close()
    _err(f"Processed a total of {count} messages")
    return 0


# --- nodes ------------------------------------------------------------------------------------------------

NODES_HEADERS = ["NodeID", "Alive", "Replicas", "Leaders", "MaxReplicas", "ReplicasDown", "Draining"]
REASSIGN_HEADERS = ["Topic", "Partition", "TargetNodes", "Adding", "Removing", "Copied(replica:offset/leader)", "Throttle(B/s)"]


def _refusals(nodes: list[dict]) -> str:
    """Lines for the hosts the cluster refused (a data directory of another cluster)."""
    return "".join(f"Refused: node {n['node_id']} on Ray node {n['ray_node_id']}: {n['refused']}\n" for n in nodes if n.get("refused"))


def cmd_nodes_list(args) -> int:
    """Print every node that may host replicas: replicas, leaders, replica limit, liveness and drain state;
    then the hosts the cluster refused, and why."""
    with _connected(args) as bus:
        nodes = bus.admin.nodes()
    rows = [[n["node_id"], "yes" if n["alive"] else "no", n["replicas"], n["leaders"], _dash(n["max_replicas"]),
             n["replicas_down"], "yes" if n.get("draining") else "no"] for n in nodes if not n.get("refused")]
    sys.stdout.write(_table(NODES_HEADERS, rows) + _refusals(nodes))
    return 0


def cmd_nodes_drain(args) -> int:
    """Move every replica and leadership off a node, so it becomes idle and an autoscaler may remove it.

    The moves start at once and proceed in the background: ``logbus topics
    describe`` shows them, and ``logbus nodes list`` the node's replicas.
    """
    with _connected(args) as bus:
        matches = [n["node_id"] for n in bus.admin.nodes() if n["node_id"].startswith(args.node)]
        if len(matches) != 1:
            raise CliError(f"{args.node!r} matches {len(matches)} nodes; give more of the node id")
        result = bus.admin.drain_node(matches[0], args.throttle)
    moving = result["moving"]
    sys.stdout.write(f"Draining node {matches[0]}: moving {len(moving)} partition(s)\n")
    for topic, partition in moving:
        sys.stdout.write(f"  {topic}-{partition}\n")
    return 0


# --- the Kafka gateway -------------------------------------------------------------------------------------

# Set to end ``logbus gateway`` (SIGINT and SIGTERM do it too); a program running the command in a
# thread of its own sets it to stop the gateway.
gateway_stop = threading.Event()


def cmd_gateway(args) -> int:
    """Serve Kafka's wire protocol until interrupted (Ctrl-C or SIGTERM), so Kafka clients (kcat,
    kafka-python, confluent-kafka, aiokafka) produce to and consume from logbus.

    Listens on 127.0.0.1 unless --host names another address; another
    address needs TLS (--tls-cert, --tls-key) and authentication (--sasl-mechanism,
    or client certificates with --tls-ca), or --allow-plaintext. Prints the
    bootstrap servers to give Kafka clients, then one line per gateway
    (broker); stops the gateways on exit.
    """
    stop = gateway_stop
    stop.clear()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with _connected(args) as bus:
            limits = {name: value for name, value in (("max_request_bytes", args.max_request_bytes),
                                                      ("max_connections", args.max_connections)) if value is not None}
            security = {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key, "ssl_cafile": args.tls_ca,
                        "sasl_mechanisms": tuple(args.sasl_mechanism or ()), "allow_plaintext": args.allow_plaintext,
                        "allow_plain_without_tls": args.allow_plain_without_tls}
            gateway = bus.start_gateway(args.host, args.port, all_nodes=args.all_nodes, advertised_host=args.advertised_host, **limits, **security)
            exposed = ListenerSecurity(**security).exposure_warning(args.host)
            if exposed:
                sys.stderr.write(f"warning: {exposed}\n")
            try:
                sys.stdout.write(f"Kafka gateway serving: bootstrap.servers={gateway.bootstrap_servers}\n")
                for host, port, broker_id, node_id in gateway.brokers:
                    sys.stdout.write(f"  broker {broker_id} on node {node_id}: {host}:{port}\n")
                sys.stdout.flush()
                try:
                    while not stop.wait(1.0):  # a timed wait, so Ctrl-C reaches this thread promptly
                        pass
                except KeyboardInterrupt:
                    pass
            finally:
                gateway.stop()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    sys.stdout.write("Kafka gateway stopped.\n")
    return 0


# --- joining a host ------------------------------------------------------------------------------------------

RACK_LABEL = "logbus.rack"  # the node label placement reads first (logbus/actors/placement.py)
LABEL_VALUE_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def _label_value(text: str) -> str:
    """A Ray node label value: 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit."""
    if not 1 <= len(text) <= 63 or not set(text) <= LABEL_VALUE_CHARS or not (text[0].isalnum() and text[-1].isalnum()):
        raise argparse.ArgumentTypeError(
            f"a rack is 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit, not {text!r}"
        )
    return text


def ray_start_argv(args, ray: str, node_id: str | None = None) -> list[str]:
    """The ``ray start`` command that ``logbus join`` runs for ``args``, the host being node ``node_id``."""
    from logbus.actors.placement import NODE_LABEL, REPLICA_NODE_RESOURCE

    resources = {REPLICA_NODE_RESOURCE: args.replica_slots} if args.replica_slots else {}
    argv = [ray, "start", "--address", args.address, "--resources", json.dumps(resources), "--disable-usage-stats"]
    labels = [f"{NODE_LABEL}={node_id}"] if node_id else []
    if args.rack:
        labels.append(f"{RACK_LABEL}={args.rack}")
    if labels:
        argv += ["--labels", ",".join(labels)]
    for flag, value in (("--node-ip-address", args.node_ip_address), ("--temp-dir", args.temp_dir), ("--num-cpus", args.num_cpus)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--block"] if args.block else [])


def cmd_join(args) -> int:
    """Join this host to a running logbus cluster as a Ray node, with token authentication.

    Runs ``ray start --address ADDRESS`` with ``RAY_AUTH_MODE=token`` and the
    cluster's token (from --token-file, else RAY_AUTH_TOKEN_PATH,
    RAY_AUTH_TOKEN or ~/.ray/auth_token), advertising --replica-slots
    replica slots (the ``logbus_replica`` resource; 0: a host for clients
    only, which hosts no replicas) and the node label ``logbus.rack``
    (--rack). Ray's processes keep running after the command returns; with
    --block the command becomes ``ray start --block`` and lasts as long as
    the node. The head's token is printed by ``ray get-auth-token`` there.

    A host with replica slots is a logbus node of its own, kept in its data
    directory (--data-dir, default ./logbus-data): the first join writes a
    new node id into DIR/meta.properties, and every join advertises it (the
    node label ``logbus.node``), so a host that joins again after a restart,
    as a new Ray node, gets its replicas back, which reopen their logs in
    DIR. The cluster records its own id in that file the first time it uses
    the host, and refuses a directory of another cluster.
    """
    from logbus.actors import ray_auth
    from logbus.actors.placement import NODE_DATA_DIR_ENV, embedded_slots
    from logbus.storage import node_identity

    address = args.address  # checked by _check()
    if args.replica_slots is None:
        import psutil

        args.replica_slots = embedded_slots(psutil.virtual_memory().total)
    try:
        env = ray_auth.join_environment(args.token_file)
    except ValueError as error:
        raise CliError(str(error)) from None
    node = ""
    node_id = None
    if args.replica_slots:
        data_dir = os.path.abspath(args.data_dir or DEFAULT_DATA_DIR_HELP)
        try:
            meta, created = node_identity.load_or_create(data_dir)
        except OSError as error:
            raise CliError(f"cannot use the data directory {data_dir}: {error}") from None
        node_id = meta.node_id
        env[NODE_DATA_DIR_ENV] = data_dir  # the host's Ray processes (its replicas) keep their logs there
        cluster = f" of cluster {meta.cluster_id}" if meta.cluster_id else ""
        node = f" as {'new ' if created else ''}node {node_id}{cluster} (data directory {data_dir})"
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    argv = ray_start_argv(args, ray, node_id)
    rack = f", rack {args.rack}" if args.rack else ""
    if args.block:
        sys.stdout.write(f"Joining {address}{node} with {args.replica_slots} replica slot(s){rack}, token authentication on\n")
        sys.stdout.flush()
        os.execve(ray, argv, env)  # the node's lifetime is the command's
    try:
        result = subprocess.run(argv, env=env, stdout=sys.stdout, stderr=sys.stderr, timeout=JOIN_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise CliError(f"ray start did not finish joining {address} in {JOIN_TIMEOUT_S} s") from None
    if result.returncode != 0:
        raise CliError(f"ray start exited {result.returncode}; this host did not join {address}")
    sys.stdout.write(f"Joined {address}{node} with {args.replica_slots} replica slot(s){rack}, token authentication on\n")
    return 0


# --- status -------------------------------------------------------------------------------------------------


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
    with _connected(args) as bus:
        status = _status(bus)
    if args.json:
        sys.stdout.write(json.dumps(status, indent=1, sort_keys=True) + "\n")
        return 0
    nodes = status["nodes"]
    out = [
        f"logbus: namespace {status['namespace']}, data dir {status['data_dir']}\n",
        f"Nodes: {sum(1 for n in nodes if not n.get('refused'))} ({sum(1 for n in nodes if n['alive'])} alive), "
        f"{sum(n['replicas'] for n in nodes)} replicas; MaxReplicas is max.replicas.per.node\n",
        _table(
            ["NodeID", "Alive", "Replicas", "Leaders", "MaxReplicas", "Bytes", "MiBPerReplica", "Draining"],
            [[_short_node_id(n["node_id"]), "yes" if n["alive"] else "no", n["replicas"], n["leaders"], _dash(n["max_replicas"]),
              n.get("bytes", 0), _mib(n.get("memory_per_replica_bytes")), "yes" if n.get("draining") else "no"]
             for n in nodes if not n.get("refused")],
        ),
        _refusals(nodes),
        f"\nTopics: {len(status['topics'])}\n",
    ]
    if status["topics"]:
        out.append(_table(["Topic", "Partitions", "ReplicationFactor", "Records", "Configs"],
                          [[t["topic"], t["partitions"], t["replication_factor"], t["records"], _configs(t["config"])] for t in status["topics"]]))
    for title, rows in (("Under-replicated partitions", status["under_replicated_partitions"]), ("Offline partitions", status["offline_partitions"])):
        out.append(f"\n{title}: {len(rows) or 'none'}\n")
        if rows:
            out.append(_table(["Topic", "Partition", "Leader", "Replicas", "Isr"],
                              [[r["topic"], r["partition"], _dash(r["leader"]), _ids(r["replicas"]), _ids(r["isr"])] for r in rows]))
    lags = status["group_lags"]
    out.append(f"\nBiggest group lags: {'none' if not lags else ''}\n")
    if lags:
        out.append(_table(["Group", "Topic", "Partition", "Lag"], [[r["group"], r["topic"], r["partition"], r["lag"]] for r in lags]))
    sys.stdout.write("".join(out))
    return 0


# --- groups -------------------------------------------------------------------------------------------------

GROUPS_LIST_HEADERS = ["GROUP", "STATE", "PROTOCOL"]
GROUPS_DESCRIBE_HEADERS = ["GROUP", "TOPIC", "PARTITION", "CURRENT-OFFSET", "LOG-END-OFFSET", "LAG", "CONSUMER-ID"]
GROUPS_MEMBERS_HEADERS = ["GROUP", "CONSUMER-ID", "GROUP-INSTANCE-ID", "CLIENT-ID", "#PARTITIONS", "ASSIGNMENT"]
GROUPS_PLAN_HEADERS = ["GROUP", "TOPIC", "PARTITION", "CURRENT-OFFSET", "NEW-OFFSET"]
GROUPS_RESET_HEADERS = ["GROUP", "TOPIC", "PARTITION", "PREVIOUS-OFFSET", "NEW-OFFSET"]
RETRY_TIMEOUT_S = 30.0  # reset-offsets retries retriable errors (leader elections) this long


def _dash(value) -> str:
    return "-" if value is None else str(value)


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
    with _connected(args) as bus:
        groups = bus.admin.list_groups()
    sys.stdout.write(_table(GROUPS_LIST_HEADERS, [[g, state, _dash(protocol)] for g, state, protocol in groups]))
    return 0


def cmd_groups_describe(args) -> int:
    """Print a group's committed offsets, log end offsets, lag and owners per partition (like kafka-consumer-groups --describe)."""
    from logbus.protocol.group_coordinator import validate_group_id

    group = validate_group_id(args.group)
    with _connected(args) as bus:
        described = bus.admin.describe_group(group)
    rows = [
        [group, r["topic"], r["partition"], _dash(r["current_offset"]), _dash(r["log_end_offset"]), _dash(r["lag"]), _dash(r["consumer_id"])]
        for r in described["offsets"]
    ]
    # Like Kafka: a member without partitions still gets a row.
    listed = {r["consumer_id"] for r in described["offsets"]}
    rows += [[group, "-", "-", "-", "-", "-", m["member_id"]] for m in described["members"] if m["member_id"] not in listed]
    if not described["members"]:
        _err(f"Consumer group '{group}' has no active members.")
    elif described["state"] != "Stable":
        _err(f"Warning: consumer group '{group}' is rebalancing (state {described['state']}).")
    out = [_table(GROUPS_DESCRIBE_HEADERS, rows)]
    if args.state:
        out.append("\nState:\n")
        out.append(
            _table(
                ["GROUP", "STATE", "PROTOCOL", "GENERATION", "#MEMBERS"],
                [[group, described["state"], _dash(described["protocol"]), described["generation"], len(described["members"])]],
            )
        )
    if args.members:
        out.append("\nMembers:\n")
        out.append(
            _table(
                GROUPS_MEMBERS_HEADERS,
                [
                    [group, m["member_id"], _dash(m["group_instance_id"]), m["client_id"], len(m["assignment"]), _assignment_text(m["assignment"])]
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
    with _connected(args) as bus:
        current, plan = _retrying(lambda: _reset_plan(bus, group, to, topics), f"planning the reset of group {group!r}")
        if args.execute:
            # Idempotent: a retry after a retriable error (the offsets topic's leader moving) commits the same offsets.
            applied = _retrying(lambda: bus.admin.reset_offsets(group, to=to, topics=topics), f"resetting the offsets of group {group!r}")
    if not args.execute:
        sys.stdout.write(_table(GROUPS_PLAN_HEADERS, [[group, tp.topic, tp.partition, _dash(current.get(tp)), offset] for tp, offset in plan]))
        _err("Dry run: nothing was changed. Add --execute to set these offsets.")
        return 0
    from logbus import TopicPartition

    rows = [[group, tp[0], tp[1], _dash(current.get(TopicPartition(*tp))), offset] for tp, offset in sorted(applied.items())]
    sys.stdout.write(_table(GROUPS_RESET_HEADERS, rows))
    return 0


# --- the parser ---------------------------------------------------------------------------------------------


def _global_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """--address, --data-dir and --namespace; accepted before or after the command."""

    def default(value):
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--address",
        default=default(None),
        help="Ray cluster address to join (e.g. auto or HOST:PORT); default: $RAY_ADDRESS if set, "
        "else an embedded local Ray started for this command and stopped after it",
    )
    parser.add_argument(
        "--data-dir",
        default=default(None),
        help=f"directory holding the logs and metadata (default: {DEFAULT_DATA_DIR_HELP}); "
        "an already running controller must serve this same directory",
    )
    parser.add_argument("--namespace", default=default("logbus"), help="Ray namespace of the logbus controller (default: logbus)")


def _topic_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("topic", nargs="?", metavar="TOPIC", help="the topic")
    parser.add_argument("--topic", dest="topic_flag", metavar="TOPIC", help="the topic (same as the positional TOPIC)")


def _add_groups_parser(commands, common: argparse.ArgumentParser) -> None:
    """``logbus groups list | describe | reset-offsets`` (like kafka-consumer-groups)."""
    groups = commands.add_parser(
        "groups", parents=[common], help="list and describe consumer groups, reset their offsets",
        description="Manage consumer groups (like kafka-consumer-groups).",
    )  # fmt: skip
    actions = groups.add_subparsers(dest="action", metavar="ACTION", required=True)

    listing = actions.add_parser(
        "list", parents=[common], help="list consumer groups",
        description=cmd_groups_list.__doc__ + " A group without members has state Empty and PROTOCOL -.",
    )  # fmt: skip
    listing.set_defaults(func=cmd_groups_list)

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
    describe.set_defaults(func=cmd_groups_describe)

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
    target.add_argument("--to-offset", type=_int_flag("--to-offset", 0), metavar="N", help="to offset N (clamped to the partition's range)")
    target.add_argument("--to-datetime", type=_datetime, metavar="ISO8601", help="to the first record at or after this time, e.g. 2026-11-22T10:00:00Z (local time without a zone)")
    run = reset.add_mutually_exclusive_group()
    run.add_argument("--execute", action="store_true", help="apply the reset (default: only print the plan)")
    run.add_argument("--dry-run", action="store_true", help="only print the plan (the default)")
    reset.set_defaults(func=cmd_groups_reset_offsets)

    for sub in (listing, describe, reset):
        sub.set_defaults(parser=sub)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``logbus`` command."""
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, suppress=True)
    formatter = argparse.RawDescriptionHelpFormatter

    doc = __doc__.replace("``", "").replace("::", ":")
    parser = argparse.ArgumentParser(prog=PROG, description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1], formatter_class=formatter)
    _global_options(parser, suppress=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    # topics
    topics = commands.add_parser("topics", parents=[common], help="create, list, describe, alter and delete topics", description="Manage topics (like kafka-topics).")
    actions = topics.add_subparsers(dest="action", metavar="ACTION", required=True)

    create = actions.add_parser("create", parents=[common], help="create a topic", description=cmd_topics_create.__doc__)
    create.add_argument("--topic", required=True, help="topic name: 1-249 characters from [a-zA-Z0-9._-]")
    create.add_argument("--partitions", type=_int_flag("--partitions", 1, PARTITIONS_MAX), default=1, help="number of partitions (default: 1)")
    create.add_argument("--replication-factor", type=_int_flag("--replication-factor"), default=1, help="replicas per partition, on distinct Ray nodes (default: 1)")
    create.add_argument("--config", action="extend", type=_config_items, metavar="KEY=VALUE", help="a topic config override, e.g. retention.ms=60000 (repeatable; or k1=v1,k2=v2)")
    create.add_argument("--if-not-exists", action="store_true", help="succeed quietly if the topic exists")
    create.set_defaults(func=cmd_topics_create)

    listing = actions.add_parser("list", parents=[common], help="list topic names", description=cmd_topics_list.__doc__)
    listing.set_defaults(func=cmd_topics_list)

    describe = actions.add_parser(
        "describe",
        parents=[common],
        help="describe topics and their partitions",
        description=cmd_topics_describe.__doc__ + " Columns: " + ", ".join(DESCRIBE_HEADERS) + ". Leader, Replicas and Isr are replica ids.",
    )
    describe.add_argument("--topic", help="the topic to describe (default: every topic)")
    describe.set_defaults(func=cmd_topics_describe)

    delete = actions.add_parser("delete", parents=[common], help="delete a topic", description=cmd_topics_delete.__doc__)
    delete.add_argument("--topic", required=True, help="the topic to delete")
    delete.add_argument("--if-exists", action="store_true", help="succeed quietly if the topic does not exist")
    delete.set_defaults(func=cmd_topics_delete)

    alter = actions.add_parser("alter", parents=[common], help="change topic configs or partition count", description=cmd_topics_alter.__doc__)
    alter.add_argument("--topic", required=True, help="the topic to alter")
    alter.add_argument("--config", "--add-config", dest="config", action="extend", type=_config_items, metavar="KEY=VALUE", help="a config override to set (repeatable; or k1=v1,k2=v2)")
    alter.add_argument("--partitions", type=_int_flag("--partitions", 1, PARTITIONS_MAX), help="grow the topic to this many partitions")
    alter.set_defaults(func=cmd_topics_alter)

    # produce
    produce = commands.add_parser(
        "produce",
        parents=[common],
        help="send lines from stdin or a file as records",
        formatter_class=formatter,
        description=(
            "Send each input line as one record (like kafka-console-producer).\n\n"
            "Lines come from stdin, or from --file. The line terminator is dropped; an empty line is an\n"
            "empty record. With --key-separator (or --parse-key, whose default separator is TAB) each\n"
            "line is split once into KEY and VALUE, and a line without the separator is an error.\n"
            "Keyed records go to murmur2(key) % partitions, as in Kafka; keyless ones stick to one\n"
            "partition per chunk of lines. Lines are sent in chunks (send_table) unless stdin is a\n"
            "terminal, where each line is delivered as it is typed. Progress goes to stderr every\n"
            f"{PROGRESS_EVERY:,} records, and a summary line at the end."
        ),
    )
    _topic_argument(produce)
    produce.add_argument("--file", metavar="PATH", help="read lines from PATH instead of stdin")
    produce.add_argument("--parse-key", action="store_true", help="split each line into key and value (separator: --key-separator, default TAB)")
    produce.add_argument("--key-separator", metavar="SEP", help="split each line at the first SEP into key and value (implies --parse-key)")
    produce.add_argument("--partition", type=_int_flag("--partition", 0, INT32_MAX), help="send every record to this partition")
    produce.add_argument("--header", action="append", type=_header_item, metavar="KEY=VALUE", help="a header added to every record (repeatable)")
    produce.add_argument("--acks", "--request-required-acks", dest="acks", type=_acks, default="all", help="0, 1 or all (= -1): what the leader waits for before acknowledging (default: all)")
    produce.add_argument("--compression", "--compression-codec", dest="compression", choices=("none", "lz4", "zstd"), default="none", help="batch compression (default: none)")
    produce.set_defaults(func=cmd_produce)

    # consume
    consume = commands.add_parser(
        "consume",
        parents=[common],
        help="print records of a topic",
        formatter_class=formatter,
        description=(
            "Print records of a topic, one per line (like kafka-console-consumer).\n\n"
            "Reads every partition (or --partition), starting at the end (new records only) unless\n"
            "--from-beginning or --offset says otherwise. Without --timeout-ms it keeps waiting for\n"
            "new records, like Kafka's console consumer, until --max-messages records were printed\n"
            "or Ctrl-C; with --timeout-ms it exits once no record arrived for that long. The count of\n"
            "records printed goes to stderr at the end.\n\n"
            "Formats: value (the value as UTF-8, undecodable bytes replaced; null for no value),\n"
            "kv (key TAB value), json (one object per line: topic, partition, offset, timestamp (ms),\n"
            "key, value, headers (a list of [name, value] pairs, or null))."
        ),
    )
    _topic_argument(consume)
    consume.add_argument("--from-beginning", action="store_true", help="start at the earliest offset of every partition (default: at the end)")
    consume.add_argument("--partition", type=_int_flag("--partition", 0, INT32_MAX), help="read only this partition")
    consume.add_argument("--offset", type=_offset, help="with --partition: earliest, latest or an offset to start at")
    consume.add_argument("--max-messages", type=_int_flag("--max-messages"), help="exit after printing this many records")
    consume.add_argument("--timeout-ms", type=_int_flag("--timeout-ms", 0, MS_MAX, unit="ms"), help="exit when no record arrived for this long (default: wait forever)")
    consume.add_argument("--format", choices=FORMATS, default="value", help="output format (default: value)")
    consume.add_argument("--print-offsets", action="store_true", help="prefix each line with Partition:P<TAB>Offset:O<TAB> (value and kv formats)")
    consume.set_defaults(func=cmd_consume)

    # groups
    _add_groups_parser(commands, common)

    # nodes
    nodes = commands.add_parser("nodes", parents=[common], help="list nodes, drain a node", description="Manage the nodes that host replicas.")
    node_actions = nodes.add_subparsers(dest="action", metavar="ACTION", required=True)
    nodes_list = node_actions.add_parser("list", parents=[common], help="list nodes with replica counts", description=cmd_nodes_list.__doc__)
    nodes_list.set_defaults(func=cmd_nodes_list)
    drain = node_actions.add_parser("drain", parents=[common], help="move every replica off a node", description=cmd_nodes_drain.__doc__)
    drain.add_argument("node", metavar="NODE", help="the node id (a unique prefix is enough)")
    drain.add_argument("--throttle", type=_int_flag("--throttle", unit="bytes per second"), metavar="BYTES_PER_S", help="limit each moving replica's copy rate")
    drain.set_defaults(func=cmd_nodes_drain)

    # gateway
    gateway = commands.add_parser("gateway", parents=[common], help="serve Kafka's wire protocol to Kafka clients",
                                  description=cmd_gateway.__doc__)
    gateway.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; other addresses only when asked)")
    gateway.add_argument("--port", type=_int_flag("--port", 0, 65535), default=9092, help="port to listen on (default: 9092; 0: any free port)")
    gateway.add_argument("--advertised-host", metavar="HOST", help="address clients are told to connect to (default: --host, or the node's IP for 0.0.0.0)")
    gateway.add_argument("--all-nodes", action="store_true", help="one gateway on every node that hosts replicas (else: this node only)")
    gateway.add_argument("--max-request-bytes", type=_int_flag("--max-request-bytes", 1, INT32_MAX, unit="bytes"), metavar="BYTES",
                         help="larger requests close their connection (default: 104857600, Kafka's socket.request.max.bytes)")
    gateway.add_argument("--max-connections", type=_int_flag("--max-connections", 1, INT32_MAX), metavar="N",
                         help="client connections per gateway; one more is closed when accepted (default: 4096)")
    gateway.add_argument("--tls-cert", metavar="PEM", help="the gateway's TLS certificate (chain); with --tls-key, clients connect with TLS")
    gateway.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    gateway.add_argument("--tls-ca", metavar="PEM", help="CA certificates client certificates must be signed by (requires them)")
    gateway.add_argument("--sasl-mechanism", action="append", choices=SASL_MECHANISMS, metavar="MECHANISM",
                         help=f"a SASL mechanism clients authenticate with ({', '.join(SASL_MECHANISMS)}; repeat for several)")
    gateway.add_argument("--allow-plaintext", action="store_true", help="listen on a non-loopback --host without TLS and authentication")
    gateway.add_argument("--allow-plain-without-tls", action="store_true", help="offer SASL PLAIN without TLS (passwords in the clear)")
    gateway.set_defaults(func=cmd_gateway)

    # join
    join = commands.add_parser("join", parents=[common], help="join this host to a running cluster as a Ray node (token auth)",
                               description=cmd_join.__doc__)
    join.add_argument("--token-file", metavar="PATH", help="the cluster's token (default: $RAY_AUTH_TOKEN_PATH, $RAY_AUTH_TOKEN or ~/.ray/auth_token)")
    join.add_argument("--replica-slots", type=_int_flag("--replica-slots", 0), metavar="N",
                      help="replicas this host may hold (default: what its memory holds at 96 MiB each; 0: no replicas)")
    join.add_argument("--rack", type=_label_value, help="this host's rack (node label logbus.rack): replicas of a partition go to distinct racks")
    join.add_argument("--node-ip-address", metavar="IP", help="this host's address the other hosts reach (default: Ray's choice)")
    join.add_argument("--temp-dir", metavar="DIR", help="Ray's directory for this node's sockets, logs and session files (default: Ray's)")
    join.add_argument("--num-cpus", type=_int_flag("--num-cpus", 0), metavar="N", help="CPUs this node offers to Ray tasks (default: Ray's count)")
    join.add_argument("--block", action="store_true", help="stay in the foreground for the node's lifetime (ray start --block)")
    join.set_defaults(func=cmd_join)

    # status
    status = commands.add_parser("status", parents=[common], help="nodes, topics, partition health and group lags at a glance", description=cmd_status.__doc__)
    status.add_argument("--json", action="store_true", help="print the status as one JSON object")
    status.set_defaults(func=cmd_status)

    # keep each subparser at hand for usage errors found after parsing
    for sub in (create, listing, describe, delete, alter, produce, consume, status, nodes_list, drain, gateway, join):
        sub.set_defaults(parser=sub)
    return parser


def _check(args) -> None:
    """Usage rules argparse cannot express; violations exit 2 through parser.error()."""
    parser = args.parser
    if args.command in ("produce", "consume"):
        if args.topic is not None and args.topic_flag is not None and args.topic != args.topic_flag:
            parser.error("give the topic once: as TOPIC or as --topic")
        args.topic = args.topic if args.topic is not None else args.topic_flag
        if args.topic is None:
            parser.error("a topic is required (TOPIC or --topic)")
    if args.command == "produce" and args.key_separator == "":
        parser.error("--key-separator must not be empty")
    if args.command == "produce" and args.compression == "none":
        args.compression = None
    if args.command == "consume":
        if args.offset is not None and args.partition is None:
            parser.error("--offset requires --partition")
        if args.offset is not None and args.from_beginning:
            parser.error("--offset and --from-beginning cannot be used together")
    if args.command == "join":
        args.address = args.address or os.environ.get("RAY_ADDRESS")
        if not args.address or args.address in ("auto", "local"):
            parser.error("join needs the head's address: --address HOST:PORT")
    if args.command == "topics" and args.action == "alter" and not args.config and args.partitions is None:
        parser.error("nothing to alter: give --config KEY=VALUE and/or --partitions N")


def _silence_stdout() -> None:
    """After EPIPE, point fd 1 at /dev/null so the interpreter's final flush does not complain."""
    with contextlib.suppress(Exception):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    """Run the ``logbus`` command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        _check(args)
    except SystemExit as exit_:  # usage errors (2) and --help (0)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        return args.func(args)
    except BrokenPipeError:
        _silence_stdout()
        return 0
    except LogbusError as error:
        _err(f"error: {error}")
        return 1
    except OSError as error:
        _err(f"error: {error}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
