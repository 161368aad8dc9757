"""The ``logbus`` command line: topic admin, a console producer and consumer, consumer groups, and cluster status.

Flag spellings follow Kafka's tools (``kafka-topics``, ``kafka-console-producer``,
``kafka-console-consumer``)::

    logbus topics create --topic events --partitions 4 --replication-factor 1 --config retention.ms=86400000
    logbus topics list
    logbus topics describe [--topic events]
    logbus topics alter --topic events --config retention.ms=3600000 [--partitions 8]
    logbus topics delete --topic events
    printf 'user-1:hello\\n' | logbus produce events --key-separator :
    logbus consume events --from-beginning --max-messages 10 --format kv
    logbus groups list
    logbus groups describe --group billing --members
    logbus groups reset-offsets --group billing --topic events --to-earliest [--execute]
    logbus nodes list
    logbus nodes drain NODE_ID [--throttle 10485760]
    logbus status
    logbus gateway --port 9092 [--host 0.0.0.0 --advertised-host HOST] [--all-nodes]
        [--tls-cert PEM --tls-key PEM [--tls-ca PEM]] [--sasl-mechanism SCRAM-SHA-512 ...] [--super-user User:admin ...] [--allow-plaintext]
    logbus join --address HEAD:6379 --token-file auth_token --data-dir /var/lib/logbus [--replica-slots 32] [--rack r1]

Connecting: without ``--address`` (and without ``RAY_ADDRESS`` in the
environment) each invocation joins the cluster of the process that serves
``--data-dir`` (default ``./logbus-data``), such as an application running
beside it, or else starts an embedded local Ray, serves the command, and
shuts Ray down again; topics and records stay on disk and the next
invocation finds them there. With
``--address`` (e.g. ``auto`` or ``HOST:PORT``) the command joins that Ray
cluster and leaves it running.

Exit codes: 0 success; 1 a logbus error (``error: <message>`` on stderr, no
traceback) or an I/O error; 2 a usage error; 130 interrupted. Writing into a
closed pipe (``logbus consume ... | head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from logbus.cli import consume, gateway, groups, join, nodes, produce, status, topics
from logbus.cli._common import DEFAULT_DATA_DIR_HELP, err
from logbus.errors import LogbusError

PROG = "logbus"


def _global_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """--address, --data-dir and --namespace; accepted before or after the command."""

    def default(value):
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--address",
        default=default(None),
        help="Ray cluster address to join (e.g. auto or HOST:PORT); default: $RAY_ADDRESS if set, "
        "else an embedded local Ray started for this command and stopped after it",
    )
    parser.add_argument(
        "--data-dir",
        default=default(None),
        help=f"directory holding the logs and metadata (default: {DEFAULT_DATA_DIR_HELP}); "
        "an already running controller must serve this same directory",
    )
    parser.add_argument("--namespace", default=default("logbus"), help="Ray namespace of the logbus controller (default: logbus)")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``logbus`` command; each command's module adds its own subparser."""
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, suppress=True)

    doc = __doc__.replace("``", "").replace("::", ":")
    parser = argparse.ArgumentParser(prog=PROG, description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _global_options(parser, suppress=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (topics, produce, consume, groups, nodes, gateway, join, status):
        module.register(commands, common)
    return parser


def _silence_stdout() -> None:
    """After EPIPE, point fd 1 at /dev/null so the interpreter's final flush does not complain."""
    with contextlib.suppress(Exception):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    """Run the ``logbus`` command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        # Usage rules argparse cannot express (a command's ``check``); violations exit 2 through parser.error().
        check = getattr(args, "check", None)
        if check is not None:
            check(args)
    except SystemExit as exit_:  # usage errors (2) and --help (0)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        return args.func(args)
    except BrokenPipeError:
        _silence_stdout()
        return 0
    except LogbusError as error:
        err(f"error: {error}")
        return 1
    except OSError as error:
        err(f"error: {error}")
        return 1
    except KeyboardInterrupt:
        return 130
