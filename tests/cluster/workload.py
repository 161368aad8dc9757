"""A driver that runs inside a namespace cluster's client host and does what the test process asks.

The test process sits outside the cluster's network (it has no route to
its addresses), so it starts this module on the client host
(:meth:`tests.cluster.netns.NetnsCluster.popen_python`) and talks to it in
JSON lines: one command per line on stdin, one reply per command on stdout
(prefixed ``@@``, apart from whatever Ray prints). :class:`Workload` is the
test side.

Every send, acknowledgement, failure and poll goes into a history file
(``tests/cluster/history.py``) as it happens. Commands (``op``):

- ``create_topic``: ``topic``, ``partitions``, ``replication_factor``, ``config``.
- ``describe``: ``topic``: each partition's leader, replicas, ISR, epoch,
  and every replica's own status (role, offsets, size, bytes fetched as a
  follower, its logbus node, its Ray node, its directory).
- ``nodes``: the controller's nodes (``Admin.nodes()``), refused hosts too.
- ``lease_isolation``: what the controller says of silences of every node
  (``Controller.lease_isolation``).
- ``note_leaders``: ``topic``: in the background, ask which replica leads
  each partition, and record the answer in the history (``leaders``);
  replies at once, so a controller away does not hold up the caller.
- ``produce``: ``topic``, ``count``, ``prefix``: send and wait for every outcome.
- ``read_all``: ``topic``, ``consumer``: a fresh consumer reads every
  partition from its start to the high watermark as of now.
- ``start``: ``topic``, ``rate`` (records/s): a producer thread (idempotent,
  acks=all) and a consumer thread (``live``) run until ``stop``.
- ``stop``: stop producing, wait for every outcome, let the consumer reach
  the high watermark (bounded by ``timeout_s``), stop it; returns counts.
- ``quit``.

A command that fails replies ``{"error": ...}``; the driver keeps serving.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import traceback

REPLY_PREFIX = "@@"
POLL_TIMEOUT_MS = 500
OUTSTANDING_MAX = 2_000  # sends without an outcome the producer thread allows before it waits
DELIVERY_TIMEOUT_MS = 120_000


class Driver:
    """The client host's side (this process)."""

    def __init__(self, address: str, data_dir: str, namespace: str, history_path: str, replica_replacement_ms: int | None) -> None:
        import logbus
        from tests.cluster.history import History

        self.logbus = logbus
        self.bus = logbus.connect(address=address, data_dir=data_dir, namespace=namespace,
                                  replica_replacement_ms=replica_replacement_ms,
                                  ray_init_options={"log_to_driver": False, "logging_level": "ERROR"})
        self.history = History(history_path)
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.outstanding = threading.Semaphore(OUTSTANDING_MAX)
        self.counts = {"sent": 0, "acked": 0, "failed": 0, "send_errors": 0, "polled": 0, "poll_errors": 0}
        self.errors: list[str] = []  # the first few, for the report
        self._lock = threading.Lock()

    # --- commands ----------------------------------------------------------------------------------------

    def create_topic(self, topic: str, partitions: int, replication_factor: int, config: dict | None = None) -> dict:
        self.bus.admin.create_topic(topic, partitions=partitions, replication_factor=replication_factor, config=config or {})
        return self.describe(topic)

    def describe(self, topic: str) -> dict:
        from logbus.actors.remote import get

        described = self.bus.admin.describe_topic(topic)
        statuses = get(self.bus.controller.replica_statuses.remote(topic))
        return {
            "partitions": [
                {"partition": p.partition, "leader": p.leader, "replicas": list(p.replicas), "isr": list(p.isr),
                 "leader_epoch": p.leader_epoch, "high_watermark": p.high_watermark, "log_end_offset": p.log_end_offset}
                for p in described.partitions
            ],
            "statuses": [[{k: s.get(k) for k in ("replica_id", "role", "leader_epoch", "log_start_offset", "log_end_offset",
                                                  "high_watermark", "isr", "size_bytes", "fetched_bytes", "node", "node_id",
                                                  "directory", "error")} for s in partition] for partition in statuses],
        }

    def note_leaders(self, topic: str) -> dict:
        def ask() -> None:
            asked = time.monotonic()
            try:
                described = self.bus.admin.describe_topic(topic)
            except Exception:  # noqa: BLE001 (the controller is away: no note)
                return
            self.history.record("leaders", topic=topic, asked=round(asked, 6),
                                leaders={str(p.partition): p.leader for p in described.partitions})

        threading.Thread(target=ask, name="note-leaders", daemon=True).start()
        return {"asking": True}

    def nodes(self) -> dict:
        return {"nodes": self.bus.admin.nodes()}

    def lease_isolation(self) -> dict:
        from logbus.actors.remote import get

        return get(self.bus.controller.lease_isolation.remote())

    def produce(self, topic: str, count: int, prefix: str = "sync") -> dict:
        """Send ``count`` records (values ``{prefix}-{i}``: unique per call, as the history checker needs)."""
        with self.logbus.Producer(self.bus, acks="all", linger_ms=1, delivery_timeout_ms=DELIVERY_TIMEOUT_MS) as producer:
            futures = [self._send(producer, topic, f"{prefix}-{i}") for i in range(count)]
            for future in futures:
                if future is not None:
                    try:
                        future.result(timeout=DELIVERY_TIMEOUT_MS / 1000 + 30)
                    except Exception:  # noqa: BLE001 (recorded by the errback)
                        pass
        self._wait_settled(time.monotonic() + 60)
        return dict(self.counts)

    def _wait_settled(self, deadline: float) -> bool:
        """Wait until every send's outcome is recorded: a future's result() returns before its callbacks ran."""
        while time.monotonic() < deadline:
            with self._lock:
                counts = dict(self.counts)
            if counts["acked"] + counts["failed"] + counts["send_errors"] >= counts["sent"]:
                return True
            time.sleep(0.05)
        return False

    def read_all(self, topic: str, consumer: str, timeout_s: float = 120.0) -> dict:
        from logbus import TopicPartition

        tps = [TopicPartition(topic, p) for p in range(self.bus.topic_metadata(topic, refresh=True).partition_count)]
        reader = self.logbus.Consumer(self.bus)
        try:
            reader.assign(tps)
            reader.seek_to_beginning(tps)
            ends = reader.end_offsets(tps)
            read = self._read_until(reader, consumer, ends, time.monotonic() + timeout_s)
        finally:
            reader.close()
        return {"read": read, "ends": {tp.partition: end for tp, end in ends.items()}}

    def start(self, topic: str, rate: float) -> dict:
        self.stopping.clear()
        self.producer = self.logbus.Producer(self.bus, acks="all", linger_ms=2, delivery_timeout_ms=DELIVERY_TIMEOUT_MS)
        self.threads = [
            threading.Thread(target=self._produce_loop, args=(topic, rate), name="producer", daemon=True),
            threading.Thread(target=self._consume_loop, args=(topic,), name="consumer", daemon=True),
        ]
        self.consumer_stop = threading.Event()
        self.consumer_caught_up = None
        for thread in self.threads:
            thread.start()
        return {"started": True}

    def stop(self, timeout_s: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout_s
        self.stopping.set()
        self.threads[0].join(max(1.0, deadline - time.monotonic()))
        try:
            self.producer.close(timeout_s=max(1.0, deadline - time.monotonic()))
        except Exception as error:  # noqa: BLE001
            self._error(f"producer close: {error!r}")
        settled = self._wait_settled(deadline)
        # Every send has its outcome by now (or its delivery timeout ran out): the consumer reads on to the end.
        self.consumer_stop.set()
        self.threads[1].join(max(1.0, deadline - time.monotonic()))
        return {**self.counts, "settled": settled, "producer_alive": self.threads[0].is_alive(), "consumer_alive": self.threads[1].is_alive(),
                "consumer_caught_up": self.consumer_caught_up, "errors": self.errors[:10]}

    # --- the threads ---------------------------------------------------------------------------------------

    def _error(self, text: str) -> None:
        with self._lock:
            if len(self.errors) < 50:
                self.errors.append(text)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def _send(self, producer, topic: str, value: str):
        self.history.record("send", topic=topic, value=value)
        self._count("sent")
        try:
            future = producer.send(topic, value.encode(), key=value.rsplit("-", 1)[-1].encode())
        except Exception as error:  # noqa: BLE001 (refused at once: nothing was queued)
            self.history.record("fail", topic=topic, value=value, error=repr(error), at_send=True)
            self._count("send_errors")
            self._error(f"send: {error!r}")
            return None

        def acked(metadata):
            self.history.record("ack", topic=topic, value=value, partition=metadata.partition, offset=metadata.offset)
            self._count("acked")

        def failed(error):
            self.history.record("fail", topic=topic, value=value, error=repr(error))
            self._count("failed")
            self._error(f"delivery: {error!r}")

        future.add_callback(acked)
        future.add_errback(failed)
        return future

    def _produce_loop(self, topic: str, rate: float) -> None:
        interval_s, next_at, seq = 1.0 / rate, time.monotonic(), 0
        while not self.stopping.is_set():
            if not self.outstanding.acquire(timeout=0.5):
                continue
            future = self._send(self.producer, topic, f"v-{seq}")
            seq += 1
            if future is None:
                self.outstanding.release()
                time.sleep(0.2)  # the topic's metadata was unavailable: the controller is away
            else:
                future.add_done_callback(lambda _: self.outstanding.release())
            next_at += interval_s
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at, time.monotonic() - 1.0)  # after a stall, no burst to catch up

    def _consume_loop(self, topic: str) -> None:
        from logbus import TopicPartition

        tps = [TopicPartition(topic, p) for p in range(self.bus.topic_metadata(topic, refresh=True).partition_count)]
        consumer = self.logbus.Consumer(self.bus)
        try:
            consumer.assign(tps)
            consumer.seek_to_beginning(tps)
            while not self.consumer_stop.is_set():
                self._poll(consumer, "live")
            ends = None
            deadline = time.monotonic() + 120
            while ends is None and time.monotonic() < deadline:
                try:
                    ends = consumer.end_offsets(tps)
                except Exception as error:  # noqa: BLE001
                    self._error(f"end_offsets: {error!r}")
                    time.sleep(0.5)
            if ends is not None:
                self._read_until(consumer, "live", ends, deadline)
                self.consumer_caught_up = all(consumer.position(tp) >= end for tp, end in ends.items())
        finally:
            consumer.close()

    def _poll(self, consumer, name: str) -> int:
        try:
            table = consumer.poll_arrow(timeout_ms=POLL_TIMEOUT_MS)
        except Exception as error:  # noqa: BLE001 (recorded; the consumer goes on)
            self._count("poll_errors")
            self._error(f"poll: {error!r}")
            time.sleep(0.2)
            return 0
        topics = table["topic"].to_pylist()
        for topic, partition, offset, value in zip(topics, table["partition"].to_pylist(), table["offset"].to_pylist(),
                                                   table["value"].to_pylist()):
            self.history.record("poll", consumer=name, topic=topic, partition=partition, offset=offset,
                                value=None if value is None else value.decode())
        self._count("polled", len(topics))
        return len(topics)

    def _read_until(self, consumer, name: str, ends: dict, deadline: float) -> int:
        read = 0
        while time.monotonic() < deadline:
            if all(consumer.position(tp) >= end for tp, end in ends.items()):
                break
            read += self._poll(consumer, name)
        return read


