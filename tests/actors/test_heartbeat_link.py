"""The heartbeat link between node agents and the controller, on real loopback sockets (no Ray)."""

import asyncio
import json
import random
import struct

import pytest

from hypothesis import given
from hypothesis import strategies as st

from logbus.actors.heartbeat_link import (
    MAX_FRAME_BYTES,
    RECONNECT_MS,
    RECONNECT_TRIES,
    RETRY_MAX_MS,
    RETRY_MS,
    HeartbeatLink,
    HeartbeatServer,
    ReopenPolicy,
    encode,
    read_frame,
)
from logbus.errors import HeartbeatLinkClosedError, HeartbeatRefusedError


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


class Controller:
    """The handler a controller gives the server: counts heartbeats per node, refuses one node."""

    def __init__(self):
        self.heard: dict[str, int] = {}

    async def handle(self, message: dict) -> dict:
        if message["node"] == "refused":
            raise ValueError("not this node")
        self.heard[message["node"]] = self.heard.get(message["node"], 0) + 1
        return {"version": ["c", self.heard[message["node"]]], "epochs": None}


async def serving():
    controller = Controller()
    server = HeartbeatServer(controller.handle)
    address = await server.start("127.0.0.1")
    return controller, server, address


def test_heartbeats_pipelined_over_one_link_get_their_own_replies_in_order():
    async def main():
        controller, server, address = await serving()
        link = await HeartbeatLink.open(address, 5)
        replies = await asyncio.gather(*(link.call({"node": "n1"}, now_ms=i) for i in range(50)))
        assert [reply["version"][1] for reply in replies] == list(range(1, 51))
        assert controller.heard == {"n1": 50}
        assert link.unanswered_since_ms() is None
        link.close()
        server.close()

    run(main())


def test_a_refused_heartbeat_raises_and_the_link_keeps_serving():
    async def main():
        controller, server, address = await serving()
        link = await HeartbeatLink.open(address, 5)
        with pytest.raises(HeartbeatRefusedError, match="not this node"):
            await link.call({"node": "refused"}, now_ms=0)
        assert (await link.call({"node": "n1"}, now_ms=0))["version"] == ["c", 1]
        link.close()
        server.close()

    run(main())


@pytest.mark.parametrize("token", ["0" * 32, "\u00fc" * 32, ""])
def test_a_wrong_token_gets_the_connection_closed_and_nothing_heard(token):
    async def main():
        controller, server, address = await serving()
        link = await HeartbeatLink.open({**address, "token": token}, 5)
        with pytest.raises(HeartbeatLinkClosedError):
            await link.call({"node": "n1"}, now_ms=0)
        assert link.closed and controller.heard == {}
        server.close()

    run(main())


def test_garbage_and_truncated_frames_close_only_their_own_connection():
    """A bounded fuzz: random bytes, bad lengths, non-JSON, JSON that is not an object, oversize
    lengths, cut frames. Each closes its connection; a correct agent is served throughout."""

    async def main():
        controller, server, address = await serving()
        good = await HeartbeatLink.open(address, 5)
        rng = random.Random(17)
        hello = encode({"token": address["token"]})
        cases = [
            hello + struct.pack(">I", 60_000) + b"[" * 60_000,  # JSON nested too deep to parse
            struct.pack(">I", MAX_FRAME_BYTES + 1) + b"x",
            struct.pack(">I", 5) + b"\xff\xfe\x00ab",
            struct.pack(">I", 2) + b"[]",
            encode({"seq": 1, "node": "n2", "incarnation": "i"})[:-3],  # cut, then the peer hangs up
        ]
        cases += [bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64))) for _ in range(40)]
        for number, garbage in enumerate(cases):
            reader, writer = await asyncio.open_connection(address["host"], address["port"])
            writer.write((hello if number % 2 else b"") + garbage)
            await writer.drain()
            writer.write_eof()
            # The server closes (or answers an error and then sees the end): never a reply for node n2's heartbeat.
            data = await asyncio.wait_for(reader.read(), 10)
            for reply in _frames(data):
                assert "error" in reply, reply
            writer.close()
            assert (await good.call({"node": "n1"}, now_ms=0))["version"][1] == number + 1
        assert set(controller.heard) == {"n1"}
        good.close()
        server.close()

    run(main())


def test_a_silent_peer_shows_in_unanswered_time_and_a_closing_one_fails_the_pending_heartbeats():
    async def main():
        stalled = asyncio.Event()

        async def never(message):
            await stalled.wait()

        server = HeartbeatServer(never)
        address = await server.start("127.0.0.1")
        link = await HeartbeatLink.open(address, 5)
        with pytest.raises(asyncio.TimeoutError):  # its caller stops waiting: still unanswered
            await asyncio.wait_for(link.call({"node": "n1"}, now_ms=123), 0.2)
        pending = asyncio.ensure_future(link.call({"node": "n1"}, now_ms=456))
        assert link.unanswered_since_ms() == 123  # the agent drops a link silent this long
        server.close()  # the controller's process ends: its sockets close
        with pytest.raises(HeartbeatLinkClosedError):
            await asyncio.wait_for(pending, 10)
        assert link.closed

    run(main())


