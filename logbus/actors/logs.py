"""Log lines of logbus's own processes (the controller, node agents, replicas): with their time.

Ray captures each worker's stderr into its log files, but leaves Python's
logging unconfigured there: a logbus warning came out as the bare message,
with no time, through logging's last-resort handler. Each logbus actor
calls :func:`configure_logging` when it starts; it gives the ``logbus``
logger one stderr handler (once per process) whose lines carry the wall
time to the millisecond, the level and the module.
"""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
_HANDLER_NAME = "logbus-actor"


def configure_logging(level: int = logging.INFO) -> None:
    """Give the ``logbus`` logger its timed stderr handler (idempotent; a driver's own setup is left alone)."""
    root = logging.getLogger("logbus")
    if any(handler.get_name() == _HANDLER_NAME for handler in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False  # one line per record, not a second one through a handler Ray may add to the root
