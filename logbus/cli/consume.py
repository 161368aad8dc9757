"""``logbus consume``: print a topic's records, one per line (like kafka-console-consumer)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from logbus.cli._common import check_topic, connected, err, int_flag, topic_argument
from logbus.errors import InvalidPartitionError, OffsetOutOfRangeError
from logbus.options import INT32_MAX, INT64_MAX, MS_MAX
from logbus.storage.names import validate_topic_name

POLL_MAX_RECORDS = 5_000
POLL_WAIT_MS = 500
FORMATS = ("value", "kv", "json")


def _offset(text: str):
    if text in ("earliest", "latest"):
        return text
    try:
        return int_flag("--offset", 0)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--offset must be 'earliest', 'latest' or an int from 0 to {INT64_MAX}, not {text!r}") from None


def _text(data: bytes | None) -> str:
    return "null" if data is None else data.decode("utf-8", errors="replace")


def _json_text(data: bytes | None) -> str | None:
    return None if data is None else data.decode("utf-8", errors="replace")


def _formatter(fmt: str, print_offsets: bool):
    if fmt == "json":

        def line(r) -> str:
            return json.dumps(
                {
                    "topic": r.topic,
                    "partition": r.partition,
                    "offset": r.offset,
                    "timestamp": r.timestamp_ms,
                    "key": _json_text(r.key),
                    "value": _json_text(r.value),
                    "headers": None if r.headers is None else [[k, _json_text(v)] for k, v in r.headers],
                },
                ensure_ascii=False,
            ) + "\n"

        return line
    prefix = (lambda r: f"Partition:{r.partition}\tOffset:{r.offset}\t") if print_offsets else (lambda r: "")
    if fmt == "kv":
        return lambda r: f"{prefix(r)}{_text(r.key)}\t{_text(r.value)}\n"
    return lambda r: f"{prefix(r)}{_text(r.value)}\n"


def cmd_consume(args) -> int:
    """Print records of a topic (see ``logbus consume --help``)."""
    import logbus
    from logbus import TopicPartition

    topic = validate_topic_name(args.topic)
    out = sys.stdout
    line = _formatter(args.format, args.print_offsets)
    count = 0
    with connected(args) as bus:
        reset = "earliest" if args.from_beginning or args.offset == "earliest" else "latest"
        consumer = logbus.Consumer(bus, auto_offset_reset=reset)
        try:
            partition_count = bus.topic_metadata(topic, refresh=True).partition_count
            if args.partition is not None:
                if args.partition >= partition_count:
                    raise InvalidPartitionError(f"topic {topic!r} has partitions 0..{partition_count - 1}, not {args.partition}")
                tps = [TopicPartition(topic, args.partition)]
            else:
                tps = [TopicPartition(topic, p) for p in range(partition_count)]
            consumer.assign(tps)
            if isinstance(args.offset, int):
                (tp,) = tps
                start = consumer.beginning_offsets(tps)[tp]
                end = consumer.end_offsets(tps)[tp]
                if not start <= args.offset <= end:
                    raise OffsetOutOfRangeError(f"offset {args.offset} is out of range for {topic}-{args.partition} (log start {start}, high watermark {end})")
                consumer.seek(tp, args.offset)
            elif args.from_beginning or args.offset == "earliest":
                consumer.seek_to_beginning()
            else:
                consumer.seek_to_end()
            idle_since = time.monotonic()
            try:
                while args.max_messages is None or count < args.max_messages:
                    wait_ms = POLL_WAIT_MS
                    if args.timeout_ms is not None:
                        wait_ms = max(0.0, min(wait_ms, args.timeout_ms - (time.monotonic() - idle_since) * 1000))
                    budget = POLL_MAX_RECORDS if args.max_messages is None else min(POLL_MAX_RECORDS, args.max_messages - count)
                    polled = consumer.poll(timeout_ms=wait_ms, max_records=budget)
                    if polled:
                        lines = [line(r) for tp in sorted(polled) for r in polled[tp]]
                        out.write("".join(lines))
                        out.flush()
                        count += len(lines)
                        idle_since = time.monotonic()
                    elif args.timeout_ms is not None and (time.monotonic() - idle_since) * 1000 >= args.timeout_ms:
                        break
            except KeyboardInterrupt:
                pass  # Ctrl-C is how a following consumer is stopped
        finally:
            consumer.close()
    err(f"Processed a total of {count} messages")
    return 0


def _check(args) -> None:
    """Usage rules argparse cannot express; violations exit 2 through parser.error()."""
    check_topic(args)
    if args.offset is not None and args.partition is None:
        args.parser.error("--offset requires --partition")
    if args.offset is not None and args.from_beginning:
        args.parser.error("--offset and --from-beginning cannot be used together")


def register(commands, common: argparse.ArgumentParser) -> None:
    """Add ``consume`` to the ``logbus`` parser's ``commands``."""
    consume = commands.add_parser(
        "consume",
        parents=[common],
        help="print records of a topic",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Print records of a topic, one per line (like kafka-console-consumer).\n\n"
            "Reads every partition (or --partition), starting at the end (new records only) unless\n"
            "--from-beginning or --offset says otherwise. Without --timeout-ms it keeps waiting for\n"
            "new records, like Kafka's console consumer, until --max-messages records were printed\n"
            "or Ctrl-C; with --timeout-ms it exits once no record arrived for that long. The count of\n"
            "records printed goes to stderr at the end.\n\n"
            "Formats: value (the value as UTF-8, undecodable bytes replaced; null for no value),\n"
            "kv (key TAB value), json (one object per line: topic, partition, offset, timestamp (ms),\n"
            "key, value, headers (a list of [name, value] pairs, or null))."
        ),
    )
    topic_argument(consume)
    consume.add_argument("--from-beginning", action="store_true", help="start at the earliest offset of every partition (default: at the end)")
    consume.add_argument("--partition", type=int_flag("--partition", 0, INT32_MAX), help="read only this partition")
    consume.add_argument("--offset", type=_offset, help="with --partition: earliest, latest or an offset to start at")
    consume.add_argument("--max-messages", type=int_flag("--max-messages"), help="exit after printing this many records")
    consume.add_argument("--timeout-ms", type=int_flag("--timeout-ms", 0, MS_MAX, unit="ms"), help="exit when no record arrived for this long (default: wait forever)")
    consume.add_argument("--format", choices=FORMATS, default="value", help="output format (default: value)")
    consume.add_argument("--print-offsets", action="store_true", help="prefix each line with Partition:P<TAB>Offset:O<TAB> (value and kv formats)")
    consume.set_defaults(func=cmd_consume, parser=consume, check=_check)
