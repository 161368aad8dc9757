"""``logbus produce``: each line of stdin or a file becomes one record (like kafka-console-producer)."""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time

from logbus.cli._common import check_topic, connected, err, int_flag, topic_argument
from logbus.errors import CliError, InvalidPartitionError, LogbusError
from logbus.options import INT32_MAX
from logbus.storage.names import validate_topic_name

PRODUCE_CHUNK_LINES = 10_000  # lines per send_table() call
PRODUCE_CHUNK_BYTES = 4 << 20  # ... or this many bytes, whichever comes first
PROGRESS_EVERY = 100_000  # records between progress lines on stderr


def _header_item(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    return key, value


def _acks(text: str):
    if text in ("all", "-1"):
        return "all"
    if text in ("0", "1"):
        return int(text)
    raise argparse.ArgumentTypeError(f"acks must be 0, 1, all or -1, not {text!r}")


def _lines(stream):
    """Lines of ``stream`` as bytes without their line terminator (\\n or \\r\\n)."""
    binary = getattr(stream, "buffer", None)
    for line in binary if binary is not None else stream:
        if isinstance(line, str):
            line = line.encode("utf-8", errors="surrogateescape")
        if line.endswith(b"\n"):
            line = line[:-1]
            if line.endswith(b"\r"):
                line = line[:-1]
        yield line


def cmd_produce(args) -> int:
    """Send each input line as one record (see ``logbus produce --help``)."""
    import pyarrow as pa

    import logbus
    from logbus.storage.record_batch import HEADERS_TYPE

    topic = validate_topic_name(args.topic)
    separator = None
    if args.key_separator is not None or args.parse_key:
        separator = (args.key_separator if args.key_separator is not None else "\t").encode()
    headers = list(args.header or []) or None
    encoded_headers = None if headers is None else [(k, v.encode()) for k, v in headers]
    source = open(args.file, "rb") if args.file is not None else sys.stdin  # fail before starting Ray
    try:
        with connected(args) as bus:
            producer = logbus.Producer(bus, acks=args.acks, compression=args.compression)
            try:
                partition_count = len(producer.partitions_for(topic))
                if args.partition is not None and args.partition >= partition_count:
                    raise InvalidPartitionError(f"topic {topic!r} has partitions 0..{partition_count - 1}, not {args.partition}")
                interactive = args.file is None and _isatty(source)
                started = time.monotonic()
                futures = []
                count = 0
                next_report = PROGRESS_EVERY

                def split(line_number: int, line: bytes):
                    if separator is None:
                        return None, line
                    key, sep, value = line.partition(separator)
                    if not sep:
                        raise CliError(
                            f"no key separator {separator.decode()!r} found on line {line_number} "
                            f"(the {count} records before it were produced)"
                        )
                    return key, value

                if interactive:
                    # One record per line, delivered before the next line is read.
                    for number, line in enumerate(_lines(source), 1):
                        key, value = split(number, line)
                        producer.send(topic, value, key=key, headers=encoded_headers, partition=args.partition).result()
                        count += 1
                else:
                    keyless_partition = random.randrange(partition_count)
                    values, keys, size = [], [], 0

                    def send_chunk():
                        nonlocal keyless_partition, values, keys, size
                        if not values:
                            return
                        columns = {"value": pa.array(values, pa.binary())}
                        if separator is not None:
                            columns["key"] = pa.array(keys, pa.binary())
                        if args.partition is not None:
                            columns["partition"] = pa.array([args.partition] * len(values), pa.int32())
                        elif separator is None:
                            # Keyless lines go to one partition per chunk, moving on each chunk (sticky, like Kafka).
                            columns["partition"] = pa.array([keyless_partition] * len(values), pa.int32())
                            keyless_partition = (keyless_partition + 1) % partition_count
                        if encoded_headers is not None:
                            columns["headers"] = pa.array([encoded_headers] * len(values), HEADERS_TYPE)
                        futures.append(producer.send_table(topic, pa.table(columns)))
                        values, keys, size = [], [], 0
                        for future in [f for f in futures if f.done()]:
                            future.result()  # raises the first failure early
                            futures.remove(future)

                    for number, line in enumerate(_lines(source), 1):
                        try:
                            key, value = split(number, line)
                        except CliError:
                            send_chunk()  # the lines before the bad one are sent, as Kafka's console producer does
                            producer.flush()
                            raise
                        values.append(value)
                        keys.append(key)
                        size += len(line)
                        count += 1
                        if len(values) >= PRODUCE_CHUNK_LINES or size >= PRODUCE_CHUNK_BYTES:
                            send_chunk()
                        if count >= next_report:
                            elapsed = max(time.monotonic() - started, 1e-9)
                            err(f"produced {count} records ({count / elapsed:,.0f} records/s)")
                            next_report += PROGRESS_EVERY
                    send_chunk()
                    producer.flush()
                    for future in futures:
                        future.result()
            finally:
                with contextlib.suppress(LogbusError):
                    producer.close(timeout_s=30)
            elapsed = time.monotonic() - started
            err(f"produced {count} records to {topic} in {elapsed:.2f} s")
    finally:
        if source is not sys.stdin:
            source.close()
    return 0


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _check(args) -> None:
    """Usage rules argparse cannot express; violations exit 2 through parser.error()."""
    check_topic(args)
    if args.key_separator == "":
        args.parser.error("--key-separator must not be empty")
    if args.compression == "none":
        args.compression = None


def register(commands, common: argparse.ArgumentParser) -> None:
    """Add ``produce`` to the ``logbus`` parser's ``commands``."""
    produce = commands.add_parser(
        "produce",
        parents=[common],
        help="send lines from stdin or a file as records",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Send each input line as one record (like kafka-console-producer).\n\n"
            "Lines come from stdin, or from --file. The line terminator is dropped; an empty line is an\n"
            "empty record. With --key-separator (or --parse-key, whose default separator is TAB) each\n"
            "line is split once into KEY and VALUE, and a line without the separator is an error.\n"
            "Keyed records go to murmur2(key) % partitions, as in Kafka; keyless ones stick to one\n"
            "partition per chunk of lines. Lines are sent in chunks (send_table) unless stdin is a\n"
            "terminal, where each line is delivered as it is typed. Progress goes to stderr every\n"
            f"{PROGRESS_EVERY:,} records, and a summary line at the end."
        ),
    )
    topic_argument(produce)
    produce.add_argument("--file", metavar="PATH", help="read lines from PATH instead of stdin")
    produce.add_argument("--parse-key", action="store_true", help="split each line into key and value (separator: --key-separator, default TAB)")
    produce.add_argument("--key-separator", metavar="SEP", help="split each line at the first SEP into key and value (implies --parse-key)")
    produce.add_argument("--partition", type=int_flag("--partition", 0, INT32_MAX), help="send every record to this partition")
    produce.add_argument("--header", action="append", type=_header_item, metavar="KEY=VALUE", help="a header added to every record (repeatable)")
    produce.add_argument("--acks", "--request-required-acks", dest="acks", type=_acks, default="all", help="0, 1 or all (= -1): what the leader waits for before acknowledging (default: all)")
    produce.add_argument("--compression", "--compression-codec", dest="compression", choices=("none", "lz4", "zstd"), default="none", help="batch compression (default: none)")
    produce.set_defaults(func=cmd_produce, parser=produce, check=_check)
