"""Transactions through the Kafka gateway: the coordinator's APIs with raw requests, then Kafka's own
transactional clients (confluent-kafka) against logbus's coordinator, markers and read_committed."""

from __future__ import annotations

import pytest
import ray

from logbus import TopicPartition
from logbus.protocol import kafka_gateway as kg
from tests.actors.test_gateway import Raw

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def gateway(bus):
    gw = bus.start_gateway(port=0)
    yield gw
    gw.stop()


def transactions(bus) -> dict:
    return {t["transactional_id"]: t for t in ray.get(bus.controller.describe_transactions.remote(), timeout=60)}


def init_producer_id(raw: Raw, transactional_id: str, producer_id: int = -1, epoch: int = -1):
    return raw.call(kg.INIT_PRODUCER_ID, 4, {"transactional_id": transactional_id, "transaction_timeout": 60_000,
                                             "producer_id": producer_id, "producer_epoch": epoch})


def add_partitions(raw: Raw, version: int, transactional_id: str, producer_id: int, epoch: int, topic: str, partitions) -> list:
    response = raw.call(kg.ADD_PARTITIONS_TO_TXN, version, {
        "v3_and_below_transactional_id": transactional_id, "v3_and_below_producer_id": producer_id,
        "v3_and_below_producer_epoch": epoch,
        "v3_and_below_topics": [{"name": topic, "partitions": list(partitions)}]})
    return [p.partition_error_code for t in response.results_by_topic_v3_and_below for p in t.results_by_partition]


def end_txn(raw: Raw, version: int, transactional_id: str, producer_id: int, epoch: int, commit: bool):
    return raw.call(kg.END_TXN, version, {"transactional_id": transactional_id, "producer_id": producer_id,
                                          "producer_epoch": epoch, "committed": commit}).error_code


def test_the_coordinators_apis_fence_older_epochs_with_the_code_each_version_knows(bus, gateway, topic_name):
    bus.admin.create_topic(topic_name, partitions=2)
    raw = Raw(gateway)
    tid = f"{topic_name}-txn"
    found = raw.call(kg.FIND_COORDINATOR, 4, {"key_type": 1, "coordinator_keys": [tid]})
    assert [(c.key, c.error_code) for c in found.coordinators] == [(tid, kg.ErrorCode.none)]

    first = init_producer_id(raw, tid)
    assert first.error_code == kg.ErrorCode.none and first.producer_id >= 0
    second = init_producer_id(raw, tid)  # a new instance with the same transactional id
    assert second.error_code == kg.ErrorCode.none
    assert (second.producer_id, second.producer_epoch) == (first.producer_id, first.producer_epoch + 1)
    # KIP-360: the first instance's re-init names the epoch it holds, which is no longer current.
    assert init_producer_id(raw, tid, first.producer_id, first.producer_epoch).error_code == kg.ErrorCode.producer_fenced

    pid, old, new = first.producer_id, first.producer_epoch, second.producer_epoch
    assert add_partitions(raw, 3, tid, pid, old, topic_name, [0, 1]) == [kg.ErrorCode.producer_fenced] * 2
    assert add_partitions(raw, 1, tid, pid, old, topic_name, [0]) == [kg.ErrorCode.invalid_producer_epoch]
    assert end_txn(raw, 3, tid, pid, old, True) == kg.ErrorCode.producer_fenced
    # The current instance: nothing open yet, so there is nothing to commit.
    assert end_txn(raw, 3, tid, pid, new, True) == kg.ErrorCode.invalid_txn_state
    assert add_partitions(raw, 3, tid, pid, new, "no-such-topic", [0]) == [kg.ErrorCode.unknown_topic_or_partition]
    assert add_partitions(raw, 3, tid, pid, new, topic_name, [0, 1]) == [kg.ErrorCode.none] * 2
    state = transactions(bus)[tid]
    assert (state["producer_id"], state["producer_epoch"], state["state"]) == (pid, new, "ONGOING")
    assert state["partitions"] == [TopicPartition(topic_name, 0), TopicPartition(topic_name, 1)]
    assert add_partitions(raw, 3, f"{tid}-unknown", pid, new, topic_name, [0]) == [kg.ErrorCode.invalid_producer_id_mapping]
    raw.close()
