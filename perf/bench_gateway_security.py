#!/usr/bin/env python
"""The gateway's security cost: confluent-kafka through a SASL_SSL gateway against a plaintext one, in one run.

Run with ``.venv/bin/python perf/bench_gateway_security.py``; ``--quick`` makes a
short smoke run; ``--records N`` sets the records per repetition.

One private local Ray, a fresh temp ``data_dir``, a unique namespace, and a
gateway on this node (loopback, a free port), started in turn plaintext and with TLS (a
certificate authority made for the run, as the tests make theirs) and SASL
SCRAM-SHA-512 (one user; the principal is a super user, so ACL checks are
made and all pass). The produce and consume cases are perf/bench_gateway.py's
Kafka cases (one partition, 100-byte values, acks=1, confluent-kafka's
``produce_batch()`` and ``consume()``), run through each gateway in turn:

1. produce   records/s through SASL_SSL against plaintext. Target: >= 0.8x.
2. consume   the same. Target: >= 0.8x.
3. connect   (info) the time from a new ``AdminClient`` to its first
             ``list_topics()`` answer, the median of 20 new clients per
             gateway: the difference is the TLS handshake and the SASL
             exchange (SCRAM's PBKDF2 runs once per connection, on the gateway).

Each case runs once unmeasured as a warm-up, then ``reps`` times (3; quick 1),
the two gateways alternating; the best repetition is reported. The machine is
shared: the load average at the start and end is printed. The last lines of
the output are one JSON object per result.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import RunInfo, arg_parser, delete_topics, exit_on_sigterm, fmt_rate, log, make_pool, new_namespace, print_table, remove_dir, shutdown_ray, start_local_ray  # noqa: I001
from bench_gateway import FULL, KAFKA_CONSUMER_TUNING, QUICK, kafka_consume, kafka_produce

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import logbus  # noqa: E402
from tests.certificates import Authority  # noqa: E402 (the tests' certificate authority: a run-local CA)

RATIO_TARGET = 0.8
CONNECTS = 20
USER, PASSWORD = "bench", "bench-secret"


def connect_s(bootstrap: str, client: dict) -> float:
    """Median seconds from a new AdminClient to its first metadata answer, over CONNECTS clients."""
    import confluent_kafka.admin as cka

    times = []
    for _ in range(CONNECTS):
        start = time.perf_counter()
        admin = cka.AdminClient({**client, "bootstrap.servers": bootstrap})
        admin.list_topics(timeout=30)
        times.append(time.perf_counter() - start)
        del admin
    return statistics.median(times)


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--records", type=int, default=None, help=f"records per repetition (default: {FULL.records:,})")
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL
    n = args.records or mode.records
    exit_on_sigterm()
    run = RunInfo(quick=bool(args.quick))
    data_dir = tempfile.mkdtemp(prefix="logbus-bench-gwsec-")
    certificates = tempfile.mkdtemp(prefix="logbus-bench-gwsec-ca-")
    namespace = new_namespace("bench-gwsec")
    log(f"mode={'quick' if args.quick else 'full'} records={n:,} reps={mode.reps} load average {run.load_start[0]:.1f} on {os.cpu_count()} CPUs")
    pool = make_pool(10_000)
    authority = Authority(certificates, "bench")
    server = authority.issue("127.0.0.1", server=True)
    secure = {"security.protocol": "SASL_SSL", "ssl.ca.location": authority.cafile, "sasl.mechanism": "SCRAM-SHA-512",
              "sasl.username": USER, "sasl.password": PASSWORD}
    cases = ("produce", "consume", "connect")
    samples: dict[tuple[str, str], list[float]] = {(case, kind): [] for case in cases for kind in ("plaintext", "sasl_ssl")}
    bus = gateway = None
    topics: list[str] = []
    try:
        start_local_ray(namespace)
        bus = logbus.connect(data_dir=data_dir, namespace=namespace)
        bus.admin.create_scram_user(USER, PASSWORD, mechanism="SCRAM-SHA-512")
        settings = {"plaintext": ({}, {}),
                    "sasl_ssl": ({"ssl_certfile": server.certfile, "ssl_keyfile": server.keyfile, "sasl_mechanisms": ("SCRAM-SHA-512",),
                                  "super_users": (f"User:{USER}",)}, secure)}
        for rep in range(mode.reps + 1):  # the first is the warm-up
            figures = {}
            for kind in (("plaintext", "sasl_ssl") if rep % 2 == 0 else ("sasl_ssl", "plaintext")):
                options, client = settings[kind]
                gateway = bus.start_gateway(port=0, **options)  # one gateway per node: each kind in turn
                try:
                    bootstrap = gateway.bootstrap_servers
                    topic = f"{kind}-{rep}"
                    bus.admin.create_topic(topic, partitions=1)
                    topics.append(topic)
                    figures[("produce", kind)] = kafka_produce(bootstrap, topic, pool, n, client).records_per_s
                    figures[("consume", kind)] = kafka_consume(bootstrap, topic, n, KAFKA_CONSUMER_TUNING, client).records_per_s
                    figures[("connect", kind)] = connect_s(bootstrap, client)
                finally:
                    gateway.stop()
                    gateway = None
            log(("warm-up: " if rep == 0 else f"rep {rep}: ") + ", ".join(
                f"{case} {kind} " + (f"{value * 1000:.1f} ms" if case == "connect" else f"{fmt_rate(value)}/s") for (case, kind), value in figures.items()))
            if rep > 0:
                for key, value in figures.items():
                    samples[key].append(value)
            delete_topics(bus, topics)
            topics.clear()
    finally:
        if gateway is not None:
            gateway.stop()
        if bus is not None:
            delete_topics(bus, topics)
        shutdown_ray()
        remove_dir(data_dir)
        remove_dir(certificates)

    results = []
    for case in ("produce", "consume"):
        best_plain, best_secure = max(samples[(case, "plaintext")]), max(samples[(case, "sasl_ssl")])
        ratio = best_secure / best_plain
        results.append({"case": f"kafka {case}, plaintext", "unit": "records/s", "best": round(best_plain), "values": samples[(case, "plaintext")]})
        results.append({"case": f"kafka {case}, SASL_SSL (SCRAM-SHA-512)", "unit": "records/s", "best": round(best_secure),
                        "values": samples[(case, "sasl_ssl")], "ratio": round(ratio, 3), "target": f">= {RATIO_TARGET}",
                        "meets_target": ratio >= RATIO_TARGET})
    for kind in ("plaintext", "sasl_ssl"):
        values = samples[("connect", kind)]
        results.append({"case": f"connect: new client to first metadata, {kind} (median of {CONNECTS})", "unit": "ms",
                        "best": round(min(values) * 1000, 2), "values": [round(v * 1000, 2) for v in values]})
    seconds = run.finish()
    log(f"done in {seconds:.0f}s; load average {run.loadavg_start} at the start, {run.loadavg_end} at the end")
    print_table(("case", "best", "ratio"), [
        (r["case"], f"{r['best']:,.1f} ms" if r["unit"] == "ms" else f"{fmt_rate(r['best'])}/s",
         f"{r['ratio']:.2f} (target {r['target']}: {'met' if r['meets_target'] else 'MISSED'})" if "ratio" in r else "")
        for r in results
    ])
    for r in results:
        print(json.dumps({"bench": "gateway_security", **r, "quick": bool(args.quick), "date": run.date,
                          "loadavg_start": run.loadavg_start, "loadavg_end": run.loadavg_end}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
