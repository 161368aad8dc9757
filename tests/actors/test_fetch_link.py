"""A follower's fetch link to its leader, on real loopback sockets (no Ray): frames, errors, the token, failures."""

import asyncio
import json
import socket
import struct

import pytest

from hypothesis import given
from hypothesis import strategies as st

from logbus.actors import fetch_link
from logbus.actors.channel_server import tcp_allowed
from logbus.actors.fetch_link import (
    MAX_HEADER_BYTES,
    FetchLink,
    FetchLinkServer,
    LinkSlot,
    error_from,
    error_header,
    parse_request,
)
from logbus.errors import (
    ChannelReplyTooLargeError,
    FetchLinkClosedError,
    LogbusError,
    NotLeaderError,
    OffsetOutOfRangeError,
)
from logbus.protocol.messages import FetchRequest, FetchResponse


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


class Leader:
    """The handler a leader gives the server: a log of ``records`` bytes per offset; refuses some fetches."""

    def __init__(self, records: list[bytes]):
        self.records = records
        self.asked: list[tuple[int, int, FetchRequest]] = []
        self.appended = asyncio.Event()

    async def handle(self, follower: int, epoch: int, request: FetchRequest):
        self.asked.append((follower, epoch, request))
        if epoch != 3:
            raise NotLeaderError(f"epoch {epoch} is not the leader's")
        if request.offset > len(self.records):
            raise OffsetOutOfRangeError(f"offset {request.offset} past the log end {len(self.records)}")
        if request.offset == len(self.records):
            try:
                await asyncio.wait_for(self.appended.wait(), request.max_wait_ms / 1000)
            except asyncio.TimeoutError:
                return FetchResponse(request.offset, request.offset, len(self.records), 0, 3, len(self.records)), None
        data = b"".join(self.records[request.offset:])
        # As a leader's reply: a view of its buffer, valid until the handler's caller yields.
        return FetchResponse(request.offset, len(self.records), len(self.records), 0, 3, len(self.records)), memoryview(bytearray(data))


async def serving(records):
    leader = Leader(records)
    server = FetchLinkServer(leader.handle, "test")
    address = await server.address("127.0.0.1")
    return leader, server, address


def test_fetches_over_one_link_return_the_leaders_batches_and_metadata():
    async def main():
        leader, server, address = await serving([b"a" * 10, b"b" * 100_000, b"c"])
        link = await FetchLink.open(address)
        meta, data = await link.fetch(7, 3, FetchRequest(1, 1 << 20, 0, False, 0))
        assert meta == FetchResponse(1, 3, 3, 0, 3, 3)
        assert data == b"b" * 100_000 + b"c"
        meta, data = await link.fetch(7, 3, FetchRequest(3, 1 << 20, 50, False, 0))
        assert (meta.first_offset, meta.next_offset, data) == (3, 3, None)  # nothing arrived within the wait
        assert [(f, e, r.offset, r.max_wait_ms) for f, e, r in leader.asked] == [(7, 3, 1, 0), (7, 3, 3, 50)]
        assert (server.links_opened, server.fetches) == (1, 2)
        link.close()
        server.close()

    run(main())


def test_a_parked_fetch_is_answered_when_the_leader_appends():
    async def main():
        leader, server, address = await serving([b"x"])
        link = await FetchLink.open(address)
        waiting = asyncio.ensure_future(link.fetch(1, 3, FetchRequest(1, 1 << 20, 10_000, False, 0)))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        leader.records.append(b"y")
        leader.appended.set()
        meta, data = await waiting
        assert (meta.next_offset, data) == (2, b"y")
        server.close()

    run(main())


def test_the_leaders_errors_are_raised_as_the_actor_call_raises_them_and_the_link_stays_open():
    async def main():
        leader, server, address = await serving([b"x"])
        link = await FetchLink.open(address)
        with pytest.raises(NotLeaderError, match="epoch 2 is not"):
            await link.fetch(1, 2, FetchRequest(0, 1 << 20, 0, False, 0))
        with pytest.raises(OffsetOutOfRangeError, match="past the log end"):
            await link.fetch(1, 3, FetchRequest(5, 1 << 20, 0, False, 0))
        assert not link.closed
        assert (await link.fetch(1, 3, FetchRequest(0, 1 << 20, 0, False, 0)))[1] == b"x"
        server.close()

    run(main())


def test_error_replies_rebuild_logbus_errors_with_their_arguments_and_nothing_else():
    too_large = error_from(error_header(ChannelReplyTooLargeError("too large for a reply", 42)))
    assert isinstance(too_large, ChannelReplyTooLargeError) and too_large.end_offset == 42
    other = error_from(error_header(KeyError("secret internals")))
    assert type(other) is LogbusError and "KeyError" in str(other)
    # Only names of logbus's error classes are looked up: anything else is a plain LogbusError.
    for name in ("os", "copy_error", "SystemExit", "Exception", 5, None):
        assert type(error_from({"error": name, "args": ["x"]})) is LogbusError
    assert type(error_from({"error": "NotLeaderError", "args": "not a list"})) is NotLeaderError


