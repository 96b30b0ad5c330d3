"""What a service does when it starts on a 3-broker cluster that is missing brokers: it waits
for them instead of exiting (found by `agentruns chaos --brokers 3`).

- the topic check (`ensure_topics`) while two brokers are down (no controller quorum: config
  changes time out) goes on once they are back;
- a transactional producer whose coordinator's broker is down starts once it is back (or its
  transaction log partition has moved);
- the processor's look-up of the record size limits leaves out what a broker that is down
  cannot answer (it exited on the future's TimeoutError).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agentruns.connectors.demo.cluster_faults import transaction_coordinator
from agentruns.connectors.devstack.local_kafka import LocalKafka
from agentruns.connectors.devstack.procs import free_port_block
from agentruns.streams import admin, transaction
from agentruns.streams.admin import ensure_topics, record_limits
from agentruns.streams.kafka_defaults import release
from agentruns.streams.topics import INBOX, topic_name
from agentruns.streams.transaction import Clients

DOWN_S = 12.0
SHORT_TIMEOUT_S = 4.0  # each call's bound, shorter than the brokers stay down


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    kafka = LocalKafka(Path(tmp_path_factory.mktemp("cluster")), port=free_port_block(6), brokers=3)
    kafka.start(timeout=180)
    try:
        yield kafka
    finally:
        kafka.kill()


def _down_for(kafka: LocalKafka, brokers: tuple[int, ...], seconds: float) -> threading.Thread:
    kafka.kill(brokers)

    def back() -> None:
        time.sleep(seconds)
        for broker in brokers:
            kafka.start_node(broker, timeout=120)

    thread = threading.Thread(target=back)
    thread.start()
    return thread


def test_the_topic_check_waits_for_a_controller_quorum(
    cluster: LocalKafka, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bootstrap = cluster.bootstrap_servers
    assert set(ensure_topics(bootstrap, prefix=unique_name, partitions=2).values()) == {"created"}
    monkeypatch.setattr(admin, "TIMEOUT_S", SHORT_TIMEOUT_S)
    thread = _down_for(cluster, (1, 2), DOWN_S)
    try:
        outcome = ensure_topics(bootstrap, prefix=unique_name)
    finally:
        thread.join()
    assert set(outcome.values()) == {"exists"}
    assert topic_name(INBOX, unique_name) in outcome


def test_a_transactional_producer_starts_once_its_coordinator_is_back(
    cluster: LocalKafka, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bootstrap = cluster.bootstrap_servers
    clients = Clients(bootstrap, f"{unique_name}-group", "0", 6000, 10000, {}, {})
    release(clients.producer("b", {}))  # the transaction log exists from the first one on
    slot = "a"
    coordinator = transaction_coordinator(bootstrap, f"{clients.member}-{slot}")
    monkeypatch.setattr(transaction, "TIMEOUT_S", SHORT_TIMEOUT_S)
    thread = _down_for(cluster, (coordinator,), DOWN_S)
    try:
        producer = clients.producer(slot, {})
    finally:
        thread.join()
    try:
        producer.begin_transaction()
        producer.commit_transaction(30)
    finally:
        release(producer)


def test_record_limits_leave_out_what_a_broker_down_cannot_answer(
    cluster: LocalKafka, unique_name: str
) -> None:
    bootstrap = cluster.bootstrap_servers
    ensure_topics(bootstrap, prefix=unique_name, partitions=2)
    inbox = topic_name(INBOX, unique_name)
    thread = _down_for(cluster, (1,), DOWN_S)  # the broker whose config is asked for
    try:
        limits = record_limits(bootstrap, [inbox], timeout_s=2.0)
    finally:
        thread.join()
    assert "" not in limits  # the broker's own limit never came
