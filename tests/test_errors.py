"""The error tree: one module owns every logbus exception, and caller mistakes are never retriable."""

from __future__ import annotations

import ast
import pathlib

import pytest

import logbus
from logbus import errors
from logbus.errors import InvalidPartitionError, InvalidPartitionsError, LogbusError, UnknownTopicError

PACKAGE = pathlib.Path(logbus.__file__).parent
# The local channel's errors (FrameError, ChannelReplyTooLargeError, ChannelClosedError) still live
# next to the channel; they join errors.py with the channel's own clean-up.
def _error_classes() -> list[type[LogbusError]]:
    return [value for value in vars(errors).values() if isinstance(value, type) and issubclass(value, LogbusError)]


def test_every_exception_class_is_defined_in_errors_py():
    defined_elsewhere = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(base, "id", getattr(base, "attr", "")) for base in node.bases}
                if any(name.endswith(("Error", "Exception")) for name in bases):
                    defined_elsewhere.append(f"{path.relative_to(PACKAGE)}: {node.name}")
    assert defined_elsewhere == []


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda cls: cls.__name__)
def test_each_error_says_what_it_means_and_whether_retrying_helps(cls):
    assert cls.__module__ == "logbus.errors"
    assert cls.__doc__ and cls.__doc__.strip()
    assert isinstance(cls.retriable, bool)
    assert getattr(logbus, cls.__name__) is cls  # part of the public API


@pytest.mark.parametrize("cls", [c for c in _error_classes() if issubclass(c, ValueError)], ids=lambda cls: cls.__name__)
def test_caller_errors_are_never_retriable(cls):
    assert cls.retriable is False
    assert cls("bad").retriable is False


def test_a_bad_partition_number_is_a_caller_error_unlike_an_unknown_topic():
    assert not InvalidPartitionError.retriable and issubclass(InvalidPartitionError, ValueError)
    assert not issubclass(InvalidPartitionError, InvalidPartitionsError)  # a number, not a count
    assert UnknownTopicError.retriable  # the topic may be being created, as in Kafka


def test_copy_error_gives_each_caller_an_exception_of_its_own():
    """A shared error (a failed batch's) is handed out as copies: raising one adds tracebacks to it alone."""
    try:
        raise ValueError("the cause")
    except ValueError as cause:
        shared = errors.RecordDeserializationError("closed", ("t", 3), 17)
        shared.__cause__ = cause
    shared.add_note("a note")
    shared.detail = "an attribute"
    own = errors.copy_error(shared)
    assert type(own) is errors.RecordDeserializationError and own is not shared
    assert (own.args, str(own), own.topic_partition, own.offset, own.detail) == (shared.args, "closed", ("t", 3), 17, "an attribute")
    assert own.__cause__ is shared.__cause__ and own.__traceback__ is None
    own.add_note("the caller's")
    assert shared.__notes__ == ["a note"] and own.__notes__ == ["a note", "the caller's"]
    try:
        raise own
    except errors.RecordDeserializationError:
        pass
    assert shared.__traceback__ is None  # the raise went to the copy


def test_copy_error_hands_out_an_error_it_cannot_rebuild_as_it_is():
    class NeedsTwo(Exception):
        def __init__(self, a, b):
            super().__init__(a)  # args no longer rebuild it

    error = NeedsTwo("a", "b")
    assert errors.copy_error(error) is error
