"""The history checker on hand-made histories: a clean one, and one breaking each invariant in turn.

No Ray: the checker is pure Python, and replica files are written here with logbus's PartitionLog.
"""

from __future__ import annotations

import json
import os

import pytest

from logbus.storage import encode_batch
from logbus.storage.partition_log import PartitionLog
from tests.cluster.history import VIOLATIONS, History, check, compare_replicas, load, replica_events, replica_records


def send(value):
    return {"kind": "send", "value": value}


def ack(value, partition, offset):
    return {"kind": "ack", "value": value, "partition": partition, "offset": offset}


def poll(consumer, value, partition, offset):
    return {"kind": "poll", "consumer": consumer, "value": value, "partition": partition, "offset": offset}


def clean_history():
    """Three records on two partitions, acknowledged, each polled once by consumer c and by the final reader."""
    events = [send("a"), send("b"), send("c"), ack("a", 0, 0), ack("b", 1, 0), ack("c", 0, 1)]
    for consumer in ("c", "final"):
        events += [poll(consumer, "a", 0, 0), poll(consumer, "c", 0, 1), poll(consumer, "b", 1, 0)]
    return events


def only(report, violation):
    """Every violation count is zero except ``violation``'s, which is not."""
    counts = report.violations()
    assert counts[violation] > 0, counts
    assert all(n == 0 for name, n in counts.items() if name != violation), counts


def test_a_clean_history_breaks_nothing():
    report = check(clean_history(), complete_consumers=["c", "final"])
    assert report.ok
    assert set(report.violations()) == set(VIOLATIONS)
    assert (report.sent, report.acked, report.failed) == (3, 3, 0)


def test_an_acknowledged_record_no_read_found_is_lost():
    events = [e for e in clean_history() if e.get("value") != "c" or e["kind"] in ("send", "ack")]
    report = check(events)
    only(report, "lost")
    assert report.lost == ["c"]


def test_a_value_at_two_offsets_is_a_duplicate():
    events = clean_history() + [poll("final", "a", 0, 2)]  # written a second time, at offset 2
    report = check(events)
    only(report, "duplicated")
    assert report.duplicated == {"a": [("", 0, 0), ("", 0, 2)]}
    # Without idempotence a second copy is allowed.
    assert check(events, idempotent=False).ok


def test_two_values_at_one_offset_between_an_ack_and_a_read():
    # "c" was acknowledged at offset 1 of partition 0, and a read finds "x" there (x was sent but never acknowledged).
    events = [send("a"), send("c"), send("x"), ack("a", 0, 0), ack("c", 0, 1),
              poll("final", "a", 0, 0), poll("final", "x", 0, 1), poll("final", "c", 0, 2)]
    report = check(events)
    assert set(report.two_values_at_offset) == {("", 0, 1)}
    assert report.two_values_at_offset[("", 0, 1)] == {"c": ["ack"], "x": ["poll:final"]}
    assert report.duplicated == {"c": [("", 0, 1), ("", 0, 2)]}  # and "c" itself sits at two offsets
    assert report.unacknowledged_written == ["x"]


def test_two_values_at_one_offset_between_replicas():
    events = [send("a"), send("b"), ack("a", 0, 0)]
    events += replica_events("", 0, 1, [(0, b"a"), (1, b"b")])
    events += replica_events("", 0, 2, [(0, b"a"), (1, b"q")])  # a diverged follower
    events.append(send("q"))
    report = check(events)
    assert report.two_values_at_offset == {("", 0, 1): {"b": ["replica:1"], "q": ["replica:2"]}}
    assert report.violations()["two_values_at_offset"] == 1
    assert not report.lost


def test_an_acknowledged_record_a_consumer_skipped_is_unseen():
    events = [e for e in clean_history() if not (e["kind"] == "poll" and e["consumer"] == "c" and e["value"] == "b")]
    report = check(events, complete_consumers=["c", "final"])
    only(report, "unseen")
    assert report.unseen == {"c": ["b"], "final": []}


