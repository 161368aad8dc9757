"""Reading the fixed binary layouts of logbus's internal records (``__consumer_offsets``,
``__transaction_state``): fields in order, big-endian as Kafka writes them, every short or
malformed read a CorruptRecordError. No Ray."""

from __future__ import annotations

import struct

from logbus.errors import CorruptRecordError

_INT16 = struct.Struct(">h")
_INT32 = struct.Struct(">i")
_INT64 = struct.Struct(">q")


class FieldReader:
    """Reads fields in order; every short or malformed read is a CorruptRecordError."""

    def __init__(self, data: bytes, what: str, position: int = 0) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CorruptRecordError(f"{what} must be bytes, not {type(data).__name__}")
        self.data, self.position, self.what = bytes(data), position, what

    def unpack(self, layout: struct.Struct) -> tuple:
        end = self.position + layout.size
        if end > len(self.data):
            raise CorruptRecordError(f"{self.what} is truncated at byte {self.position}")
        values = layout.unpack_from(self.data, self.position)
        self.position = end
        return values

    def int16(self) -> int:
        return self.unpack(_INT16)[0]

    def int32(self) -> int:
        return self.unpack(_INT32)[0]

    def int64(self) -> int:
        return self.unpack(_INT64)[0]

    def uvarint(self) -> int:
        value = shift = 0
        while True:
            if self.position >= len(self.data) or shift > 28:
                raise CorruptRecordError(f"{self.what} has a bad varint at byte {self.position}")
            byte = self.data[self.position]
            self.position += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def _text(self, length: int) -> str:
        end = self.position + length
        if length < 0 or end > len(self.data):
            raise CorruptRecordError(f"{self.what} has a bad string length {length} at byte {self.position}")
        try:
            text = self.data[self.position : end].decode()
        except UnicodeDecodeError:
            raise CorruptRecordError(f"{self.what} has a string that is not UTF-8") from None
        self.position = end
        return text

    def string(self) -> str:
        return self._text(self.int16())

    def compact_string(self) -> str:
        return self._text(self.uvarint() - 1)

    def tagged_fields(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()  # tag
            size = self.uvarint()
            if self.position + size > len(self.data):
                raise CorruptRecordError(f"{self.what} has a tagged field past its end")
            self.position += size

    def finish(self) -> None:
        if self.position != len(self.data):
            raise CorruptRecordError(f"{self.what} has {len(self.data) - self.position} trailing bytes")