def test_frames_over_the_limit_are_refused_by_the_sender():
    with pytest.raises(ValueError, match="over the"):
        encode({"down": ["x" * MAX_FRAME_BYTES]})


def _frames(data: bytes):
    while len(data) >= 4:
        (size,) = struct.unpack(">I", data[:4])
        if len(data) < 4 + size:
            return
        yield json.loads(data[4 : 4 + size])
        data = data[4 + size :]


@pytest.mark.parametrize("error", [TimeoutError(110, "Connection timed out"), ConnectionResetError(104, "Connection reset by peer"), OSError(113, "No route to host")])
def test_a_connection_that_fails_ends_the_link_as_closed_not_with_its_os_error(error):
    """ETIMEDOUT (keepalive after a cut network), a reset: the link ends as closed, which the server
    logs in one line; the OS error never escapes as an unhandled exception with its traceback."""
    async def main():
        reader = asyncio.StreamReader()
        reader.set_exception(error)
        with pytest.raises(HeartbeatLinkClosedError, match=type(error).__name__):
            await read_frame(reader)

    run(main())


def test_the_controller_and_agents_log_lines_carry_their_time():
    import io
    import logging
    import re

    from logbus.actors import logs

    logger = logging.getLogger("logbus")
    before = (list(logger.handlers), logger.level, logger.propagate)
    try:
        logs.configure_logging()
        logs.configure_logging()  # once per process, however often called
        ours = [h for h in logger.handlers if h.get_name() == "logbus-actor"]
        assert len(ours) == 1
        out = io.StringIO()
        ours[0].setStream(out)
        logging.getLogger("logbus.actors.controller").warning("node %s: lease expired", "abc")
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} WARNING logbus\.actors\.controller: node abc: lease expired\n",
                            out.getvalue()), out.getvalue()
    finally:
        logger.handlers[:] = before[0]
        logger.setLevel(before[1])
        logger.propagate = before[2]


ADDRESS = {"host": "10.0.0.1", "port": 4321, "token": "t"}


def test_a_link_that_worked_is_reopened_to_the_same_address_soon_and_quickly_while_the_network_is_cut():
    reopen = ReopenPolicy()
    assert reopen.due(0) and reopen.address is None  # first: ask the controller
    reopen.asked(ADDRESS)
    assert reopen.connect_timeout_s(5.0) == 5.0  # never connected: the first connection may take long
    reopen.opened()
    # The link went silent (a cut): tried again at the same address, with a short timeout, every RECONNECT_MS.
    now = 10_000
    for _ in range(RECONNECT_TRIES - 1):
        assert reopen.failed(now, refused=False) == RECONNECT_MS
        assert reopen.address == ADDRESS and reopen.connect_timeout_s(5.0) < 1.0
        assert not reopen.due(now + RECONNECT_MS - 1) and reopen.due(now + RECONNECT_MS)
        now += RECONNECT_MS
    # So many in a row: the controller may be elsewhere now; ask it again, backing off.
    assert reopen.failed(now, refused=False) == RETRY_MS
    assert reopen.address is None
    reopen.asked(ADDRESS)
    assert reopen.connect_timeout_s(5.0) == 5.0


def test_a_refused_connection_asks_for_the_address_again_and_a_success_resets_the_pace():
    reopen = ReopenPolicy()
    reopen.asked(ADDRESS)
    reopen.opened()
    assert reopen.failed(0, refused=True) == RETRY_MS  # the controller's port is closed: it restarted
    assert reopen.address is None
    reopen.asked({**ADDRESS, "port": 5555})
    reopen.opened()
    assert reopen.failed(0, refused=False) == RECONNECT_MS


@given(st.lists(st.booleans(), min_size=1, max_size=300))
def test_without_a_link_that_ever_worked_tries_back_off_to_the_slowest_pace_and_stay_there(refusals):
    reopen = ReopenPolicy()
    delays, loud = [], 0
    for refused in refusals:
        reopen.asked(ADDRESS)
        delays.append(reopen.failed(0, refused))
        loud += reopen.slowest
        assert reopen.address is None
    assert delays == sorted(delays) and delays[0] == RETRY_MS and max(delays) <= RETRY_MAX_MS
    to_slowest = next(k for k in range(1, 64) if RETRY_MS * 2**k >= RETRY_MAX_MS)  # failures until it is reached
    assert loud == (1 if len(refusals) >= to_slowest else 0)  # said loudly once, when reached
