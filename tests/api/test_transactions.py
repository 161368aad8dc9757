"""Transactional producers through real actors: the coordinator in the controller, ``__transaction_state``,
markers on the partitions' leaders, and read_committed readers."""

from __future__ import annotations

import os
import signal

import pytest
import ray

import logbus
from logbus.actors.controller import CONTROLLER_NAME
from logbus.errors import (
    IllegalStateError,
    InvalidConfigError,
    InvalidTxnStateError,
    ProducerFencedError,
)
from logbus.protocol.transaction_coordinator import TRANSACTION_STATE_TOPIC
from tests.conftest import wait_for


def kill_controller(bus) -> None:
    """SIGKILL the controller's process; returns once Ray restarted it and it answers."""
    controller = ray.get_actor(CONTROLLER_NAME, namespace=bus.namespace)
    pid = ray.get(controller.ping.remote())
    os.kill(pid, signal.SIGKILL)

    def restarted():
        try:
            return ray.get(controller.ping.remote(), timeout=30) != pid
        except Exception:  # noqa: BLE001 (restarting)
            return False

    wait_for(restarted, timeout_s=120, message="controller restart")


def transactions(bus) -> dict:
    return {t["transactional_id"]: t for t in ray.get(bus.controller.describe_transactions.remote(), timeout=60)}


def test_transactional_options_are_checked(bus, topic_name):
    with pytest.raises(InvalidConfigError):
        logbus.Producer(bus, transactional_id="t", acks=1)
    with pytest.raises(InvalidConfigError):
        logbus.Producer(bus, transactional_id="t", enable_idempotence=False)
    with pytest.raises(InvalidConfigError):
        logbus.Producer(bus, transactional_id="")
    plain = logbus.Producer(bus)
    try:
        with pytest.raises(IllegalStateError):
            plain.begin_transaction()
    finally:
        plain.close()


def test_calls_out_of_order_are_refused_before_anything_is_sent(bus, topic_name):
    bus.admin.create_topic(topic_name, partitions=1)
    producer = logbus.Producer(bus, transactional_id=f"{topic_name}-tx")
    try:
        with pytest.raises(InvalidTxnStateError):
            producer.begin_transaction()  # before init_transactions()
        with pytest.raises(InvalidTxnStateError):
            producer.send(topic_name, b"x")
        producer.init_transactions()
        assert producer.acks == "all" and producer.enable_idempotence
        with pytest.raises(InvalidTxnStateError):
            producer.send(topic_name, b"x")  # outside a transaction
        with pytest.raises(InvalidTxnStateError):
            producer.commit_transaction()
        producer.begin_transaction()
        with pytest.raises(InvalidTxnStateError):
            producer.begin_transaction()
        producer.commit_transaction()  # an empty transaction: nothing to tell the coordinator
    finally:
        producer.close()


def test_init_fences_the_previous_instance_and_survives_a_controller_restart(bus, topic_name):
    tid = f"{topic_name}-tx"
    first = logbus.Producer(bus, transactional_id=tid, transaction_timeout_ms=30_000)
    second = logbus.Producer(bus, transactional_id=tid, transaction_timeout_ms=30_000)
    try:
        first.init_transactions()
        state = transactions(bus)[tid]
        assert (state["producer_epoch"], state["state"], state["timeout_ms"]) == (0, "EMPTY", 30_000)
        producer_id = state["producer_id"]
        second.init_transactions()
        assert (transactions(bus)[tid]["producer_id"], transactions(bus)[tid]["producer_epoch"]) == (producer_id, 1)
        assert TRANSACTION_STATE_TOPIC in ray.get(bus.controller.list_topics.remote(include_internal=True), timeout=60)

        kill_controller(bus)
        # The restarted coordinator read __transaction_state: same id and epoch, and the next
        # instance gets the next epoch.
        assert (transactions(bus)[tid]["producer_id"], transactions(bus)[tid]["producer_epoch"]) == (producer_id, 1)
        third = logbus.Producer(bus, transactional_id=tid)
        try:
            third.init_transactions()
            assert (third._producer_id, third._producer_epoch) == (producer_id, 2)
        finally:
            third.close()
    finally:
        first.close()
        second.close()
