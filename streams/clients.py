"""Where the processor's Kafka clients come from: one factory (`KafkaClients`) that makes each of
them, so the processor and its collaborators (`streams.restore`, `streams.rebalance`) are
given their clients instead of building them, and a test can hand them in-memory ones.

`ConfluentClients` is the real factory: confluent-kafka clients made from the processor's
configuration (`transaction.Clients` holds the settings the executors share), and the two
questions the processor asks the cluster's admin API once at start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from confluent_kafka import Consumer, Message, Producer, TopicPartition

from agentruns.streams import admin
from agentruns.streams.access import restore_group
from agentruns.streams.kafka_defaults import client_settings
from agentruns.streams.transaction import ClientConfig, Clients, Watermarked


class Reader(Watermarked, Protocol):
    """A consumer that reads assigned partitions to their end and is closed after one read (a
    restore). What of `confluent_kafka.Consumer` a restore uses."""

    def assign(self, partitions: list[TopicPartition]) -> None: ...

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]: ...

    def close(self) -> None: ...


class KafkaClients(Protocol):
    """Every Kafka client the processor uses, and what it asks the cluster's admin API."""

    @property
    def member(self) -> str:
        """``<group>-<instance>``: the static member id and the base of the transactional ids."""
        ...

    def consumer(self, settings: Mapping[str, Any], fetch_window_ms: int = 0) -> Consumer:
        """The group's long-lived consumer (read_committed, manual commits)."""
        ...

    def producer(self, slot: str, settings: Mapping[str, Any]) -> Producer:
        """A transactional producer of slot ``slot``, its transactions initialized."""
        ...

    def reader(self) -> Reader:
        """A new read_committed consumer outside the group that reports each partition's end
        (`KafkaError._PARTITION_EOF`): a restore's."""
        ...

    def topic_id(self, topic: str) -> str:
        """The id the cluster gave ``topic`` (a recreated topic has another)."""
        ...

    def record_limits(self, topics: list[str]) -> dict[str, int]:
        """The largest record each of ``topics`` takes, as far as the cluster tells
        (`admin.record_limits`: the broker's, under "", for topics whose own is unknown)."""
        ...


@dataclass(frozen=True)
class ConfluentClients:
    """`KafkaClients` of confluent-kafka, made from the processor's configuration."""

    clients: Clients

    @classmethod
    def of(cls, config: ClientConfig, group_id: str) -> ConfluentClients:
        return cls(Clients.of(config, group_id))

    @property
    def member(self) -> str:
        return self.clients.member

    def consumer(self, settings: Mapping[str, Any], fetch_window_ms: int = 0) -> Consumer:
        return self.clients.consumer(settings, fetch_window_ms)

    def producer(self, slot: str, settings: Mapping[str, Any]) -> Producer:
        return self.clients.producer(slot, settings)

    def reader(self) -> Reader:
        reader: Reader = Consumer(
            {
                "bootstrap.servers": self.clients.bootstrap,
                **client_settings(),
                "group.id": restore_group(self.clients.group_id),
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "enable.partition.eof": True,
                "fetch.wait.max.ms": 10,
                "log_level": 3,
            }
        )
        return reader

    def topic_id(self, topic: str) -> str:
        return admin.topic_id(self.clients.bootstrap, topic)

    def record_limits(self, topics: list[str]) -> dict[str, int]:
        return admin.record_limits(self.clients.bootstrap, topics)


__all__ = ["ConfluentClients", "KafkaClients", "Reader"]
