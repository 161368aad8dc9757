"""The local channel's frame format and frame reader (no Ray, no sockets)."""

import itertools
import pickle
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logbus.errors import (
    ChannelClosedError,
    ChannelReplyTooLargeError,
    FrameError,
    LeaderNotAvailableError,
    LogbusError,
    NotLeaderError,
)
from logbus.protocol import local_channel as wire
from logbus.protocol.messages import FetchResponse


def encode(request_id, kind, payload) -> bytes:
    """One frame as bytes: the parts a sender writes, joined."""
    return b"".join(wire.encode_parts(request_id, kind, payload))


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
    frame = encode(request_id, kind, payload)
    length, got_id, got_kind = wire.decode_header(frame[: wire.HEADER_SIZE])
    assert (got_id, got_kind) == (request_id, kind)
    assert length == len(frame) - wire.HEADER_SIZE
    assert wire.decode_body(frame[wire.HEADER_SIZE :]) == payload


def test_replies_carry_messages_and_errors():
    meta = FetchResponse(10, 12, 12, 0, 3)
    frame = encode(5, wire.OK, (meta, b"batches"))
    assert wire.decode_body(frame[wire.HEADER_SIZE :]) == (meta, b"batches")
    error = wire.decode_body(encode(6, wire.ERROR, NotLeaderError("moved"))[wire.HEADER_SIZE :])
    assert isinstance(error, NotLeaderError) and error.retriable and str(error) == "moved"
    too_large = ChannelReplyTooLargeError("batch at 7 too large", 9)
    error = wire.decode_body(encode(7, wire.ERROR, too_large)[wire.HEADER_SIZE :])
    assert isinstance(error, ChannelReplyTooLargeError) and error.end_offset == 9 and str(error) == "batch at 7 too large"


def test_impossible_headers_are_refused():
    oversized = wire.HEADER.pack(wire.MAX_BODY_BYTES + 1, 1, wire.PRODUCE)
    with pytest.raises(FrameError, match="exceeds"):
        wire.decode_header(oversized)
    with pytest.raises(FrameError, match="header"):
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
    frame = encode(9, wire.OK, payload)
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
    good = encode(1, wire.OK, pickle.PickleBuffer(b"z" * wire.OUT_OF_BAND_MIN_BYTES))[wire.HEADER_SIZE :]
    with pytest.raises(FrameError, match="out-of-band buffer runs past"):
        wire.decode_body(good[:-8])
    with pytest.raises(FrameError, match="pickle runs past"):
        wire.decode_body(wire.BODY_PREFIX.pack(1000, 0) + b"x" * 10)
    with pytest.raises(FrameError, match="at most"):
        wire.decode_body(wire.BODY_PREFIX.pack(0, wire.MAX_BUFFERS + 1))
    with pytest.raises(FrameError, match="at least"):
        wire.decode_body(b"\x01")
    with pytest.raises(FrameError, match="exceeds"):
        wire.encode_parts(1, wire.PRODUCE, (pickle.PickleBuffer(bytearray(wire.MAX_BODY_BYTES)),))


def test_channel_errors_are_part_of_the_error_tree():
    assert issubclass(FrameError, LogbusError) and not issubclass(FrameError, ValueError)
    assert issubclass(ChannelClosedError, LeaderNotAvailableError) and ChannelClosedError("closed").retriable
    assert not ChannelReplyTooLargeError("too large", 3).retriable


# --- the frame reader --------------------------------------------------------------------------


@st.composite
def small_readers(draw):
    """(large body bytes, read buffer bytes) small enough that compaction and large bodies happen often."""
    large = draw(st.integers(0, 1024))
    return large, draw(st.integers(wire.HEADER_SIZE + large, wire.HEADER_SIZE + large + 512))


