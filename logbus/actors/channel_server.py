"""The replica's end of the local channel: a Unix socket server on the actor's event loop.

See ``logbus/protocol/local_channel.py`` for why and the frame format. Each
request runs as its own task on the replica's event loop (as Ray runs an async
actor's calls), so a fetch held open waiting for data does not hold up the
produce requests behind it on the same connection. At most
``MAX_CONCURRENT_PER_CONNECTION`` requests of one connection run at once, and
replies waiting to be sent are bounded too: beyond either, the connection is
not read until requests finish or the client takes its replies, so a client
that sends faster than the replica answers is slowed by the socket, not
queued without bound. Frames are cut from the stream in ``buffer_updated``
by the protocol's ``FrameReader`` (a buffered protocol rather than a stream
reader: one event-loop turn less per request, and a large request's body is
received where the request keeps it).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import resource
import secrets
import socket
import struct
import sys
from asyncio import selector_events
from collections.abc import Awaitable, Callable

from logbus.errors import FrameError, LogbusError
from logbus.protocol import local_channel as wire

logger = logging.getLogger(__name__)

MAX_CONCURRENT_PER_CONNECTION = 256
WRITE_BUFFER_HIGH_BYTES = 4 << 20  # wait for the socket to drain above this much unsent reply data
TCP_CONNECTIONS_MAX = 1024  # clients on other nodes at once (each holds one connection per replica it uses)
TCP_UNGREETED_MAX = 32  # of those, connections that have not sent their HELLO yet
WARN_EVERY_S = 10.0  # refused TCP connections are logged at most this often per replica
HELLO_TIMEOUT_S = 5.0  # a TCP connection that has not sent its HELLO in this long is closed
HELLO_MAX_BYTES = 256  # a HELLO's body (the token); a connection whose first frame is larger is closed unread
# Sent data unacknowledged this long ends a TCP connection (TCP_USER_TIMEOUT), keepalive one whose
# peer vanished while idle: a client on a host that died leaves neither its requests nor their replies here.
TCP_USER_TIMEOUT_MS = 30_000
TCP_KEEPALIVE_S = (10, 5, 3)  # idle, interval, probes

Handler = Callable[[int, tuple], Awaitable[object]]


def supported() -> bool:
    """Abstract Unix sockets and SO_PEERCRED exist on Linux only; elsewhere clients use actor calls."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_PEERCRED")


def _write_copies(transport) -> bool:
    """Whether ``transport.write()`` is done with the buffer it was given when it returns.

    A reply's out-of-band buffer may be a view of a mapped segment, valid only
    until the reply's task yields. Python 3.11's own socket transport sends such
    a view, or copies what it cannot send yet, before write() returns; later
    versions, and other event loops (uvloop, which Ray uses where it is
    installed), may keep the view: the server copies it for those.
    """
    return isinstance(transport, selector_events._SelectorSocketTransport) and sys.version_info < (3, 12)


def tcp_allowed(environ=None) -> bool:
    """Whether replicas serve other nodes over plain TCP (the channel, followers' fetch links): not
    where Ray encrypts its own traffic (``RAY_USE_TLS``); clients and followers then use actor calls,
    which go over Ray's TLS."""
    environ = os.environ if environ is None else environ
    return str(environ.get("RAY_USE_TLS", "0")).lower() not in ("1", "true")


def tcp_connections_max() -> int:
    """TCP_CONNECTIONS_MAX, or a quarter of this process's file descriptor limit if that is less:
    the replica's own files (segments, indexes) keep room."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return TCP_CONNECTIONS_MAX
    return TCP_CONNECTIONS_MAX if soft == resource.RLIM_INFINITY else max(16, min(TCP_CONNECTIONS_MAX, soft // 4))


def tune_tcp(sock) -> None:
    """A channel's TCP socket: Nagle off (frames go whole), keepalive and TCP_USER_TIMEOUT (a peer that
    vanished ends the connection, and the requests waiting on it fail, rather than waiting for good)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), TCP_KEEPALIVE_S):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)


