"""The local channel's frame format (no Ray, no sockets)."""

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


def test_impossible_headers_are_refused():
    oversized = wire.HEADER.pack(wire.MAX_BODY_BYTES + 1, 1, wire.PRODUCE)
    with pytest.raises(wire.FrameError, match="exceeds"):
        wire.decode_header(oversized)
    with pytest.raises(wire.FrameError, match="header"):
        wire.decode_header(b"\x00" * (wire.HEADER_SIZE - 1))


def test_addresses_are_abstract_and_distinct():
    a, b = wire.abstract_address("x1"), wire.abstract_address("x2")
    assert a.startswith("\0") and a != b
