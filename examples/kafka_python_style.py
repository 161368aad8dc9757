"""A kafka-python program on logbus: only the imports and the constructors change.

With kafka-python, this program begins::

    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.structs import OffsetAndMetadata

    producer = KafkaProducer(bootstrap_servers="localhost:9092", acks="all",
                             key_serializer=str.encode, value_serializer=to_json)
    consumer = KafkaConsumer("orders", bootstrap_servers="localhost:9092", group_id="billing",
                             auto_offset_reset="earliest", enable_auto_commit=False,
                             key_deserializer=bytes.decode, value_deserializer=from_json,
                             consumer_timeout_ms=10_000)

Everything after the constructors is the same code: ``send`` with serializers,
``flush(timeout=...)``, futures with ``get(timeout=...)``, iterating the
consumer, ``message.value`` / ``message.timestamp``, and ``commit`` with
``OffsetAndMetadata``. Run it with ``.venv/bin/python examples/kafka_python_style.py``.
"""

from __future__ import annotations

import argparse
import json

import logbus
from logbus import OffsetAndMetadata, TopicPartition

ORDERS = 300


def to_json(value) -> bytes:
    return json.dumps(value).encode()


def from_json(data: bytes):
    return json.loads(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default="logbus-data")
    args = parser.parse_args()

    # --- the only lines that differ from kafka-python ------------------------------------------
    bus = logbus.connect(data_dir=args.data_dir)
    if "orders" not in bus.admin.list_topics():
        bus.admin.create_topic("orders", partitions=3)
    producer = logbus.Producer(bus, acks="all", key_serializer=str.encode, value_serializer=to_json)
    consumer = logbus.Consumer(
        bus, "orders", group_id="billing", auto_offset_reset="earliest", enable_auto_commit=False,
        key_deserializer=bytes.decode, value_deserializer=from_json, consumer_timeout_ms=10_000,
    )
    # --------------------------------------------------------------------------------------------

    futures = [producer.send("orders", {"order": i, "amount": i % 50}, key=f"customer-{i % 7}") for i in range(ORDERS)]
    producer.flush(timeout=60)
    first = futures[0].get(timeout=10)
    print(f"sent {ORDERS} orders; the first went to {first.topic}-{first.partition} at offset {first.offset}")

    billed, total = 0, 0
    for message in consumer:
        total += message.value["amount"]
        billed += 1
        consumer.commit({TopicPartition(message.topic, message.partition): OffsetAndMetadata(message.offset + 1, "billed")})
        if billed == ORDERS:
            break
    committed = consumer.committed(TopicPartition("orders", 0))
    print(f"billed {billed} orders, total {total}; partition 0 committed up to offset {committed}")
    consumer.close()
    producer.close()


if __name__ == "__main__":
    main()
