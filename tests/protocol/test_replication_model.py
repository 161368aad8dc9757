"""Replication without Ray: three real partition logs wired together through ReplicaState, under faults.

Each replica is what its actor holds: a :class:`PartitionLog` in a directory of
its own and a :class:`ReplicaState`, whose actions it carries out as the actor
does (log actions through ``apply_to_log``, timers as due times, the fetch loop
one call at a time, a follower's fetch parked at the leader's end until an
append or its wait runs out). The controller is the real
:class:`ClusterMetadata`: it elects from the ISR, accepts ISR changes only
from the current leader and epoch, and sends role changes until they are
acknowledged; each replica's fence file is a number the node's agent moves
when its node is reachable.

Every call is a message on a network that Hypothesis drives: it delivers any
message in flight (so they are reordered), loses any, and lets callers time
out while their call is still on its way (so it arrives late). It also
crashes replicas (the log is closed and reopened from its files, the state
starts again from the persisted epoch), cuts a node off (its lease lapses,
the controller elects without it) and heals it, appends and deletes records,
and moves the clock.

Checked after every step:

- one value per offset: below a replica's own high watermark, its records are
  the committed ones (what a leader held below its high watermark);
- a replica's high watermark never goes backwards while its process lives;
- records under the high watermark survive every leader change: the leader
  and every member of the controller's ISR hold all of them;

and at the end, with the faults over (every node back, nothing lost): the
ISR is full again and every replica holds the same log. With unclean
elections allowed (a second machine), only the end is checked: such an
election may lose committed records, but never leaves the logs apart.

The checks are incremental: each replica's records are read as they change
(appends from where the last read ended; a truncation, which the model
carries out itself, drops what it cut), and each check goes on from where
the last one ended unless a cut lowered it; the end compares the records
read step by step with each whole log.

Cost: in the suite, LOGBUS_MODEL_EXAMPLES examples (default 100; half as
many for the unclean machine) of LOGBUS_MODEL_STEPS steps (default 60). A
long run, for a change to replication::

    LOGBUS_MODEL_EXAMPLES=1000 LOGBUS_MODEL_STEPS=100 \
        .venv/bin/python -m pytest -p no:cacheprovider tests/protocol/test_replication_model.py
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from dataclasses import dataclass, field

from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from logbus.errors import LogbusError, OffsetOutOfRangeError
from logbus.protocol.cluster_metadata import ClusterMetadata
from logbus.protocol.messages import FetchRequest, FetchResponse
from logbus.protocol.replica_state import (
    ISR_TIMER,
    LEADER,
    ROLE_TIMER,
    AppendFromLeader,
    ArmTimer,
    AskEpochEnd,
    AskRole,
    DisarmTimer,
    HighWatermarkMoved,
    LeadershipChanged,
    ProposeIsr,
    ReplicaState,
    SaveEpoch,
    StartFollowing,
    StartLogAt,
    StopFollowing,
    Truncate,
    apply_to_log,
)
from logbus.storage import batch_header as bh
from logbus.storage.log_config import LogConfig
from logbus.storage.partition_log import PartitionLog
from logbus.storage.record_batch import encode_batch

TOPIC = "t"
LAG_MS = 1_000
FETCH_SLACK_MS = 1_000  # the actor's FOLLOWER_FETCH_SLACK_MS
CALL_TIMEOUT_MS = 5_000  # the actor's ALTER_ISR_TIMEOUT_S and FOLLOWER_CALL_TIMEOUT_S
CONFIG = LogConfig.from_dict({"replica.lag.time.max.ms": LAG_MS, "segment.bytes": 4096})
CONTROLLER = "controller"
# Once the faults end, the cluster heals within this many rounds of 100 ms (30 s of the model's time:
# every call's deadline and every timer, 5 s at most, passes several times over).
HEAL_ROUNDS = 300


@dataclass
class Message:
    """A call on its way (``kind``: fetch, epoch_end, offsets, alter_isr, ask_role, role), or a reply to one."""

    kind: str
    source: int | str
    target: int | str
    call: int
    body: tuple = ()


@dataclass
class Call:
    """A call its caller still waits for; the reply to any other is dropped, as the actor's awaits do."""

    call: int
    kind: str
    deadline_ms: int
    epoch: int = -1
    proposal: ProposeIsr | None = None