def test_a_consumer_going_back_is_non_monotonic_unless_it_seeked():
    events = clean_history() + [poll("c", "a", 0, 0)]  # c polls offset 0 again after offset 1
    report = check(events)
    only(report, "non_monotonic")
    assert report.non_monotonic == [{"consumer": "c", "topic": "", "partition": 0, "previous": 1, "offset": 0}]
    seeked = clean_history() + [{"kind": "seek", "consumer": "c", "partition": 0, "offset": 0}, poll("c", "a", 0, 0)]
    assert check(seeked).ok
    repeated = clean_history() + [poll("c", "c", 0, 1)]  # the same offset twice is no progress either
    assert check(repeated).violations()["non_monotonic"] == 1


def test_a_value_nobody_sent_is_a_phantom():
    events = clean_history() + [poll("final", "zz", 1, 1)]
    report = check(events)
    only(report, "phantoms")
    assert report.phantoms == ["zz"]


def test_failed_sends_found_in_the_log_are_indeterminate_not_violations():
    events = clean_history() + [send("d"), {"kind": "fail", "value": "d", "error": "RequestTimedOutError"},
                                poll("final", "d", 1, 1), send("e"), {"kind": "fail", "value": "e", "error": "x"}]
    report = check(events)
    assert report.ok
    assert report.failed == 2
    assert report.failed_but_written == ["d"]


def test_group_processing_counts_each_acknowledged_record():
    events = clean_history()
    for member, value, partition, offset in [("m1", "a", 0, 0), ("m1", "c", 0, 1), ("m2", "c", 0, 1)]:
        events.append({"kind": "process", "group": "g", "member": member, "value": value, "partition": partition, "offset": offset})
    report = check(events)
    assert report.ok  # at-least-once processing: a second processing is reported, not a violation
    assert report.processing["g"]["records_by_times_processed"] == {"0": 1, "1": 1, "2": 1}
    assert report.processing["g"]["never_processed"] == ["b"]
    assert report.processing["g"]["processed_more_than_once"] == ["c"]


def test_topics_keep_their_offsets_apart():
    events = [send("a"), send("b"), {**ack("a", 0, 0), "topic": "t1"}, {**ack("b", 0, 0), "topic": "t2"},
              {**poll("final", "a", 0, 0), "topic": "t1"}, {**poll("final", "b", 0, 0), "topic": "t2"}]
    assert check(events).ok


def test_unknown_event_kinds_are_refused():
    with pytest.raises(ValueError, match="unknown event kind"):
        check([{"kind": "sned", "value": "a"}])


def test_the_history_file_round_trips_and_survives_a_torn_line(tmp_path):
    path = str(tmp_path / "history.jsonl")
    history = History(path)
    history.record("send", value="a")
    history.record("ack", value="a", partition=0, offset=0)
    history.close()
    with open(path, "a") as file:
        file.write('{"kind": "poll", "consu')  # a writer that died mid-line
    events = load(path)
    assert [e["kind"] for e in events] == ["send", "ack"]
    assert events == history.events
    assert json.loads(open(path).readline())["value"] == "a"


def _log_with(directory, values, epoch=1):
    log = PartitionLog(directory)
    for chunk in values:
        log.append(encode_batch(chunk), leader_epoch=epoch)
    log.close()


def test_replica_files_are_read_without_being_written(tmp_path):
    directory = str(tmp_path / "t-0")
    _log_with(directory, [[b"a", b"b"], [b"c"]])
    before = {name: os.path.getmtime(os.path.join(directory, name)) for name in os.listdir(directory)}
    assert replica_records(directory) == [(0, b"a"), (1, b"b"), (2, b"c")]
    assert replica_records(directory, max_offset=2) == [(0, b"a"), (1, b"b")]
    after = {name: os.path.getmtime(os.path.join(directory, name)) for name in os.listdir(directory)}
    assert after == before