@given(st.dictionaries(st.sampled_from(["follower", "epoch", "offset", "max_bytes", "max_wait_ms", "other"]),
                       st.one_of(st.integers(-2, 2**40), st.booleans(), st.none(), st.text(max_size=3), st.floats())))
def test_a_request_header_is_taken_only_with_every_field_a_non_negative_integer(header):
    fields = ("follower", "epoch", "offset", "max_bytes", "max_wait_ms")
    valid = all(isinstance(header.get(f), int) and not isinstance(header.get(f), bool) and header[f] >= 0 for f in fields)
    if valid:
        follower, epoch, request = parse_request(header)
        assert (follower, epoch, request.offset, request.max_bytes, request.max_wait_ms) == tuple(header[f] for f in fields)
        assert request.verify_crc is False and request.session is None and request.tier_plan is False
    else:
        with pytest.raises(FetchLinkClosedError):
            parse_request(header)


def _raw_frame(header) -> bytes:
    body = json.dumps(header).encode()
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize("first, then", [
    ({"token": "wrong"}, {"follower": 1, "epoch": 3, "offset": 0, "max_bytes": 10, "max_wait_ms": 0}),
    ({"token": "\u00fc" * 32}, {"follower": 1, "epoch": 3, "offset": 0, "max_bytes": 10, "max_wait_ms": 0}),
    ({"token": ["a list"]}, {"follower": 1, "epoch": 3, "offset": 0, "max_bytes": 10, "max_wait_ms": 0}),
    (None, b"[" * 60_000),  # JSON nested too deep to parse
    (None, {"follower": "1", "epoch": 3, "offset": 0, "max_bytes": 10, "max_wait_ms": 0}),
    (None, [1, 2]),
    (None, b"\xff\xfe not json"),
    (None, b"x" * (MAX_HEADER_BYTES + 1)),
])
def test_a_connection_with_a_wrong_token_or_a_bad_frame_is_closed_unanswered(first, then):
    async def main():
        leader, server, address = await serving([b"x"])
        reader, writer = await asyncio.open_connection(address["host"], address["port"])
        writer.write(_raw_frame(first if first is not None else {"token": address["token"]}))
        if isinstance(then, bytes):
            writer.write(struct.pack(">I", len(then)) + then)
        else:
            writer.write(_raw_frame(then))
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing answered
        assert leader.asked == []
        writer.close()
        server.close()

    run(main())


def test_a_connection_that_never_sends_its_token_is_closed(monkeypatch):
    monkeypatch.setattr(fetch_link, "HELLO_TIMEOUT_S", 0.2)

    async def main():
        leader, server, address = await serving([b"x"])
        reader, writer = await asyncio.open_connection(address["host"], address["port"])
        assert await asyncio.wait_for(reader.read(), 10) == b""
        assert server.links_opened == 0
        writer.close()
        server.close()

    run(main())


def test_a_reset_connection_fails_the_fetch_waiting_on_it_and_the_link_closes():
    async def main():
        leader, server, address = await serving([b"x"])
        link = await FetchLink.open(address)
        waiting = asyncio.ensure_future(link.fetch(1, 3, FetchRequest(1, 1 << 20, 10_000, False, 0)))
        await asyncio.sleep(0.05)
        server.close()  # the leader's end goes away while the fetch is parked
        with pytest.raises(FetchLinkClosedError):
            await waiting
        assert link.closed
        with pytest.raises(FetchLinkClosedError):
            await link.fetch(1, 3, FetchRequest(0, 1 << 20, 0, False, 0))

    run(main())


def test_a_malformed_reply_closes_the_link():
    async def main():
        async def answer(reader, writer):
            for _ in ("the token", "the request"):
                await reader.readexactly(struct.unpack(">I", await reader.readexactly(4))[0])
            writer.write(_raw_frame({"meta": [0, 1, 1, 0, True, 1], "size": 1}))

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        link = await FetchLink.open({"host": "127.0.0.1", "port": port, "token": "t"})
        with pytest.raises(FetchLinkClosedError, match="malformed"):
            await link.fetch(1, 3, FetchRequest(0, 10, 0, False, 0))
        assert link.closed
        server.close()

    run(main())


