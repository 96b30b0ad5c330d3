"""An in-memory stand-in for the Kafka clients the processor gets from its factory
(`agentruns.streams.clients.KafkaClients`), for unit tests of its restore, rebalance, eviction
and recovery without a broker.

`MemoryCluster` holds topics (per partition, a list of committed records) and a group's
committed offsets. Its clients implement only what the processor calls:

- `MemoryProducer`: transactions. Records produced in a transaction become visible to readers
  at `commit_transaction`, with the offsets `send_offsets_to_transaction` sent; an abort drops
  both (read_committed as the broker serves it). `fail` makes the next call of a step raise.
- `MemoryConsumer`: the group consumer: committed offsets, seeks, pauses, group metadata, the
  partition count of a topic.
- `MemoryReader`: a restore's reader: assigned partitions read in order, each followed once by a
  `_PARTITION_EOF` event when its end is reached (`enable.partition.eof`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition

Headers = list[tuple[str, str | bytes | None]]


@dataclass(frozen=True)
class Stored:
    """One committed record of a partition."""

    key: bytes | None
    value: bytes | None
    timestamp: int
    headers: Headers = field(default_factory=list)


@dataclass
class MemoryMessage:
    """What of `confluent_kafka.Message` our code reads."""

    _topic: str
    _partition: int
    _offset: int
    _key: bytes | None = None
    _value: bytes | None = None
    _timestamp: int = 0
    _headers: Headers = field(default_factory=list)
    _error: KafkaError | None = None

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def timestamp(self) -> tuple[int, int]:
        return (1, self._timestamp)  # TIMESTAMP_CREATE_TIME

    def headers(self) -> Headers:
        return self._headers

    def error(self) -> KafkaError | None:
        return self._error


class MemoryCluster:
    """Topics of `partitions` partitions each, and one group's committed offsets."""

    def __init__(self, partitions: int = 3) -> None:
        self.partitions = partitions
        self.logs: dict[tuple[str, int], list[Stored]] = {}
        self.committed: dict[tuple[str, int], int] = {}
        self.lock = threading.Lock()  # the committer thread commits, the test reads

    def log(self, topic: str, partition: int) -> list[Stored]:
        return self.logs.setdefault((topic, partition), [])

    def append(
        self,
        topic: str,
        partition: int,
        key: bytes | None,
        value: bytes | None,
        timestamp: int = 0,
        headers: Headers | None = None,
    ) -> int:
        """A committed record; its offset."""
        with self.lock:
            log = self.log(topic, partition)
            log.append(Stored(key, value, timestamp, headers or []))
            return len(log) - 1

    def message(self, topic: str, partition: int, offset: int) -> MemoryMessage:
        stored = self.log(topic, partition)[offset]
        return MemoryMessage(
            topic,
            partition,
            offset,
            stored.key,
            stored.value,
            stored.timestamp,
            list(stored.headers),
        )


@dataclass
class _Produced:
    topic: str
    partition: int
    key: bytes | None
    value: bytes | None
    headers: Headers
    on_delivery: Callable[[KafkaError | None, Any], None] | None


class MemoryProducer:
    """A transactional producer over a `MemoryCluster`; `calls` records each step by name."""

    def __init__(self, cluster: MemoryCluster, slot: str) -> None:
        self.cluster = cluster
        self.slot = slot
        self.calls: list[str] = []
        self.fail: dict[str, Exception] = {}  # step -> what its next call raises
        self._records: list[_Produced] = []
        self._offsets: dict[tuple[str, int], int] = {}
        self.closed = False

    def _step(self, name: str) -> None:
        self.calls.append(name)
        error = self.fail.pop(name, None)
        if error is not None:
            raise error

    def begin_transaction(self) -> None:
        self._step("begin")
        self._records, self._offsets = [], {}

    def produce(
        self,
        topic: str,
        key: bytes | None = None,
        value: bytes | None = None,
        partition: int = -1,
        headers: Headers | None = None,
        on_delivery: Callable[[KafkaError | None, Any], None] | None = None,
    ) -> None:
        self._step("produce")
        # no partitioner here: a record without a partition goes to partition 0
        self._records.append(
            _Produced(topic, max(partition, 0), key, value, headers or [], on_delivery)
        )

    def send_offsets_to_transaction(
        self, positions: list[TopicPartition], metadata: Any, timeout: float
    ) -> None:
        self._step("offsets")
        for tp in positions:
            self._offsets[(tp.topic, tp.partition)] = tp.offset

    def flush(self, timeout: float = -1) -> int:
        self._step("flush")
        with self.cluster.lock:  # the offsets the records get once committed
            next_offset: dict[tuple[str, int], int] = {}
            for r in self._records:
                where = (r.topic, r.partition)
                offset = next_offset.get(where, len(self.cluster.log(*where)))
                next_offset[where] = offset + 1
                if r.on_delivery is not None:
                    r.on_delivery(None, MemoryMessage(r.topic, r.partition, offset))
        return 0

    def commit_transaction(self, timeout: float = -1) -> None:
        self._step("commit")
        with self.cluster.lock:
            for r in self._records:
                self.cluster.log(r.topic, r.partition).append(
                    Stored(r.key, r.value, int(time.time() * 1000), r.headers)
                )
            self.cluster.committed.update(self._offsets)
        self._records, self._offsets = [], {}

    def abort_transaction(self, timeout: float = -1) -> None:
        self._step("abort")
        self._records, self._offsets = [], {}

    def purge(self) -> None:
        self._records = []

    def poll(self, timeout: float = 0) -> int:
        return 0

    def __len__(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


class MemoryConsumer:
    """The group consumer: answers `committed` from the cluster and records seeks, pauses and
    resumes as (topic, partition, offset) / (topic, partition)."""

    def __init__(self, cluster: MemoryCluster) -> None:
        self.cluster = cluster
        self.seeks: list[tuple[str, int, int]] = []
        self.paused: set[tuple[str, int]] = set()
        self.closed = False

    def committed(self, partitions: list[TopicPartition], timeout: float = -1) -> list[Any]:
        with self.cluster.lock:
            return [
                TopicPartition(
                    tp.topic,
                    tp.partition,
                    self.cluster.committed.get((tp.topic, tp.partition), -1001),
                )
                for tp in partitions
            ]

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append((tp.topic, tp.partition, tp.offset))

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused |= {(tp.topic, tp.partition) for tp in partitions}

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused -= {(tp.topic, tp.partition) for tp in partitions}

    def consumer_group_metadata(self) -> str:
        return "group metadata"

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        partitions = {p: SimpleNamespace(id=p) for p in range(self.cluster.partitions)}
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions=partitions)})

    def close(self) -> None:
        self.closed = True


