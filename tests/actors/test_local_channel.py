"""The local channel: its server and client on a real Unix socket, then producers and consumers through it."""

import asyncio
import os
import pickle
import random
import signal
import socket
import threading
import time
import zlib

import numpy as np
import pyarrow as pa
import pytest
import ray

import logbus
from logbus import TopicPartition
from logbus.actors import channel_client, channel_server
from logbus.actors.channel_server import ChannelServer
from logbus.actors.channel_client import Connection, cancel_request, channels
from logbus.errors import ChannelBusyError, ChannelClosedError, NotLeaderError
from logbus.protocol import local_channel as wire
from tests.api.test_broker import drain
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(not channel_server.supported(), reason="the local channel needs Linux")


def encode(request_id, kind, payload) -> bytes:
    """One frame as bytes: the parts a sender writes, joined."""
    return b"".join(wire.encode_parts(request_id, kind, payload))


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


class Service:
    """A handler with the shapes the replica's has: immediate results, long waits, errors."""

    def __init__(self):
        self.started = 0
        self.release: asyncio.Event | None = None

    async def __call__(self, kind, args):
        self.started += 1
        if args and args[0] == "sleep":
            await asyncio.sleep(args[1])
        elif args and args[0] == "block":
            await self.release.wait()
        elif args and args[0] == "raise":
            raise NotLeaderError("not the leader")
        elif args and args[0] == "big":
            return b"x" * (1 << 20)
        return (kind, args)


def start(loop, service):
    server = ChannelServer(service, "test")

    async def go():
        service.release = asyncio.Event()
        return await server.start()

    address = asyncio.run_coroutine_threadsafe(go(), loop).result(10)
    return server, address


def test_results_errors_and_replies_out_of_order(loop):
    service = Service()
    server, address = start(loop, service)
    connection = Connection(address)
    try:
        slow = connection.call(wire.FETCH, ("block",))
        fast = connection.call(wire.PRODUCE, (b"batch", 1))
        assert fast.result(10) == (wire.PRODUCE, (b"batch", 1))
        assert not slow.done()  # the slow request does not hold up the one behind it
        loop.call_soon_threadsafe(service.release.set)
        assert slow.result(10) == (wire.FETCH, ("block",))
        with pytest.raises(NotLeaderError, match="not the leader"):  # the replica's error, as raised there
            connection.call(wire.PRODUCE, ("raise",)).result(10)
        with pytest.raises(ValueError, match="unknown local channel request kind"):
            connection.call(77, ()).result(10)
        assert connection.requests_sent == 4
    finally:
        connection.close()
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)


def test_a_cancelled_request_stops_at_the_server_and_the_connection_goes_on(loop):
    service = Service()
    cancelled = []

    async def handler(kind, args):
        try:
            return await service(kind, args)
        except asyncio.CancelledError:
            cancelled.append(args)
            raise

    server, address = start(loop, handler)
    service.release = asyncio.Event()  # never set: the request waits until it is cancelled
    connection = Connection(address)
    try:
        parked = connection.call(wire.FETCH, ("block",))
        wait_for(lambda: service.started == 1, timeout_s=30, message="the request to reach the server")
        assert cancel_request(parked)
        assert parked.cancelled()
        wait_for(lambda: cancelled == [("block",)], timeout_s=30, message="the server to cancel the request")
        assert connection.call(wire.PRODUCE, (b"after",)).result(10) == (wire.PRODUCE, (b"after",))
        assert not cancel_request(parked)  # once only
        done = connection.call(wire.PRODUCE, (b"done",))
        done.result(10)
        assert not cancel_request(done)  # answered already: nothing to cancel
    finally:
        connection.close()
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)