@st.composite
def frames(draw, large: int, buffer_bytes: int):
    """(request id, kind, the frame's bytes, (in-band bytes, blobs) for a frame of encode_parts or None).

    Raw frames have bodies of any bytes and any length around the reader's thresholds (zero
    included); encoded frames carry PickleBuffers, those of OUT_OF_BAND_MIN_BYTES or more out of band.
    """
    request_id, kind = draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 255))
    rng = random.Random(draw(st.integers(0, 2**32)))
    if draw(st.booleans()):
        edges = [0, 1, large - 1, large, large + 1, 2 * large + 7, buffer_bytes - wire.HEADER_SIZE, buffer_bytes + 99]
        size = draw(st.sampled_from([e for e in edges if e >= 0]) | st.integers(0, 3 * large + 64))
        return request_id, kind, wire.HEADER.pack(size, request_id, kind) + rng.randbytes(size), None
    oob = wire.OUT_OF_BAND_MIN_BYTES
    sizes = draw(st.lists(st.sampled_from([0, 10, oob - 1, oob, large + 1]) | st.integers(0, 2 * oob), max_size=3))
    extra = rng.randbytes(draw(st.integers(0, 64)))
    blobs = [rng.randbytes(size) for size in sizes]
    return request_id, kind, encode(request_id, kind, (extra, [pickle.PickleBuffer(b) for b in blobs])), (extra, blobs)


def chunkings(buffer_bytes: int):
    """Chunk sizes to cycle through: single bytes, a few bytes, up to several frames at once."""
    return st.lists(st.sampled_from([1, 2, 7, 13]) | st.integers(1, 3 * buffer_bytes), min_size=1, max_size=8)


def feed(reader, stream, chunk_sizes, takes, got: list, large: int) -> None:
    """Receive ``stream`` into ``reader`` in chunks of ``chunk_sizes`` (cycled); after each chunk take
    frames into ``got`` as ``takes`` says (cycled; 0 none, n up to n, -1 all), the way a server at its
    request limit stops taking frames for a while. Then take every frame left.

    Whenever every complete frame has been taken, the reader offers room for the rest of the
    incomplete frame, if small: a whole small frame never waits for a second receive for want of room."""
    stream = memoryview(stream)
    chunks, plan = itertools.cycle(chunk_sizes), itertools.cycle(takes)
    position = 0
    while position < len(stream):
        view = reader.get_buffer()
        if not len(view):
            # The reused buffer is full of frames not taken: a server would have stopped reading
            # the socket; it takes a frame before it reads on.
            frame = reader.next_frame()
            if frame is None:
                assert len(reader.get_buffer()), "no room to receive into and no frame to take"
            else:
                got.append(frame)
            continue
        size = min(next(chunks), len(view), len(stream) - position)
        view[:size] = stream[position : position + size]
        reader.buffer_updated(size)
        position += size
        take = next(plan)
        while take:
            frame = reader.next_frame()
            if frame is None:
                if not reader.filling_body:
                    assert len(reader.get_buffer()) >= wire.HEADER_SIZE + large - reader.buffered_bytes
                break
            got.append(frame)
            take -= 1
    while (frame := reader.next_frame()) is not None:
        got.append(frame)


def check_frames(got, sent, large: int) -> None:
    """``got`` (from a reader) are the ``sent`` frames, in order, bodies whole and decoding equal."""
    assert [(request_id, kind) for request_id, kind, _ in got] == [(request_id, kind) for request_id, kind, _, _ in sent]
    for (_, _, body), (_, _, frame, payload) in zip(got, sent):
        if len(body) > large:
            assert isinstance(body, np.ndarray) and body.dtype == np.uint8  # a buffer of its own
        else:
            assert isinstance(body, bytes)
        assert bytes(body) == frame[wire.HEADER_SIZE :]
        if payload is None:
            continue
        extra, blobs = payload
        got_extra, views = wire.decode_body(body)
        assert got_extra == extra and [bytes(v) for v in views] == blobs
        for view, blob in zip(views, blobs):
            if len(blob) >= wire.OUT_OF_BAND_MIN_BYTES:
                assert isinstance(view, memoryview) and view.readonly
                if isinstance(body, np.ndarray):
                    assert view.obj is body  # decoded in place, not copied out of the frame's buffer


