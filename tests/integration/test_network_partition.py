"""Network partitions of a 3-broker cluster: each broker in a network namespace of its own, the
test's producer in the machine's, packets dropped between chosen pairs (`netlab`).

A broker cut off from the other two while an acks=all producer writes to every partition: the
other two go on without it (its partitions move to them) and every acknowledged record is in the
log afterwards. Then the producer cut off from one broker but not the others: the partitions
that broker leads wait, the others go on, and when the link is back everything is delivered and
nothing acknowledged is missing.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from agentruns.connectors.devstack.local_kafka import LocalKafka
from agentruns.connectors.devstack.netlab import HOST, NetLab
from agentruns.connectors.devstack.procs import free_port_block
from agentruns.streams.kafka_defaults import client_settings
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic

TOPIC = "partitioned"
PARTITIONS = 6
CUT_S = 15.0


class Writer:
    """An idempotent acks=all producer writing to every partition in turn, keeping what the
    brokers acknowledged (partition, offset) -> value, and when."""

    def __init__(self, bootstrap: str) -> None:
        self.producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                **client_settings(),
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 5,
                "log_level": 0,
            }
        )
        self.acked: dict[tuple[int, int], bytes] = {}
        self.acked_at: dict[int, list[float]] = {p: [] for p in range(PARTITIONS)}
        self.failed: list[str] = []
        self.sent = 0

    def _report(self, error: KafkaError | None, message: Message) -> None:
        if error is not None:
            self.failed.append(str(error))
            return
        partition, offset = message.partition() or 0, message.offset() or 0
        self.acked[(partition, offset)] = message.value() or b""
        self.acked_at[partition].append(time.monotonic())

    def write_for(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            for p in range(PARTITIONS):
                self.producer.produce(
                    TOPIC, value=f"r{self.sent}".encode(), partition=p, on_delivery=self._report
                )
                self.sent += 1
            self.producer.poll(0.05)

    def acked_between(self, partition: int, began: float, ended: float) -> int:
        return sum(began <= t <= ended for t in self.acked_at[partition])


def _log(bootstrap: str) -> dict[tuple[int, int], bytes]:
    reader = Consumer(
        {
            "bootstrap.servers": bootstrap,
            **client_settings(),
            "group.id": "partition-check",
            "enable.partition.eof": True,
            "log_level": 0,
        }
    )
    found: dict[tuple[int, int], bytes] = {}
    try:
        reader.assign([TopicPartition(TOPIC, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        pending = set(range(PARTITIONS))
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            for m in reader.consume(1000, 0.5):
                error = m.error()
                if error is not None and error.code() == KafkaError._PARTITION_EOF:
                    pending.discard(m.partition() or 0)
                elif error is None:
                    found[(m.partition() or 0, m.offset() or 0)] = m.value() or b""
        assert not pending, f"partitions {pending} never reached their end"
    finally:
        reader.close()
    return found


def _leaders(admin: AdminClient) -> dict[int, int]:
    meta = admin.list_topics(TOPIC, timeout=30).topics[TOPIC]
    return {p: info.leader for p, info in meta.partitions.items()}


@pytest.mark.timeout(600)
def test_partitions_of_a_broker_and_of_a_client_lose_no_acknowledged_record(
    tmp_path: Path,
) -> None:
    brokers = ["b1", "b2", "b3"]
    with NetLab(brokers) as lab:
        kafka = LocalKafka(
            tmp_path / "kafka",
            port=free_port_block(6),
            brokers=3,
            placed=[(lab.members[b].address, lab.members[b].command([])) for b in brokers],
        )
        try:
            kafka.start(timeout=180)
            admin = AdminClient(
                {"bootstrap.servers": kafka.bootstrap_servers, **client_settings(), "log_level": 0}
            )
            admin.create_topics(
                [NewTopic(TOPIC, PARTITIONS, 3, config={"min.insync.replicas": "2"})]
            )[TOPIC].result(timeout=60)
            writer = Writer(kafka.bootstrap_servers)
            writer.write_for(3.0)
            assert writer.producer.flush(60) == 0

            # one broker cut off from the other two; the client still reaches all three
            lab.partition("b1", "b2")
            lab.partition("b1", "b3")
            began = time.monotonic()
            writer.write_for(CUT_S)
            ended = time.monotonic()
            lab.heal()
            # the two that still form a quorum and an ISR went on writing
            assert sum(writer.acked_between(p, began, ended) for p in range(PARTITIONS)) > 0
            writer.write_for(10.0)  # b1 catches up and rejoins
            assert writer.producer.flush(120) == 0, "records left unacknowledged after healing"

            # the client cut off from one broker, the brokers still reach each other
            leaders = _leaders(admin)
            cut = leaders[0]
            lab.partition(HOST, brokers[cut - 1])
            began = time.monotonic()
            writer.write_for(CUT_S)
            ended = time.monotonic()
            lab.heal()
            others = [p for p, b in leaders.items() if b != cut]
            if others:  # partitions led elsewhere went on
                assert sum(writer.acked_between(p, began, ended) for p in others) > 0
            assert writer.producer.flush(120) == 0, "records left unacknowledged after healing"

            assert not writer.failed, writer.failed[:5]
            assert len(writer.acked) == writer.sent
            log = _log(kafka.bootstrap_servers)
            missing = {k: v for k, v in writer.acked.items() if log.get(k) != v}
            assert not missing, f"{len(missing)} acknowledged records are not in the log"
        finally:
            kafka.kill()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert lab.router not in left and not any(
        m.netns and m.netns in left for m in lab.members.values()
    ), left
