"""Wire format of the local channel: produce and fetch requests between processes on one node.

A Ray actor call costs about 1 ms here, most of it in Ray's machinery (the
caller's submission, the raylet, the actor's event loop hand-offs); a message
over a Unix socket between the same two processes takes under 0.1 ms, and a
1 MB batch crosses one in about 0.3 ms where putting it into Ray's object
store alone takes 1.5 ms. So a client on the node of a partition's leader
sends its produce requests and its fetches over a Unix socket to that
replica, and keeps actor calls (and the object store) for everything else:
batches over 32 MiB, clients on other nodes, and whenever the socket is
unavailable.

Frames, both ways (little-endian)::

    offset  size  field
    0       4     body length in bytes (the bytes after this 13-byte header)
    4       8     request id (chosen by the client; a reply carries its request's id)
    12      1     kind: a request's method (PRODUCE, FETCH) or a reply's status (OK, ERROR)
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

Replies may come back in any order. The listening socket is in Linux's
abstract namespace (no file to clean up; it vanishes with the process) and
the server accepts only peers running as its own user. This module is
Ray-free; the server lives in ``logbus/actors/channel_server.py``, the client
in ``logbus/api/local_channel.py``.
"""

from __future__ import annotations

import pickle
import struct

from logbus.errors import LogbusError

HEADER = struct.Struct("<IQB")
HEADER_SIZE = HEADER.size
BODY_PREFIX = struct.Struct("<II")  # pickle length, out-of-band buffer count
BUFFER_LENGTH = struct.Struct("<Q")
ALIGN_BYTES = 8
MAX_BODY_BYTES = 64 << 20  # larger frames are refused (the connection is closed)
MAX_BUFFERS = 64  # out-of-band buffers in one frame (a request or reply has one or none)
OUT_OF_BAND_MIN_BYTES = 4096  # smaller PickleBuffers go inside the pickle

# request kinds
PRODUCE = 1
FETCH = 2
REQUEST_KINDS = (PRODUCE, FETCH)

# reply kinds
OK = 0
ERROR = 1

# Produce requests over the channel carry batches up to this size; larger ones (topics whose
# max.message.bytes allows them) go through the object store. A fetch over the channel returns
# at most this many bytes of whole batches; where the first batch alone is larger, the replica
# answers ChannelReplyTooLargeError and the reader fetches it with an actor call. Half the
# frame limit leaves ample room for the pickled arguments or metadata.
CHANNEL_PRODUCE_MAX_BYTES = MAX_BODY_BYTES // 2
CHANNEL_FETCH_MAX_BYTES = MAX_BODY_BYTES // 2


class FrameError(ValueError):
    """A frame that cannot be valid (the stream is out of step, or the peer misbehaves)."""


class ChannelReplyTooLargeError(LogbusError):
    """A batch a fetch reached is larger than a channel reply carries: fetch up to ``end_offset`` with actor calls."""

    def __init__(self, message: str, end_offset: int) -> None:
        super().__init__(message, end_offset)
        self.end_offset = end_offset

    def __str__(self) -> str:
        return self.args[0]


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


def encode(request_id: int, kind: int, payload) -> bytes:
    """One frame as bytes (``encode_parts`` joined)."""
    return b"".join(encode_parts(request_id, kind, payload))


def decode_header(header) -> tuple[int, int, int]:
    """(body length, request id, kind) of a frame header; FrameError if the length is out of bounds."""
    if len(header) != HEADER_SIZE:
        raise FrameError(f"a frame header is {HEADER_SIZE} bytes, got {len(header)}")
    length, request_id, kind = HEADER.unpack(header)
    if length > MAX_BODY_BYTES:
        raise FrameError(f"frame body of {length} bytes exceeds {MAX_BODY_BYTES}")
    return length, request_id, kind


def decode_body(body) -> object:
    """The payload of a frame's body; out-of-band buffers come back as read-only memoryviews into ``body``."""
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
    return pickle.loads(pickled, buffers=buffers)


def abstract_address(token: str) -> str:
    """A Unix socket address in Linux's abstract namespace (a leading NUL byte)."""
    return "\0logbus-" + token
