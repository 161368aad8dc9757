"""A fetch's batches packaged for the transport that carries the reply: an actor call, or the local channel.

The read (``PartitionLog.read``) returns a memoryview of whole batches in a
mapped segment. What travels:

- in an actor call's reply, a copy: ``bytes`` inside the reply when small (at
  most the request's ``inline_max_bytes``, capped at FETCH_INLINE_MAX_BYTES:
  no object-store round trip for the reader, and bytes serialize faster than
  an array), else one copy into the object store as a uint8 array, whose
  ObjectRef the reply carries. Readers asking for the same batches at the
  same time (the followers, mostly) share that copy: the last one is kept
  until :meth:`FetchPackaging.forget` (a truncation, a cleaning's swap or a
  change of leadership may have changed the bytes at those offsets);
- over the local channel, the view itself (no copy), as a PickleBuffer the
  channel writes out of band before the reply's task yields
  (``channel_server.py``). A first batch larger than a channel reply carries
  raises ChannelReplyTooLargeError: the reader fetches it with an actor call.

Not thread-safe; the replica's event loop owns it.
"""

from __future__ import annotations

import pickle

import numpy as np
import ray

from logbus.errors import ChannelReplyTooLargeError
from logbus.protocol import local_channel as wire
from logbus.protocol.messages import FETCH_INLINE_MAX_BYTES, FetchRequest
from logbus.storage.partition_log import ReadResult


class FetchPackaging:
    """Packages reads for actor calls and the local channel; keeps the last large read shared."""

    def __init__(self, partition_name: str) -> None:
        self.partition_name = partition_name
        self._shared = None  # ((first offset, next offset, bytes, CRC checked), ObjectRef) of the last large read

    def forget(self) -> None:
        """The log's bytes may have changed (truncated, cleaned, another leadership): share no older copy."""
        self._shared = None

    def for_actor_call(self, result: ReadResult, request: FetchRequest):
        """A read's batches as an actor call's reply carries them: bytes when small, else an ObjectRef."""
        size = len(result.data)
        if size <= min(max(0, int(request.inline_max_bytes)), FETCH_INLINE_MAX_BYTES):
            return bytes(result.data)
        key = (result.first_offset, result.next_offset, size, bool(request.verify_crc))  # checked or not
        if self._shared is not None and self._shared[0] == key:
            return self._shared[1]
        ref = ray.put(np.frombuffer(result.data, dtype=np.uint8))
        self._shared = (key, ref)
        return ref

    def for_channel(self, result: ReadResult):
        """A read's batches for the local channel: a view of the mapped segment (no copy), however small."""
        if len(result.data) > wire.CHANNEL_FETCH_MAX_BYTES:
            raise ChannelReplyTooLargeError(
                f"{self.partition_name}: the batch at offset {result.first_offset} is too large "
                f"for the local channel", result.next_offset,
            )
        return pickle.PickleBuffer(result.data)