def check_reader(data, large: int, buffer_bytes: int, max_frames: int, min_chunk: int = 1) -> None:
    sent = data.draw(st.lists(frames(large, buffer_bytes), max_size=max_frames), label="frames")
    chunk_sizes = data.draw(chunkings(buffer_bytes), label="chunk sizes") + [min_chunk]
    takes = data.draw(st.lists(st.sampled_from([0, 1, 2, -1]), min_size=1, max_size=6), label="takes")
    reader = wire.FrameReader(buffer_bytes, large)
    got = []
    feed(reader, b"".join(frame for _, _, frame, _ in sent), chunk_sizes, takes, got, large)
    check_frames(got, sent, large)
    assert reader.buffered_bytes == 0 and not reader.filling_body


@settings(max_examples=300, deadline=None)
@given(data=st.data(), sizes=small_readers())
def test_the_reader_cuts_the_same_frames_from_any_chunking(data, sizes):
    """Frames split anywhere (mid-header, mid-body, several to a chunk), taken only now and then,
    come out once each, in order, whole."""
    check_reader(data, *sizes, max_frames=8)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_the_reader_cuts_the_same_frames_at_its_default_sizes(data):
    """The same at the sizes both ends use: bodies around LARGE_BODY_BYTES and beyond the read buffer."""
    check_reader(data, wire.LARGE_BODY_BYTES, wire.READ_BUFFER_BYTES, max_frames=6, min_chunk=1 << 20)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), sizes=small_readers())
def test_the_reader_keeps_a_partial_frame_until_the_rest_arrives(data, sizes):
    large, buffer_bytes = sizes
    sent = data.draw(st.lists(frames(large, buffer_bytes), min_size=1, max_size=6), label="frames")
    stream = b"".join(frame for _, _, frame, _ in sent)
    cut = data.draw(st.integers(0, len(stream)), label="cut")
    ends = list(itertools.accumulate(len(frame) for _, _, frame, _ in sent))
    whole = sum(end <= cut for end in ends)
    reader = wire.FrameReader(buffer_bytes, large)
    got = []
    feed(reader, stream[:cut], data.draw(chunkings(buffer_bytes)), [-1], got, large)
    assert len(got) == whole  # every frame received whole, none of the one cut
    assert reader.buffered_bytes == cut - (ends[whole - 1] if whole else 0)
    feed(reader, stream[cut:], data.draw(chunkings(buffer_bytes)), [-1], got, large)
    check_frames(got, sent, large)
    assert reader.buffered_bytes == 0


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    sizes=small_readers(),
    length=st.integers(wire.MAX_BODY_BYTES + 1, 2**32 - 1),
    trailing=st.binary(max_size=64),
)
def test_an_out_of_bounds_length_stops_the_reader(data, sizes, length, trailing):
    large, buffer_bytes = sizes
    sent = data.draw(st.lists(frames(large, buffer_bytes), max_size=4), label="frames")
    stream = b"".join(frame for _, _, frame, _ in sent) + wire.HEADER.pack(length, 1, wire.PRODUCE) + trailing
    reader = wire.FrameReader(buffer_bytes, large)
    got = []
    with pytest.raises(FrameError, match="exceeds"):
        takes = data.draw(st.lists(st.sampled_from([0, 1, -1]), min_size=1, max_size=6))
        feed(reader, stream, data.draw(chunkings(buffer_bytes)), takes, got, large)
    check_frames(got, sent, large)  # every frame before the bad header came out
    with pytest.raises(FrameError, match="exceeds"):
        reader.next_frame()  # the stream cannot be read past it


