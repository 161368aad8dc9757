"""The ``logbus`` command line (``logbus --help``; its usage text is ``parser``'s docstring).

One module per command: ``topics``, ``produce``, ``consume``, ``groups``, ``nodes``,
``gateway``, ``join`` and ``status`` each run their commands and add their own
subparser (``register``); ``_common`` holds what they share (connecting, tables,
flag types); ``parser`` builds the whole parser and runs a command line (``main``).
"""

from __future__ import annotations

from logbus.cli.gateway import gateway_stop
from logbus.cli.groups import GROUPS_DESCRIBE_HEADERS, GROUPS_LIST_HEADERS, GROUPS_MEMBERS_HEADERS, GROUPS_PLAN_HEADERS, GROUPS_RESET_HEADERS
from logbus.cli.join import ray_start_argv
from logbus.cli.nodes import NODES_HEADERS
from logbus.cli.parser import build_parser, main
from logbus.cli.topics import DESCRIBE_HEADERS, REASSIGN_HEADERS
from logbus.errors import CliError

__all__ = [
    "DESCRIBE_HEADERS",
    "GROUPS_DESCRIBE_HEADERS",
    "GROUPS_LIST_HEADERS",
    "GROUPS_MEMBERS_HEADERS",
    "GROUPS_PLAN_HEADERS",
    "GROUPS_RESET_HEADERS",
    "NODES_HEADERS",
    "REASSIGN_HEADERS",
    "CliError",
    "build_parser",
    "gateway_stop",
    "main",
    "ray_start_argv",
]
