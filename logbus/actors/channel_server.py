"""The replica's end of the local channel: a Unix socket server on the actor's event loop.

See ``logbus/protocol/local_channel.py`` for why and the frame format. Each
request runs as its own task on the replica's event loop (as Ray runs an async
actor's calls), so a fetch held open waiting for data does not hold up the
produce requests behind it on the same connection. At most
``MAX_CONCURRENT_PER_CONNECTION`` requests of one connection run at once; the
next frame is not read until one finishes, so a client that sends faster than
the replica answers is slowed by the socket, not queued without bound.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import struct
import sys
from collections.abc import Awaitable, Callable

from logbus.protocol import local_channel as wire

MAX_CONCURRENT_PER_CONNECTION = 256
WRITE_BUFFER_HIGH_BYTES = 4 << 20  # wait for the socket to drain above this much unsent reply data

Handler = Callable[[int, tuple], Awaitable[object]]


def supported() -> bool:
    """Abstract Unix sockets and SO_PEERCRED exist on Linux only; elsewhere clients use actor calls."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_PEERCRED")


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
        self._writers: set[asyncio.StreamWriter] = set()
        self.address: str | None = None

    async def start(self) -> str | None:
        """Listen; returns the address, or None where the channel is not supported."""
        if not supported():
            return None
        address = wire.abstract_address(secrets.token_hex(12))
        self._server = await asyncio.start_unix_server(self._serve_connection, path=address, limit=1 << 16)
        self.address = address
        return address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if _peer_uid(writer.get_extra_info("socket")) != os.getuid():
            writer.close()  # only processes of this user (Ray's own workers) may talk to the replica
            return
        self._writers.add(writer)
        slots = asyncio.Semaphore(MAX_CONCURRENT_PER_CONNECTION)
        drained = asyncio.Lock()
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                try:
                    length, request_id, kind = wire.decode_header(await reader.readexactly(wire.HEADER_SIZE))
                    body = await reader.readexactly(length)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client went away
                except wire.FrameError as error:
                    print(f"logbus {self._label}: closing a local channel connection: {error}", file=sys.stderr)
                    return
                await slots.acquire()
                task = asyncio.get_running_loop().create_task(self._serve_request(writer, drained, slots, request_id, kind, body))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            self._writers.discard(writer)
            writer.close()
            for task in tasks:
                task.cancel()

    async def _serve_request(
        self, writer: asyncio.StreamWriter, drained: asyncio.Lock, slots: asyncio.Semaphore, request_id: int, kind: int, body: bytes
    ) -> None:
        try:
            try:
                if kind not in wire.REQUEST_KINDS:
                    raise ValueError(f"unknown local channel request kind {kind}")
                args = wire.decode_body(body)
                del body
                if not isinstance(args, tuple):
                    raise ValueError("local channel request arguments must be a tuple")
                frame = wire.encode(request_id, wire.OK, await self._handler(kind, args))
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 (every failure goes back to the caller)
                try:
                    frame = wire.encode(request_id, wire.ERROR, error)
                except Exception:  # noqa: BLE001 (an error that does not pickle goes as its text)
                    from logbus.errors import LogbusError

                    frame = wire.encode(request_id, wire.ERROR, LogbusError(f"{type(error).__name__}: {error}"))
            if writer.is_closing():
                return
            writer.write(frame)
            if writer.transport.get_write_buffer_size() > WRITE_BUFFER_HIGH_BYTES:
                async with drained:
                    try:
                        await writer.drain()
                    except ConnectionError:
                        return
        finally:
            slots.release()
