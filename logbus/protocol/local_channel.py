"""Wire format of the local channel: produce and fetch requests between processes on one node.

A Ray actor call costs about 1 ms here, most of it in Ray's machinery (the
caller's submission, the raylet, the actor's event loop hand-offs); a message
over a Unix socket between the same two processes takes under 0.1 ms, and a
1 MB batch crosses one in about 0.3 ms where putting it into Ray's object
store alone takes 1.5 ms. So a client on the node of a partition's leader
sends its produce requests and its fetches over a Unix socket to that
replica, and a client on another node over TCP to it; it keeps actor calls
(and the object store) for everything else: batches over 32 MiB, and
whenever the socket is unavailable.

Over TCP the client's first frame is HELLO, whose body is the token the
replica gave with its address (through an actor call: only a process that
may call the cluster's actors learns it); a connection that sends anything
else first is closed unread. Frames that came over TCP are unpickled with
an allowlist (``decode_body(restricted=True)``): logbus's produce and fetch
messages and its errors, plain containers, numbers, strings and buffers,
and no other class or function, so a frame cannot make the receiver run
code.

Frames, both ways (little-endian)::

    offset  size  field
    0       4     body length in bytes (the bytes after this 13-byte header)
    4       8     request id (chosen by the client; a reply carries its request's id)
    12      1     kind: a request's method (PRODUCE, FETCH), CANCEL, or a reply's status (OK, ERROR)
    13      n     body

    body:
    0       4     pickle length p
    4       4     out-of-band buffer count b
    8       8*b   each buffer's length
    8+8b    p     pickle (protocol 5) of the request's arguments, the reply's result, or the
                  error raised; then zero padding to a multiple of 8 bytes (from the body's start)
    ...           the out-of-band buffers in order, each padded to a multiple of 8 bytes

A large buffer travels out of band: a produce request's batch and a fetch
reply's batches are written to the socket as they are (one kernel copy each
way, no pickling), and the receiver gets a memoryview into the frame's body.
Pickle protocol 5 does the bookkeeping: a ``pickle.PickleBuffer`` of at least
``OUT_OF_BAND_MIN_BYTES`` in the payload becomes an out-of-band buffer, and
comes back as a read-only memoryview (smaller ones stay inside the pickle and
come back as bytes). Buffers start at multiples of 8 bytes in the body, so
Arrow reads a fetch reply's batches in place.

Both ends cut frames from the stream with one :class:`FrameReader` (sans-IO:
the caller receives into the buffer it offers). A body larger than
``LARGE_BODY_BYTES`` is received straight into a buffer of its own, which the
frame keeps: neither process copies a large produce batch or fetch reply,
and it is decoded in place.

Replies may come back in any order. A client that no longer wants a reply
(a long poll another partition answered first) sends CANCEL with that
request's id: the server cancels the request if it still runs, and neither
frame is answered. The listening socket is in Linux's
abstract namespace (no file to clean up; it vanishes with the process) and
the server accepts only peers running as its own user. This module is
Ray-free; the server lives in ``logbus/actors/channel_server.py``, the client
in ``logbus/actors/channel_client.py``.
"""

from __future__ import annotations

import io
import pickle
import struct

import numpy as np

from logbus import errors
from logbus.errors import FrameError
from logbus.protocol import messages

HEADER = struct.Struct("<IQB")
HEADER_SIZE = HEADER.size
BODY_PREFIX = struct.Struct("<II")  # pickle length, out-of-band buffer count
BUFFER_LENGTH = struct.Struct("<Q")
ALIGN_BYTES = 8
MAX_BODY_BYTES = 64 << 20  # larger frames are refused (the connection is closed)
MAX_BUFFERS = 64  # out-of-band buffers in one frame (a request or reply has one or none)
OUT_OF_BAND_MIN_BYTES = 4096  # smaller PickleBuffers go inside the pickle
READ_BUFFER_BYTES = 256 << 10  # a FrameReader's reused receive buffer
LARGE_BODY_BYTES = 64 << 10  # a frame body larger than this is received into a buffer of its own

