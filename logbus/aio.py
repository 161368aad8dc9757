"""The asyncio clients, for coroutines that must not block their event loop (Ray Serve, async actors).

    import logbus.aio

    async with logbus.aio.Producer(bus) as producer:
        await producer.send_and_wait("events", b"hello")

The implementation and its notes are in ``logbus/api/aio.py``.
"""

from logbus.api.aio import Consumer, Producer

__all__ = ["Consumer", "Producer"]
