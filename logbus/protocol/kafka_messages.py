"""Kafka's messages as the gateway reads and writes them: frames, kio entities from plain values, error replies.

Message types are the ``kio`` package's dataclasses (generated from Kafka's
own JSON message definitions, one per API key and version). This module
adds what the gateway needs around them:

- frames: :func:`peek_header`, :func:`parse_request`, :func:`encode_response`;
- :func:`build`, a kio entity of any version from plain values: fields the
  version lacks are left out, and a field the values leave out, or give as
  None where this version's field is not nullable, takes Kafka's default
  (the schema's default, else 0, "", b"", false, an empty array or a
  nested entity of defaults), so one set of values encodes in every
  version (JoinGroup's ``protocol_name`` is nullable from v7 only, say);
- :func:`error_response`: the reply of any request kio knows, with every
  error code at one code and nothing else (what an API the gateway does
  not serve is answered with);
- the few message versions kio does not have (ListOffsets v0), written in
  kio's form so kio's readers and writers serve them;
- the consumer protocol's bytes (a member's subscription and assignment),
  read as Kafka reads them: a version newer than known is read as the
  newest known, and fields past what the bytes hold take their defaults.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import io
import struct
import typing
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from kio.index import load_request_schema, load_response_schema
from kio.schema.consumer_protocol_assignment.v0 import ConsumerProtocolAssignment as AssignmentV0
from kio.schema.consumer_protocol_assignment.v1 import ConsumerProtocolAssignment as AssignmentV1
from kio.schema.consumer_protocol_subscription.v0 import ConsumerProtocolSubscription as SubscriptionV0
from kio.schema.consumer_protocol_subscription.v1 import ConsumerProtocolSubscription as SubscriptionV1
from kio.schema.consumer_protocol_subscription.v2 import ConsumerProtocolSubscription as SubscriptionV2
from kio.schema.consumer_protocol_subscription.v3 import ConsumerProtocolSubscription as SubscriptionV3
from kio.schema.errors import ErrorCode
from kio.serial import entity_reader, entity_writer
from kio.serial.errors import SerialError

from logbus import errors as e
from logbus.protocol.kafka_schemas import ListOffsetsRequestV0, ListOffsetsResponseV0
from logbus.protocol.messages import TopicPartition
from logbus.storage.names import validate_topic_name

_SIZE = struct.Struct(">i")
_KEY_AND_VERSION = struct.Struct(">hhi")
_VERSION = struct.Struct(">h")
UNKNOWN_AUTHORIZED_OPERATIONS = -(2**31)  # Kafka's "not asked for" value of authorized operations


# (api key, version) -> (request class, response class), consulted before kio.
_EXTRA_SCHEMAS: dict[tuple[int, int], tuple[type, type]] = {
    (2, 0): (ListOffsetsRequestV0, ListOffsetsResponseV0),  # see kafka_schemas.py
}


def request_class(api_key: int, api_version: int):
    """The request entity class of an API version (kio's, or one of this module's); LookupError if none."""
    extra = _EXTRA_SCHEMAS.get((api_key, api_version))
    if extra is not None:
        return extra[0]
    try:
        return load_request_schema(api_key, api_version)
    except Exception as error:  # noqa: BLE001 (kio's UnknownAPIKey / UnknownEntity)
        raise LookupError(f"no request schema for API key {api_key} version {api_version}: {error}") from None


def response_class(api_key: int, api_version: int):
    """The response entity class of an API version (kio's, or one of this module's); LookupError if none."""
    extra = _EXTRA_SCHEMAS.get((api_key, api_version))
    if extra is not None:
        return extra[1]
    try:
        return load_response_schema(api_key, api_version)
    except Exception as error:  # noqa: BLE001
        raise LookupError(f"no response schema for API key {api_key} version {api_version}: {error}") from None


def knows(api_key: int, api_version: int) -> bool:
    """Whether a request of this API version can be read and answered at all."""
    try:
        request_class(api_key, api_version)
        response_class(api_key, api_version)
    except LookupError:
        return False
    return True


# --- frames ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body: Any  # the kio request entity


@functools.cache
def _request_codec(api_key: int, api_version: int):
    cls = request_class(api_key, api_version)
    return cls, entity_reader(cls.__header_schema__), entity_reader(cls)


@functools.cache
def _response_codec(api_key: int, api_version: int):
    cls = response_class(api_key, api_version)
    return cls, entity_writer(cls.__header_schema__), cls.__header_schema__, entity_writer(cls)


def peek_header(frame: bytes) -> tuple[int, int, int]:
    """(api key, api version, correlation id) of a request frame; KafkaProtocolError if it is too short."""
    if len(frame) < _KEY_AND_VERSION.size:
        raise e.KafkaProtocolError(f"a request of {len(frame)} bytes has no header")
    return _KEY_AND_VERSION.unpack_from(frame, 0)


def read_request(frame: bytes) -> Request:
    """Read one request frame (without its size prefix) of any API version this module knows;
    KafkaProtocolError if it cannot be read."""
    frame = bytes(frame)  # kio reads read-only buffers only
    api_key, api_version, correlation_id = peek_header(frame)
    try:
        cls, read_header, read_body = _request_codec(api_key, api_version)
    except LookupError as error:
        raise e.KafkaProtocolError(str(error)) from None
    try:
        header, header_size = read_header(frame, 0)
        body, body_size = read_body(frame, header_size)
    except (SerialError, ValueError, TypeError, OverflowError, IndexError, UnicodeDecodeError) as error:
        raise e.KafkaProtocolError(f"malformed {cls.__name__} v{api_version}: {type(error).__name__}: {error}") from None
    if header_size + body_size > len(frame):
        raise e.KafkaProtocolError(f"{cls.__name__} v{api_version} runs past its frame")
    # Bytes after the request are ignored, as Kafka's brokers ignore them (librdkafka's admin client
    # sends some after a Metadata v12).
    return Request(api_key, api_version, correlation_id, header.client_id, body)


def encode_response(api_key: int, api_version: int, correlation_id: int, values: Mapping) -> bytes:
    """The response frame, size prefix included, of the given API version built from ``values``."""
    cls, write_header, header_cls, write_body = _response_codec(api_key, api_version)
    out = io.BytesIO()
    out.write(b"\0\0\0\0")
    write_header(out, header_cls(correlation_id=correlation_id))
    write_body(out, build(cls, values))
    frame = out.getbuffer()
    _SIZE.pack_into(frame, 0, len(frame) - 4)
    del frame
    return out.getvalue()


# --- kio entities from plain values ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    kafka_type: str | None
    nested: type | None  # the entity class of a nested field (or of an array's items)
    is_array: bool
    nullable: bool
    default: Any  # dataclasses.MISSING when the schema has none


def _nested_class(field_type) -> tuple[type | None, bool]:
    """(the entity class of a field, whether the field is a tuple of them)."""
    if dataclasses.is_dataclass(field_type):
        return field_type, False
    origin = typing.get_origin(field_type)
    for arg in typing.get_args(field_type):
        if dataclasses.is_dataclass(arg):
            return arg, origin is tuple
        inner, is_tuple = _nested_class(arg)
        if inner is not None:
            return inner, is_tuple or origin is tuple
    return None, False


def _is_array(field_type) -> bool:
    if typing.get_origin(field_type) is tuple:
        return True
    return any(typing.get_origin(arg) is tuple for arg in typing.get_args(field_type))


def _is_nullable(field_type) -> bool:
    """Whether the field itself (not an array's items) may be None."""
    return typing.get_origin(field_type) in (typing.Union, __import__("types").UnionType) and type(None) in typing.get_args(field_type)


@functools.cache
def _fields(cls) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        nested, is_array = _nested_class(hint)
        out.append(_Field(f.name, f.metadata.get("kafka_type"), nested, is_array or _is_array(hint), _is_nullable(hint), f.default))
    return tuple(out)


_IMPLICIT_DEFAULTS = {
    "bool": False, "bytes": b"", "records": b"", "string": "", "int8": 0, "int16": 0, "int32": 0, "int64": 0, "uint16": 0,
    "float64": 0.0, "error_code": ErrorCode.none, "timedelta_i32": datetime.timedelta(0), "timedelta_i64": datetime.timedelta(0),
    "uuid": uuid.UUID(int=0),
}


def _default(spec: _Field):
    """Kafka's default of a field: the schema's, else its type's zero value (never None)."""
    if spec.default is not dataclasses.MISSING and spec.default is not None:
        return spec.default
    if spec.is_array:
        return ()
    if spec.nested is not None:
        return build(spec.nested, {})
    if spec.kafka_type == "datetime_i64":
        return datetime.datetime.fromtimestamp(0, datetime.UTC)
    return _IMPLICIT_DEFAULTS[spec.kafka_type]


def build(cls, values: Mapping):
    """A kio entity of ``cls`` from plain values (see the module docstring).

    Nested dicts become nested entities, ms become timedeltas, codes
    ErrorCodes, hex ids UUIDs; a field missing from ``values``, or None
    where this version cannot hold None, takes its default.
    """
    kwargs = {}
    for spec in _fields(cls):
        if spec.name not in values:
            if spec.default is dataclasses.MISSING:
                kwargs[spec.name] = None if spec.nullable else _default(spec)
            continue
        value = values[spec.name]
        if value is None:
            kwargs[spec.name] = None if spec.nullable else _default(spec)
            continue
        if spec.nested is not None:
            value = tuple(build(spec.nested, v) for v in value) if spec.is_array else build(spec.nested, value)
        elif spec.kafka_type in ("timedelta_i32", "timedelta_i64"):
            value = datetime.timedelta(milliseconds=value) if not isinstance(value, datetime.timedelta) else value
        elif spec.kafka_type == "datetime_i64":
            if isinstance(value, int):
                value = None if value < 0 else datetime.datetime.fromtimestamp(value / 1000, datetime.UTC)
                if value is None and not spec.nullable:
                    value = _default(spec)
        elif spec.kafka_type == "error_code":
            value = ErrorCode(int(value))
        elif spec.kafka_type == "uuid" and isinstance(value, str):
            value = uuid.UUID(value)
        elif spec.is_array and not isinstance(value, tuple):
            value = tuple(value)
        kwargs[spec.name] = value
    return cls(**kwargs)


def error_values(cls, code: ErrorCode, message: str | None) -> dict:
    """Values of a response of ``cls`` that says ``code`` wherever it has an error code at its top level,
    with ``message`` where it has a message, and nothing else (arrays empty)."""
    values: dict = {"throttle_time": 0}
    for spec in _fields(cls):
        if spec.kafka_type == "error_code":
            values[spec.name] = code
        elif spec.name == "error_message":
            values[spec.name] = message
    return values


def error_response(api_key: int, api_version: int, correlation_id: int, code: ErrorCode, message: str | None) -> bytes:
    """The response frame of any request this module knows, carrying only ``code`` (see :func:`error_values`)."""
    return encode_response(api_key, api_version, correlation_id, error_values(response_class(api_key, api_version), code, message))


def ms(value) -> int:
    """A kio timedelta (or int) in ms."""
    return int(value.total_seconds() * 1000) if isinstance(value, datetime.timedelta) else int(value)


def get(entity, *names, default=None):
    """The first of ``names`` that this version of the entity has."""
    for name in names:
        if hasattr(entity, name):
            return getattr(entity, name)
    return default


# --- the consumer protocol (a member's subscription and assignment bytes) --------------------------
#
# Kafka's ConsumerProtocolSubscription and ConsumerProtocolAssignment: a version (int16), then the
# fields of that version. Kafka's ConsumerProtocol reads a version newer than it knows as the newest
# it knows (later versions only add fields at the end), and a reader that runs out of bytes keeps
# what it read (a client that writes a higher version over an older layout is served).

_SUBSCRIPTIONS = {0: SubscriptionV0, 1: SubscriptionV1, 2: SubscriptionV2, 3: SubscriptionV3}
_SUBSCRIPTION_LAYOUTS = (SubscriptionV3, SubscriptionV2, SubscriptionV1, SubscriptionV0)
_ASSIGNMENTS = {0: AssignmentV0, 1: AssignmentV1}


@dataclass(frozen=True, slots=True)
class Subscription:
    """What a consumer's protocol metadata says: the topics it subscribes to and the partitions it owns."""

    version: int
    topics: tuple[str, ...]
    owned: tuple[TopicPartition, ...]
    user_data: bytes | None
    generation: int = -1
    rack: str | None = None


def _read_as(cls, data: bytes):
    entity, _ = entity_reader(cls)(data, 2)
    return entity


def read_subscription(metadata: bytes) -> Subscription:
    """A ConsumerProtocolSubscription, read as Kafka reads one (see above).

    The version's own layout is tried first, then each older one (a body
    laid out as an older version than its version field says); the first
    that reads is taken. InvalidConfigError only for bytes no version reads.
    Topics that are not valid topic names are left out.
    """
    data = bytes(metadata)
    if len(data) < 2:
        raise e.InvalidConfigError(f"a consumer subscription of {len(data)} bytes (at least 2: its version)")
    (version,) = _VERSION.unpack_from(data, 0)
    if version < 0:
        raise e.InvalidConfigError(f"a consumer subscription of version {version}")
    newest = _SUBSCRIPTIONS[min(version, 3)]
    layouts = [newest] + [cls for cls in _SUBSCRIPTION_LAYOUTS if cls.__version__ < newest.__version__]
    last_error: Exception | None = None
    for cls in layouts:
        try:
            subscription = _read_as(cls, data)
        except (SerialError, ValueError, TypeError, IndexError, UnicodeDecodeError, OverflowError) as error:
            last_error = error
            continue
        topics = tuple(t for t in subscription.topics if _valid_topic(t))
        owned = tuple(TopicPartition(tp.topic, int(p)) for tp in getattr(subscription, "owned_partitions", ())
                      if _valid_topic(tp.topic) for p in tp.partitions if 0 <= int(p) < 2**31)
        return Subscription(version, topics, owned, subscription.user_data, int(getattr(subscription, "generation_id", -1)),
                            getattr(subscription, "rack_id", None))
    raise e.InvalidConfigError(f"unreadable consumer subscription (version {version}): {last_error}")


def parse_subscription(metadata: bytes) -> tuple[tuple[str, ...], tuple[TopicPartition, ...]]:
    """(topics, owned partitions) of a ConsumerProtocolSubscription (see :func:`read_subscription`)."""
    subscription = read_subscription(metadata)
    return subscription.topics, subscription.owned


def _valid_topic(name) -> bool:
    try:
        validate_topic_name(name)
    except e.LogbusError:
        return False
    return True


def encode_subscription(topics, owned=(), user_data: bytes | None = None, version: int = 0) -> bytes:
    """A ConsumerProtocolSubscription of ``topics`` (version 0, or 1 with owned partitions)."""
    cls = _SUBSCRIPTIONS[version]
    values: dict = {"topics": tuple(topics), "user_data": user_data}
    if version >= 1:
        values["owned_partitions"] = _by_topic(owned)
    out = io.BytesIO()
    out.write(_VERSION.pack(version))
    entity_writer(cls)(out, build(cls, values))
    return out.getvalue()


def _by_topic(partitions) -> list[dict]:
    by_topic: dict[str, list[int]] = {}
    for topic, partition in sorted(partitions):
        by_topic.setdefault(topic, []).append(partition)
    return [{"topic": t, "partitions": tuple(ps)} for t, ps in by_topic.items()]


def encode_assignment(partitions, user_data: bytes | None = None) -> bytes:
    """A ConsumerProtocolAssignment (version 0) of ``partitions`` (TopicPartitions)."""
    assignment = build(AssignmentV0, {"assigned_partitions": _by_topic(partitions), "user_data": user_data})
    out = io.BytesIO()
    out.write(_VERSION.pack(0))
    entity_writer(AssignmentV0)(out, assignment)
    return out.getvalue()


def parse_assignment_full(data: bytes) -> tuple[tuple[TopicPartition, ...], bytes | None]:
    """(partitions, user data) of a ConsumerProtocolAssignment of any version (later ones add fields after
    these); InvalidConfigError if it cannot be read. Empty bytes are an empty assignment."""
    data = bytes(data)
    if len(data) < 2:
        return (), None
    (version,) = _VERSION.unpack_from(data, 0)
    cls = _ASSIGNMENTS[min(max(version, 0), 1)]
    try:
        assignment = _read_as(cls, data)
    except (SerialError, ValueError, TypeError, IndexError, UnicodeDecodeError, OverflowError) as error:
        if cls is AssignmentV0:
            raise e.InvalidConfigError(f"unreadable consumer assignment (version {version}): {error}") from None
        try:
            assignment = _read_as(AssignmentV0, data)
        except (SerialError, ValueError, TypeError, IndexError, UnicodeDecodeError, OverflowError) as error:
            raise e.InvalidConfigError(f"unreadable consumer assignment (version {version}): {error}") from None
    partitions = tuple(TopicPartition(tp.topic, int(p)) for tp in assignment.assigned_partitions
                       if _valid_topic(tp.topic) for p in tp.partitions if 0 <= int(p) < 2**31)
    return partitions, assignment.user_data


def parse_assignment(data: bytes) -> tuple[TopicPartition, ...]:
    """The partitions of a ConsumerProtocolAssignment (any version)."""
    return parse_assignment_full(data)[0]
