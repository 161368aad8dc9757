"""Wire format of the local channel: produce and fetch requests between processes on one node.

A Ray actor call costs about 1 ms here, most of it in Ray's machinery (the
caller's submission, the raylet, the actor's event loop hand-offs); a message
over a Unix socket between the same two processes takes under 0.1 ms. So a
client on the node of a partition's leader sends its small produce requests
and its fetches at the log end over a Unix socket to that replica, and keeps
actor calls (and the object store) for everything else: large batches,
clients on other nodes, and whenever the socket is unavailable.

Frames, both ways (little-endian)::

    offset  size  field
    0       4     body length in bytes (the bytes after this 13-byte header)
    4       8     request id (chosen by the client; a reply carries its request's id)
    12      1     kind: a request's method (PRODUCE, FETCH) or a reply's status (OK, ERROR)
    13      n     body: pickle (protocol 5) of the request's arguments, the reply's result,
                  or the error raised

Replies may come back in any order. The listening socket is in Linux's
abstract namespace (no file to clean up; it vanishes with the process) and
the server accepts only peers running as its own user. This module is
Ray-free; the server lives in ``logbus/actors/channel_server.py``, the client
in ``logbus/api/local_channel.py``.
"""

from __future__ import annotations

import pickle
import struct

HEADER = struct.Struct("<IQB")
HEADER_SIZE = HEADER.size
MAX_BODY_BYTES = 64 << 20  # larger frames are refused (the connection is closed)

# request kinds
PRODUCE = 1
FETCH = 2
REQUEST_KINDS = (PRODUCE, FETCH)

# reply kinds
OK = 0
ERROR = 1

# Produce requests over the channel carry batches up to this size; larger ones go through
# the object store. A fetch over the channel returns at most this many bytes (whole batches;
# one batch larger than that comes whole).
CHANNEL_FETCH_MAX_BYTES = 1 << 20
CHANNEL_PRODUCE_MAX_BYTES = 1 << 20


class FrameError(ValueError):
    """A frame header that cannot be valid (the stream is out of step, or the peer misbehaves)."""


def encode(request_id: int, kind: int, payload) -> bytes:
    """One frame: header and pickled payload."""
    body = pickle.dumps(payload, protocol=5)
    if len(body) > MAX_BODY_BYTES:
        raise FrameError(f"frame body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
    return HEADER.pack(len(body), request_id, kind) + body


def decode_header(header: bytes) -> tuple[int, int, int]:
    """(body length, request id, kind) of a frame header; FrameError if the length is out of bounds."""
    if len(header) != HEADER_SIZE:
        raise FrameError(f"a frame header is {HEADER_SIZE} bytes, got {len(header)}")
    length, request_id, kind = HEADER.unpack(header)
    if length > MAX_BODY_BYTES:
        raise FrameError(f"frame body of {length} bytes exceeds {MAX_BODY_BYTES}")
    return length, request_id, kind


def decode_body(body) -> object:
    return pickle.loads(body)


def abstract_address(token: str) -> str:
    """A Unix socket address in Linux's abstract namespace (a leading NUL byte)."""
    return "\0logbus-" + token