def test_replicas_compared_below_the_high_watermark(tmp_path):
    for replica, chunks in {1: [[b"a", b"b"], [b"c"]], 2: [[b"a", b"b"], [b"x"]], 3: [[b"a"]]}.items():
        _log_with(str(tmp_path / f"r{replica}"), chunks)
    logs = {replica: replica_records(str(tmp_path / f"r{replica}")) for replica in (1, 2, 3)}
    compared = compare_replicas(logs, bound=3)
    assert compared["disagree"] == {2: {b"c": [1], b"x": [2]}}
    assert compared["missing"] == {3: [1, 2]}
    assert compare_replicas(logs)["bound"] == 1  # the common prefix: replica 3 ends at offset 1
    assert compare_replicas(logs)["disagree"] == {}
    events = [send("a"), send("b"), send("c"), send("x")]
    for replica, records in logs.items():
        events += replica_events("t", 0, replica, records)
    assert check(events).two_values_at_offset == {("t", 0, 2): {"c": ["replica:1"], "x": ["replica:2"]}}


def test_ack_stalls_are_the_longest_waits_of_records_sent_during_each_kind_of_fault():
    from tests.cluster.fault_run import ack_stalls

    events = [{"kind": "send", "value": v, "t": t} for v, t in (("a", 1.0), ("b", 5.0), ("c", 6.0), ("d", 20.0))]
    events += [{"kind": "ack", "value": v, "t": t, "partition": p} for v, t, p in (("a", 1.1, 0), ("b", 9.5, 2), ("c", 6.2, 1), ("d", 20.1, 0))]
    faults = [{"kind": "cut", "targets": ("n1",), "began_s": 4.0, "began_t": 4.0, "ended_t": 8.0},
              {"kind": "pause", "targets": ("head",), "began_s": 19.0, "began_t": 19.0, "ended_t": 21.0},
              {"kind": "cut", "targets": ("n2",), "began_s": 30.0, "began_t": 30.0, "ended_t": 32.0}]
    assert ack_stalls(events, faults) == {
        "cut": {"worst_ack_s": 4.5, "partition": 2, "targets": ("n1",), "began_s": 4.0, "records_sent": 2},
        "pause": {"worst_ack_s": 0.1, "partition": 0, "targets": ("head",), "began_s": 19.0, "records_sent": 1},
    }


def test_ack_stalls_split_by_the_role_the_faults_targets_had_in_each_partition_as_it_began():
    from tests.cluster.fault_run import ack_stalls

    hosts = {0: "n1", 1: "n2", 2: "n3"}
    events = [{"kind": "send", "value": v, "t": t} for v, t in (("a", 5.0), ("b", 5.5), ("c", 6.0), ("d", 20.0), ("e", 41.0))]
    events += [{"kind": "ack", "value": v, "t": t, "partition": p}
               for v, t, p in (("a", 5.4, 0), ("b", 9.5, 1), ("c", 6.2, 2), ("d", 23.0, 1), ("e", 41.5, 0))]
    # Asked just before the first cut (answered before it began); before the second, answered too late.
    events += [{"kind": "leaders", "t": 3.9, "asked": 3.0, "leaders": {"0": 0, "1": 1, "2": None}},
               {"kind": "leaders", "t": 40.5, "asked": 39.0, "leaders": {"0": 1, "1": 1, "2": 1}}]
    faults = [{"kind": "cut", "targets": ("n2",), "began_s": 4.0, "began_t": 4.0, "ended_t": 8.0},
              {"kind": "pause", "targets": ("head",), "began_s": 19.0, "began_t": 19.0, "ended_t": 21.0},
              {"kind": "cut", "targets": ("n1",), "began_s": 40.0, "began_t": 40.0, "ended_t": 42.0}]
    stalls = ack_stalls(events, faults, hosts)
    assert stalls["cut"]["worst_ack_s"] == 4.0 and stalls["cut"]["partition"] == 1
    # n2 led partition 1 (4.0 s) and followed 0 and 2 (0.4 s at most); the second cut's note came after it began.
    assert {role: figure["worst_ack_s"] for role, figure in stalls["cut"]["by_role"].items()} == {
        "leader": 4.0, "follower": 0.4, "unknown": 0.5}
    assert stalls["pause"]["by_role"] == {"none": {"worst_ack_s": 3.0, "partition": 1, "targets": ("head",), "began_s": 19.0}}
