"""A follower's fetches from its leader over TCP: one connection per follower loop, beside the actor calls.

Why. A follower's fetch is the hop an acks=all write waits on twice per
replication round (the leader's reply with the batch, then the follower's
next fetch saying it has it). As a Ray actor call each hop costs about 1 ms
here, 1.3-1.8 ms under load, most of it Ray's machinery in both processes
(perf/RESULTS.md, Replication); over a socket between the two event loops the
same hop costs a few tens of microseconds.

How. The leader replica listens on its node's Ray address (where Ray's own
services listen) on a port the system picks, once a follower first asks for
it through an actor call (``PartitionReplica.fetch_link_address``): only a
process that may call the cluster's actors learns the random token the
address comes with. The follower's first frame carries the token; a
connection that sends a wrong one, a malformed frame or one over
``MAX_HEADER_BYTES`` is closed. Frames are a 4-byte big-endian length, a JSON
header (never pickle: nothing read from the network is executed) and, in a
reply with records, ``size`` bytes of batches exactly as the leader stores
them (the follower's append checks every batch's CRC)::

    follower -> leader   {"token": "..."}                                  first frame only
                         {"follower": id, "epoch": e, "offset": o, "max_bytes": n, "max_wait_ms": w}
    leader -> follower   {"meta": [first, next, high watermark, log start, leader epoch, last stable], "size": n}
                         then n bytes (n = -1: no records)
                         {"error": "NotLeaderError", "args": ["..."]}

One request at a time per connection, as the follower's loop fetches: a
reply answers the request before it. A fetch that passes its deadline (a
cut network) closes the connection, since a reply could still come and the
stream would be out of step. Any failure of the link (refused, closed, timed
out, a frame it cannot read) sends that fetch as an actor call instead, and
the follower opens a link again after ``RETRY_S``, in the background, so a
fetch never waits for a link to open. Failures in a row with no working link
between them double that wait, up to ``RETRY_MAX_S``. The other calls of the follower (where
an epoch ends, the leader's offsets) stay actor calls: they are rare.

Costs: a socket per follower loop and one listening socket per leader
process that has followers, no timer; TCP keepalive ends a connection to a
host that vanished. A link is plain TCP, so where Ray encrypts its own
traffic (``RAY_USE_TLS``: ``channel_server.tcp_allowed``) leaders offer none and
followers keep to actor calls.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import struct
from collections.abc import Awaitable, Callable

from logbus import errors
from logbus.actors.channel_server import LazyListener, _write_copies, tcp_allowed, tune_tcp
from logbus.errors import FetchLinkClosedError, LogbusError
from logbus.protocol.local_channel import CHANNEL_FETCH_MAX_BYTES
from logbus.protocol.messages import FetchRequest, FetchResponse

logger = logging.getLogger(__name__)

LENGTH = struct.Struct(">I")
MAX_HEADER_BYTES = 64 << 10  # a request or reply header is under 200 bytes
MAX_CONNECTIONS = 256  # per leader process: its followers (replication factor - 1), and their reconnections
CONNECT_TIMEOUT_S = 1.0  # a connection not open in this long (a cut network) is given up; the fetch goes as an actor call
RETRY_S = 1.0  # after a link failed or could not open, fetches go as actor calls this long before it is opened again
# Failures in a row without a working link (a firewall between the hosts, a long cut) double that wait
# each time, up to RETRY_MAX_S: a link is still tried once a minute, and opens soon after a cut heals.
RETRY_MAX_S = 60.0
HELLO_TIMEOUT_S = 5.0  # a connection that has not sent the token in this long is closed
REQUEST_FIELDS = ("follower", "epoch", "offset", "max_bytes", "max_wait_ms")


def _tune(writer: asyncio.StreamWriter) -> None:
    """The channel's TCP settings (``tune_tcp``): Nagle off, keepalive, and TCP_USER_TIMEOUT, so a reply
    stuck in the socket of a peer that vanished mid-send frees its buffer."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        tune_tcp(sock)


def _frame(header: dict) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    return LENGTH.pack(len(body)) + body


async def _read_header(reader: asyncio.StreamReader) -> dict:
    """The next frame's header; FetchLinkClosedError at the end of the stream or on a bad frame."""
    try:
        (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
        if size > MAX_HEADER_BYTES:
            raise FetchLinkClosedError(f"a header of {size} bytes is over the {MAX_HEADER_BYTES}-byte limit")
        header = json.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, OSError, ValueError, RecursionError) as error:
        # OSError: reset, or timed out (keepalive found the peer gone); ValueError: not JSON or not UTF-8;
        # RecursionError: JSON nested too deep.
        raise FetchLinkClosedError(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__) from None
    if not isinstance(header, dict):
        raise FetchLinkClosedError("a frame's header is not a JSON object")
    return header