def test_requests_that_may_not_wait_queue_behind_a_full_socket_in_order_then_are_refused(loop, monkeypatch):
    """``block=False`` (the gateway's event loop) never waits for a replica that stopped reading:
    what the socket cannot take goes from a thread of the connection's own, in order, up to a
    bound; past it a request is refused unsent (ChannelBusyError: the caller uses an actor call)."""
    monkeypatch.setattr(channel_server, "MAX_CONCURRENT_PER_CONNECTION", 1)
    monkeypatch.setattr(channel_client, "BACKLOG_MAX_BYTES", 4 << 20)
    service = Service()
    arrived = []

    async def handler(kind, args):
        if args[0] == "payload":  # what arrived, without sending it all back
            arrived.append(args[1])
            return ("payload", args[1], len(args[2]), zlib.crc32(args[2]))
        return await service(kind, args)

    server, address = start(loop, handler)
    service.release = asyncio.Event()
    connection = Connection(address)
    try:
        first = connection.call(wire.FETCH, ("block",))
        wait_for(lambda: service.started == 1, timeout_s=30, message="the first request to start")
        # One request at a time: the server stops reading, and what follows fills the socket.
        payloads = [bytes([i]) * (1 << 20) for i in range(64)]  # 64 MiB: far more than a socket and the queue hold
        sent = []
        with pytest.raises(ChannelBusyError) as refused:
            for i, payload in enumerate(payloads):
                sent.append(connection.call(wire.PRODUCE, ("payload", i, pickle.PickleBuffer(payload)), block=False))
        assert refused.value.retriable and not connection.closed
        assert 2 <= len(sent) <= 6  # the socket's share of one, then 4 MiB queued
        loop.call_soon_threadsafe(service.release.set)
        assert first.result(30) == (wire.FETCH, ("block",))
        for i, future in enumerate(sent):
            assert future.result(60) == ("payload", i, 1 << 20, zlib.crc32(payloads[i]))  # each frame whole, in step
        assert arrived == list(range(len(sent)))  # in the order sent; the refused one never went
        assert connection.call(wire.PRODUCE, (b"after",), block=False).result(30) == (wire.PRODUCE, (b"after",))
    finally:
        connection.close()
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)


def test_a_cancel_queues_behind_frames_the_sender_thread_still_has_and_reaches_the_server(loop, monkeypatch):
    """While the connection's sender thread works through frames a full socket could not take, a
    cancel goes in the same queue, in order, rather than being skipped (the reply merely dropped)."""
    monkeypatch.setattr(channel_server, "MAX_CONCURRENT_PER_CONNECTION", 2)
    events = {"A": asyncio.Event(), "B": asyncio.Event()}
    started, cancelled = [], []

    async def handler(kind, args):
        if args[0] == "wait":
            started.append(args[1])
            try:
                await events[args[1]].wait()
            except asyncio.CancelledError:
                cancelled.append(args[1])
                raise
            return args[1]
        return ("payload", args[1], len(args[2]))

    server, address = start(loop, handler)
    connection = Connection(address)
    try:
        parked = connection.call(wire.FETCH, ("wait", "A"))
        other = connection.call(wire.FETCH, ("wait", "B"))
        wait_for(lambda: started == ["A", "B"], timeout_s=30, message="both requests to start")
        # Two requests at a time: the server reads no more frames, and these fill the socket and the queue.
        payload = b"p" * (1 << 20)
        sent = [connection.call(wire.PRODUCE, ("payload", i, pickle.PickleBuffer(payload)), block=False) for i in range(8)]
        assert cancel_request(parked) and parked.cancelled()
        assert cancelled == []  # queued behind the payloads
        loop.call_soon_threadsafe(events["B"].set)
        assert other.result(30) == "B"
        assert [future.result(60) for future in sent] == [("payload", i, 1 << 20) for i in range(8)]
        wait_for(lambda: cancelled == ["A"], timeout_s=30, message="the cancel to reach the server")
        assert connection.call(wire.PRODUCE, ("payload", 99, b"after"), block=False).result(30) == ("payload", 99, 5)
    finally:
        connection.close()
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)


def test_outstanding_requests_fail_retriably_when_the_server_goes_away(loop):
    service = Service()
    server, address = start(loop, service)
    connection = Connection(address)
    waiting = connection.call(wire.FETCH, ("block",))
    wait_for(lambda: service.started == 1, timeout_s=30, message="the request to reach the server")
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
    with pytest.raises(ChannelClosedError) as raised:
        waiting.result(30)
    assert raised.value.retriable
    wait_for(lambda: connection.closed, timeout_s=30, message="the connection to close")
    with pytest.raises(ChannelClosedError):
        connection.call(wire.PRODUCE, (b"batch",))  # refused before anything is sent
    with pytest.raises(OSError):
        Connection(address)  # nobody listens there any more


