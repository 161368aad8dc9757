"""The ``logbus`` command line: real Ray, real files, no mocks of logbus components.

Most tests call ``logbus.cli.main`` in-process against the test session's Ray
and the ``bus`` fixture's controller (same namespace and data dir); one test
runs the console entry in subprocesses with an embedded Ray of its own.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import logbus.cli
from logbus.cli import DESCRIBE_HEADERS, main
from logbus.errors import CliError, LogbusError
from tests.api.cli_helpers import cli, table_rows  # noqa: F401 (cli is a fixture)
from tests.api.murmur2_reference import kafka_partition

REPO_ROOT = Path(__file__).resolve().parents[2]


# --- no Ray needed --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["topics"],
        ["topics", "create"],
        ["topics", "list"],
        ["topics", "describe"],
        ["topics", "delete"],
        ["topics", "alter"],
        ["produce"],
        ["consume"],
        ["status"],
        ["gateway"],
        ["join"],
    ],
)
def test_every_command_has_help(argv, capsys):
    assert main([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: logbus")
    assert len(out.splitlines()) > 5


def test_usage_errors_exit_2_without_connecting(capsys):
    for argv in (
        ["bogus"],
        ["topics"],
        ["topics", "create"],  # --topic missing
        ["topics", "create", "--topic", "t", "--config", "no-value"],
        ["topics", "create", "--topic", "t", "--partitions", "0"],
        ["topics", "alter", "--topic", "t"],  # nothing to alter
        ["produce"],  # no topic
        ["produce", "a", "--topic", "b"],
        ["produce", "a", "--acks", "2"],
        ["produce", "a", "--key-separator", ""],
        ["consume", "t", "--offset", "3"],  # --offset needs --partition
        ["consume", "t", "--partition", "0", "--offset", "-1"],
        ["consume", "t", "--partition", "0", "--offset", "soon"],
        ["consume", "t", "--partition", "0", "--offset", "1", "--from-beginning"],
        ["consume", "t", "--format", "xml"],
        ["consume", "t", "--max-messages", "0"],
        ["gateway", "--port", "70000"],
        ["gateway", "--port", "kafka"],
        ["gateway", "--max-request-bytes", "0"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "usage: logbus" in err and "error:" in err, argv


def test_join_checks_its_arguments_and_token_before_starting_ray(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for argv in (
        ["join"],  # no address
        ["join", "--address", "auto"],  # a host joins a head by its address
        ["join", "--address", "10.0.0.1:6379", "--rack", "rack 1"],
        ["join", "--address", "10.0.0.1:6379", "--rack", "-r1"],
        ["join", "--address", "10.0.0.1:6379", "--replica-slots", "-1"],
    ):
        assert main(argv) == 2, argv
        assert "usage: logbus join" in capsys.readouterr().err, argv
    assert main(["join", "--address", "10.0.0.1:6379", "--token-file", str(tmp_path / "missing")]) == 1
    assert "error: cannot read the token file" in capsys.readouterr().err
    (tmp_path / "empty").write_text("")
    assert main(["join", "--address", "10.0.0.1:6379", "--token-file", str(tmp_path / "empty")]) == 1
    assert "is empty" in capsys.readouterr().err
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token there
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    assert main(["join", "--address", "10.0.0.1:6379"]) == 1
    assert "the cluster's token is needed" in capsys.readouterr().err


def test_join_runs_ray_start_with_the_slots_and_the_rack():
    args = logbus.cli.build_parser().parse_args(
        ["join", "--address", "10.0.0.1:6379", "--replica-slots", "16", "--rack", "r1", "--node-ip-address", "10.0.0.2",
         "--num-cpus", "0"])
    assert logbus.cli.ray_start_argv(args, "ray") == [
        "ray", "start", "--address", "10.0.0.1:6379", "--resources", '{"logbus_replica": 16}', "--disable-usage-stats",
        "--labels", "logbus.rack=r1", "--node-ip-address", "10.0.0.2", "--num-cpus", "0"]
    assert logbus.cli.ray_start_argv(args, "ray", "node-0123456789abcdef")[7:9] == [
        "--labels", "logbus.node=node-0123456789abcdef,logbus.rack=r1"]
    args = logbus.cli.build_parser().parse_args(["join", "--address", "h:1", "--replica-slots", "0", "--block"])
    assert logbus.cli.ray_start_argv(args, "ray") == ["ray", "start", "--address", "h:1", "--resources", "{}",
                                                      "--disable-usage-stats", "--block"]


def test_the_cli_error_is_part_of_the_error_tree():
    # main() reports every LogbusError as "error: <message>" with exit code 1; CliError is one.
    assert logbus.cli.CliError is CliError
    assert issubclass(CliError, LogbusError) and not CliError.retriable


# --- against the bus fixture's cluster ---------------------------------------------------------------


def test_topic_create_list_describe_alter_delete(cli, bus, topic_name):
    created = cli("topics", "create", "--topic", topic_name, "--partitions", "2", "--replication-factor", "1", "--config", "retention.ms=60000")
    assert (created.code, created.out) == (0, f"Created topic {topic_name}.\n")

    again = cli("topics", "create", "--topic", topic_name)
    assert again.code == 1
    assert again.err == f"error: topic {topic_name!r} already exists\n"
    assert cli("topics", "create", "--topic", topic_name, "--if-not-exists").code == 0

    listed = cli("topics", "list")
    assert (listed.code, listed.out) == (0, f"{topic_name}\n")

    described = cli("topics", "describe", "--topic", topic_name)
    assert described.code == 0
    lines = described.lines
    assert lines[0] == f"Topic: {topic_name}\tPartitionCount: 2\tReplicationFactor: 1\tConfigs: retention.ms=60000"
    assert lines[1].split() == DESCRIBE_HEADERS
    rows = [line.split() for line in lines[2:]]
    assert [row[:2] for row in rows] == [[topic_name, "0"], [topic_name, "1"]]
    for row in rows:
        assert row[2] in ("0", "none")  # the leader's replica id (none only mid-election)
        assert row[3] == "0"  # replicas
        assert row[6:] == ["0", "0"]  # log start offset, high watermark of an empty topic
    assert cli("topics", "describe").out == described.out  # all topics: the only one

    altered = cli("topics", "alter", "--topic", topic_name, "--config", "retention.ms=120000")
    assert (altered.code, altered.out) == (0, f"Updated config of topic {topic_name}: retention.ms=120000\n")
    altered = cli("topics", "alter", "--topic", topic_name, "--add-config", "segment.bytes=1048576,flush.policy=batch")
    assert altered.code == 0
    assert altered.out == f"Updated config of topic {topic_name}: flush.policy=batch,retention.ms=120000,segment.bytes=1048576\n"
    assert bus.admin.describe_topic(topic_name).config == {"retention.ms": 120000, "segment.bytes": 1048576, "flush.policy": "batch"}
    bad = cli("topics", "alter", "--topic", topic_name, "--config", "no.such.key=1")
    assert bad.code == 1 and bad.err.startswith("error: unknown topic config 'no.such.key'")

    grown = cli("topics", "alter", "--topic", topic_name, "--partitions", "3")
    assert (grown.code, grown.out) == (0, f"Topic {topic_name} now has 3 partitions.\n")
    assert cli("topics", "describe", "--topic", topic_name).lines[0].startswith(f"Topic: {topic_name}\tPartitionCount: 3\t")

    deleted = cli("topics", "delete", "--topic", topic_name)
    assert (deleted.code, deleted.out) == (0, f"Deleted topic {topic_name}.\n")
    assert cli("topics", "list").out == ""
    assert cli("topics", "describe").out == ""
    gone = cli("topics", "describe", "--topic", topic_name)
    assert (gone.code, gone.err) == (1, f"error: topic {topic_name!r} does not exist\n")
    assert cli("topics", "delete", "--topic", topic_name).code == 1
    assert cli("topics", "delete", "--topic", topic_name, "--if-exists").code == 0


def test_produce_keyed_lines_then_consume_in_every_format(cli, bus, topic_name, tmp_path, monkeypatch, capsys):
    assert cli("topics", "create", "--topic", topic_name, "--partitions", "1").code == 0
    before_ms = time.time_ns() // 1_000_000

    produced = cli("produce", topic_name, "--key-separator", ":", stdin="user-1:hello\nuser-2:wörld:with:colons\n:no key\n")
    assert produced.code == 0
    assert produced.out == ""
    assert produced.err.startswith(f"produced 3 records to {topic_name} in ")

    path = tmp_path / "input.txt"
    path.write_bytes(b"k4|\xff\xfebad utf8\r\nk5|\n")
    produced = cli("produce", "--topic", topic_name, "--file", str(path), "--key-separator", "|", "--header", "source=file", "--acks", "1", "--compression", "zstd")
    assert produced.code == 0, produced.err
    assert produced.err.startswith(f"produced 2 records to {topic_name} in ")
    after_ms = time.time_ns() // 1_000_000

    no_separator = cli("produce", topic_name, "--key-separator", ":", stdin="no separator here\n")
    assert no_separator.code == 1
    assert no_separator.err == "error: no key separator ':' found on line 1 (the 0 records before it were produced)\n"
    missing = cli("produce", topic_name, "--file", str(tmp_path / "missing.txt"))
    assert missing.code == 1 and missing.err.startswith("error: ") and "missing.txt" in missing.err

    value = cli("consume", topic_name, "--from-beginning", "--max-messages", "5")
    assert value.code == 0
    assert value.lines == ["hello", "wörld:with:colons", "no key", "\ufffd\ufffdbad utf8", ""]
    assert value.err == "Processed a total of 5 messages\n"

    kv = cli("consume", topic_name, "--from-beginning", "--max-messages", "5", "--format", "kv")
    assert kv.lines == ["user-1\thello", "user-2\twörld:with:colons", "\tno key", "k4\t\ufffd\ufffdbad utf8", "k5\t"]

    as_json = cli("consume", topic_name, "--from-beginning", "--max-messages", "5", "--format", "json")
    records = [json.loads(line) for line in as_json.lines]
    for record in records:
        assert before_ms - 1000 <= record.pop("timestamp") <= after_ms + 1000
    no_headers = dict(topic=topic_name, partition=0, headers=None)
    from_file = dict(topic=topic_name, partition=0, headers=[["source", "file"]])
    assert records == [
        dict(no_headers, offset=0, key="user-1", value="hello"),
        dict(no_headers, offset=1, key="user-2", value="wörld:with:colons"),
        dict(no_headers, offset=2, key="", value="no key"),
        dict(from_file, offset=3, key="k4", value="\ufffd\ufffdbad utf8"),
        dict(from_file, offset=4, key="k5", value=""),
    ]

    offsets = cli("consume", topic_name, "--partition", "0", "--offset", "1", "--max-messages", "2", "--print-offsets")
    assert offsets.lines == ["Partition:0\tOffset:1\twörld:with:colons", "Partition:0\tOffset:2\tno key"]
    offsets = cli("consume", topic_name, "--partition", "0", "--offset", "3", "--max-messages", "1", "--print-offsets", "--format", "kv")
    assert offsets.lines == ["Partition:0\tOffset:3\tk4\t\ufffd\ufffdbad utf8"]

    # A reader that went away (``| head``): the command ends quietly.
    class ClosedPipe(io.TextIOBase):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    with monkeypatch.context() as patch:
        patch.setattr(sys, "stdout", ClosedPipe())
        code = main(["--namespace", bus.namespace, "--data-dir", bus.data_dir, "consume", topic_name, "--from-beginning"])
    assert code == 0
    assert capsys.readouterr().err == ""

    # A long input: progress lines on stderr, then the summary; every line arrives.
    count = 100_001
    long_input = "".join(f"line-{i}\n" for i in range(count))
    produced = cli("produce", topic_name, stdin=long_input)
    assert produced.code == 0
    progress, summary = produced.err.splitlines()
    assert progress.startswith("produced 100000 records (") and progress.endswith(" records/s)")
    assert summary.startswith(f"produced {count} records to {topic_name} in ")
    tail = cli("consume", topic_name, "--partition", "0", "--offset", str(5 + count - 2), "--max-messages", "2")
    assert tail.lines == [f"line-{count - 2}", f"line-{count - 1}"]
    rows = table_rows(cli("topics", "describe", "--topic", topic_name).lines, "Topic")
    assert rows[0][-1] == str(5 + count)  # high watermark


@pytest.mark.own_bus  # it counts its node's replicas: the shared cluster's node holds the offsets topic's too
def test_partition_and_offset_selection_and_status(cli, bus, topic_name):
    assert cli("topics", "create", "--topic", topic_name, "--partitions", "2").code == 0
    assert cli("produce", topic_name, "--partition", "1", stdin="a\nb\nc\n").code == 0
    keys = [f"key-{i}" for i in range(20)]
    assert cli("produce", topic_name, "--parse-key", stdin="".join(f"{k}\tv-{k}\n" for k in keys)).code == 0
    expected = {p: [k for k in keys if kafka_partition(k.encode(), 2) == p] for p in (0, 1)}
    assert expected[0] and expected[1]  # the keys spread over both partitions

    picked = cli("consume", topic_name, "--partition", "1", "--offset", "1", "--max-messages", "2")
    assert (picked.code, picked.lines) == (0, ["b", "c"])
    earliest = cli("consume", topic_name, "--partition", "1", "--offset", "earliest", "--max-messages", "3")
    assert earliest.lines == ["a", "b", "c"]

    # Every record of partition 0, then exit once nothing new came for --timeout-ms.
    only_zero = cli("consume", topic_name, "--partition", "0", "--from-beginning", "--timeout-ms", "1000", "--format", "kv")
    assert only_zero.code == 0
    assert only_zero.lines == [f"{k}\tv-{k}" for k in expected[0]]
    assert only_zero.err == f"Processed a total of {len(expected[0])} messages\n"

    everything = cli("consume", topic_name, "--from-beginning", "--max-messages", "23", "--format", "json")
    records = [json.loads(line) for line in everything.lines]
    by_partition = {p: [(r["offset"], r["key"], r["value"]) for r in records if r["partition"] == p] for p in (0, 1)}
    assert by_partition[0] == [(i, k, f"v-{k}") for i, k in enumerate(expected[0])]
    assert by_partition[1] == [(0, None, "a"), (1, None, "b"), (2, None, "c")] + [(3 + i, k, f"v-{k}") for i, k in enumerate(expected[1])]

    # From the end (the default) and from 'latest': nothing new arrives, so nothing is printed.
    for argv in (["--timeout-ms", "300"], ["--partition", "1", "--offset", "latest", "--timeout-ms", "300"]):
        quiet = cli("consume", topic_name, *argv)
        assert (quiet.code, quiet.out, quiet.err) == (0, "", "Processed a total of 0 messages\n")

    out_of_range = cli("consume", topic_name, "--partition", "1", "--offset", "99")
    assert out_of_range.code == 1
    assert out_of_range.err == f"error: offset 99 is out of range for {topic_name}-1 (log start 0, high watermark {3 + len(expected[1])})\n"
    no_partition = cli("consume", topic_name, "--partition", "5", "--max-messages", "1")
    assert (no_partition.code, no_partition.err) == (1, f"error: topic {topic_name!r} has partitions 0..1, not 5\n")
    produce_to_none = cli("produce", topic_name, "--partition", "7", stdin="x\n")
    assert (produce_to_none.code, produce_to_none.err) == (1, f"error: topic {topic_name!r} has partitions 0..1, not 7\n")

    status = cli("status")
    assert status.code == 0
    lines = status.lines
    assert lines[0] == f"logbus: namespace {bus.namespace}, data dir {bus.data_dir}"
    records = len(expected[0]) + 3 + len(expected[1])
    (node,) = table_rows(lines, "NodeID")
    assert node[1:4] == ["yes", "2", "2"]  # alive, 2 replicas, 2 leaders
    assert int(node[5]) > 0 and float(node[6]) > 0  # bytes of log, MiB per replica process
    assert "Topics: 1" in lines
    assert table_rows(lines, "Topic")[0][:4] == [topic_name, "2", "1", str(records)]
    assert "Under-replicated partitions: none" in lines and "Offline partitions: none" in lines
    as_json = json.loads(cli("status", "--json").out)
    assert [(t["topic"], t["records"]) for t in as_json["topics"]] == [(topic_name, records)]
    assert [(n["replicas"], n["leaders"]) for n in as_json["nodes"]] == [(2, 2)]
    assert as_json["under_replicated_partitions"] == [] and as_json["offline_partitions"] == []


def test_errors_exit_1_with_a_message_and_create_nothing(cli, bus, tmp_path):
    for argv, stdin in (
        (["topics", "create", "--topic", "../x"], None),
        (["topics", "create", "--topic", "a/b", "--partitions", "2"], None),
        (["topics", "describe", "--topic", "../x"], None),
        (["topics", "alter", "--topic", "..", "--config", "retention.ms=1"], None),
        (["topics", "delete", "--topic", "../x"], None),
        (["produce", "../x"], "hello\n"),
        (["consume", "../x", "--max-messages", "1"], None),
    ):
        result = cli(*argv, stdin=stdin)
        assert result.code == 1, argv
        assert result.err.startswith("error: topic name "), (argv, result.err)
        assert result.out == ""

    for argv in (
        ["topics", "describe", "--topic", "nope"],
        ["topics", "alter", "--topic", "nope", "--config", "retention.ms=1"],
        ["topics", "delete", "--topic", "nope"],
        ["consume", "nope", "--max-messages", "1"],
    ):
        result = cli(*argv)
        assert (result.code, result.err) == (1, "error: topic 'nope' does not exist\n"), argv
    assert cli("produce", "nope", stdin="x\n").err == "error: topic 'nope' does not exist\n"

    too_many = cli("topics", "create", "--topic", "wide", "--replication-factor", "50")
    assert too_many.code == 1
    assert too_many.err.startswith("error: replication factor 50 exceeds the ")
    bad_config = cli("topics", "create", "--topic", "conf", "--config", "retention.ms=soon")
    assert (bad_config.code, bad_config.err) == (1, "error: retention.ms must be an integer, not 'soon'\n")

    assert bus.admin.list_topics() == []
    assert cli("topics", "list").out == ""
    names = {name for _, dirs, files in os.walk(tmp_path) for name in dirs + files}
    assert not any(n == "x" or n.startswith(("x-", "b-", "wide-", "conf-")) for n in names), sorted(names)


# --- the console entry in its own processes -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_console_entry_starts_embedded_ray_and_finds_its_topics_again(tmp_path):
    """Two processes, each with its own embedded Ray: the second lists what the first created."""
    data_dir = tmp_path / "cli-data"
    command = [sys.executable, "-m", "logbus.cli", "--data-dir", str(data_dir), "--namespace", f"cli-{uuid.uuid4().hex[:8]}"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([*command, *argv], capture_output=True, text=True, timeout=110, env=env, cwd=REPO_ROOT)

    created = run("topics", "create", "--topic", "persisted", "--partitions", "2")
    assert (created.returncode, created.stdout) == (0, "Created topic persisted.\n"), created.stderr
    assert (data_dir / "controller" / "metadata.json").is_file()

    listed = run("topics", "list")
    assert (listed.returncode, listed.stdout) == (0, "persisted\n"), listed.stderr
    assert "Traceback" not in created.stderr + listed.stderr
