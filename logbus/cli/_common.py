"""What every ``logbus`` command shares: connecting to the cluster, printing tables, parsing flags.

Each command module (``topics``, ``produce``, ``consume``, ``groups``, ``nodes``,
``gateway``, ``join``, ``status``) builds its own subparser with ``register()``
and runs its commands with the helpers here; ``parser`` puts them together.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from logbus.errors import InvalidConfigError
from logbus.options import INT64_MAX, check_int

DEFAULT_DATA_DIR_HELP = "./logbus-data"


# --- connecting -----------------------------------------------------------------------------------


@contextlib.contextmanager
def connected(args):
    """A Bus for the command; starts or joins (and afterwards leaves) Ray only if it was not running here.

    Without ``--address`` and without ``RAY_ADDRESS``, the command does what
    ``logbus.connect()`` does by default: it joins the cluster of the process
    that serves the data directory (an application running beside it), or
    starts a fresh local Ray (``address="local"``), never attaching to
    whatever cluster ``/tmp/ray/ray_current_cluster`` happens to name.
    """
    import ray

    import logbus

    started_here = not ray.is_initialized()
    address = args.address
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
    quiet = {"log_to_driver": False, "logging_level": logging.ERROR}
    try:
        yield logbus.connect(address=address, data_dir=args.data_dir, namespace=args.namespace, ray_init_options=quiet)
    finally:
        if started_here and ray.is_initialized():
            ray.shutdown()


# --- output helpers --------------------------------------------------------------------------------


def table(headers: list[str], rows: list[list]) -> str:
    """Left-aligned columns separated by two spaces (the last column is not padded)."""
    cells = [[str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        padded = [cell.ljust(widths[i]) if i < len(row) - 1 else cell for i, cell in enumerate(row)]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines) + "\n"


def ids(values) -> str:
    """Replica or node ids as ``1,2,3``; ``-`` for none."""
    return ",".join(str(v) for v in values) if values else "-"


def configs(config: dict) -> str:
    """Topic configs as ``k1=v1,k2=v2``, sorted by key; booleans as Kafka writes them (``true``)."""
    return ",".join(f"{k}={_config_value(v)}" for k, v in sorted(config.items()))


def _config_value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def dash(value) -> str:
    """``-`` for None, else the value as text."""
    return "-" if value is None else str(value)


def refusals(nodes: list[dict]) -> str:
    """Lines for the hosts the cluster refused (a data directory of another cluster)."""
    return "".join(f"Refused: node {n['node_id']} on Ray node {n['ray_node_id']}: {n['refused']}\n" for n in nodes if n.get("refused"))


def err(message: str) -> None:
    """Print ``message`` on stderr at once (progress, summaries, notes, errors)."""
    print(message, file=sys.stderr, flush=True)


# --- argument types and shared arguments ----------------------------------------------------------


def int_flag(flag: str, minimum: int = 1, maximum: int = INT64_MAX, unit: str = ""):
    """An argparse type: the flag's text as an int, checked as every client checks the option
    (logbus/options.py), so a flag and the option it sets fail with the same words."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = text  # not an int: the check names it as given
        try:
            return check_int(flag, value, minimum, maximum, unit=unit)
        except InvalidConfigError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = flag  # argparse names the type in its own messages
    return parse


def topic_argument(parser: argparse.ArgumentParser) -> None:
    """The topic as a positional TOPIC or as --topic (``produce`` and ``consume``); see ``check_topic``."""
    parser.add_argument("topic", nargs="?", metavar="TOPIC", help="the topic")
    parser.add_argument("--topic", dest="topic_flag", metavar="TOPIC", help="the topic (same as the positional TOPIC)")


def check_topic(args) -> None:
    """Exactly one topic, given as TOPIC or --topic (or both the same), ends up in ``args.topic``."""
    parser = args.parser
    if args.topic is not None and args.topic_flag is not None and args.topic != args.topic_flag:
        parser.error("give the topic once: as TOPIC or as --topic")
    args.topic = args.topic if args.topic is not None else args.topic_flag
    if args.topic is None:
        parser.error("a topic is required (TOPIC or --topic)")