@dataclass
class Parked:
    """A follower's fetch waiting at the leader's end."""

    call: int
    follower: int
    epoch: int
    request: FetchRequest
    token: tuple
    deadline_ms: int


@dataclass
class Replica:
    """One replica's process: its log, its replication state, and what its actor would have in flight."""

    replica_id: int
    directory: str
    clock: "Clock"
    saved_epoch: int = -1  # replica.json: the epoch survives a restart, the role does not
    up: bool = False
    log: PartitionLog | None = None
    state: ReplicaState | None = None
    timers: dict[str, int] = field(default_factory=dict)
    fetching: Call | None = None  # the fetch loop's call in flight
    loop: tuple[int, int] | None = None  # the fetch loop running: (epoch, leader)
    parked: list[Parked] = field(default_factory=list)
    isr_calls: list[Call] = field(default_factory=list)
    role_call: Call | None = None  # the role question in flight (asked again if it is not answered)
    hw_seen: int = 0
    # The log's records as last read (offset -> record), kept up to date incrementally: appends are read
    # from ``held_end`` on, and every truncation is noted in ``cut_at`` (the model makes them all).
    held: dict[int, tuple[int, int]] = field(default_factory=dict)
    held_start: int = 0
    held_end: int = 0
    cut_at: int | None = None  # the lowest offset cut since the records were last read
    # The checks' progress: offsets below these were found right, and stay so unless a cut lowers them.
    checked_below: int = 0  # one value per offset: below this, the log holds the committed records
    survived_below: int = 0  # committed records survive: below this, every committed record is held

    def start(self) -> None:
        self.log = PartitionLog(self.directory, CONFIG, clock_ms=self.clock)
        self.state = ReplicaState(self.replica_id, self.saved_epoch, partition_name=f"{TOPIC}-0")
        self.up = True
        self.timers, self.fetching, self.loop, self.parked, self.isr_calls = {}, None, None, [], []
        self.role_call = None
        self.hw_seen = 0
        self.held, self.held_start, self.held_end, self.cut_at = {}, 0, 0, None  # the log was reopened: read it all again
        self.checked_below = self.survived_below = 0

    def cut(self, offset: int) -> None:
        """The log loses everything at and after ``offset`` (a truncation; 0: the whole log)."""
        self.cut_at = offset if self.cut_at is None else min(self.cut_at, offset)

    def records(self) -> dict[int, tuple[int, int]]:
        """offset -> (leader epoch, CRC) for every offset the log holds, reading only what changed."""
        log = self.log
        if self.cut_at is not None:
            for offset in [o for o in self.held if o >= self.cut_at]:
                del self.held[offset]
            self.held_end = min(self.held_end, self.cut_at)
            self.checked_below = min(self.checked_below, self.cut_at)
            self.survived_below = min(self.survived_below, self.cut_at)
            self.cut_at = None
        start = log.log_start_offset
        if start > self.held_start:  # delete_records: what is below the log start is gone
            for offset in range(self.held_start, min(start, self.held_end)):
                self.held.pop(offset, None)
        self.held_start = start
        self.held.update(records_of(log, max(self.held_end, start)))
        self.held_end = log.log_end_offset
        return self.held

    def crash(self) -> None:
        self.log.close()
        self.up = False

    @property
    def high_watermark(self) -> int:
        return self.state.high_watermark(self.log.log_end_offset)


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms


def records_of(log: PartitionLog, start: int | None = None) -> dict[int, tuple[int, int]]:
    """offset -> (leader epoch, CRC) of the batch that holds it, for every offset the log holds (from ``start`` on)."""
    held = {}
    offset, end = log.log_start_offset if start is None else max(start, log.log_start_offset), log.log_end_offset
    while offset < end:
        result = log.read(offset, 1 << 30)
        if result is None:
            break
        for _, header in bh.iter_headers(result.data):
            for o in range(max(header.base_offset, offset), header.next_offset):
                held[o] = (header.leader_epoch, header.crc)
        offset = result.next_offset
    return held