class LazyListener:
    """A TCP listener started by the first caller of ``port(host)`` with ``start(host)`` (once; a start
    that failed, out of file descriptors say, is tried again by the next caller), never after ``close()``."""

    def __init__(self, start: Callable[[str], Awaitable[asyncio.AbstractServer]]) -> None:
        self._start = start
        self._starting: asyncio.Task | None = None
        self._closed = False

    async def port(self, host: str) -> int:
        if self._closed:
            raise OSError("the listener is closed")
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._start(host))
        starting = self._starting
        try:
            server = await asyncio.shield(starting)
        except OSError:
            if self._starting is starting:
                self._starting = None
            raise
        return server.sockets[0].getsockname()[1]

    def close(self) -> None:
        self._closed = True
        starting, self._starting = self._starting, None
        if starting is None:
            return
        if not starting.done():
            starting.cancel()
        elif not starting.cancelled() and starting.exception() is None:
            starting.result().close()


def _peer_uid(sock) -> int | None:
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return struct.unpack("3i", creds)[1]


class ChannelServer:
    """Serves requests of kinds ``wire.REQUEST_KINDS`` by awaiting ``handler(kind, args)``.

    The handler's result is pickled into an OK reply; an exception it raises
    into an ERROR reply (the client raises it).
    """

    def __init__(self, handler: Handler, label: str) -> None:
        self._handler = handler
        self._label = label
        self._server: asyncio.AbstractServer | None = None
        self._tcp = LazyListener(lambda host: asyncio.get_running_loop().create_server(lambda: _Connection(self, self._token), host, 0))
        self._token = secrets.token_hex(16)
        self._connections: set[_Connection] = set()
        self.address: str | None = None
        self.tcp_connections = 0  # TCP connections open now, HELLO or not
        self.tcp_ungreeted = 0  # of those, the ones whose HELLO has not come yet
        self._warned_at = float("-inf")

    def warn(self, message: str, *args) -> None:
        """A refused TCP connection, logged at most every WARN_EVERY_S (anyone on the network may cause one)."""
        now = asyncio.get_running_loop().time()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            logger.warning("%s: " + message, self._label, *args)

    async def start(self) -> str | None:
        """Listen; returns the address, or None where the channel is not supported."""
        if not supported():
            return None
        address = wire.abstract_address(secrets.token_hex(12))
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), path=address)
        self.address = address
        return address

    async def tcp_address(self, host: str) -> dict:
        """Listen on TCP at ``host`` too (once), for clients on other nodes; returns host, port and the
        token their HELLO must carry. Such frames are decoded restricted (``wire.decode_body``)."""
        return {"host": host, "port": await self._tcp.port(host), "token": self._token}

    async def close(self) -> None:
        self._tcp.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        for connection in list(self._connections):
            connection.close()
        self._connections.clear()


