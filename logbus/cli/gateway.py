"""``logbus gateway``: serve Kafka's wire protocol to Kafka clients until interrupted."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from logbus.cli._common import connected, int_flag
from logbus.options import INT32_MAX
from logbus.protocol.listener_security import SASL_MECHANISMS, ListenerSecurity

# Set to end ``logbus gateway`` (SIGINT and SIGTERM do it too); a program running the command in a
# thread of its own sets it to stop the gateway.
gateway_stop = threading.Event()


def cmd_gateway(args) -> int:
    """Serve Kafka's wire protocol until interrupted (Ctrl-C or SIGTERM), so Kafka clients (kcat,
    kafka-python, confluent-kafka, aiokafka) produce to and consume from logbus.

    Listens on 127.0.0.1 unless --host names another address; another
    address needs TLS (--tls-cert, --tls-key) and authentication (--sasl-mechanism,
    or client certificates with --tls-ca), or --allow-plaintext. Prints the
    bootstrap servers to give Kafka clients, then one line per gateway
    (broker); stops the gateways on exit.
    """
    stop = gateway_stop
    stop.clear()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with connected(args) as bus:
            limits = {name: value for name, value in (("max_request_bytes", args.max_request_bytes),
                                                      ("max_connections", args.max_connections)) if value is not None}
            security = {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key, "ssl_cafile": args.tls_ca,
                        "sasl_mechanisms": tuple(args.sasl_mechanism or ()), "allow_plaintext": args.allow_plaintext,
                        "allow_plain_without_tls": args.allow_plain_without_tls, "super_users": tuple(args.super_user or ())}
            gateway = bus.start_gateway(args.host, args.port, all_nodes=args.all_nodes, advertised_host=args.advertised_host, **limits, **security)
            exposed = ListenerSecurity(**security).exposure_warning(args.host)
            if exposed:
                sys.stderr.write(f"warning: {exposed}\n")
            try:
                sys.stdout.write(f"Kafka gateway serving: bootstrap.servers={gateway.bootstrap_servers}\n")
                for host, port, broker_id, node_id in gateway.brokers:
                    sys.stdout.write(f"  broker {broker_id} on node {node_id}: {host}:{port}\n")
                sys.stdout.flush()
                try:
                    while not stop.wait(1.0):  # a timed wait, so Ctrl-C reaches this thread promptly
                        pass
                except KeyboardInterrupt:
                    pass
            finally:
                gateway.stop()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    sys.stdout.write("Kafka gateway stopped.\n")
    return 0


def register(commands, common: argparse.ArgumentParser) -> None:
    """Add ``gateway`` to the ``logbus`` parser's ``commands``."""
    gateway = commands.add_parser("gateway", parents=[common], help="serve Kafka's wire protocol to Kafka clients",
                                  description=cmd_gateway.__doc__)
    gateway.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; other addresses only when asked)")
    gateway.add_argument("--port", type=int_flag("--port", 0, 65535), default=9092, help="port to listen on (default: 9092; 0: any free port)")
    gateway.add_argument("--advertised-host", metavar="HOST", help="address clients are told to connect to (default: --host, or the node's IP for 0.0.0.0)")
    gateway.add_argument("--all-nodes", action="store_true", help="one gateway on every node that hosts replicas (else: this node only)")
    gateway.add_argument("--max-request-bytes", type=int_flag("--max-request-bytes", 1, INT32_MAX, unit="bytes"), metavar="BYTES",
                         help="larger requests close their connection (default: 104857600, Kafka's socket.request.max.bytes)")
    gateway.add_argument("--max-connections", type=int_flag("--max-connections", 1, INT32_MAX), metavar="N",
                         help="client connections per gateway; one more is closed when accepted (default: 4096)")
    gateway.add_argument("--tls-cert", metavar="PEM", help="the gateway's TLS certificate (chain); with --tls-key, clients connect with TLS")
    gateway.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    gateway.add_argument("--tls-ca", metavar="PEM", help="CA certificates client certificates must be signed by (requires them)")
    gateway.add_argument("--sasl-mechanism", action="append", choices=SASL_MECHANISMS, metavar="MECHANISM",
                         help=f"a SASL mechanism clients authenticate with ({', '.join(SASL_MECHANISMS)}; repeat for several)")
    gateway.add_argument("--allow-plaintext", action="store_true", help="listen on a non-loopback --host without TLS and authentication")
    gateway.add_argument("--allow-plain-without-tls", action="store_true", help="offer SASL PLAIN without TLS (passwords in the clear)")
    gateway.add_argument("--super-user", action="append", metavar="PRINCIPAL",
                         help="a principal (User:NAME) the ACLs never refuse; repeat for more (ACLs are checked whenever SASL is on)")
    gateway.set_defaults(func=cmd_gateway, parser=gateway)