# request kinds
PRODUCE = 1
FETCH = 2
REQUEST_KINDS = (PRODUCE, FETCH)
# A client no longer wants the reply to the request whose id this frame carries (its body: an
# empty tuple): the server cancels that request if it still runs (a fetch waiting for data) and
# sends nothing back.
CANCEL = 3

# The first frame a client sends over TCP (a channel to a replica on another node): its body is the
# token the replica gave with its address, as bytes (not pickled). Nothing else is read before it.
HELLO = 4

# reply kinds
OK = 0
ERROR = 1

# Produce requests over the channel carry batches up to this size; larger ones (topics whose
# max.message.bytes allows them) go through the object store. A fetch over the channel returns
# at most this many bytes of whole batches; where the first batch alone is larger, the replica
# answers ChannelReplyTooLargeError and the consumer fetches it with an actor call. Half the
# frame limit leaves ample room for the pickled arguments or metadata.
CHANNEL_PRODUCE_MAX_BYTES = MAX_BODY_BYTES // 2
CHANNEL_FETCH_MAX_BYTES = MAX_BODY_BYTES // 2


def _padding(size: int) -> int:
    return -size % ALIGN_BYTES


def encode_parts(request_id: int, kind: int, payload) -> list:
    """One frame as a list of byte buffers to write in order (the out-of-band buffers uncopied)."""
    buffers: list[memoryview] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        view = buffer.raw()
        if view.nbytes < OUT_OF_BAND_MIN_BYTES or len(buffers) >= MAX_BUFFERS:
            return True  # in band
        buffers.append(view)
        return False

    pickled = pickle.dumps(payload, protocol=5, buffer_callback=out_of_band)
    prefix_size = BODY_PREFIX.size + BUFFER_LENGTH.size * len(buffers)
    lengths = b"".join(BUFFER_LENGTH.pack(b.nbytes) for b in buffers)
    pickle_padding = _padding(prefix_size + len(pickled))
    body_size = prefix_size + len(pickled) + pickle_padding + sum(b.nbytes + _padding(b.nbytes) for b in buffers)
    if body_size > MAX_BODY_BYTES:
        raise FrameError(f"frame body of {body_size} bytes exceeds {MAX_BODY_BYTES}")
    parts = [
        b"".join((
            HEADER.pack(body_size, request_id, kind), BODY_PREFIX.pack(len(pickled), len(buffers)), lengths, pickled,
            bytes(pickle_padding),
        ))
    ]
    for buffer in buffers:
        parts.append(buffer)
        if _padding(buffer.nbytes):
            parts.append(bytes(_padding(buffer.nbytes)))
    return parts


def decode_header(header) -> tuple[int, int, int]:
    """(body length, request id, kind) of a frame header; FrameError if the length is out of bounds."""
    if len(header) != HEADER_SIZE:
        raise FrameError(f"a frame header is {HEADER_SIZE} bytes, got {len(header)}")
    length, request_id, kind = HEADER.unpack(header)
    if length > MAX_BODY_BYTES:
        raise FrameError(f"frame body of {length} bytes exceeds {MAX_BODY_BYTES}")
    return length, request_id, kind