class MemoryReader:
    """A restore's reader over a `MemoryCluster`. `ends` holds the offset where each assigned
    partition's end was reported; `never_ends` partitions are never at their end (a reader
    that keeps waiting)."""

    def __init__(self, cluster: MemoryCluster, never_ends: frozenset[tuple[str, int]]) -> None:
        self.cluster = cluster
        self.never_ends = never_ends
        self.positions: dict[tuple[str, int], int] = {}
        self.ends: dict[tuple[str, int], int] = {}
        self._at_end: set[tuple[str, int]] = set()
        self.closed = False

    def assign(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            start = 0 if tp.offset == OFFSET_BEGINNING else tp.offset
            self.positions[(tp.topic, tp.partition)] = start

    def get_watermark_offsets(
        self, partition: TopicPartition, timeout: float = -1, cached: bool = False
    ) -> tuple[int, int]:
        return 0, len(self.cluster.log(partition.topic, partition.partition))

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Any]:
        out: list[Any] = []
        with self.cluster.lock:
            for (topic, p), at in self.positions.items():
                log = self.cluster.log(topic, p)
                while at < len(log) and len(out) < num_messages:
                    out.append(self.cluster.message(topic, p, at))
                    at += 1
                self.positions[(topic, p)] = at
                ended = at >= len(log) and (topic, p) not in self.never_ends
                if ended and (topic, p) not in self._at_end and len(out) < num_messages:
                    self._at_end.add((topic, p))
                    self.ends[(topic, p)] = at
                    eof = KafkaError(KafkaError._PARTITION_EOF)
                    out.append(MemoryMessage(topic, p, at, _error=eof))
        if not out:
            time.sleep(min(max(timeout, 0), 0.01))
        return out

    def close(self) -> None:
        self.closed = True


class MemoryClients:
    """`KafkaClients` over a `MemoryCluster`: every client it made is kept for the test."""

    member = "g-0"

    def __init__(self, cluster: MemoryCluster, topic_id: str = "memory-topic") -> None:
        self.cluster = cluster
        self.producers: list[MemoryProducer] = []
        self.consumers: list[MemoryConsumer] = []
        self.readers: list[MemoryReader] = []
        self.never_ends: frozenset[tuple[str, int]] = frozenset()
        self._topic_id = topic_id

    def consumer(self, settings: Mapping[str, Any], fetch_window_ms: int = 0) -> Any:
        consumer = MemoryConsumer(self.cluster)
        self.consumers.append(consumer)
        return consumer

    def producer(self, slot: str, settings: Mapping[str, Any]) -> Any:
        producer = MemoryProducer(self.cluster, slot)
        self.producers.append(producer)
        return producer

    def reader(self) -> Any:
        reader = MemoryReader(self.cluster, self.never_ends)
        self.readers.append(reader)
        return reader

    def topic_id(self, topic: str) -> str:
        return self._topic_id

    def record_limits(self, topics: list[str]) -> dict[str, int]:
        return {}


def abortable(message: str = "the broker refused the transaction") -> KafkaException:
    """A transaction's abortable error (neither fatal nor retriable)."""
    return KafkaException(KafkaError(KafkaError._FAIL, message, txn_requires_abort=True))


__all__ = [
    "MemoryClients",
    "MemoryCluster",
    "MemoryConsumer",
    "MemoryMessage",
    "MemoryProducer",
    "MemoryReader",
    "Stored",
    "abortable",
]
