"""The local channel's frame format (no Ray, no sockets)."""

import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbus.errors import NotLeaderError
from logbus.protocol import local_channel as wire
from logbus.protocol.messages import FetchResponse


@given(
    request_id=st.integers(0, 2**64 - 1),
    kind=st.integers(0, 255),
    payload=st.recursive(
        st.none() | st.booleans() | st.integers() | st.binary(max_size=256) | st.text(max_size=32),
        lambda inner: st.tuples(inner, inner) | st.lists(inner, max_size=4),
        max_leaves=10,
    ),
)
def test_frames_round_trip(request_id, kind, payload):
    frame = wire.encode(request_id, kind, payload)
    length, got_id, got_kind = wire.decode_header(frame[: wire.HEADER_SIZE])
    assert (got_id, got_kind) == (request_id, kind)
    assert length == len(frame) - wire.HEADER_SIZE
    assert wire.decode_body(frame[wire.HEADER_SIZE :]) == payload


def test_replies_carry_messages_and_errors():
    meta = FetchResponse(10, 12, 12, 0, 3)
    frame = wire.encode(5, wire.OK, (meta, b"batches"))
    assert wire.decode_body(frame[wire.HEADER_SIZE :]) == (meta, b"batches")
    error = wire.decode_body(wire.encode(6, wire.ERROR, NotLeaderError("moved"))[wire.HEADER_SIZE :])
    assert isinstance(error, NotLeaderError) and error.retriable and str(error) == "moved"
    too_large = wire.ChannelReplyTooLargeError("batch at 7 too large", 9)
    error = wire.decode_body(wire.encode(7, wire.ERROR, too_large)[wire.HEADER_SIZE :])
    assert isinstance(error, wire.ChannelReplyTooLargeError) and error.end_offset == 9 and str(error) == "batch at 7 too large"


def test_impossible_headers_are_refused():
    oversized = wire.HEADER.pack(wire.MAX_BODY_BYTES + 1, 1, wire.PRODUCE)
    with pytest.raises(wire.FrameError, match="exceeds"):
        wire.decode_header(oversized)
    with pytest.raises(wire.FrameError, match="header"):
        wire.decode_header(b"\x00" * (wire.HEADER_SIZE - 1))


def test_addresses_are_abstract_and_distinct():
    a, b = wire.abstract_address("x1"), wire.abstract_address("x2")
    assert a.startswith("\0") and a != b


@given(
    sizes=st.lists(st.integers(0, 3 * wire.OUT_OF_BAND_MIN_BYTES), max_size=5),
    extra=st.binary(max_size=64),
)
def test_large_buffers_travel_out_of_band_aligned(sizes, extra):
    blobs = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    payload = (extra, [pickle.PickleBuffer(b) for b in blobs])
    parts = wire.encode_parts(9, wire.OK, payload)
    frame = wire.encode(9, wire.OK, payload)
    assert b"".join(bytes(p) for p in parts) == frame
    length, _, _ = wire.decode_header(frame[: wire.HEADER_SIZE])
    assert length == len(frame) - wire.HEADER_SIZE
    body = bytearray(frame[wire.HEADER_SIZE :])
    got_extra, got = wire.decode_body(body)
    assert got_extra == extra
    assert [bytes(g) for g in got] == blobs
    large = [g for g, b in zip(got, blobs) if len(b) >= wire.OUT_OF_BAND_MIN_BYTES]
    assert len(parts) >= 1 + len(large)  # each large buffer is a part of its own: never joined
    for view in large:
        assert isinstance(view, memoryview) and view.readonly
        assert view.obj is body  # a view into the received body, not a copy
        offset = np.frombuffer(view, np.uint8).ctypes.data - np.frombuffer(body, np.uint8).ctypes.data
        assert offset % wire.ALIGN_BYTES == 0  # Arrow reads batches in place
    assert all(isinstance(g, bytes) for g, b in zip(got, blobs) if len(b) < wire.OUT_OF_BAND_MIN_BYTES)


def test_malformed_bodies_are_refused():
    good = wire.encode(1, wire.OK, pickle.PickleBuffer(b"z" * wire.OUT_OF_BAND_MIN_BYTES))[wire.HEADER_SIZE :]
    with pytest.raises(wire.FrameError, match="out-of-band buffer runs past"):
        wire.decode_body(good[:-8])
    with pytest.raises(wire.FrameError, match="pickle runs past"):
        wire.decode_body(wire.BODY_PREFIX.pack(1000, 0) + b"x" * 10)
    with pytest.raises(wire.FrameError, match="at most"):
        wire.decode_body(wire.BODY_PREFIX.pack(0, wire.MAX_BUFFERS + 1))
    with pytest.raises(wire.FrameError, match="at least"):
        wire.decode_body(b"\x01")
    with pytest.raises(wire.FrameError, match="exceeds"):
        wire.encode_parts(1, wire.PRODUCE, (pickle.PickleBuffer(bytearray(wire.MAX_BODY_BYTES)),))