def test_a_connection_runs_a_bounded_number_of_requests(loop, monkeypatch):
    monkeypatch.setattr(channel_server, "MAX_CONCURRENT_PER_CONNECTION", 2)
    service = Service()
    server, address = start(loop, service)
    connection = Connection(address)
    try:
        blocked = [connection.call(wire.FETCH, ("block",)) for _ in range(3)]
        wait_for(lambda: service.started == 2, timeout_s=30, message="two requests to start")
        assert service.started == 2 and not any(f.done() for f in blocked)  # the third waits its turn
        loop.call_soon_threadsafe(service.release.set)
        assert [f.result(30)[1] for f in blocked] == [("block",)] * 3
        assert service.started == 3
    finally:
        connection.close()
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)


def test_a_client_that_does_not_take_its_replies_is_not_served_further(loop, monkeypatch):
    """Replies waiting to be sent are bounded: past the limit the server stops reading requests."""
    monkeypatch.setattr(channel_server, "MAX_CONCURRENT_PER_CONNECTION", 2)
    monkeypatch.setattr(channel_server, "WRITE_BUFFER_HIGH_BYTES", 2 << 20)
    service = Service()
    server, address = start(loop, service)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(address)
            raw.settimeout(60)
            raw.sendall(b"".join(encode(i, wire.FETCH, ("big",)) for i in range(40)))
            wait_for(lambda: any(c._read_paused for c in list(server._connections)), timeout_s=30, message="reading to pause")
            assert service.started < 40  # the rest wait until the client takes its replies
            replies = 0
            while replies < 40:  # now read everything: the server resumes and answers every request
                length, _, kind = wire.decode_header(raw.recv(wire.HEADER_SIZE, socket.MSG_WAITALL))
                body = b""
                while len(body) < length:
                    body += raw.recv(length - len(body))
                assert kind == wire.OK and len(wire.decode_body(body)) == 1 << 20
                replies += 1
        assert service.started == 40
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)


def test_a_malformed_frame_closes_the_connection(loop):
    server, address = start(loop, Service())
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(address)
            raw.settimeout(30)
            raw.sendall(wire.HEADER.pack(wire.MAX_BODY_BYTES + 1, 1, wire.PRODUCE))
            assert raw.recv(1) == b""  # closed, nothing served
        connection = Connection(address)  # the server itself keeps serving
        assert connection.call(wire.PRODUCE, (b"ok",)).result(10) == (wire.PRODUCE, (b"ok",))
        connection.close()
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)


def on_loop(loop, read):
    """``read()`` run on the server's event loop (its counters change there)."""

    async def call():
        return read()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(10)


def closed_unanswered(raw) -> bool:
    """Whether the peer closed the connection without a byte (a reset counts: unread bytes were dropped)."""
    try:
        return raw.recv(1) == b""
    except ConnectionResetError:
        return True


def tcp_start(loop, service):
    server, _ = start(loop, service)
    return server, asyncio.run_coroutine_threadsafe(server.tcp_address("127.0.0.1"), loop).result(10)


