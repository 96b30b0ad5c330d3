"""What a service does when it starts on a 3-broker cluster that is missing brokers: it waits
for them instead of exiting (found by `agentruns chaos --brokers 3`).

- the topic check (`ensure_topics`) while two brokers are down (no controller quorum: config
  changes time out) goes on once they are back;
- a transactional producer whose coordinator's broker is down starts once it is back (or its
  transaction log partition has moved);
- the processor's look-up of the record size limits leaves out what a broker that is down
  cannot answer (it exited on the future's TimeoutError);
- a transaction that fails while its coordinator's broker is down is aborted once the
  coordinator answers: the abort that timed out is resumed, not left in progress (every later
  transaction of the producer failed as conflicting with it).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer

from agentruns.connectors.dev.demo.cluster_faults import transaction_coordinator
from agentruns.connectors.dev.stack.local_kafka import LocalKafka
from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.streams import admin, transaction
from agentruns.streams.admin import ensure_topics, record_limits
from agentruns.streams.kafka_defaults import client_settings, close_consumer, release
from agentruns.streams.topics import INBOX, topic_name
from agentruns.streams.transaction import Clients, Committer, Record, Timings

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


def _paused_for(kafka: LocalKafka, broker: int, seconds: float) -> threading.Thread:
    pid = int(kafka.node(broker).pid_file.read_text())
    os.kill(pid, signal.SIGSTOP)

    def back() -> None:
        time.sleep(seconds)
        os.kill(pid, signal.SIGCONT)

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
    # the lowest registered broker is the one whose config is asked for: every broker is in
    # the metadata first, so the one killed is still there when the limits are read
    cluster.wait_ready(120)
    thread = _down_for(cluster, (1,), DOWN_S)
    try:
        limits = record_limits(bootstrap, [inbox], timeout_s=2.0)
    finally:
        thread.join()
    assert "" not in limits  # the broker's own limit never came


@dataclass
class _Unit:
    """One record and the offset after it, for the committer; `durable` may fail the
    transaction (as an artifact store that cannot be reached does)."""

    topic: str
    metadata: Any
    offset: int
    fail: bool = False
    offsets: Mapping[int, int] = field(init=False)
    offset_notes: Mapping[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.offsets = {0: self.offset}

    def records(self) -> Iterable[Record]:
        return [(self.topic, b"key", f"value {self.offset}".encode(), 0, None)]

    def durable(self) -> None:
        if self.fail:
            raise RuntimeError("the store is down")


def test_an_abort_that_timed_out_is_resumed_and_the_next_transaction_commits(
    cluster: LocalKafka,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bootstrap = cluster.bootstrap_servers
    ensure_topics(bootstrap, prefix=unique_name, partitions=2)
    inbox = topic_name(INBOX, unique_name)
    clients = Clients(bootstrap, f"{unique_name}-group", "0", 6000, 10000, {}, {})
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, **client_settings(), "group.id": clients.group_id}
    )
    metadata = consumer.consumer_group_metadata()
    committed: list[_Unit] = []

    def on_commit(units: list[_Unit], _: Timings) -> None:
        committed.extend(units)

    committer: Committer[_Unit] = Committer(
        lambda slot: clients.producer(slot, {}), inbox, on_commit
    )
    # the brokers an earlier test stopped may still be taking back their partitions: the
    # transactions before the abort keep the normal bound, only the abort gets the short one
    cluster.wait_ready(120)
    try:
        assert committer.submit(_Unit(inbox, metadata, 1))
        committer.wait()
        assert [u.offset for u in committed] == [1]
        # the next transaction (the other id) commits too; the one after is the first id's
        assert committer.submit(_Unit(inbox, metadata, 2))
        committer.wait()
        producer = committer.producer
        # a transaction fails (its unit cannot be made durable), and the coordinator stands
        # still (connections open, nothing answered) as the failed transaction is aborted
        failing = _Unit(inbox, metadata, 3, fail=True)
        assert committer.submit(failing)
        committer.wait()
        failure = committer.take_failure()
        assert failure is not None and failure.units == [failing]
        # asked now, not before the first transaction: leadership moves back to a broker an
        # earlier test restarted (the preferred-leader check), and the coordinator with it
        coordinator = transaction_coordinator(bootstrap, f"{clients.member}-a")
        monkeypatch.setattr(transaction, "TIMEOUT_S", SHORT_TIMEOUT_S)
        thread = _paused_for(cluster, coordinator, 2 * SHORT_TIMEOUT_S)
        try:
            with caplog.at_level(logging.WARNING, logger=transaction.log.name):
                committer.recover(failure.error)
        finally:
            thread.join()
            monkeypatch.undo()
        # the abort timed out and was resumed until the coordinator answered: nothing is left
        # in progress, the same producer goes on and its next transaction commits
        timed_out = [
            r
            for r in caplog.records
            if "abort failed" in r.getMessage() and "_TIMED_OUT" in r.getMessage()
        ]
        assert timed_out, caplog.text
        assert committer.producer is producer
        assert committer.submit(_Unit(inbox, metadata, 3))
        committer.wait()
        assert committer.take_failure() is None
        assert [u.offset for u in committed] == [1, 2, 3]
    finally:
        committer.close()
        close_consumer(consumer, 10)