class _Connection(asyncio.BufferedProtocol):
    """One client connection: frames are cut from the byte stream as it arrives, each request
    runs as a task, replies are written as they finish. Reading pauses while
    MAX_CONCURRENT_PER_CONNECTION requests run or while unsent replies exceed
    WRITE_BUFFER_HIGH_BYTES; frames received meanwhile wait in the reader.

    The socket is read into the reader's reused buffer of wire.READ_BUFFER_BYTES;
    a frame whose body is larger than wire.LARGE_BODY_BYTES (a produce request
    with a large batch) gets a buffer of its own, which the socket fills
    directly and the request keeps: its batch is never copied in this process."""

    def __init__(self, server: ChannelServer, token: str | None = None) -> None:
        self._server = server
        self._token = token  # a TCP connection: its first frame must be HELLO with this token
        self._hello_timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self._reader = wire.FrameReader()
        self._running = 0
        self._tasks: dict[int, asyncio.Task] = {}  # request id -> its task
        self._write_paused = False
        self._read_paused = False
        self._write_copies = False

    # --- asyncio.BufferedProtocol ----------------------------------------------------------------

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        if self._token is None:
            if _peer_uid(sock) != os.getuid():
                transport.close()  # only processes of this user (Ray's own workers) may talk to the replica
                return
        else:
            server = self._server
            if server.tcp_connections >= tcp_connections_max() or server.tcp_ungreeted >= TCP_UNGREETED_MAX:
                server.warn("channel connections from other nodes refused: %d open, %d of them without a HELLO yet",
                            server.tcp_connections, server.tcp_ungreeted)
                transport.close()
                return
            try:
                tune_tcp(sock)
            except OSError:
                transport.close()
                return
            server.tcp_connections += 1
            server.tcp_ungreeted += 1
            self._hello_timer = asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, transport.close)
        self._transport = transport
        self._write_copies = _write_copies(transport)
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH_BYTES)
        self._server._connections.add(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self._transport is None:
            return
        self._reader.buffer_updated(nbytes)
        self._take_frames()

    def connection_lost(self, exc) -> None:
        if self._token is not None and self._transport is not None:
            self._server.tcp_connections -= 1
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
            self._server.tcp_ungreeted -= 1
        self._server._connections.discard(self)
        self._transport = None
        for task in self._tasks.values():
            task.cancel()  # the client is gone: nobody waits for these replies

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()
        self._take_frames()

    # --- frames and requests --------------------------------------------------------------------------

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _may_start(self) -> bool:
        return (
            self._transport is not None
            and not self._transport.is_closing()
            and self._running < MAX_CONCURRENT_PER_CONNECTION
            and not self._write_paused
        )

    def _take_frames(self) -> None:
        # Frames not taken here (a request limit or a full write buffer) stay in the reader and
        # reading pauses (_update_reading) until _finished or resume_writing takes them.
        while self._may_start():
            try:
                if self._hello_timer is not None:
                    header = self._reader.peek_header()
                    if header is not None and (header[2] != wire.HELLO or header[0] > HELLO_MAX_BYTES):
                        raise FrameError(f"the first frame is {header[0]} bytes of kind {header[2]}, not a HELLO")
                frame = self._reader.next_frame()
            except FrameError as error:
                if self._token is None:
                    logger.warning("%s: closing a local channel connection: %s", self._server._label, error)
                else:
                    self._server.warn("closing a channel connection from %s: %s", self._transport.get_extra_info("peername"), error)
                self._transport.close()
                return
            if frame is None:
                break
            if self._hello_timer is not None or (self._token is not None and frame[1] == wire.HELLO):
                if not self._hello(frame):
                    return
                continue
            if frame[1] == wire.CANCEL:
                task = self._tasks.get(frame[0])
                if task is not None:
                    task.cancel()  # its client stopped waiting (a long poll it no longer wants)
                continue
            self._start_request(*frame)
        self._update_reading()

    def _hello(self, frame) -> bool:
        """The first frame of a TCP connection: HELLO with the token, else the connection closes."""
        _, kind, body = frame
        if self._hello_timer is None or kind != wire.HELLO or not hmac.compare_digest(bytes(body), self._token.encode()):
            self._server.warn("a channel connection from %s closed: no HELLO with the token first",
                              self._transport.get_extra_info("peername"))
            self._transport.close()
            return False
        self._hello_timer.cancel()
        self._hello_timer = None
        self._server.tcp_ungreeted -= 1
        return True

    def _start_request(self, request_id: int, kind: int, body) -> None:
        self._running += 1
        task = asyncio.get_running_loop().create_task(self._serve(request_id, kind, body))
        self._tasks[request_id] = task
        task.add_done_callback(lambda done: self._finished(request_id, done))

    def _update_reading(self) -> None:
        transport = self._transport
        if transport is None:
            return
        # The reader holds at most one buffer of small frames and one large body: it is not read
        # into while frames are waiting to be taken.
        pause = self._write_paused or self._running >= MAX_CONCURRENT_PER_CONNECTION
        if pause and not self._read_paused:
            transport.pause_reading()
            self._read_paused = True
        elif not pause and self._read_paused:
            transport.resume_reading()
            self._read_paused = False

    def _finished(self, request_id: int, task: asyncio.Task) -> None:
        if self._tasks.get(request_id) is task:
            del self._tasks[request_id]
        self._running -= 1
        self._take_frames()  # frames that waited for a free slot

    async def _serve(self, request_id: int, kind: int, body) -> None:
        try:
            if kind not in wire.REQUEST_KINDS:
                raise ValueError(f"unknown local channel request kind {kind}")
            args = wire.decode_body(body, restricted=self._token is not None)
            del body
            if not isinstance(args, tuple):
                raise ValueError("local channel request arguments must be a tuple")
            parts = wire.encode_parts(request_id, wire.OK, await self._server._handler(kind, args))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 (every failure goes back to the caller)
            if self._token is not None and not isinstance(error, LogbusError):
                # A client on another node rebuilds only logbus's errors: others go as their text.
                error = LogbusError(f"{type(error).__name__}: {error}")
            try:
                parts = wire.encode_parts(request_id, wire.ERROR, error)
            except Exception:  # noqa: BLE001 (an error that does not pickle goes as its text)
                parts = wire.encode_parts(request_id, wire.ERROR, LogbusError(f"{type(error).__name__}: {error}"))
        transport = self._transport
        if transport is not None and not transport.is_closing():
            for part in parts:
                transport.write(part if self._write_copies or isinstance(part, bytes) else bytes(part))