# What a frame that came over TCP may rebuild: the messages of the produce and fetch paths and
# logbus's errors (see _RestrictedUnpickler). Containers, numbers, strings and buffers need no global.
_MESSAGE_CLASSES = frozenset({"ProduceResponse", "FetchRequest", "FetchResponse"})


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only what the channel's requests and replies hold: a frame from another host can
    rebuild logbus's message dataclasses and errors, and call nothing else (no other global is
    found, so no other constructor or function runs)."""

    def find_class(self, module: str, name: str):
        if module == "logbus.protocol.messages" and name in _MESSAGE_CLASSES:
            return getattr(messages, name)
        if module == "logbus.errors":
            found = getattr(errors, name, None)
            if isinstance(found, type) and issubclass(found, errors.LogbusError):
                return found
        raise pickle.UnpicklingError(f"a channel frame from the network may not rebuild {module}.{name}")


def decode_body(body, restricted: bool = False) -> object:
    """The payload of a frame's body; out-of-band buffers come back as read-only memoryviews into ``body``.

    ``restricted`` (a frame that came over TCP): only logbus's messages and errors are rebuilt;
    anything else raises FrameError."""
    view = memoryview(body)
    if len(view) < BODY_PREFIX.size:
        raise FrameError(f"a frame body is at least {BODY_PREFIX.size} bytes, got {len(view)}")
    pickle_size, count = BODY_PREFIX.unpack_from(view)
    if count > MAX_BUFFERS:
        raise FrameError(f"a frame has at most {MAX_BUFFERS} out-of-band buffers, not {count}")
    position = BODY_PREFIX.size + BUFFER_LENGTH.size * count
    if position + pickle_size > len(view):
        raise FrameError("a frame's pickle runs past its body")
    lengths = [BUFFER_LENGTH.unpack_from(view, BODY_PREFIX.size + BUFFER_LENGTH.size * i)[0] for i in range(count)]
    pickled = view[position : position + pickle_size]
    position += pickle_size + _padding(position + pickle_size)
    buffers = []
    for length in lengths:
        if position + length > len(view):
            raise FrameError("a frame's out-of-band buffer runs past its body")
        buffers.append(view[position : position + length].toreadonly())
        position += length + _padding(length)
    if not restricted:
        return pickle.loads(pickled, buffers=buffers)
    try:
        return _RestrictedUnpickler(io.BytesIO(pickled), buffers=buffers).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, RecursionError) as error:
        raise FrameError(f"a channel frame that does not decode: {type(error).__name__}: {error}") from None


class FrameReader:
    """Cuts frames from a byte stream that arrives in pieces; sans-IO (no sockets, no event loop).

    The caller receives into ``get_buffer()``, reports the bytes received with
    ``buffer_updated(nbytes)`` and takes the complete frames with
    ``next_frame()``, one at a time and whenever it likes: frames not taken
    stay in the reader (a server at its concurrency limit stops taking them
    and stops reading the socket, and takes them later).

    Bytes are received into a reused buffer of ``buffer_bytes``. A frame whose
    body is larger than ``large_body_bytes`` gets a buffer of its own as soon
    as its header is taken: ``get_buffer()`` then offers the rest of that body
    (the socket fills it directly), and the frame comes out with that buffer
    as its body. Smaller bodies come out as ``bytes`` (copied out of the
    reused buffer, which is overwritten later).

    ``get_buffer()`` offers at least one byte whenever every complete frame
    has been taken; while frames wait untaken the reused buffer may be full,
    and then it offers none.
    """

    def __init__(self, buffer_bytes: int = READ_BUFFER_BYTES, large_body_bytes: int = LARGE_BODY_BYTES) -> None:
        if large_body_bytes < 0 or buffer_bytes < HEADER_SIZE + large_body_bytes:
            raise ValueError(f"the read buffer must hold a whole small frame: {HEADER_SIZE} + {large_body_bytes} bytes")
        self._buffer = bytearray(buffer_bytes)
        self._large_body_bytes = large_body_bytes
        self._start = 0  # first byte of _buffer not yet taken as a frame
        self._end = 0  # end of the bytes received into _buffer
        self._large: np.ndarray | None = None  # the body of a large frame, being received
        self._large_filled = 0
        self._large_frame: tuple[int, int] = (0, 0)  # its (request id, kind)
        self._complete: tuple[int, int, np.ndarray] | None = None  # a received large frame, not yet taken

    @property
    def filling_body(self) -> bool:
        """Whether ``get_buffer()`` is the rest of a large frame's body: every byte it offers is on its way."""
        return self._large is not None

    @property
    def buffered_bytes(self) -> int:
        """Bytes of frames received and not yet taken, headers included (a partial frame at the end of a stream, say)."""
        size = self._end - self._start
        if self._large is not None:
            size += HEADER_SIZE + self._large_filled
        if self._complete is not None:
            size += HEADER_SIZE + len(self._complete[2])
        return size

    def get_buffer(self) -> memoryview:
        """A writable view to receive the next bytes of the stream into (possibly more than arrive)."""
        if self._large is not None:
            return memoryview(self._large)[self._large_filled :]  # a uint8 array: a byte view
        if self._start and len(self._buffer) - self._end < HEADER_SIZE + self._large_body_bytes:
            # Too little room left for a whole small frame: move the bytes not yet taken to the
            # front. An incomplete frame then fits (a larger body gets a buffer of its own as
            # soon as its header is taken); moving only when room runs short, not after every
            # frame, keeps the copies few.
            remaining = self._end - self._start
            self._buffer[:remaining] = self._buffer[self._start : self._end]
            self._start, self._end = 0, remaining
        return memoryview(self._buffer)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        """Record that ``nbytes`` were received at the start of the last ``get_buffer()``."""
        if self._large is not None:
            room = len(self._large) - self._large_filled
        else:
            room = len(self._buffer) - self._end
        if not 0 <= nbytes <= room:
            raise ValueError(f"{nbytes} bytes received into a buffer of {room}")
        if self._large is None:
            self._end += nbytes
            return
        self._large_filled += nbytes
        if self._large_filled == len(self._large):
            self._complete = (*self._large_frame, self._large)
            self._large = None

    def peek_header(self) -> tuple[int, int, int] | None:
        """(body length, request id, kind) of the next frame, without taking it; None until its header
        has arrived (or while a large body is being received)."""
        if self._complete is not None or self._large is not None or self._end - self._start < HEADER_SIZE:
            return None
        return decode_header(memoryview(self._buffer)[self._start : self._start + HEADER_SIZE])

    def next_frame(self) -> tuple[int, int, bytes | np.ndarray] | None:
        """The next complete frame as (request id, kind, body), or None until more bytes arrive.

        The body is ``bytes``, or for a body over ``large_body_bytes`` a uint8
        ``np.ndarray`` of its own (``decode_body`` returns views into it).
        Raises FrameError on a header whose length is out of bounds (and again
        on every later call: the stream cannot be read past it).
        """
        if self._complete is not None:
            frame, self._complete = self._complete, None
            return frame
        if self._large is not None or self._end - self._start < HEADER_SIZE:
            return None
        buffer = self._buffer
        body_start = self._start + HEADER_SIZE
        length, request_id, kind = decode_header(memoryview(buffer)[self._start : body_start])
        if length > self._large_body_bytes:
            # A buffer of its own, filled directly by the socket from here on (np.empty: a
            # bytearray would be zeroed first).
            large = np.empty(length, np.uint8)
            received = min(self._end - body_start, length)
            if received:
                large[:received] = np.frombuffer(buffer, np.uint8, received, body_start)
            self._taken(body_start + received)
            if received == length:
                return request_id, kind, large
            self._large, self._large_filled, self._large_frame = large, received, (request_id, kind)
            return None
        end = body_start + length
        if end > self._end:
            return None
        body = bytes(memoryview(buffer)[body_start:end])
        self._taken(end)
        return request_id, kind, body

    def _taken(self, position: int) -> None:
        self._start = position
        if self._start == self._end:
            self._start = self._end = 0  # nothing left: receive at the front again


def encode_hello(token: str) -> bytes:
    """The HELLO frame a TCP client sends first: the token, not pickled."""
    body = token.encode()
    return HEADER.pack(len(body), 0, HELLO) + body


def abstract_address(token: str) -> str:
    """A Unix socket address in Linux's abstract namespace (a leading NUL byte)."""
    return "\0logbus-" + token
