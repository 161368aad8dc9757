"""The client's end of the local channel (see ``logbus/protocol/local_channel.py``).

``channels()`` is this process's registry: for a leader's actor handle it
returns an open :class:`Connection` when that replica's socket is up (a
Unix socket on this node, TCP to another node), else None (the caller then
makes an actor call). Looking up a replica's address is itself an actor
call, made once and in the background, and so is opening a TCP connection:
the first requests to a replica go as actor calls while either is on its
way, so neither delays a request. A process keeps at most
``REMOTE_CONNECTIONS_MAX`` TCP connections; replicas past that get actor calls.

A connection whose socket fails fails every request waiting on it with
LeaderNotAvailableError (retriable: producers retry, consumers fetch again)
and is dropped from the registry; the next request looks the address up
again (Ray restarts a replica under the same actor id, with a new socket).
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import struct
import threading
import time
from concurrent.futures import Future

import ray

from logbus.actors.channel_server import tune_tcp
from logbus.errors import ChannelBusyError, ChannelClosedError, FrameError, LogbusError
from logbus.protocol import local_channel as wire

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5.0  # a replica that stops reading its socket fails the send after this long
RETRY_LOOKUP_S = 5.0  # a failed lookup or connection is tried again after this long
SEND_PARTS_MAX = 64  # buffers per sendmsg call (Linux allows 1,024)
TURN_WAIT_MAX_S = 1.0  # a caller that waits its turn behind another thread's send (over TCP) waits at most this long
BACKLOG_MAX_BYTES = 64 << 20  # frames queued for a replica's socket by callers that may not wait
LOOKUP_TIMEOUT_S = 30.0  # a replica that has not said its address in this long (busy, restarting) is asked again
# Replicas the registry remembers. Past that, a new one drops the oldest entries without an open
# connection (replicas reached by actor calls, failed lookups): those cost one lookup to learn again.
# Entries with a connection are replicas on this node, bounded by what one node hosts, and at most
# REMOTE_CONNECTIONS_MAX on other nodes.
ENTRIES_MAX = 4096
# TCP connections to replicas on other nodes that one process keeps open; past that, requests to
# further replicas go as actor calls (each connection has a reader thread).
REMOTE_CONNECTIONS_MAX = 64
CONNECT_TIMEOUT_S = 2.0  # a TCP connection not open in this long (a cut network) is given up
# A TCP connection that cannot be opened, or that closes before any reply (the replica refused it, a
# firewall between the hosts, a long cut), is tried again after RETRY_LOOKUP_S, then twice as late each
# time in a row, up to REMOTE_RETRY_MAX_S (actor calls meanwhile).
REMOTE_RETRY_MAX_S = 60.0
REMOTE_FULL_RETRY_S = 30.0  # with REMOTE_CONNECTIONS_MAX open, another replica asks again this much later


class Connection:
    """One socket to one replica, shared by every producer and consumer of this process: a Unix
    socket to a replica on this node (``address`` a string), or TCP to one on another node
    (``address`` a dict of host, port and token; connecting may take up to CONNECT_TIMEOUT_S).

    ``call`` sends a request and returns a Future of its result; a reader
    thread completes the futures as replies arrive (in any order).
    Over TCP every send is as with ``block=False`` (a caller never waits on a
    cut network), and replies are decoded restricted (``wire.decode_body``).
    """

    def __init__(self, address, on_close=None) -> None:
        self.remote = isinstance(address, dict)
        if self.remote:
            sock = socket.socket(socket.AF_INET6 if ":" in address["host"] else socket.AF_INET, socket.SOCK_STREAM)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if self.remote:
                sock.settimeout(CONNECT_TIMEOUT_S)
                sock.connect((address["host"], address["port"]))
                sock.settimeout(None)
                tune_tcp(sock)
                sock.sendall(wire.encode_hello(address["token"]))
            else:
                sock.connect(address)
            seconds = int(SEND_TIMEOUT_S)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, int((SEND_TIMEOUT_S - seconds) * 1e6)))
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._on_close = on_close
        self._lock = threading.Lock()  # guards _pending and closed
        self._send_lock = threading.Lock()  # one frame at a time on the socket
        # Frames of callers that may not wait, queued behind a frame the socket took only in part
        # (see _send_without_waiting); guarded by _backlog_lock.
        self._backlog_lock = threading.Lock()
        self._backlog: collections.deque[list] = collections.deque()
        self._backlog_bytes = 0
        self._sender_active = False
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self.closed = False
        self.requests_sent = 0  # for tests and diagnostics
        self.replies = 0  # replies received
        self._reader = threading.Thread(target=self._read_replies, name="logbus-local-channel", daemon=True)
        try:
            self._reader.start()
        except RuntimeError as error:  # no thread to be had: no connection either
            sock.close()
            raise OSError(f"cannot start the channel's reader thread: {error}") from None

    def call(self, kind: int, args: tuple, block: bool = True) -> Future:
        """Send one request; the Future holds its result or the error it raised.

        Raises ChannelClosedError if the connection is (or becomes) unusable
        before the request is sent: nothing was sent then, and the caller may
        use an actor call instead. With ``block=False`` (a caller on an event
        loop, which must not wait for a replica that stopped reading) it never
        waits: what the socket cannot take at once is sent by a thread of the
        connection's own, in order, up to ``BACKLOG_MAX_BYTES`` queued; past
        that, or while another thread is sending, ChannelBusyError (a
        ChannelClosedError: nothing was sent).
        """
        future: Future = Future()
        request_id = next(self._ids)
        future.channel_request = (self, request_id)  # for cancel_request()
        parts = wire.encode_parts(request_id, kind, args)
        # Over TCP nothing waits for the socket; a caller that may wait (a producer: its batches of a
        # partition must not overtake one another) waits only for another thread's send to finish.
        wait_turn, block = block and self.remote, block and not self.remote
        with self._lock:
            if self.closed:
                raise ChannelClosedError("the local channel is closed")
            self._pending[request_id] = future
        try:
            # Not under self._lock: the reader thread must be able to take replies while a send
            # waits for room in the socket.
            if block:
                with self._send_lock:
                    _send_parts(self._sock, parts)
            else:
                self._send_without_waiting(parts, wait_turn)
            self.requests_sent += 1
        except ChannelBusyError:
            with self._lock:
                self._pending.pop(request_id, None)
            raise
        except OSError as error:
            # Part of the frame may have gone out: the stream is out of step, so it closes.
            with self._lock:
                self._pending.pop(request_id, None)
                self._close_locked(f"send failed: {error}")
            raise ChannelClosedError(f"the local channel failed: {error}") from None
        return future

    def _send_without_waiting(self, parts: list, wait_turn: bool = False) -> None:
        """Send what the socket takes now; the rest, and frames after it, go to a sender thread.

        Frames keep their order: while the sender thread has frames to send,
        later ones queue behind them (up to ``BACKLOG_MAX_BYTES``, then
        ChannelBusyError, nothing sent). Another thread's send under way is
        waited for with ``wait_turn`` (it never waits on the socket: a short
        wait), else ChannelBusyError.
        """
        views = [memoryview(part).cast("B") for part in parts if len(part)]
        deadline = None
        while True:
            with self._backlog_lock:
                if self._sender_active:
                    size = sum(view.nbytes for view in views)
                    if self._backlog_bytes + size > BACKLOG_MAX_BYTES:
                        raise ChannelBusyError("the replica is not reading its socket fast enough")
                    self._backlog.append(views)
                    self._backlog_bytes += size
                    return
                if self._send_lock.acquire(blocking=False):
                    break
                if not wait_turn:
                    raise ChannelBusyError("another send to this replica is under way")
            # Another thread is in a send that does not wait: it holds the lock for one sendmsg, or
            # hands it to the sender thread (and then this frame queues behind it). Look again shortly.
            if deadline is None:
                deadline = time.monotonic() + TURN_WAIT_MAX_S
            elif time.monotonic() > deadline:
                raise ChannelBusyError("another send to this replica is under way")
            time.sleep(0.0001)
        try:
            sent = self._sock.sendmsg(views[:SEND_PARTS_MAX], (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except BaseException:
            self._send_lock.release()
            raise
        _advance(views, sent)
        if not views:
            self._send_lock.release()
            return
        # The socket is full: the rest of this frame, and frames after it, go from a thread of
        # their own, which holds the send lock until the backlog is empty.
        with self._backlog_lock:
            self._sender_active = True
            self._backlog.append(views)
            self._backlog_bytes += sum(view.nbytes for view in views)
        threading.Thread(target=self._send_backlog, name="logbus-local-channel-send", daemon=True).start()

    def _send_backlog(self) -> None:
        """Send the queued frames in order, holding the send lock ``_send_without_waiting`` took."""
        while True:
            with self._backlog_lock:
                if not self._backlog or self.closed:
                    self._backlog.clear()
                    self._backlog_bytes = 0
                    self._sender_active = False
                    self._send_lock.release()
                    return
                views = self._backlog.popleft()
                self._backlog_bytes -= sum(view.nbytes for view in views)
            try:
                _send_views(self._sock, views)
            except OSError as error:
                with self._lock:
                    self._close_locked(f"send failed: {error}")  # every request still waiting fails

    @property
    def sending_in_background(self) -> bool:
        """Whether the connection's sender thread holds frames the replica has not read yet."""
        return self._sender_active

    def cancel(self, request_id: int) -> bool:
        """Tell the replica its reply to ``request_id`` is no longer wanted; the request's Future is cancelled.

        Never blocks (callers may be on an event loop): the CANCEL frame goes
        as requests sent with ``block=False`` do, queued behind frames the
        connection's sender thread still has to send. If it cannot go (a
        blocking send is under way, or the queue is full), the request is
        forgotten here only, and its reply, if it comes, is dropped. Returns
        whether the replica will be told.
        """
        with self._lock:
            future = self._pending.pop(request_id, None)
            if future is None or self.closed:
                return False
        future.cancel()
        try:
            self._send_without_waiting(wire.encode_parts(request_id, wire.CANCEL, ()))
            return True
        except ChannelBusyError:
            return False
        except OSError as error:
            with self._lock:
                self._close_locked(f"send failed: {error}")
            return False

    def _read_replies(self) -> None:
        reason = "the replica closed the connection"
        reader = wire.FrameReader()
        try:
            while True:
                # Into the reader's buffer: a large reply's body lands in a buffer of its own, where
                # its batches are decoded in place. Every byte of such a body is on its way: wait for
                # all of them in one call.
                flags = socket.MSG_WAITALL if reader.filling_body else 0
                received = self._sock.recv_into(reader.get_buffer(), 0, flags)
                if not received:
                    if reader.buffered_bytes:
                        reason += f" in the middle of a frame ({reader.buffered_bytes} bytes received of it)"
                    break
                reader.buffer_updated(received)
                while (frame := reader.next_frame()) is not None:
                    self._complete(*frame)
        except (OSError, FrameError) as error:
            reason = f"{type(error).__name__}: {error}"
            if isinstance(error, FrameError):
                logger.warning("closing the local channel to a replica: %s", reason)
        with self._lock:
            self._close_locked(reason)

    def _complete(self, request_id: int, kind: int, body) -> None:
        """Complete the Future of the request a reply answers."""
        self.replies += 1
        with self._lock:
            future = self._pending.pop(request_id, None)
        if future is None:
            return
        try:
            value = wire.decode_body(body, restricted=self.remote)
        except Exception as error:  # noqa: BLE001 (a reply that does not decode fails its request)
            future.set_exception(LogbusError(f"undecodable local channel reply: {error}"))
            return
        if kind == wire.OK:
            future.set_result(value)
        elif isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_exception(LogbusError(f"local channel error reply: {value!r}"))

    def _close_locked(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ChannelClosedError(f"the local channel to the replica closed: {reason}"))
        if self._on_close is not None:
            self._on_close(self)

    def close(self) -> None:
        with self._lock:
            self._close_locked("closed by the client")


