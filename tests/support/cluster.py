"""A 3-broker cluster's test traffic: a producer writing to every partition of a topic with
acks=all, keeping what was acknowledged, and a reader of the whole log to check it against."""

from __future__ import annotations

import time
from collections.abc import Callable

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic

from agentruns.streams.kafka_defaults import client_settings

TOPIC = "cluster-traffic"
PARTITIONS = 6


def create_topic(bootstrap: str) -> AdminClient:
    """The topic, replication factor 3 and ``min.insync.replicas=2``; returns the admin client."""
    admin = AdminClient({"bootstrap.servers": bootstrap, **client_settings(), "log_level": 0})
    admin.create_topics([NewTopic(TOPIC, PARTITIONS, 3, config={"min.insync.replicas": "2"})])[
        TOPIC
    ].result(timeout=60)
    return admin


def missing_from_log(writer: Writer, bootstrap: str) -> int:
    """How many acknowledged records are not in the log at their acknowledged place."""
    log = read_log(bootstrap)
    return sum(1 for k, v in writer.acked.items() if log.get(k) != v)


class Writer:
    """An idempotent acks=all producer writing to every partition in turn, keeping what the
    brokers acknowledged (partition, offset) -> value, and when."""

    def __init__(self, bootstrap: str, value_bytes: int = 0) -> None:
        self.pad = b"x" * value_bytes
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

    def write_for(self, seconds: float, until: Callable[[], bool] = lambda: False) -> None:
        """Write for ``seconds``, or less once ``until()`` holds."""
        stop = time.monotonic() + seconds
        while time.monotonic() < stop and not until():
            if len(self.producer) > 600:  # the brokers lag: wait for them, queue no more
                self.producer.poll(0.05)
                continue
            for p in range(PARTITIONS):
                self.producer.produce(
                    TOPIC,
                    value=f"r{self.sent}".encode() + self.pad,
                    partition=p,
                    on_delivery=self._report,
                )
                self.sent += 1
            self.producer.poll(0.05)

    def acked_between(self, partition: int, began: float, ended: float) -> int:
        return sum(began <= t <= ended for t in self.acked_at[partition])


def read_log(bootstrap: str) -> dict[tuple[int, int], bytes]:
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
