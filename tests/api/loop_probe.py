"""Calls that block, made on an event loop's thread: what logbus's asyncio clients must never make.

``BlockingCalls(thread_id)`` wraps the primitives that wait for something else (another process,
another thread, the network, a timer) and records each call made on that thread that would wait:

* ``ray.get``, ``ray.wait``, ``ray.get_actor`` (a round trip to another process or the GCS);
* ``time.sleep``;
* a socket in blocking mode (``recv*``, ``send*``, ``connect``, ``accept``; ``MSG_DONTWAIT`` and
  non-blocking sockets, such as the loop's own, do not wait);
* ``threading.Event.wait`` (not yet set), ``Condition.wait``/``wait_for``, ``Semaphore.acquire`` (at
  zero), ``Barrier.wait``, ``Thread.join`` (of a live thread), ``queue.Queue.get`` (empty) and ``put``
  (full), ``concurrent.futures.Future.result``/``exception`` (not yet done), ``concurrent.futures.wait``:
  as the call finds things when it is made, and unless told not to wait (``blocking=False``,
  ``block=False``, a zero timeout). A call made inside another wrapped call counts as part of it.

Not counted: plain lock acquisitions (``with lock:``; critical sections held for moments, as the sync
producer's while ``send()`` takes a record), and the wait inside ``Thread.start`` for the new thread
to begin (an executor starting its worker). Holding the GIL is not a call either: the figure for how
late a loop runs under load is perf/bench_broker.py's ``aio_loop_lateness`` case.

It patches the modules of the process it runs in: use it where nothing else runs (a test, an actor
of the test's own), and ``uninstall()`` (or leave the ``with`` block) when done.
"""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import socket
import sys
import threading
import time
import traceback

import ray

MSG_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)


def _timeout_is_zero(timeout) -> bool:
    return timeout is not None and timeout <= 0


def _always(*args, **kwargs) -> bool:
    return True


def _semaphore_waits(self, blocking=True, timeout=None) -> bool:
    return bool(blocking) and not _timeout_is_zero(timeout) and self._value == 0


def _event_waits(self, timeout=None) -> bool:
    return not _timeout_is_zero(timeout) and not self.is_set()


def _condition_waits(self, timeout=None) -> bool:  # also Barrier.wait
    return not _timeout_is_zero(timeout)


def _join_waits(self, timeout=None) -> bool:
    return not _timeout_is_zero(timeout) and self.is_alive()


def _condition_wait_for_waits(self, predicate, timeout=None) -> bool:
    return not _timeout_is_zero(timeout)


def _queue_get_waits(self, block=True, timeout=None) -> bool:
    return bool(block) and not _timeout_is_zero(timeout) and self.empty()


def _queue_put_waits(self, item, block=True, timeout=None) -> bool:
    return bool(block) and not _timeout_is_zero(timeout) and self.full()


def _future_waits(self, timeout=None) -> bool:
    return not self.done() and not _timeout_is_zero(timeout)


def _futures_wait_waits(fs, timeout=None, return_when=concurrent.futures.ALL_COMPLETED) -> bool:
    return not _timeout_is_zero(timeout) and not all(f.done() for f in fs)


def _socket_waits(flags_at: int | None):
    def waits(self, *args, **kwargs) -> bool:
        if self.gettimeout() == 0.0:
            return False  # non-blocking: raises BlockingIOError rather than waiting
        flags = kwargs.get("flags", args[flags_at] if flags_at is not None and len(args) > flags_at else 0)
        return not (flags & MSG_DONTWAIT)

    return waits


class BlockingCalls:
    """Records blocking calls made on one thread (see the module docstring); a context manager."""

    def __init__(self, thread_id: int | None = None) -> None:
        self.thread_id = threading.get_ident() if thread_id is None else thread_id
        self.calls: list[str] = []  # "name, called from file:line (function)"
        self._saved: list[tuple[object, str, object]] = []
        self._inside = 0  # wrapped calls under way on the thread: the calls they make are theirs

    def __enter__(self) -> "BlockingCalls":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def install(self) -> None:
        targets = [
            (ray, "get", _always), (ray, "wait", _always), (ray, "get_actor", _always),
            (time, "sleep", lambda seconds: seconds > 0),
            (threading.Event, "wait", _event_waits),
            (threading.Condition, "wait", _condition_waits),
            (threading.Condition, "wait_for", _condition_wait_for_waits),
            (threading.Semaphore, "acquire", _semaphore_waits),
            (threading.Barrier, "wait", _condition_waits),
            (threading.Thread, "join", _join_waits),
            (queue.Queue, "get", _queue_get_waits),
            (queue.Queue, "put", _queue_put_waits),
            (concurrent.futures.Future, "result", _future_waits),
            (concurrent.futures.Future, "exception", _future_waits),
            (concurrent.futures, "wait", _futures_wait_waits),
            (socket.socket, "recv", _socket_waits(1)),
            (socket.socket, "recv_into", _socket_waits(2)),
            (socket.socket, "recvfrom", _socket_waits(1)),
            (socket.socket, "recvfrom_into", _socket_waits(2)),
            (socket.socket, "recvmsg", _socket_waits(2)),
            (socket.socket, "send", _socket_waits(1)),
            (socket.socket, "sendall", _socket_waits(1)),
            (socket.socket, "sendto", _socket_waits(None)),
            (socket.socket, "sendmsg", _socket_waits(2)),
            (socket.socket, "connect", _socket_waits(None)),
            (socket.socket, "accept", _socket_waits(None)),
        ]
        for owner, name, waits in targets:
            original = getattr(owner, name)
            self._saved.append((owner, name, owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else original))
            setattr(owner, name, self._wrap(owner, name, original, waits))

    def uninstall(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            if original is _MISSING:
                delattr(owner, name)  # it was inherited (socket.socket's from _socket.socket)
            else:
                setattr(owner, name, original)

    def _wrap(self, owner, name: str, original, waits):
        probe = self
        label = f"{getattr(owner, '__name__', owner)}.{name}"
        start_code = threading.Thread.start.__code__

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if threading.get_ident() != probe.thread_id:
                return original(*args, **kwargs)
            if not probe._inside:
                try:
                    blocking = waits(*args, **kwargs)
                except Exception:  # noqa: BLE001 (arguments the call itself will refuse)
                    blocking = False
                if blocking and not _called_from(start_code):
                    frames = traceback.extract_stack(limit=6)[:-1]
                    where = "; ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} ({f.name})" for f in reversed(frames))
                    probe.calls.append(f"{label}, called from {where}")
            probe._inside += 1
            try:
                return original(*args, **kwargs)
            finally:
                probe._inside -= 1

        return wrapper


_MISSING = object()


def _called_from(code) -> bool:
    """Whether a frame of ``code`` is among the wrapper's callers (the two frames above it)."""
    frame = sys._getframe(2)
    for _ in range(2):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
