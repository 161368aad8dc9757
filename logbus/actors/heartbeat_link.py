"""The node agents' heartbeat link to the controller: one TCP connection per agent, JSON frames.

A node's lease is renewed five times a second. As a Ray actor call each
renewal cost each of its two processes about 1.7 ms of CPU on a 2-core VM
(the caller's submission, the raylet, several threads woken on each side), so
an idle cluster's agent and controller used 1.35 % of a core each, four times
a plain idle actor. Over a socket between the two event loops the same
renewal costs a few tens of microseconds.

The controller listens on its node's Ray address (where Ray's own services
listen) on a port the system picks, and gives the address and a random token
to agents that ask through an actor call (``Controller.heartbeat_address``).
The agent's first frame carries the token; a connection that sends a wrong
one, a malformed frame or a frame over ``MAX_FRAME_BYTES`` is closed. Frames
are JSON (never pickle: nothing sent over TCP is executed), each preceded by
its length as 4 bytes, big-endian::

    agent -> controller   {"token": "..."}                      first frame only
                          {"seq": n, "node": ..., "incarnation": ..., "down": [...], "version": [...]}
    controller -> agent   {"seq": n, "reply": {...}} or {"seq": n, "error": "..."}

Replies come back in order. The agent keeps actor calls as the fallback:
while the link is down (not yet open, the controller restarting, a silent
peer) it heartbeats through Ray as before and reopens the link in the
background (:class:`ReopenPolicy`).

Reopening after a cut network. A link that went silent while the network
between the agent and the controller was cut is reopened to the address it
had, without asking the controller again (that is an actor call, which waits
for the network as long as the link did), with a short connect timeout, and
tried again every ``RECONNECT_MS`` while the cut lasts: a connection opened
after the heal is up at once, whereas one whose first packets were sent
during the cut waits for the kernel's SYN retransmits (1, 2, 4 s...), and
the node's lease lapses again meanwhile. After ``RECONNECT_TRIES`` tries in a
row, or a refused connection (the controller is not there any more), the
agent asks the controller for its address again, with a doubling backoff
from ``RETRY_MS`` up to ``RETRY_MAX_MS`` (where the port cannot be reached at
all, heartbeats stay actor calls).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable

from logbus.errors import HeartbeatLinkClosedError, HeartbeatRefusedError

logger = logging.getLogger(__name__)

LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 64 << 20  # a node's epoch table: about 40 bytes per replica on the node
WRITE_BUFFER_HIGH_BYTES = 1 << 20  # the controller waits for a slow agent's socket above this
KEEPALIVE_S = (10, 5, 3)  # idle, interval, probes: a peer whose host vanished is noticed within 25 s

RETRY_MS = 1_000  # asking the controller for its address again after a failure: no sooner (doubling each time)
RETRY_MAX_MS = 60_000  # ... up to this
RECONNECT_MS = 250  # reconnecting to an address that worked before: this often while the network is cut
RECONNECT_TRIES = 40  # ... this many times in a row (10-30 s), then the address is asked again
CONNECT_TIMEOUT_S = 0.5  # a connection to an address that worked before opens within this, or is tried again


class ReopenPolicy:
    """When the agent tries to open its heartbeat link again, and whether it asks for the address first.

    Pure state with an explicit clock; the agent reports each try's outcome (see the module docstring).
    """

    def __init__(self) -> None:
        self.address: dict | None = None  # the controller's address and token, once it gave them
        self.proven = False  # a link to ``address`` opened before
        self.failures = 0  # tries in a row that failed
        self._retry_ms = RETRY_MS
        self._next_ms = 0
        self.slowest = False  # the last failure set the slowest pace (RETRY_MAX_MS) for the first time

    def due(self, now_ms: int) -> bool:
        return now_ms >= self._next_ms

    def connect_timeout_s(self, default_s: float) -> float:
        """How long the next try's connection may take: short to an address that worked before."""
        return CONNECT_TIMEOUT_S if self.proven else default_s

    def asked(self, address: dict) -> None:
        """The controller gave its address (an actor call)."""
        if address != self.address:
            self.address, self.proven = address, False

    def opened(self) -> None:
        self.proven, self.failures, self._retry_ms = True, 0, RETRY_MS

    def failed(self, now_ms: int, refused: bool) -> int:
        """A try failed (``refused``: the connection was refused); returns the delay before the next, in ms."""
        self.failures += 1
        self.slowest = False
        if self.proven and not refused and self.failures < RECONNECT_TRIES:
            delay = RECONNECT_MS  # a cut network: try the same address again soon
        else:
            self.address, self.proven = None, False  # ask the controller where it is now
            delay, self._retry_ms = self._retry_ms, min(2 * self._retry_ms, RETRY_MAX_MS)
            self.slowest = delay < RETRY_MAX_MS == self._retry_ms
        self._next_ms = now_ms + delay
        return delay




def encode(message: dict) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"heartbeat frame of {len(body)} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return LENGTH.pack(len(body)) + body