class Bug:
    """An object whose unpickling would run a function (it writes a file): a frame from the network
    must never rebuild it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_over_tcp_a_client_with_the_token_is_served_and_gets_logbus_errors_only(loop):
    service = Service()
    server, address = tcp_start(loop, service)
    try:
        connection = Connection(address)
        assert connection.remote
        assert connection.call(wire.FETCH, ("x", 1)).result(10) == (wire.FETCH, ("x", 1))
        with pytest.raises(NotLeaderError, match="not the leader"):
            connection.call(wire.PRODUCE, ("raise",)).result(10)
        assert connection.call(wire.FETCH, ("big",)).result(30) == b"x" * (1 << 20)
        assert on_loop(loop, lambda: (server.tcp_connections, server.tcp_ungreeted)) == (1, 0)
        connection.close()
        wait_for(lambda: on_loop(loop, lambda: server.tcp_connections) == 0, timeout_s=30, message="the connection counted out")
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
    # A request far larger than a socket's buffer goes out of band, whole.
    server, address = tcp_start(loop, Echo())
    try:
        connection = Connection(address)
        blob = os.urandom(3 << 20)
        assert connection.call(wire.PRODUCE, (pickle.PickleBuffer(blob),)).result(30) == (zlib.crc32(blob), len(blob), "memoryview")
        connection.close()
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)


@pytest.mark.parametrize("first", ["wrong token", "no hello", "large hello", "silence"])
def test_over_tcp_a_connection_without_the_token_first_is_closed_unserved(loop, monkeypatch, first):
    monkeypatch.setattr(channel_server, "HELLO_TIMEOUT_S", 0.3)
    service = Service()
    server, address = tcp_start(loop, service)
    try:
        with socket.create_connection((address["host"], address["port"]), timeout=30) as raw:
            if first == "wrong token":
                raw.sendall(wire.encode_hello("0" * 32) + encode(1, wire.PRODUCE, ("x",)))
            elif first == "no hello":
                raw.sendall(encode(1, wire.PRODUCE, ("x",)))
            elif first == "large hello":
                raw.sendall(wire.HEADER.pack(wire.MAX_BODY_BYTES, 0, wire.HELLO))
            assert closed_unanswered(raw)
        assert service.started == 0
        wait_for(lambda: on_loop(loop, lambda: (server.tcp_connections, server.tcp_ungreeted)) == (0, 0), timeout_s=30,
                 message="the connection counted out")
        connection = Connection(address)  # the server itself keeps serving
        assert connection.call(wire.PRODUCE, ("ok",)).result(10) == (wire.PRODUCE, ("ok",))
        connection.close()
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)


def test_over_tcp_a_frame_rebuilds_nothing_but_logbus_messages_and_errors(loop, tmp_path):
    """A request whose pickle would call a function is refused at the server; a reply that would is
    refused at the client. Over the Unix socket (same user, same trust as Ray) both are pickles as any."""
    marker = tmp_path / "ran"
    service = Service()
    server, address = tcp_start(loop, service)
    try:
        connection = Connection(address)
        with pytest.raises(logbus.LogbusError, match="may not rebuild"):
            connection.call(wire.PRODUCE, (Bug(str(marker)),)).result(10)
        assert not marker.exists() and service.started == 0

        class Answer:
            async def __call__(self, kind, args):
                return Bug(str(marker))

        server._handler = Answer()
        with pytest.raises(logbus.LogbusError, match="undecodable"):
            connection.call(wire.FETCH, ()).result(10)
        assert not marker.exists()  # the reply was refused, not unpickled
        connection.close()
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)


def test_over_tcp_connections_without_a_hello_are_bounded_and_counted_out(loop, monkeypatch):
    monkeypatch.setattr(channel_server, "TCP_UNGREETED_MAX", 2)
    monkeypatch.setattr(channel_server, "HELLO_TIMEOUT_S", 1.0)
    service = Service()
    server, address = tcp_start(loop, service)
    silent = [socket.create_connection((address["host"], address["port"]), timeout=30) for _ in range(2)]
    try:
        wait_for(lambda: on_loop(loop, lambda: server.tcp_ungreeted) == 2, timeout_s=30, message="two connections waiting")
        with socket.create_connection((address["host"], address["port"]), timeout=30) as third:
            assert closed_unanswered(third)  # refused while two wait for their HELLO
        for raw in silent:
            assert closed_unanswered(raw)  # their HELLO did not come in time
        assert on_loop(loop, lambda: (server.tcp_connections, server.tcp_ungreeted)) == (0, 0)
        connection = Connection(address)
        assert connection.call(wire.FETCH, ("ok",)).result(10) == (wire.FETCH, ("ok",))
        connection.close()
        assert service.started == 1
    finally:
        for raw in silent:
            raw.close()
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)


class Replica:
    """What the registry keeps of a replica's actor handle: its actor id."""

    def __init__(self, actor_id):
        self._actor_id = actor_id


def ready_entry(registry, replica, address):
    """Put a replica in the registry as its lookup would (on another node, with a TCP address)."""
    entry = channel_client._Entry()
    entry.state, entry.address = "ready", address
    registry._entries[replica._actor_id] = entry
    return entry