def test_a_large_body_is_received_into_the_buffer_the_frame_keeps():
    blob = random.Random(3).randbytes(3 << 20)
    frame = encode(4, wire.PRODUCE, (pickle.PickleBuffer(blob),))
    reader = wire.FrameReader()
    first = 1000  # the header and the start of the body arrive in the reused buffer
    reader.get_buffer()[:first] = frame[:first]
    reader.buffer_updated(first)
    assert reader.next_frame() is None and reader.filling_body
    rest = reader.get_buffer()  # then the rest of the body, exactly, in the body's own buffer
    assert len(rest) == len(frame) - first
    address = np.frombuffer(rest, np.uint8).ctypes.data
    rest[:] = frame[first:]
    reader.buffer_updated(len(rest))
    del rest
    request_id, kind, body = reader.next_frame()
    assert (request_id, kind) == (4, wire.PRODUCE)
    assert body.ctypes.data + first - wire.HEADER_SIZE == address  # received where the frame keeps it
    (got,) = wire.decode_body(body)
    assert got.obj is body and got.readonly and got == blob
    assert reader.next_frame() is None and not reader.filling_body and reader.buffered_bytes == 0


def test_the_reader_refuses_impossible_sizes():
    with pytest.raises(ValueError, match="whole small frame"):
        wire.FrameReader(buffer_bytes=100, large_body_bytes=100)
    reader = wire.FrameReader(buffer_bytes=200, large_body_bytes=100)
    with pytest.raises(ValueError, match="received into a buffer of 200"):
        reader.buffer_updated(201)


class _Calls:
    """Unpickling it would call a function (``os.getcwd``): a frame from the network must not."""

    def __reduce__(self):
        import os

        return (os.getcwd, ())


def test_a_restricted_decode_rebuilds_the_channels_messages_and_errors_only():
    from logbus.protocol.messages import FetchRequest, ProduceResponse

    allowed = [
        (pickle.PickleBuffer(b"b" * 5000), "all", None, 30_000),
        (FetchRequest(3, 1 << 20, 500, False, 0, 7),),
        (FetchResponse(1, 2, 2, 0, 5, 2, ((9, 1),), {"uri": "s3://b/t", "files": [["f", 0, 2]]}), pickle.PickleBuffer(b"x" * 5000)),
        ProduceResponse(0, 1, 0, 17),
        NotLeaderError("moved"),
        ChannelReplyTooLargeError("too large", 42),
    ]
    for payload in allowed:
        body = encode(1, wire.OK, payload)[wire.HEADER_SIZE :]
        got = wire.decode_body(body, restricted=True)
        assert type(got) is type(payload)
        assert repr(got) == repr(wire.decode_body(body)) or isinstance(got, tuple)
    too_large = wire.decode_body(encode(1, wire.ERROR, ChannelReplyTooLargeError("too large", 42))[wire.HEADER_SIZE :], restricted=True)
    assert too_large.end_offset == 42
    # A function's call, a numpy scalar, a class object that is not one of logbus's, another library's error.
    refused = [(_Calls(),), np.int64(5), (int,), (ValueError("not logbus's"),)]
    for payload in refused:
        body = encode(1, wire.OK, payload)[wire.HEADER_SIZE :]
        with pytest.raises(FrameError, match="may not rebuild"):
            wire.decode_body(body, restricted=True)
        wire.decode_body(body)  # the Unix socket's frames (same user) are pickles as any


def test_a_reader_shows_the_next_header_before_taking_its_frame():
    reader = wire.FrameReader()
    frame = wire.encode_hello("token")
    view = reader.get_buffer()
    view[: wire.HEADER_SIZE - 1] = frame[: wire.HEADER_SIZE - 1]
    reader.buffer_updated(wire.HEADER_SIZE - 1)
    assert reader.peek_header() is None
    view = reader.get_buffer()
    view[: len(frame) - wire.HEADER_SIZE + 1] = frame[wire.HEADER_SIZE - 1 :]
    reader.buffer_updated(len(frame) - wire.HEADER_SIZE + 1)
    assert reader.peek_header() == (5, 0, wire.HELLO)
    assert reader.next_frame() == (0, wire.HELLO, b"token")
    assert reader.peek_header() is None