def _keep_alive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive, so that a connection to a host that vanished (no FIN, no RST) ends.

    The agent notices a silent controller sooner, by its unanswered heartbeats;
    the controller's end of a dead node's link would otherwise stay open for good.
    """
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE_S):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


async def read_frame(reader: asyncio.StreamReader) -> dict:
    """The next frame's message; raises HeartbeatLinkClosedError at the end of the stream or on a bad frame."""
    try:
        (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        if size > MAX_FRAME_BYTES:
            message = None
        else:
            message = json.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, OSError, ValueError, RecursionError) as error:
        # OSError: the connection reset, or timed out (ETIMEDOUT: keepalive found the peer gone, a cut
        # network); ValueError: not JSON, or not UTF-8; RecursionError: JSON nested too deep.
        raise HeartbeatLinkClosedError(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__) from None
    if size > MAX_FRAME_BYTES:
        raise HeartbeatLinkClosedError(f"frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    if not isinstance(message, dict):
        raise HeartbeatLinkClosedError("a frame is not a JSON object")
    return message


class HeartbeatServer:
    """The controller's end: answers each heartbeat with ``await handler(message)``."""

    def __init__(self, handler: Callable[[dict], Awaitable[dict]]) -> None:
        self._handler = handler
        self._token = secrets.token_hex(16)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.address: dict | None = None
        self.links_opened = 0  # connections that passed the token check

    async def start(self, host: str) -> dict:
        """Listen on ``host`` (once); returns what an agent needs to connect: host, port and token."""
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, host, 0, limit=1 << 16)
            port = self._server.sockets[0].getsockname()[1]
            self.address = {"host": host, "port": port, "token": self._token}
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One agent's connection until it ends. A connection that fails (reset, timed out, a cut
        network) is an operating error: one line, no traceback; the agent reopens it."""
        self._writers.add(writer)
        peer = writer.get_extra_info("peername")
        try:
            _keep_alive(writer)
            hello = await read_frame(reader)
            if not hmac.compare_digest(str(hello.get("token", "")).encode(), self._token.encode()):  # any text, not only ASCII
                logger.warning("heartbeat link from %s: wrong token; closed", writer.get_extra_info("peername"))
                return
            self.links_opened += 1
            while True:
                message = await read_frame(reader)
                try:
                    reply = {"seq": message.get("seq"), "reply": await self._handler(message)}
                except Exception as error:  # noqa: BLE001 (the agent counts it as no renewal)
                    reply = {"seq": message.get("seq"), "error": f"{type(error).__name__}: {error}"}
                writer.write(encode(reply))
                if writer.transport.get_write_buffer_size() > WRITE_BUFFER_HIGH_BYTES:
                    await writer.drain()
        except HeartbeatLinkClosedError as error:
            logger.info("heartbeat link from %s closed: %s", peer, error)
        except OSError as error:  # a write or keepalive setting on a connection already gone
            logger.info("heartbeat link from %s failed: %s: %s", peer, type(error).__name__, error)
        finally:
            self._writers.discard(writer)
            writer.close()


class HeartbeatLink:
    """The agent's end: ``call(message)`` sends a heartbeat and returns the controller's reply."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._pending: dict[int, asyncio.Future] = {}  # seq -> its reply
        self._unanswered_since_ms: int | None = None  # the first heartbeat sent since the last reply
        self._sequence = 0
        self.closed = False
        self._task = asyncio.get_running_loop().create_task(self._receive())

    @classmethod
    async def open(cls, address: dict, timeout_s: float) -> "HeartbeatLink":
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address["host"], address["port"], limit=1 << 16), timeout_s)
        writer.write(encode({"token": address["token"]}))
        return cls(reader, writer)

    def unanswered_since_ms(self) -> int | None:
        """When the first heartbeat sent since the last reply was sent (None if every one was answered).

        Heartbeats whose callers stopped waiting count too: a peer that stopped
        answering shows here however short the callers' timeouts.
        """
        return self._unanswered_since_ms

    async def call(self, message: dict, now_ms: int) -> dict:
        if self.closed:
            raise HeartbeatLinkClosedError("the heartbeat link is closed")
        self._sequence += 1
        seq = self._sequence
        future = asyncio.get_running_loop().create_future()
        self._pending[seq] = future
        if self._unanswered_since_ms is None:
            self._unanswered_since_ms = now_ms
        try:
            self._writer.write(encode({**message, "seq": seq}))
            return await future
        finally:
            self._pending.pop(seq, None)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._task is not asyncio.current_task():
            self._task.cancel()
        self._writer.close()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(HeartbeatLinkClosedError("the heartbeat link closed"))

    async def _receive(self) -> None:
        try:
            while True:
                message = await read_frame(self._reader)
                self._unanswered_since_ms = None
                future = self._pending.get(message.get("seq"))
                if future is None or future.done():
                    continue  # its caller gave up waiting
                if "error" in message:
                    future.set_exception(HeartbeatRefusedError(str(message["error"])))
                else:
                    future.set_result(message.get("reply"))
        except HeartbeatLinkClosedError as error:
            logger.info("heartbeat link to the controller closed: %s", error)
        finally:
            self.close()