def cancel_request(future: Future) -> bool:
    """Cancel at the replica a request sent with ``Connection.call`` whose reply is no longer wanted."""
    connection, request_id = getattr(future, "channel_request", (None, None))
    return connection is not None and connection.cancel(request_id)


def _send_parts(sock: socket.socket, parts: list) -> None:
    """Write ``parts`` in order with scatter-gather sends (an out-of-band batch is not joined or copied here)."""
    _send_views(sock, [memoryview(part).cast("B") for part in parts if len(part)])


def _send_views(sock: socket.socket, views: list) -> None:
    while views:
        _advance(views, sock.sendmsg(views[:SEND_PARTS_MAX]))


def _advance(views: list, sent: int) -> None:
    """Drop from ``views`` the ``sent`` bytes a send took (in place)."""
    while sent:
        if sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        else:
            views[0] = views[0][sent:]
            sent = 0


class _Entry:
    __slots__ = ("state", "address", "connection", "retry_at", "failures")

    def __init__(self) -> None:
        # then "ready" (address known), "connecting" (TCP, in the background), "remote" (actor calls for
        # good: the replica offers no TCP address), "failed" (looked up again at retry_at)
        self.state = "looking-up"
        self.address: str | dict | None = None
        self.connection: Connection | None = None
        self.retry_at = time.monotonic() + LOOKUP_TIMEOUT_S  # a lookup still unanswered then is asked again
        self.failures = 0  # TCP connections that failed in a row (carried over to the entry that replaces it)


