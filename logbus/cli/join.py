"""``logbus join``: this host joins a running cluster as a Ray node, with token authentication."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from logbus.cli._common import DEFAULT_DATA_DIR_HELP, int_flag
from logbus.errors import CliError

JOIN_TIMEOUT_S = 300  # bound on `ray start` joining a node
RACK_LABEL = "logbus.rack"  # the node label placement reads first (logbus/actors/placement.py)
LABEL_VALUE_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def _label_value(text: str) -> str:
    """A Ray node label value: 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit."""
    if not 1 <= len(text) <= 63 or not set(text) <= LABEL_VALUE_CHARS or not (text[0].isalnum() and text[-1].isalnum()):
        raise argparse.ArgumentTypeError(
            f"a rack is 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit, not {text!r}"
        )
    return text


def ray_start_argv(args, ray: str, node_id: str | None = None) -> list[str]:
    """The ``ray start`` command that ``logbus join`` runs for ``args``, the host being node ``node_id``."""
    from logbus.actors.placement import NODE_LABEL, REPLICA_NODE_RESOURCE

    resources = {REPLICA_NODE_RESOURCE: args.replica_slots} if args.replica_slots else {}
    argv = [ray, "start", "--address", args.address, "--resources", json.dumps(resources), "--disable-usage-stats"]
    labels = [f"{NODE_LABEL}={node_id}"] if node_id else []
    if args.rack:
        labels.append(f"{RACK_LABEL}={args.rack}")
    if labels:
        argv += ["--labels", ",".join(labels)]
    for flag, value in (("--node-ip-address", args.node_ip_address), ("--temp-dir", args.temp_dir), ("--num-cpus", args.num_cpus)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--block"] if args.block else [])


def cmd_join(args) -> int:
    """Join this host to a running logbus cluster as a Ray node, with token authentication.

    Runs ``ray start --address ADDRESS`` with ``RAY_AUTH_MODE=token`` and the
    cluster's token (from --token-file, else RAY_AUTH_TOKEN_PATH,
    RAY_AUTH_TOKEN or ~/.ray/auth_token), advertising --replica-slots
    replica slots (the ``logbus_replica`` resource; 0: a host for clients
    only, which hosts no replicas) and the node label ``logbus.rack``
    (--rack). Ray's processes keep running after the command returns; with
    --block the command becomes ``ray start --block`` and lasts as long as
    the node. The head's token is printed by ``ray get-auth-token`` there.

    A host with replica slots is a logbus node of its own, kept in its data
    directory (--data-dir, default ./logbus-data): the first join writes a
    new node id into DIR/meta.properties, and every join advertises it (the
    node label ``logbus.node``), so a host that joins again after a restart,
    as a new Ray node, gets its replicas back, which reopen their logs in
    DIR. The cluster records its own id in that file the first time it uses
    the host, and refuses a directory of another cluster.
    """
    from logbus.actors import ray_auth
    from logbus.actors.placement import NODE_DATA_DIR_ENV, embedded_slots
    from logbus.storage import node_identity

    address = args.address  # checked by _check()
    if args.replica_slots is None:
        import psutil

        args.replica_slots = embedded_slots(psutil.virtual_memory().total)
    try:
        env = ray_auth.join_environment(args.token_file)
    except ValueError as error:
        raise CliError(str(error)) from None
    node = ""
    node_id = None
    if args.replica_slots:
        data_dir = os.path.abspath(args.data_dir or DEFAULT_DATA_DIR_HELP)
        try:
            meta, created = node_identity.load_or_create(data_dir)
        except OSError as error:
            raise CliError(f"cannot use the data directory {data_dir}: {error}") from None
        node_id = meta.node_id
        env[NODE_DATA_DIR_ENV] = data_dir  # the host's Ray processes (its replicas) keep their logs there
        cluster = f" of cluster {meta.cluster_id}" if meta.cluster_id else ""
        node = f" as {'new ' if created else ''}node {node_id}{cluster} (data directory {data_dir})"
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    argv = ray_start_argv(args, ray, node_id)
    rack = f", rack {args.rack}" if args.rack else ""
    if args.block:
        sys.stdout.write(f"Joining {address}{node} with {args.replica_slots} replica slot(s){rack}, token authentication on\n")
        sys.stdout.flush()
        os.execve(ray, argv, env)  # the node's lifetime is the command's
    try:
        result = subprocess.run(argv, env=env, stdout=sys.stdout, stderr=sys.stderr, timeout=JOIN_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise CliError(f"ray start did not finish joining {address} in {JOIN_TIMEOUT_S} s") from None
    if result.returncode != 0:
        raise CliError(f"ray start exited {result.returncode}; this host did not join {address}")
    sys.stdout.write(f"Joined {address}{node} with {args.replica_slots} replica slot(s){rack}, token authentication on\n")
    return 0


def _check(args) -> None:
    """The head's address comes from --address or $RAY_ADDRESS; violations exit 2 through parser.error()."""
    args.address = args.address or os.environ.get("RAY_ADDRESS")
    if not args.address or args.address in ("auto", "local"):
        args.parser.error("join needs the head's address: --address HOST:PORT")


def register(commands, common: argparse.ArgumentParser) -> None:
    """Add ``join`` to the ``logbus`` parser's ``commands``."""
    join = commands.add_parser("join", parents=[common], help="join this host to a running cluster as a Ray node (token auth)",
                               description=cmd_join.__doc__)
    join.add_argument("--token-file", metavar="PATH", help="the cluster's token (default: $RAY_AUTH_TOKEN_PATH, $RAY_AUTH_TOKEN or ~/.ray/auth_token)")
    join.add_argument("--replica-slots", type=int_flag("--replica-slots", 0), metavar="N",
                      help="replicas this host may hold (default: what its memory holds at 96 MiB each; 0: no replicas)")
    join.add_argument("--rack", type=_label_value, help="this host's rack (node label logbus.rack): replicas of a partition go to distinct racks")
    join.add_argument("--node-ip-address", metavar="IP", help="this host's address the other hosts reach (default: Ray's choice)")
    join.add_argument("--temp-dir", metavar="DIR", help="Ray's directory for this node's sockets, logs and session files (default: Ray's)")
    join.add_argument("--num-cpus", type=int_flag("--num-cpus", 0), metavar="N", help="CPUs this node offers to Ray tasks (default: Ray's count)")
    join.add_argument("--block", action="store_true", help="stay in the foreground for the node's lifetime (ray start --block)")
    join.set_defaults(func=cmd_join, parser=join, check=_check)
