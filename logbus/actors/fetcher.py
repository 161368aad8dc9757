"""The client side of a replica's fetch: one request, one choice of transport, one way to read the reply.

Consumers (``logbus/api/consumer.py``), Ray Data read tasks
(``logbus/api/dataset.py``) and the controller's loader of committed offsets
(``logbus/actors/committed_offsets.py``) all fetch through here:

- :func:`send_fetch` sends a :class:`~logbus.protocol.messages.FetchRequest`
  over the leader's local channel when this process runs on the leader's
  node and the channel is up (the reply is a ``concurrent.futures.Future``),
  else as an actor call (an ObjectRef);
- :func:`wait_reply` / :func:`reply_async` turn what came back into
  ``(FetchResponse, data, large)``: ``data`` is a buffer of whole batches
  (bytes, a memoryview into a channel frame, or the object store's array), or
  None when the fetch found nothing in time;
- :func:`~logbus.storage.record_batch.slice_batches` then decodes the
  batches in place and cuts them to the offsets wanted.

How many fetches to keep in flight, and what to do with a reply, is each
reader's own policy.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import ray

from logbus.actors.remote import get
from logbus.errors import ChannelClosedError
from logbus.protocol.local_channel import CHANNEL_FETCH_MAX_BYTES, FETCH
from logbus.protocol.messages import FETCH_INLINE_MAX_BYTES, FetchRequest, FetchResponse


def send_fetch(leader, request: FetchRequest, channels=None, block: bool = True):
    """Send ``request`` to ``leader`` (an actor handle); returns a Future (local channel) or an ObjectRef.

    ``channels`` is this process's local channel registry (``channel_client.channels()``),
    or None to use actor calls only. ``block=False`` (callers on an event loop): the
    channel never waits for its socket (see ``Connection.call``); when its queue is full
    the request goes as an actor call.
    """
    if channels is not None:
        connection = channels.connection(leader)
        if connection is not None:
            if request.max_bytes > CHANNEL_FETCH_MAX_BYTES:
                request = dataclasses.replace(request, max_bytes=CHANNEL_FETCH_MAX_BYTES)
            try:
                return connection.call(FETCH, (request,), block=block)
            except ChannelClosedError:
                pass  # nothing was sent (closed, or busy): an actor call carries the fetch
    return leader.fetch.remote(request)


def wait_reply(pending, timeout_s: float | None = None) -> tuple[FetchResponse, object, bool]:
    """Wait for a fetch sent with :func:`send_fetch`: ``(FetchResponse, data or None, large)``.

    ``large`` says the reply was too big to travel inside an actor call's
    reply (a reader at the log end gets small replies). Raises the logbus
    error the replica raised.
    """
    if isinstance(pending, Future):
        meta, data = pending.result(timeout_s)
        return meta, data, data is not None and len(data) > FETCH_INLINE_MAX_BYTES
    meta, data = get(pending, timeout_s=timeout_s)
    if isinstance(data, ray.ObjectRef):
        return meta, get(data, timeout_s=timeout_s), True
    return meta, data, False


async def reply_async(ref) -> tuple[FetchResponse, object]:
    """Await an actor-call fetch (for callers on an event loop): ``(FetchResponse, data or None)``."""
    meta, data = await ref
    if isinstance(data, ray.ObjectRef):
        data = await data
    return meta, data