class Channels:
    """Per process: the channel connection of each replica, by actor id (a Unix socket on this node, TCP
    to another)."""

    def __init__(self, entries_max: int = ENTRIES_MAX, remote_max: int = REMOTE_CONNECTIONS_MAX) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._entries: dict[object, _Entry] = {}
        self.entries_max = entries_max
        self.remote_max = remote_max
        self._remote = 0  # TCP connections open or being opened

    def connection(self, replica) -> Connection | None:
        """The open connection to ``replica`` (an actor handle), or None: use an actor call."""
        key = replica._actor_id
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.state == "ready" and entry.connection is not None and not entry.connection.closed:
                return entry.connection
            if entry is None or (entry.state in ("failed", "looking-up") and time.monotonic() >= entry.retry_at):
                if entry is None and len(self._entries) >= self.entries_max:
                    self._drop_unconnected()
                failures = 0 if entry is None else entry.failures
                entry = self._entries[key] = _Entry()
                entry.failures = failures
                start_lookup = True
            else:
                start_lookup = False
            if entry.state != "ready":
                address = None
            else:
                address = entry.address
        if start_lookup:
            self._look_up(key, replica, entry)
            return None
        if address is None:
            return None
        if isinstance(address, dict):
            self._connect_remote(key, entry, address)
            return None
        # The address is known but there is no open connection (first use, or it closed): connect.
        try:
            connection = Connection(address, on_close=lambda c: self._closed(key, c))
        except OSError:
            with self._lock:
                if self._entries.get(key) is entry:
                    entry.state, entry.retry_at = "failed", time.monotonic() + RETRY_LOOKUP_S
            return None
        with self._lock:
            if self._entries.get(key) is entry and entry.state == "ready" and (entry.connection is None or entry.connection.closed):
                entry.connection = connection
                return connection
        connection.close()  # another thread connected first, or the entry changed
        return self.connection(replica) if self._entries.get(key) is entry else None

    def _connect_remote(self, key, entry: _Entry, address: dict) -> None:
        """Open a TCP connection to a replica on another node, in a thread of its own: a connect into a
        cut network waits up to CONNECT_TIMEOUT_S, which no caller should. Meanwhile, actor calls."""
        with self._lock:
            if self._entries.get(key) is not entry or entry.state != "ready":
                return
            if self._remote >= self.remote_max:
                # Enough TCP connections: this replica gets actor calls, and asks again later.
                entry.state, entry.retry_at = "failed", time.monotonic() + REMOTE_FULL_RETRY_S
                return
            entry.state = "connecting"
            self._remote += 1

        def connect() -> None:
            try:
                connection = Connection(address, on_close=lambda c: self._closed(key, c))
            except Exception:  # noqa: BLE001 (refused, timed out, no thread: actor calls, and later again)
                with self._lock:
                    self._remote -= 1
                    self._connect_failed(key, entry)
                return
            with self._lock:
                if self._entries.get(key) is entry and entry.state == "connecting":
                    if connection.closed:
                        self._connect_failed(key, entry)  # closed at once (refused); _closed counted it out
                    else:
                        entry.state, entry.connection = "ready", connection
                    return
            connection.close()  # the entry was dropped meanwhile (_closed counts the connection out)

        try:
            threading.Thread(target=connect, name="logbus-channel-connect", daemon=True).start()
        except RuntimeError:  # no thread to be had: actor calls
            with self._lock:
                self._remote -= 1
                self._connect_failed(key, entry)

    def _connect_failed(self, key, entry: _Entry) -> None:
        """Under the lock: a TCP connection could not open or closed unanswered: back off."""
        if self._entries.get(key) is not entry:
            return
        entry.connection = None
        entry.failures += 1
        delay = min(RETRY_LOOKUP_S * 2 ** (entry.failures - 1), REMOTE_RETRY_MAX_S)
        entry.state, entry.retry_at = "failed", time.monotonic() + delay

    def _drop_unconnected(self) -> None:
        """Under the lock, with the registry full: forget the oldest half of the entries without an open
        connection (a lookup on its way for one of them then finds its entry gone and is dropped)."""
        unconnected = [key for key, entry in self._entries.items() if entry.connection is None or entry.connection.closed]
        for key in unconnected[: max(1, len(self._entries) // 2)]:
            del self._entries[key]

    def entry_count(self) -> int:
        """How many replicas the registry remembers (at most ``entries_max``, beyond replicas with a connection)."""
        return len(self._entries)

    def backlogged(self) -> int:
        """How many open connections have frames waiting for a replica that is not reading (a stopped
        process, a full socket): their sender threads send them, not the callers."""
        with self._lock:
            connections = [e.connection for e in self._entries.values() if e.connection is not None and not e.connection.closed]
        return sum(1 for c in connections if c.sending_in_background)

    def _look_up(self, key, replica, entry: _Entry) -> None:
        try:
            # Asked each time, not cached: a process may leave one Ray cluster and join another.
            node_id = ray.get_runtime_context().get_node_id()
            ref = replica.channel_address.remote()
        except Exception:  # noqa: BLE001 (no channel; actor calls still work or report the problem)
            self._failed(key, entry)
            return
        ref.future().add_done_callback(lambda future: self._found(key, entry, node_id, future))

    def _found(self, key, entry: _Entry, node_id: str, future) -> None:
        try:
            found = future.result()
        except Exception:  # noqa: BLE001 (the replica is unavailable or predates the channel)
            self._failed(key, entry)
            return
        with self._lock:
            if self._entries.get(key) is not entry:
                return
            if found is None:
                entry.state = "remote"  # the replica has no channel (not Linux): never ask again
            elif found[0] != node_id:
                # Another node: TCP where the replica listens for it, else actor calls for good.
                tcp = found[2] if len(found) > 2 else None
                entry.state, entry.address = ("ready", tcp) if tcp else ("remote", None)
            else:
                entry.state, entry.address = "ready", found[1]

    def _failed(self, key, entry: _Entry) -> None:
        with self._lock:
            if self._entries.get(key) is entry:
                entry.state, entry.retry_at = "failed", time.monotonic() + RETRY_LOOKUP_S

    def _closed(self, key, connection: Connection) -> None:
        """A connection closed: look the address up again (a restarted replica has a new socket)."""
        with self._lock:
            if connection.remote:
                self._remote -= 1
            entry = self._entries.get(key)
            if entry is not None and entry.connection is connection:
                if connection.remote and not connection.replies:
                    self._connect_failed(key, entry)  # refused after it opened (a wrong token, a full server)
                    return
                entry.failures = 0
                entry.state, entry.connection, entry.retry_at = "failed", None, time.monotonic()


_channels: Channels | None = None
_channels_lock = threading.Lock()


def channels() -> Channels:
    """This process's registry of local channels."""
    global _channels
    with _channels_lock:
        if _channels is None or _channels.pid != os.getpid():
            # A forked child inherits the parent's sockets but not their reader threads: it starts afresh.
            _channels = Channels()
        return _channels