def parse_request(header: dict) -> tuple[int, int, FetchRequest]:
    """(follower id, epoch, the fetch) of a request header; FetchLinkClosedError if it is not one."""
    values = [header.get(name) for name in REQUEST_FIELDS]
    if any(isinstance(value, bool) or not isinstance(value, int) or value < 0 for value in values):
        raise FetchLinkClosedError(f"a fetch request needs non-negative integers {', '.join(REQUEST_FIELDS)}")
    follower, epoch, offset, max_bytes, max_wait_ms = values
    return follower, epoch, FetchRequest(offset, max_bytes, max_wait_ms, False, 0)


def error_header(error: BaseException) -> dict:
    """An error reply: the error's class (a logbus error's, else LogbusError) and its arguments, as JSON allows."""
    name = type(error).__name__ if isinstance(error, LogbusError) else "LogbusError"
    args = list(error.args) if isinstance(error, LogbusError) else [f"{type(error).__name__}: {error}"]
    try:
        json.dumps(args)
    except (TypeError, ValueError):
        args = [str(error)]
    return {"error": name, "args": args}


def error_from(header: dict) -> LogbusError:
    """The error an error reply names, rebuilt from its arguments (one of logbus's; else LogbusError)."""
    name, args = header.get("error"), header.get("args")
    args = args if isinstance(args, list) else []
    cls = getattr(errors, name, None) if isinstance(name, str) else None
    if isinstance(cls, type) and issubclass(cls, LogbusError):
        try:
            return cls(*args)
        except TypeError:
            pass
    return LogbusError(f"{name}: {args[0] if args else ''}")


class FetchLinkServer:
    """The leader's end: answers each fetch with ``await handler(follower, epoch, request)``, which returns
    (FetchResponse, None or a buffer valid until the caller next yields)."""

    def __init__(self, handler: Callable[[int, int, FetchRequest], Awaitable[tuple[FetchResponse, object]]], label: str) -> None:
        self._handler = handler
        self._label = label
        self._token = secrets.token_hex(16)
        self._listener = LazyListener(lambda host: asyncio.start_server(self._serve, host, 0, limit=1 << 16))
        self._writers: set[asyncio.StreamWriter] = set()
        self.links_opened = 0  # connections that passed the token check
        self.fetches = 0  # fetches answered over links

    async def address(self, host: str) -> dict:
        """Listen on ``host`` (once); returns what a follower needs to connect: host, port and token."""
        return {"host": host, "port": await self._listener.port(host), "token": self._token}

    def close(self) -> None:
        self._listener.close()
        for writer in list(self._writers):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One follower's connection until it ends. A connection that fails (reset, timed out, a cut
        network) is an operating error: one line, no traceback; the follower opens another."""
        peer = writer.get_extra_info("peername")
        if len(self._writers) >= MAX_CONNECTIONS:
            logger.warning("replica %s: fetch link from %s refused: %d links open", self._label, peer, len(self._writers))
            writer.close()
            return
        self._writers.add(writer)
        copies = _write_copies(writer.transport)
        try:
            _tune(writer)
            try:
                hello = await asyncio.wait_for(_read_header(reader), HELLO_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise FetchLinkClosedError(f"no token within {HELLO_TIMEOUT_S:g} s") from None
            if not hmac.compare_digest(str(hello.get("token", "")).encode(), self._token.encode()):
                logger.warning("replica %s: fetch link from %s: wrong token; closed", self._label, peer)
                return
            self.links_opened += 1
            while True:
                follower, epoch, request = parse_request(await _read_header(reader))
                try:
                    meta, data = await self._handler(follower, epoch, request)
                except Exception as error:  # noqa: BLE001 (the follower raises it, as from an actor call)
                    writer.write(_frame(error_header(error)))
                else:
                    view = None if data is None else memoryview(data.raw() if hasattr(data, "raw") else data)
                    writer.write(_frame({
                        "meta": [meta.first_offset, meta.next_offset, meta.high_watermark, meta.log_start_offset,
                                 meta.leader_epoch, meta.last_stable_offset],
                        "size": -1 if view is None else view.nbytes,
                    }))
                    if view is not None:
                        # A view of a mapped segment is valid only until this task yields: sent or copied now.
                        writer.write(view if copies else bytes(view))
                        del view, data
                    self.fetches += 1
                await writer.drain()
        except FetchLinkClosedError as error:
            logger.info("replica %s: fetch link from %s closed: %s", self._label, peer, error)
        except OSError as error:  # a write or keepalive setting on a connection already gone
            logger.info("replica %s: fetch link from %s failed: %s: %s", self._label, peer, type(error).__name__, error)
        finally:
            self._writers.discard(writer)
            writer.close()


class FetchLink:
    """The follower's end: ``fetch(follower, epoch, request)`` returns the leader's (FetchResponse, bytes or None)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._busy = False
        self.closed = False
        self.answered = 0  # replies read (errors included): a link that never answered may be at a stale address

    @classmethod
    async def open(cls, address: dict, timeout_s: float = CONNECT_TIMEOUT_S) -> "FetchLink":
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(address["host"], address["port"], limit=1 << 16), timeout_s)
        except (OSError, asyncio.TimeoutError) as error:
            raise FetchLinkClosedError(f"cannot connect to {address['host']}:{address['port']}: {type(error).__name__}: {error}") from None
        try:
            _tune(writer)
        except OSError as error:
            writer.close()
            raise FetchLinkClosedError(f"the connection to {address['host']}:{address['port']} failed: {error}") from None
        writer.write(_frame({"token": address["token"]}))
        return cls(reader, writer)

    async def fetch(self, follower: int, epoch: int, request: FetchRequest) -> tuple[FetchResponse, bytes | None]:
        """One fetch. Raises the leader's error as the actor call would (a logbus error), or
        FetchLinkClosedError when the link failed; a caller that stops waiting must close the link."""
        if self.closed or self._busy:
            raise FetchLinkClosedError("the fetch link is closed" if self.closed else "the fetch link is busy")
        self._busy = True
        try:
            self._writer.write(_frame({
                "follower": follower, "epoch": epoch, "offset": request.offset,
                "max_bytes": request.max_bytes, "max_wait_ms": request.max_wait_ms,
            }))
            header = await _read_header(self._reader)
            self.answered += 1
            if "error" in header:
                raise error_from(header)
            meta, size = header.get("meta"), header.get("size")
            if (
                not isinstance(meta, list) or len(meta) != 6 or not isinstance(size, int)
                or not all(isinstance(value, int) and not isinstance(value, bool) for value in meta)
                or not (size == -1 or 1 <= size <= CHANNEL_FETCH_MAX_BYTES)
            ):
                raise FetchLinkClosedError(f"a malformed fetch reply: {header!r:.200}")
            data = None
            if size >= 0:
                try:
                    data = await self._reader.readexactly(size)
                except (asyncio.IncompleteReadError, OSError) as error:
                    raise FetchLinkClosedError(f"{type(error).__name__}: {error}") from None
            return FetchResponse(*meta), data
        except FetchLinkClosedError:
            self.close()
            raise
        finally:
            self._busy = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._writer.close()