class ReplicationModel(RuleBasedStateMachine):
    """Three replicas of partition t-0, a controller, and a network between them (see the module docstring)."""

    replicas = 3
    unclean = False  # unclean.leader.election.enable

    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="logbus-model-")
        self.clock = Clock()
        self.calls = itertools.count()
        self.values = itertools.count()
        self.network: list[Message] = []
        self.metadata = ClusterMetadata()
        self.metadata.create_topic(TOPIC, 1, self.replicas, None, [f"n{r}" for r in range(self.replicas)])
        self.nodes = [Replica(r, f"{self.root}/replica-{r}", self.clock) for r in range(self.replicas)]
        self.cut: set[int] = set()  # nodes nobody can reach (and whose lease lapsed)
        self.reported: set[int] = set(range(self.replicas))  # alive to the controller
        self.fence = {r: 0 for r in range(self.replicas)}  # each replica's fence file
        self.roles_due: dict[int, int] = {}  # replica -> epoch it must acknowledge (the controller's RoleDeliveries)
        self.committed: dict[int, tuple[int, int]] = {}  # offset -> record, for offsets a leader exposed
        self.committed_end = 0  # past the last offset in committed
        self.deleted_below = 0  # DeleteRecords went this far: records below need not survive anywhere
        for node in self.nodes:
            node.start()
        self.expect_roles()
        for _ in range(3):  # the topic is created: its replicas learn their roles, the followers truncate
            self.steady_round(10)

    def teardown(self) -> None:
        try:
            if self.nodes:
                self.heal_and_check()
        finally:
            for node in self.nodes:
                if node.up:
                    node.log.close()
            shutil.rmtree(self.root, ignore_errors=True)

    # --- the controller --------------------------------------------------------------------------------

    def partition(self):
        return self.metadata.topics[TOPIC].partitions[0]

    def expect_roles(self) -> None:
        epoch = self.partition().leader_epoch
        for r in self.partition().replicas:
            self.roles_due[r] = epoch

    def elect(self, alive: set[int]) -> None:
        """The controller's election: from the live ISR; the fence moves on every reachable node first."""
        if self.metadata.elect_leader(TOPIC, 0, alive, self.unclean):
            epoch = self.partition().leader_epoch
            for r, node in enumerate(self.nodes):
                if r not in self.cut:
                    self.fence[r] = epoch
                    if node.up:
                        self.run(node, node.state.on_fence(epoch))  # the agent's fence_moved
            self.expect_roles()

    def live(self) -> set[int]:
        return {r for r in self.reported if r not in self.cut}

    def controller_receives(self, message: Message) -> None:
        p = self.partition()
        if message.kind == "alter_isr":
            leader, epoch, isr = message.body
            accepted = self.metadata.alter_isr(TOPIC, 0, leader, epoch, list(isr))
            self.send("reply", CONTROLLER, message.source, message.call, ("ok", accepted))
        elif message.kind == "ask_role":
            if p.leader is None or p.leader not in self.live():
                self.elect(self.live())  # replica_started elects when a leader is possible
            p = self.partition()
            self.send("reply", CONTROLLER, message.source, message.call, ("ok", (p.leader, p.leader_epoch, list(p.replicas), list(p.isr))))
        elif message.kind == "ack":
            (epoch,) = message.body
            if self.roles_due.get(message.source, epoch + 1) <= epoch:
                del self.roles_due[message.source]

    def send_roles(self) -> None:
        """The controller sends each role change not yet acknowledged (again), as of now."""
        p = self.partition()
        if p.leader is None:
            return
        for r, epoch in sorted(self.roles_due.items()):
            if epoch == p.leader_epoch and not any(m.kind == "role" and m.target == r for m in self.network):
                self.send("role", CONTROLLER, r, next(self.calls), (p.leader, p.leader_epoch, list(p.replicas), list(p.isr)))

    # --- the network -----------------------------------------------------------------------------------

    def send(self, kind: str, source, target, call: int, body: tuple = ()) -> None:
        self.network.append(Message(kind, source, target, call, body))

    def reachable(self, message: Message) -> bool:
        ends = {message.source, message.target} - {CONTROLLER}
        if ends & self.cut:
            return False
        return message.target == CONTROLLER or self.nodes[message.target].up

    def deliver_message(self, index: int) -> None:
        message = self.network.pop(index)
        if not self.reachable(message):
            return  # lost: the caller times out
        if message.target == CONTROLLER:
            self.controller_receives(message)
        else:
            self.receive(self.nodes[message.target], message)

    # --- a replica's actor -----------------------------------------------------------------------------

    def run(self, node: Replica, actions: list) -> None:
        """What the actor's ``_run`` does with the state's actions."""
        for action in actions:
            match action:
                case SaveEpoch(epoch):
                    node.saved_epoch = epoch
                case LeadershipChanged():
                    pass  # fetch sessions and shared reads: none here
                case HighWatermarkMoved():
                    self.record_committed(node)
                    self.wake(node)
                case StopFollowing():
                    node.loop, node.fetching = None, None
                case StartFollowing(epoch, leader_id):
                    node.loop, node.fetching = (epoch, leader_id), None
                case ProposeIsr():
                    call = next(self.calls)
                    node.isr_calls.append(Call(call, "alter_isr", self.clock.now_ms + CALL_TIMEOUT_MS, proposal=action))
                    self.send("alter_isr", node.replica_id, CONTROLLER, call, (node.replica_id, action.leader_epoch, action.isr))
                case ArmTimer(name, delay_ms):
                    node.timers[name] = self.clock.now_ms + max(0, delay_ms)
                case DisarmTimer(name):
                    node.timers.pop(name, None)
                case AskRole():
                    self.ask_role(node)
                case Truncate(offset):
                    node.cut(offset)
                    apply_to_log(node.log, action)
                case StartLogAt():
                    node.cut(0)  # everything goes, wherever the log starts again
                    apply_to_log(node.log, action)
                case _:
                    apply_to_log(node.log, action)

    def ask_role(self, node: Replica) -> None:
        if node.role_call is None:  # one question at a time (the actor's _role_question)
            node.role_call = Call(next(self.calls), "ask_role", self.clock.now_ms + CALL_TIMEOUT_MS)
            self.send("ask_role", node.replica_id, CONTROLLER, node.role_call.call)

    def fetch_reply(self, node: Replica, request: FetchRequest) -> tuple:
        """The leader's read for a follower (the actor's ``_serve_fetch``): (FetchResponse, data or None)."""
        result = node.log.read(request.offset, request.max_bytes, max_offset=None, verify_crc=False)
        state = node.state
        if result is None:
            meta = FetchResponse(request.offset, request.offset, node.high_watermark, node.log.log_start_offset, state.leader_epoch)
            return meta, None
        meta = FetchResponse(result.first_offset, result.next_offset, node.high_watermark, node.log.log_start_offset, state.leader_epoch)
        return meta, bytes(result.data)

    def receive(self, node: Replica, message: Message) -> None:
        state = node.state
        now = self.clock.now_ms
        reply = lambda body: self.send("reply", node.replica_id, message.source, message.call, body)  # noqa: E731
        if message.kind == "fetch":
            follower, epoch, request = message.body
            self.run(node, state.on_fence(self.fence[node.replica_id]))
            try:
                self.run(node, state.on_replica_fetch(follower, epoch, request.offset, node.log, now))
                if request.offset < node.log.log_end_offset:
                    reply(("ok", self.fetch_reply(node, request)))
                    return
            except LogbusError as error:
                reply(("error", error))
                return
            token = state.park(follower, request.offset, now)
            node.parked.append(Parked(message.call, follower, epoch, request, token, now + request.max_wait_ms))
        elif message.kind == "epoch_end":
            (epoch,) = message.body
            reply(("ok", node.log.epochs.end_offset_for(epoch, node.log.log_end_offset)))
        elif message.kind == "offsets":
            reply(("ok", (node.log.log_start_offset, node.high_watermark, node.log.log_end_offset)))
        elif message.kind == "role":
            leader, epoch, replicas, isr = message.body
            if leader == node.replica_id:
                accepted, actions = state.become_leader(epoch, replicas, isr, node.log, now)
            else:
                accepted, actions = state.become_follower(epoch, leader, leader, node.log)
            self.run(node, actions)
            if accepted:
                self.send("ack", node.replica_id, CONTROLLER, message.call, (epoch,))
        elif message.kind == "reply":
            self.reply_arrives(node, message)

    def reply_arrives(self, node: Replica, message: Message) -> None:
        outcome, value = message.body
        now = self.clock.now_ms
        state = node.state
        if message.source == CONTROLLER:
            for call in node.isr_calls:
                if call.call == message.call:
                    node.isr_calls.remove(call)
                    self.run(node, state.isr_answered(call.proposal.leadership, value, node.log, now))
                    return
            if node.role_call is not None and node.role_call.call == message.call:
                node.role_call = None
                leader, epoch, replicas, isr = value
                self.run(node, state.reconcile(leader, epoch, replicas, isr, leader, node.log, now))
            return
        call = node.fetching
        if call is None or call.call != message.call or node.loop is None or node.loop[0] != call.epoch:
            return  # nobody waits for it any more
        node.fetching = None
        epoch = call.epoch
        if outcome == "error":
            if isinstance(value, OffsetOutOfRangeError) and call.kind == "fetch":
                self.call_leader(node, "offsets", ())
            else:
                state.on_fetch_failed(epoch)
            return
        try:
            if call.kind == "epoch_end":
                self.run(node, state.on_epoch_end(epoch, *value, node.log))
            elif call.kind == "offsets":
                start, _, end = value
                self.run(node, state.on_out_of_range(epoch, start, end, node.log))
            else:
                meta, data = value
                for action in state.on_fetch_reply(epoch, meta, data is not None):
                    assert isinstance(action, AppendFromLeader)
                    node.log.append_as_follower(data, action.first_offset, action.next_offset)
                self.run(node, state.fetch_reply_applied(epoch, meta, node.log))
        except LogbusError:
            state.on_fetch_failed(epoch)  # as the actor's loop: logged, and the next fetch tries again

    def call_leader(self, node: Replica, kind: str, body: tuple, wait_ms: int = CALL_TIMEOUT_MS) -> None:
        epoch, leader = node.loop
        call = next(self.calls)
        node.fetching = Call(call, kind, self.clock.now_ms + wait_ms, epoch)
        self.send(kind, node.replica_id, leader, call, body)

    def wake(self, node: Replica) -> None:
        """An append or a high watermark move wakes the fetches parked on ``node`` (the actor's Wakeup)."""
        for parked in list(node.parked):
            self.serve_parked(node, parked, expired=False)

    def serve_parked(self, node: Replica, parked: Parked, expired: bool) -> None:
        state = node.state
        reply = lambda body: self.send("reply", node.replica_id, parked.follower, parked.call, body)  # noqa: E731
        if state.role != LEADER or state.leader_epoch != parked.epoch:
            body = ("error", LogbusError("leadership changed during the fetch"))
        elif parked.request.offset < node.log.log_end_offset:
            body = ("ok", self.fetch_reply(node, parked.request))
        elif expired:
            body = ("ok", self.fetch_reply(node, parked.request))
        else:
            return
        node.parked.remove(parked)
        state.unpark(parked.follower, parked.token)
        reply(body)

    def fetch_step(self, node: Replica) -> None:
        """The fetch loop's next call, if it runs and waits for nothing."""
        if node.loop is None or node.fetching is not None:
            return
        epoch, _ = node.loop
        state = node.state
        self.run(node, state.on_fence(self.fence[node.replica_id]))
        step = state.next_fetch(epoch, node.log)
        if step is None:
            node.loop = None
        elif isinstance(step, AskEpochEnd):
            self.call_leader(node, "epoch_end", (step.epoch,))
        else:
            self.call_leader(node, "fetch", (node.replica_id, epoch, step), step.max_wait_ms + FETCH_SLACK_MS)

    def time_passes(self) -> None:
        """Timers, parked fetches and calls whose time has come."""
        now = self.clock.now_ms
        for node in self.nodes:
            if not node.up:
                continue
            for name, due in sorted(node.timers.items(), key=lambda item: item[1]):
                if due <= now and node.timers.get(name) == due:
                    del node.timers[name]
                    if name == ISR_TIMER:
                        self.run(node, node.state.check_isr(node.log, now))
                    elif name == ROLE_TIMER:
                        self.run(node, node.state.role_timer_fired(self.fence[node.replica_id]))
            for parked in list(node.parked):
                if parked.deadline_ms <= now:
                    self.serve_parked(node, parked, expired=True)
            if node.fetching is not None and node.fetching.deadline_ms <= now:
                epoch = node.fetching.epoch
                node.fetching = None  # the call goes on without anyone waiting for it
                node.state.on_fetch_failed(epoch)
            for call in list(node.isr_calls):
                if call.deadline_ms <= now:
                    node.isr_calls.remove(call)  # its answer, if one comes, is dropped
                    self.run(node, node.state.isr_unanswered(call.proposal.leadership))
            if node.role_call is not None and node.role_call.deadline_ms <= now:
                node.role_call = None  # the actor's _ask_role tries until it is answered
                self.ask_role(node)

    # --- rules: what happens --------------------------------------------------------------------------

    def deliverable(self) -> list[int]:
        """Messages that may arrive next: any, except that a leader's ISR changes reach the controller in
        the order it sent them (one caller's calls to one actor; see the replica's _propose_isr)."""
        seen, indexes = set(), []
        for i, message in enumerate(self.network):
            if message.kind == "alter_isr":
                if message.source in seen:
                    continue
                seen.add(message.source)
            indexes.append(i)
        return indexes

    @rule(data=st.data())
    def deliver(self, data):
        if self.network:
            self.deliver_message(data.draw(st.sampled_from(self.deliverable())))

    @rule(rounds=st.integers(1, 8), produce_every=st.integers(0, 3))
    def replicate(self, rounds, produce_every):
        """Nothing goes wrong for a while: each round, followers fetch, every message arrives in order,
        10 ms pass; a producer writes every ``produce_every`` rounds (0: not)."""
        for i in range(rounds):
            if produce_every and i % produce_every == 0:
                self.produce(1)
            self.steady_round(10)

    def steady_round(self, ms: int) -> None:
        for node in self.nodes:
            if node.up:
                self.fetch_step(node)
        for _ in range(100):  # what arrives makes more (replies, parked fetches answered): bounded
            if not self.network:
                break
            self.deliver_message(0)
        self.clock.now_ms += ms
        self.time_passes()
        self.send_roles()

    @rule(data=st.data())
    def lose(self, data):
        if self.network:
            self.network.pop(data.draw(st.integers(0, len(self.network) - 1)))

    @rule()
    def followers_fetch(self):
        for node in self.nodes:
            if node.up:
                self.fetch_step(node)

    @rule(ms=st.sampled_from([100, 600, 1_100, 5_500]))
    def clock_moves(self, ms):
        self.clock.now_ms += ms
        self.time_passes()
        self.send_roles()

    @rule(count=st.integers(1, 3))
    def produce(self, count):
        """A producer writes to whichever replica takes writes (its lease holds and its epoch is the fence's)."""
        for node in self.nodes:
            state = node.state
            if not node.up or node.replica_id in self.cut or state.role != LEADER:
                continue
            if self.fence[node.replica_id] != state.leader_epoch:
                continue  # the lease files refuse it
            now = self.clock.now_ms
            self.run(node, state.on_fence(self.fence[node.replica_id]))
            self.run(node, state.before_append(node.log, now))
            node.log.append(encode_batch([f"v{next(self.values)}".encode()] * count, timestamps_ms=[now] * count), leader_epoch=state.leader_epoch)
            self.wake(node)
            self.run(node, state.after_append(node.log, now))

    @rule(data=st.data())
    def delete_records(self, data):
        """Kafka's DeleteRecords on the leader, up to some offset below its high watermark."""
        for node in self.nodes:
            state = node.state
            if node.up and node.replica_id not in self.cut and state.role == LEADER and self.fence[node.replica_id] == state.leader_epoch:
                start, hw = node.log.log_start_offset, node.high_watermark
                if hw > start:
                    node.log.delete_records(data.draw(st.integers(start, hw)))
                    self.deleted_below = max(self.deleted_below, node.log.log_start_offset)

    @rule(data=st.data())
    def crash(self, data):
        r = data.draw(st.integers(0, self.replicas - 1))
        if self.nodes[r].up:
            self.nodes[r].crash()

    @rule(data=st.data())
    def down_reported(self, data):
        """The node's agent reports the replica's process gone: the controller elects if it led."""
        r = data.draw(st.integers(0, self.replicas - 1))
        if not self.nodes[r].up and r in self.reported and r not in self.cut:
            self.reported.discard(r)
            if self.partition().leader == r:
                self.elect(self.live())

    @rule(data=st.data())
    def restart(self, data):
        """Ray restarts the replica: the log is reopened from its files; it registers and asks its role.

        Its node's agent reported the process gone first (it watches a pidfd: at once), unless the
        node is cut off."""
        r = data.draw(st.integers(0, self.replicas - 1))
        node = self.nodes[r]
        if node.up or (r in self.reported and r not in self.cut):
            return
        node.start()
        self.reported.add(r)
        self.ask_role(node)

    @precondition(lambda self: len(self.cut) < 1)
    @rule(data=st.data())
    def cut_off(self, data):
        """A node's network is cut: its lease lapses, and the controller elects without it if it led."""
        r = data.draw(st.integers(0, self.replicas - 1))
        self.cut.add(r)
        if self.partition().leader == r:
            self.elect(self.live())

    @rule()
    def network_heals(self):
        for r in sorted(self.cut):
            self.cut.discard(r)
            epoch = max(self.fence[r], self.partition().leader_epoch)
            self.fence[r] = epoch
            if self.nodes[r].up:
                self.run(self.nodes[r], self.nodes[r].state.on_fence(epoch))
        if self.partition().leader is None:
            self.elect(self.live())
        self.send_roles()

    @rule()
    def preferred_leader_election(self):
        """The controller moves leadership to the first live in-sync replica (as its preferred-leader check)."""
        if self.metadata.elect_preferred_leader(TOPIC, 0, self.live()):
            epoch = self.partition().leader_epoch
            for r, node in enumerate(self.nodes):
                if r not in self.cut:
                    self.fence[r] = epoch
                    if node.up:
                        self.run(node, node.state.on_fence(epoch))
            self.expect_roles()

    # --- invariants ------------------------------------------------------------------------------------

    @invariant()
    def high_watermarks_never_go_back(self):
        if self.unclean:
            return  # a follower of a leader that lacks committed records cuts below its high watermark
        for node in self.nodes:
            if node.up:
                hw = node.high_watermark
                assert hw >= node.hw_seen, f"replica {node.replica_id}'s high watermark went back from {node.hw_seen} to {hw}"
                node.hw_seen = hw

    def record_committed(self, node: Replica) -> None:
        """A replica's records below its high watermark are committed: the first seen at an offset is
        its value, and every other replica's there must equal it."""
        if self.unclean:
            return  # an unclean election may replace committed records
        held = node.records()
        high_watermark = node.high_watermark
        # Offsets below checked_below were checked before and have not changed since (a cut lowers it).
        for offset in range(max(node.log.log_start_offset, node.checked_below), high_watermark):
            assert offset in held, f"replica {node.replica_id} holds nothing at {offset}, below its high watermark {high_watermark}"
            record = self.committed.get(offset)
            if record is None:
                record = self.committed[offset] = held[offset]
                if offset < self.committed_end:  # a committed offset new below others: every replica is checked for it
                    for other in self.nodes:
                        other.survived_below = min(other.survived_below, offset)
                self.committed_end = max(self.committed_end, offset + 1)
            assert record == held[offset], (
                f"offset {offset}: replica {node.replica_id} ({node.state.role}, epoch {node.state.leader_epoch}) holds "
                f"{held[offset]} below its high watermark {high_watermark}; committed: {record}"
            )
        node.checked_below = max(node.checked_below, high_watermark)

    @invariant()
    def one_value_per_offset_below_the_high_watermark(self):
        for node in sorted(self.nodes, key=lambda n: n.state.role != LEADER):  # leaders first
            if node.up:
                self.record_committed(node)

    @invariant()
    def committed_records_survive_on_every_electable_replica(self):
        if self.unclean:
            return
        p = self.partition()
        for r in set(p.isr) | ({p.leader} if p.leader is not None else set()):
            node = self.nodes[r]
            if not node.up:
                continue
            held = node.records()
            # Committed records below survived_below were found here before and have not changed since.
            for offset in range(max(node.log.log_start_offset, self.deleted_below, node.survived_below), self.committed_end):
                record = self.committed.get(offset)
                if record is not None:
                    assert held.get(offset) == record, (
                        f"replica {r} (ISR {p.isr}, leader {p.leader}) holds {held.get(offset)} at committed offset {offset}, not {record}"
                    )
            node.survived_below = max(node.survived_below, self.committed_end)

    # --- the end: faults over, the cluster heals ------------------------------------------------------

    def heal_and_check(self) -> None:
        self.cut.clear()
        for r, node in enumerate(self.nodes):
            if not node.up:
                node.start()
                self.ask_role(node)
            self.reported.add(r)
        p = self.partition()
        if p.leader is None:
            self.elect(self.live())
        for r in range(self.replicas):
            self.fence[r] = self.partition().leader_epoch
            self.run(self.nodes[r], self.nodes[r].state.on_fence(self.fence[r]))
        for _ in range(HEAL_ROUNDS):
            while self.network:
                self.deliver_message(0)
                self.check_all()
            for node in self.nodes:
                self.fetch_step(node)
            self.clock.now_ms += 100
            self.time_passes()
            self.send_roles()
            self.check_all()
            if self.healed():
                break
        p = self.partition()
        assert p.leader is not None, f"no leader after healing (ISR {p.isr}); {self.describe()}"
        leader = self.nodes[p.leader]
        assert sorted(p.isr) == sorted(p.replicas), f"the controller's ISR {p.isr} is not every replica {p.replicas}; {self.describe()}"
        assert leader.state.role == LEADER and sorted(leader.state.leader.isr) == sorted(p.replicas), (
            f"leader {p.leader} ({leader.state.role}) has ISR {leader.state.leader and sorted(leader.state.leader.isr)}; {self.describe()}"
        )
        logs = {node.replica_id: records_of(node.log) for node in self.nodes}
        for node in self.nodes:  # the model's own bookkeeping: what it read step by step is what the log holds
            assert node.records() == logs[node.replica_id], f"replica {node.replica_id}: the records read step by step are not the log's"
        start = max(node.log.log_start_offset for node in self.nodes)
        ends = {node.replica_id: node.log.log_end_offset for node in self.nodes}
        assert len(set(ends.values())) == 1, f"log ends differ: {ends}"
        for r, held in logs.items():
            mine = {o: v for o, v in held.items() if o >= start}
            theirs = {o: v for o, v in logs[p.leader].items() if o >= start}
            assert mine == theirs, f"replica {r}'s log differs from the leader's ({p.leader})"

    def describe(self) -> str:
        """The controller's and each replica's view, for a failure's message."""
        p = self.partition()
        lines = [f"controller: leader {p.leader}, epoch {p.leader_epoch}, ISR {p.isr}, roles due {self.roles_due}"]
        for node in self.nodes:
            state = node.state
            lines.append(
                f"replica {node.replica_id}: {state.role} at epoch {state.leader_epoch} (leader {state.leader_id}), "
                f"log [{node.log.log_start_offset}, {node.log.log_end_offset}), HW {node.high_watermark}, "
                f"ISR {state.leader and sorted(state.leader.isr)} (pending {state.leader and state.leader.pending_isr}), "
                f"loop {node.loop}, fetching {node.fetching}, timers {node.timers}, fence {self.fence[node.replica_id]}"
            )
        return "\n".join(lines)

    def healed(self) -> bool:
        p = self.partition()
        if p.leader is None or sorted(p.isr) != sorted(p.replicas):
            return False
        leader = self.nodes[p.leader].state
        if leader.role != LEADER or leader.leader is None or sorted(leader.leader.isr) != sorted(p.replicas):
            return False
        ends = {node.log.log_end_offset for node in self.nodes}
        return len(ends) == 1 and not self.network

    def check_all(self) -> None:
        self.high_watermarks_never_go_back()
        self.one_value_per_offset_below_the_high_watermark()
        self.committed_records_survive_on_every_electable_replica()


class UncleanReplicationModel(ReplicationModel):
    """The same with unclean.leader.election.enable: when no in-sync replica lives, another may lead,
    and committed records it lacks are lost. What must still hold: once the faults end, the ISR is
    full and every replica holds the leader's log (no replica keeps records of a history the leader
    does not have)."""

    unclean = True


# No explain phase: it replays a failing run under a tracer, which here takes many minutes.
PHASES = [phase for phase in Phase if phase != Phase.explain]
# In the suite, a short run (well under a minute for both machines); a long one through the environment.
EXAMPLES = int(os.environ.get("LOGBUS_MODEL_EXAMPLES", "100"))
STEPS = int(os.environ.get("LOGBUS_MODEL_STEPS", "60"))
ReplicationModel.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, phases=PHASES)
test_replication_model = ReplicationModel.TestCase
UncleanReplicationModel.TestCase.settings = settings(
    max_examples=max(1, EXAMPLES // 2), stateful_step_count=STEPS, deadline=None, phases=PHASES
)
test_unclean_replication_model = UncleanReplicationModel.TestCase
