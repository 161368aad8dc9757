"""logbus: a distributed, persistent, partitioned, replicated commit log on Ray."""

from logbus import errors
from logbus.errors import *  # noqa: F401,F403  (the error tree is part of the public API)

__version__ = "0.1.0"