def test_the_registry_opens_tcp_connections_in_the_background_up_to_its_bound(loop):
    server, address = tcp_start(loop, Service())
    registry = channel_client.Channels(remote_max=2)
    replicas = [Replica(i) for i in range(3)]
    try:
        for replica in replicas:
            ready_entry(registry, replica, address)
            assert registry.connection(replica) is None  # connecting: this request goes as an actor call
        opened = [wait_for(lambda r=r: registry.connection(r), timeout_s=30, message="a connection") for r in replicas[:2]]
        assert all(c.remote for c in opened) and opened[0] is not opened[1]
        assert registry.connection(replicas[2]) is None and registry._entries[2].state == "failed"  # past the bound
        assert opened[0].call(wire.FETCH, ("x",)).result(10) == (wire.FETCH, ("x",))
        opened[0].close()  # it had answered: looked up again at once, and the count is one less
        assert registry._entries[0].state == "failed" and registry._entries[0].failures == 0
        assert registry._remote == 1
        opened[1].close()
        assert registry._remote == 0
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)


def test_the_registry_backs_off_from_a_replica_it_cannot_reach(monkeypatch):
    monkeypatch.setattr(channel_client, "RETRY_LOOKUP_S", 10.0)  # (nothing here waits for a retry: entries are set up anew)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    address = {"host": "127.0.0.1", "port": closed.getsockname()[1], "token": "t"}
    closed.close()  # nothing listens there: every connection is refused
    registry = channel_client.Channels()
    replica = Replica("r")
    delays = []
    for attempt in range(1, 8):
        entry = ready_entry(registry, replica, address)
        entry.failures = attempt - 1  # as the entry before it left them
        assert registry.connection(replica) is None
        wait_for(lambda: entry.state == "failed", timeout_s=30, message="the connection failed")
        assert registry._remote == 0 and entry.failures == attempt
        delays.append(entry.retry_at - time.monotonic())
    # 10 s, then twice as long each time, up to REMOTE_RETRY_MAX_S (less the time each failure took here).
    expected = [min(10.0 * 2 ** i, channel_client.REMOTE_RETRY_MAX_S) for i in range(len(delays))]
    assert expected[-1] == channel_client.REMOTE_RETRY_MAX_S
    assert all(want - 5 < got <= want for got, want in zip(delays, expected)), (delays, expected)


class Echo:
    """Answers a request of one blob with (its CRC, its length, the type it arrived as), and
    a request for n bytes with n bytes out of band."""

    async def __call__(self, kind, args):
        if args[0] == "give":
            return pickle.PickleBuffer(b"g" * args[1])
        (blob,) = args
        return zlib.crc32(blob), len(blob), type(blob).__name__


def test_frames_are_cut_from_any_chunking_and_large_bodies_arrive_whole(loop):
    """Requests of every size, written in chunks cut anywhere (mid-header, mid-body), are each served once."""
    rng = random.Random(5)
    server, address = start(loop, Echo())
    sizes = [rng.choice([10, 5000, wire.LARGE_BODY_BYTES + 10, wire.READ_BUFFER_BYTES + 99, 3 << 20])
             for _ in range(60)]
    blobs = [rng.randbytes(size) for size in sizes]
    stream = b"".join(encode(i, wire.PRODUCE, (pickle.PickleBuffer(b),)) for i, b in enumerate(blobs))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(address)
            raw.settimeout(60)
            replies = {}

            def read_replies():
                while len(replies) < len(blobs):
                    length, request_id, kind = wire.decode_header(raw.recv(wire.HEADER_SIZE, socket.MSG_WAITALL))
                    replies[request_id] = (kind, wire.decode_body(raw.recv(length, socket.MSG_WAITALL)))

            reader = threading.Thread(target=read_replies, daemon=True)
            reader.start()
            position = 0
            while position < len(stream):
                step = rng.choice([1, 7, 13, 4096, 70_000, 1 << 20])
                raw.sendall(stream[position : position + step])
                position += step
            reader.join(60)
            assert len(replies) == len(blobs)
        for i, blob in enumerate(blobs):
            kind, (crc, length, arrived_as) = replies[i]
            assert kind == wire.OK and (crc, length) == (zlib.crc32(blob), len(blob))
            # Large blobs reach the handler as views of the frame's own buffer; small ones inside the pickle.
            assert arrived_as == ("memoryview" if len(blob) >= wire.OUT_OF_BAND_MIN_BYTES else "bytes")
        # The client's side: a request's batch goes out uncopied (sendmsg), a reply's comes back as a view.
        connection = Connection(address)
        try:
            blob = rng.randbytes(5 << 20)
            assert connection.call(wire.PRODUCE, (pickle.PickleBuffer(blob),)).result(30) == (zlib.crc32(blob), len(blob), "memoryview")
            got = connection.call(wire.FETCH, ("give", 2 << 20)).result(30)
            assert isinstance(got, memoryview) and got.readonly and bytes(got) == b"g" * (2 << 20)
            assert isinstance(got.obj, np.ndarray)  # a view of the buffer the reply was received into
        finally:
            connection.close()
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)