def test_a_slot_opens_its_link_in_the_background_and_after_a_failure_waits_before_opening_again(monkeypatch):
    monkeypatch.setattr(fetch_link, "RETRY_S", 0.2)

    async def main():
        leader, server, address = await serving([b"x"])
        asked = []

        async def ask():
            asked.append(1)
            return address

        slot = LinkSlot(ask, "test")
        assert slot.ready() is None  # opening: the fetch goes as an actor call
        link = None
        for _ in range(200):
            await asyncio.sleep(0.01)
            link = slot.ready()
            if link is not None:
                break
        assert link is not None and asked == [1]
        assert (await link.fetch(1, 3, FetchRequest(0, 1 << 20, 0, False, 0)))[1] == b"x"
        failed_at = asyncio.get_running_loop().time()
        slot.failed(FetchLinkClosedError("reset"))
        assert link.closed and slot.ready() is None
        links_before = server.links_opened
        while (link := slot.ready()) is None:
            await asyncio.sleep(0.01)
        # Opened again only once RETRY_S had passed, with the address it had (the link had answered).
        assert asyncio.get_running_loop().time() - failed_at >= 0.2
        assert asked == [1]
        assert (await link.fetch(1, 3, FetchRequest(0, 1 << 20, 0, False, 0)))[1] == b"x"
        assert server.links_opened == links_before + 1
        slot.close()
        server.close()

    run(main())


def test_a_slot_asks_for_the_address_again_when_it_cannot_connect_and_gives_up_where_none_is_offered(monkeypatch):
    monkeypatch.setattr(fetch_link, "RETRY_S", 0.05)

    async def main():
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()  # nothing listens there: connections are refused
        answers = [{"host": "127.0.0.1", "port": port, "token": "t"}, None]
        asked = []

        async def ask():
            asked.append(1)
            return answers[len(asked) - 1]

        slot = LinkSlot(ask, "test")
        for _ in range(100):
            slot.ready()
            await asyncio.sleep(0.01)
        assert asked == [1, 1]  # refused, so asked again; then no link is offered, and it is not asked again
        assert slot.ready() is None
        slot.close()

    run(main())


def test_a_link_that_fails_before_any_reply_asks_for_the_address_again(monkeypatch):
    """The leader restarted and another process took its old port (here another leader, with another
    token): the link opens, its first fetch fails unanswered, and the slot asks for the address again."""

    async def main():
        _, other, other_address = await serving([b"other"])
        leader, server, address = await serving([b"x"])
        stale = {**other_address, "token": address["token"]}  # the leader's token, at a port another process has
        answers = [stale, address]
        asked = []

        async def ask():
            asked.append(1)
            return answers[min(len(asked), 2) - 1]

        monkeypatch.setattr(fetch_link, "RETRY_S", 0.05)
        slot = LinkSlot(ask, "test")
        while (link := slot.ready()) is None:
            await asyncio.sleep(0.01)
        with pytest.raises(FetchLinkClosedError):
            await link.fetch(1, 3, FetchRequest(0, 1 << 20, 0, False, 0))
        slot.failed(FetchLinkClosedError("closed unanswered"))
        while (link := slot.ready()) is None:
            await asyncio.sleep(0.01)
        assert asked == [1, 1]
        assert (await link.fetch(1, 3, FetchRequest(0, 1 << 20, 0, False, 0)))[1] == b"x"
        assert (other.links_opened, server.links_opened) == (0, 1)
        slot.close()
        other.close()
        server.close()

    run(main())


@pytest.mark.parametrize("environ, links", [
    ({}, True), ({"RAY_USE_TLS": "0"}, True), ({"RAY_USE_TLS": "1"}, False), ({"RAY_USE_TLS": "True"}, False),
])
def test_no_link_is_offered_where_ray_encrypts_its_own_traffic(environ, links):
    assert tcp_allowed(environ) is links


def test_a_slot_that_cannot_connect_waits_twice_as_long_each_time_up_to_a_bound():
    """A firewall between the hosts, or a long cut: every connection fails. The follower does not try
    every second for good: each wait doubles, up to RETRY_MAX_S, and it keeps trying at that pace."""

    async def main():
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        address = {"host": "127.0.0.1", "port": closed.getsockname()[1], "token": "t"}
        closed.close()  # nothing listens there: connections are refused
        asked = []

        async def ask():
            asked.append(1)
            return address

        slot = LinkSlot(ask, "test")
        loop = asyncio.get_running_loop()
        waits = []
        for _ in range(9):
            slot._retry_at = 0.0  # (no waiting here: each try is let through at once, and its wait read)
            assert slot.ready() is None
            while slot._opening is not None:
                await asyncio.sleep(0.01)
            waits.append(slot._retry_at - loop.time())
        expected = [min(fetch_link.RETRY_S * 2 ** i, fetch_link.RETRY_MAX_S) for i in range(9)]
        assert expected[-1] == fetch_link.RETRY_MAX_S
        assert all(want - 1 < got <= want for got, want in zip(waits, expected)), (waits, expected)
        assert len(asked) == 9  # refused each time: the address is asked again each time
        slot.close()

    run(main())