def serve(driver: Driver) -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            reply = {"quit": True}
        else:
            try:
                reply = getattr(driver, op)(**command)
            except Exception as error:  # noqa: BLE001 (reported to the test, which decides)
                reply = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-2000:]}
        sys.stdout.write(REPLY_PREFIX + json.dumps(reply) + "\n")
        sys.stdout.flush()
        if op == "quit":
            break
    driver.history.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--history", required=True)
    parser.add_argument("--replica-replacement-ms", type=int)
    args = parser.parse_args()
    driver = Driver(args.address, args.data_dir, args.namespace, args.history, args.replica_replacement_ms)
    sys.stdout.write(REPLY_PREFIX + json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    serve(driver)


class Workload:
    """The test's side: a driver process on the cluster's client host, and its commands.

    Each command waits for its reply up to ``timeout_s``; a driver that
    exits or overruns fails the command with AssertionError (and is killed
    on :meth:`close`).
    """

    def __init__(self, cluster, data_dir: str, namespace: str, history_path: str, replica_replacement_ms: int | None = None,
                 start_timeout_s: float = 180.0) -> None:
        self.history_path = history_path
        self.namespace = namespace
        self.stderr_path = history_path + ".stderr"
        self._stderr = open(self.stderr_path, "w")  # noqa: SIM115 (closed by close())
        cluster.register_logbus_namespace(namespace)
        argv = ["-m", "tests.cluster.workload", cluster.address, "--data-dir", data_dir, "--namespace", namespace,
                "--history", history_path]
        if replica_replacement_ms is not None:
            argv += ["--replica-replacement-ms", str(replica_replacement_ms)]
        self.process = cluster.popen_python(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self._replies: list = []
        self._arrived = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True, name="workload-replies")
        self._reader.start()
        self._wait_reply("start", start_timeout_s)

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith(REPLY_PREFIX):
                with self._arrived:
                    self._replies.append(json.loads(line[len(REPLY_PREFIX):]))
                    self._arrived.notify_all()
        with self._arrived:
            self._replies.append(None)  # the driver's output ended
            self._arrived.notify_all()

    def _wait_reply(self, what: str, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while not self._replies:
                if not self._arrived.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    raise AssertionError(f"the workload driver did not answer {what} in {timeout_s} s; see {self.stderr_path}")
            reply = self._replies.pop(0)
        if reply is None:
            raise AssertionError(f"the workload driver exited ({self.process.wait(30)}) during {what}; see {self.stderr_path}:\n"
                                 + open(self.stderr_path).read()[-3000:])
        return reply

    def call(self, op: str, reply_timeout_s: float = 300.0, **arguments) -> dict:
        """Run one command (``arguments`` are its own); its reply, awaited up to ``reply_timeout_s`` (a reply with
        ``error`` raises AssertionError)."""
        self.process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self.process.stdin.flush()
        reply = self._wait_reply(op, reply_timeout_s)
        if "error" in reply:
            raise AssertionError(f"{op} failed in the workload driver: {reply['error']}\n{reply.get('traceback', '')}")
        return reply

    def close(self) -> None:
        """Ask the driver to quit; kill it if it does not within a minute."""
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(60)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.process.kill()
                self.process.wait(30)
        self._stderr.close()


if __name__ == "__main__":
    main()