class LinkSlot:
    """A follower loop's link to one leader: opened in the background, used while open, and after a
    failure left alone for ``RETRY_S``, twice as long after each further failure in a row, up to
    ``RETRY_MAX_S`` (fetches go as actor calls meanwhile).

    ``ask_address`` makes the actor call that returns the leader's address (or None: it offers no
    link); the address is kept and asked again only when connecting to it fails.
    """

    def __init__(self, ask_address: Callable[[], Awaitable[dict | None]], label: str) -> None:
        self._ask_address = ask_address
        self._label = label
        self._address: dict | None = None
        self._link: FetchLink | None = None
        self._opening: asyncio.Task | None = None
        self._retry_at = 0.0
        self._failures = 0  # in a row, with no working link between them
        self._last_error: str | None = None

    def ready(self) -> FetchLink | None:
        """The open link, or None (then one is being opened, or will be once ``RETRY_S`` has passed)."""
        if self._link is not None and not self._link.closed:
            return self._link
        self._link = None
        loop = asyncio.get_running_loop()
        if self._opening is None and loop.time() >= self._retry_at:
            self._opening = loop.create_task(self._open())
        return None

    async def _open(self) -> None:
        try:
            if self._address is None:
                self._address = await self._ask_address()
                if self._address is None:
                    self._retry_at = float("inf")  # this leader offers no link: actor calls for good
                    return
            try:
                self._link = await FetchLink.open(self._address)
            except FetchLinkClosedError:
                self._address = None  # the leader may have restarted: ask for its address again
                raise
            self._last_error = None
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 (the fetches go as actor calls meanwhile)
            self.failed(error)
        finally:
            self._opening = None

    def failed(self, error: BaseException) -> None:
        """The link failed (or could not open): close it and use actor calls for ``RETRY_S``. A link that
        failed before any reply may have reached another process at a stale address (the leader
        restarted, and its old port was taken): the address is asked for again."""
        worked = False
        if self._link is not None:
            worked = self._link.answered > 0
            if not worked:
                self._address = None
            self._link.close()
            self._link = None
        self._failures = 1 if worked else self._failures + 1
        self._retry_at = asyncio.get_running_loop().time() + min(RETRY_S * 2 ** (self._failures - 1), RETRY_MAX_S)
        if repr(error) != self._last_error:  # once per kind of failure, not every second
            self._last_error = repr(error)
            logger.info("replica %s: fetch link to the leader: %s; fetching with actor calls", self._label, error)

    def close(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
            self._opening = None
        if self._link is not None:
            self._link.close()
            self._link = None
