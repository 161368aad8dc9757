"""A bare Kafka-protocol client for the gateway benchmark: what the gateway itself sustains.

A Kafka client library builds and reads one object per record; this one does
neither, so its own cost per record is near zero and the figure it gives is the
gateway's (and the replica's behind it). Requests and responses are kio's
message types; record batches are built once (produce) or only walked by their
61-byte headers (fetch), never decoded record by record. Benchmark use only:
one partition, no retries, every error is fatal.
"""

from __future__ import annotations

import io
import socket
import struct
import time

from kio.index import load_request_schema, load_response_schema
from kio.serial import entity_reader, entity_writer

from logbus.protocol import kafka_gateway as kg
from logbus.protocol import kafka_records as kr

PRODUCE_VERSION = 9
FETCH_VERSION = 12
IN_FLIGHT = 5  # produce requests on the wire at once (librdkafka's max.in.flight default)
_SIZE = struct.Struct(">i")


def _frame(api_key: int, version: int, values: dict, correlation_id: int) -> bytes:
    cls = load_request_schema(api_key, version)
    out = io.BytesIO()
    header = cls.__header_schema__(request_api_key=api_key, request_api_version=version, correlation_id=correlation_id,
                                   client_id="bench-wire")
    entity_writer(cls.__header_schema__)(out, header)
    entity_writer(cls)(out, kg.build(cls, values))
    body = out.getvalue()
    return _SIZE.pack(len(body)) + body


def _response(api_key: int, version: int, frame: bytes):
    cls = load_response_schema(api_key, version)
    _, used = entity_reader(cls.__header_schema__)(frame, 0)
    body, _ = entity_reader(cls)(frame, used)
    return body


class _Connection:
    def __init__(self, bootstrap: str) -> None:
        host, port = bootstrap.split(",", 1)[0].rsplit(":", 1)
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb", buffering=1 << 20)

    def read_frame(self) -> bytes:
        head = self.reader.read(4)
        if len(head) < 4:
            raise ConnectionError("the gateway closed the connection")
        (size,) = _SIZE.unpack(head)
        frame = self.reader.read(size)
        if len(frame) < size:
            raise ConnectionError("the gateway closed the connection mid-frame")
        return frame

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def produce(bootstrap: str, topic: str, batch: bytes, records_per_batch: int, n: int, time_cap_s: float) -> float:
    """Records/s sending ``batch`` (one Kafka batch) in Produce requests, ``IN_FLIGHT`` at once, acks=1, until ``n`` records."""
    values = {"transactional_id": None, "acks": 1, "timeout": 30_000, "topic_data": [
        {"name": topic, "partition_data": [{"index": 0, "records": batch}]}]}
    template = _frame(kg.PRODUCE, PRODUCE_VERSION, values, 0)
    connection = _Connection(bootstrap)
    try:
        requests = (n + records_per_batch - 1) // records_per_batch
        sent = answered = 0
        start = time.perf_counter()
        deadline = start + time_cap_s
        while answered < requests:
            while sent < requests and sent - answered < IN_FLIGHT:
                # The correlation id sits after the size, api key and version: bytes 8-12.
                connection.sock.sendall(template[:8] + _SIZE.pack(sent) + template[12:])
                sent += 1
            response = _response(kg.PRODUCE, PRODUCE_VERSION, connection.read_frame())
            (part,) = response.responses[0].partition_responses
            if part.error_code != kg.ErrorCode.none:
                raise RuntimeError(f"wire produce: error {part.error_code!r}")
            answered += 1
            if time.perf_counter() > deadline:
                raise RuntimeError(f"wire produce: {answered} of {requests} requests answered in {time_cap_s:.0f}s")
        seconds = time.perf_counter() - start
    finally:
        connection.close()
    return answered * records_per_batch / seconds


def consume(bootstrap: str, topic: str, n: int, time_cap_s: float, max_bytes: int = 4 << 20) -> float:
    """Records/s fetching partition 0 of ``topic`` from offset 0 until ``n`` records, counting them from batch headers."""
    connection = _Connection(bootstrap)
    try:
        offset = total = correlation = 0
        start = time.perf_counter()
        deadline = start + time_cap_s
        while total < n:
            values = {"replica_id": -1, "max_wait": 500, "min_bytes": 1, "max_bytes": max_bytes, "isolation_level": 0,
                      "session_id": 0, "session_epoch": -1, "forgotten_topics_data": [], "rack_id": "", "topics": [
                          {"topic": topic, "partitions": [{"partition": 0, "current_leader_epoch": -1, "fetch_offset": offset,
                                                           "last_fetched_epoch": -1, "log_start_offset": -1,
                                                           "partition_max_bytes": max_bytes}]}]}
            correlation += 1
            connection.sock.sendall(_frame(kg.FETCH, FETCH_VERSION, values, correlation))
            response = _response(kg.FETCH, FETCH_VERSION, connection.read_frame())
            (part,) = response.responses[0].partitions
            if part.error_code != kg.ErrorCode.none:
                raise RuntimeError(f"wire consume: error {part.error_code!r} at offset {offset}")
            for _, header in kr.iter_batches(part.records or b""):
                if header.base_offset + header.last_offset_delta < offset:
                    continue
                total += header.record_count
                offset = header.base_offset + header.last_offset_delta + 1
            if time.perf_counter() > deadline:
                raise RuntimeError(f"wire consume: {total} of {n} records in {time_cap_s:.0f}s")
        seconds = time.perf_counter() - start
    finally:
        connection.close()
    return total / seconds