def test_replies_are_whole_where_the_transport_may_keep_what_it_is_given(loop, monkeypatch):
    """On event loops whose transports may hold on to a written view (uvloop, Python >= 3.12), the
    server copies out-of-band reply buffers first; the client sees the same replies."""
    monkeypatch.setattr(channel_server, "_write_copies", lambda transport: False)
    server, address = start(loop, Echo())
    connection = Connection(address)
    try:
        assert not any(c._write_copies for c in list(server._connections))
        replies = [connection.call(wire.FETCH, ("give", size)) for size in (10, 5000, 3 << 20)]
        assert [bytes(r.result(30)) for r in replies] == [b"g" * 10, b"g" * 5000, b"g" * (3 << 20)]
        assert all(not c._write_copies for c in list(server._connections))
    finally:
        connection.close()
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)


# --- through real replicas ----------------------------------------------------------------------


def channel_requests(leader) -> int:
    """Requests sent so far over this process's open channel to ``leader`` (0 if none is open)."""
    connection = channels().connection(leader)
    return connection.requests_sent if connection is not None else 0


def test_producer_and_consumer_on_the_leaders_node_use_the_channel(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    tp = TopicPartition(topic_name, 0)
    leader = bus.topic_metadata(topic_name).leaders[0]
    consumer = logbus.Consumer(bus, fetch_max_wait_ms=200)
    consumer.assign([tp])
    assert consumer.poll_arrow(timeout_ms=100).num_rows == 0
    wait_for(lambda: channels().connection(leader) is not None, timeout_s=60, message="the channel to the leader")
    before = channel_requests(leader)
    with logbus.Producer(bus, linger_ms=0) as producer:
        offsets = [producer.send(topic_name, b"v-%d" % i).result(30).offset for i in range(300)]
    assert offsets == list(range(300))
    got = drain(consumer, 300)
    assert got["offset"].to_pylist() == list(range(300))
    assert got["value"].to_pylist() == [b"v-%d" % i for i in range(300)]
    # 300 produce requests (one record each, each awaited) and the consumer's fetches at the log end.
    assert channel_requests(leader) - before >= 300
    assert consumer.poll_arrow(timeout_ms=300).num_rows == 0  # nothing twice
    consumer.close()
    # Without the channel the same records land the same way, as actor calls.
    sent_before = channel_requests(leader)
    with logbus.Producer(bus, linger_ms=0, local_channel=False) as producer:
        offsets = [producer.send(topic_name, b"w-%d" % i).result(30).offset for i in range(50)]
    assert offsets == list(range(300, 350))
    assert channel_requests(leader) == sent_before
    consumer = logbus.Consumer(bus, local_channel=False)
    consumer.assign([tp])
    consumer.seek(tp, 300)
    assert drain(consumer, 50)["value"].to_pylist() == [b"w-%d" % i for i in range(50)]
    consumer.close()
    assert channel_requests(leader) == sent_before


def test_a_large_batch_at_the_log_end_arrives_whole(bus, topic_name):
    """A tailing consumer fetches over the channel; a batch over 1 MiB comes whole, then it tails on."""
    bus.admin.create_topic(topic_name, partitions=1)
    tp = TopicPartition(topic_name, 0)
    consumer = logbus.Consumer(bus, fetch_max_wait_ms=200)
    consumer.assign([tp])
    with logbus.Producer(bus, linger_ms=0) as producer:
        producer.send(topic_name, b"small").result(30)
        assert drain(consumer, 1)["value"].to_pylist() == [b"small"]
        leader = bus.topic_metadata(topic_name).leaders[0]
        wait_for(lambda: channels().connection(leader) is not None, timeout_s=60, message="the channel to the leader")
        values = [os.urandom(1000) for _ in range(3000)]  # one 3 MB batch
        producer.send_table(topic_name, pa.table({"value": pa.array(values, pa.binary())})).result(60)
        got = drain(consumer, 3000)
        assert got["offset"].to_pylist() == list(range(1, 3001))
        assert got["value"].to_pylist() == values
        producer.send(topic_name, b"after").result(30)
        assert drain(consumer, 1)["value"].to_pylist() == [b"after"]
    consumer.close()


def test_a_consumer_behind_reads_over_the_channel_and_an_oversized_batch_by_actor_call(bus, topic_name):
    """Reading from the start goes over the channel too; a batch larger than a channel frame carries comes
    through the object store, in its place."""
    bus.admin.create_topic(topic_name, partitions=1, config={"max.message.bytes": 40 << 20})
    tp = TopicPartition(topic_name, 0)
    leader = bus.topic_metadata(topic_name).leaders[0]
    wait_for(lambda: channels().connection(leader) is not None, timeout_s=60, message="the channel to the leader")
    rng = random.Random(11)
    tables = [[rng.randbytes(1000) for _ in range(1000)] for _ in range(12)]  # ~1 MB batches
    tables.insert(6, [rng.randbytes(1 << 20) for _ in range(wire.CHANNEL_FETCH_MAX_BYTES // (1 << 20) + 1)])  # > 32 MiB
    with logbus.Producer(bus) as producer:
        for values in tables:
            producer.send_table(topic_name, pa.table({"value": pa.array(values, pa.binary())})).result(60)
    before = channel_requests(leader)
    consumer = logbus.Consumer(bus, fetch_max_bytes=4 << 20, max_buffered_bytes=80 << 20)
    consumer.assign([tp])
    consumer.seek_to_beginning()
    expected = [v for values in tables for v in values]
    got = drain(consumer, len(expected))
    assert got["offset"].to_pylist() == list(range(len(expected)))
    assert got["value"].to_pylist() == expected
    assert channel_requests(leader) - before >= 3  # ~16 MB before the large batch, ~6 MB after it, 4 MB a fetch
    assert consumer.poll_arrow(timeout_ms=300).num_rows == 0  # nothing twice
    consumer.close()


@pytest.mark.slow
def test_killed_leader_process_loses_nothing_and_the_channel_reconnects(bus, topic_name):
    """Fault: kill the leader's process while an idempotent producer sends over the channel."""
    bus.admin.create_topic(topic_name, partitions=1)
    tp = TopicPartition(topic_name, 0)
    leader = bus.topic_metadata(topic_name).leaders[0]
    pid = ray.get(leader.ping.remote())
    wait_for(lambda: channels().connection(leader) is not None, timeout_s=60, message="the channel to the leader")
    first = channels().connection(leader)
    producer = logbus.Producer(bus, linger_ms=0, delivery_timeout_ms=90_000)
    futures = [producer.send(topic_name, b"r-%d" % i) for i in range(200)]
    producer.flush(timeout_s=60)
    assert first.requests_sent > 0
    for i in range(200, 6000):
        futures.append(producer.send(topic_name, b"r-%d" % i))
        if i == 3000:
            os.kill(pid, signal.SIGKILL)
    producer.flush(timeout_s=120)
    acknowledged = {f.result().offset: b"r-%d" % i for i, f in enumerate(futures) if f.exception() is None}
    assert len(acknowledged) > 3000
    assert ray.get(leader.ping.remote()) != pid  # Ray restarted the replica in a new process
    assert first.closed
    # The producer finds the restarted replica's new socket and uses it again.
    wait_for(lambda: channels().connection(leader) not in (None, first), timeout_s=60, message="a new channel")
    with producer:
        for i in range(6000, 6100):
            futures.append(producer.send(topic_name, b"r-%d" % i))
            acknowledged[futures[-1].result(60).offset] = b"r-%d" % i
    assert channels().connection(leader).requests_sent >= 100
    consumer = logbus.Consumer(bus)
    consumer.assign([tp])
    end = consumer.end_offsets([tp])[tp]
    stored = drain(consumer, end)
    values = stored["value"].to_pylist()
    assert stored["offset"].to_pylist() == list(range(end))  # offsets never reused or skipped
    assert len(values) == len(set(values))  # idempotence: no record written twice
    by_offset = dict(zip(stored["offset"].to_pylist(), values))
    for offset, value in acknowledged.items():
        assert by_offset[offset] == value  # every acknowledged record survived, at its offset
    consumer.close()
