"""The user-facing API: connect, Admin, Producer, Consumer."""

from logbus.api.admin import Admin
from logbus.api.client import Bus, connect
from logbus.api.consumer import Consumer
from logbus.api.producer import BatchMetadata, Producer

__all__ = ["Admin", "BatchMetadata", "Bus", "Consumer", "Producer", "connect"]
