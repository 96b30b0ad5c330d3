"""Writes run logs the way the processor does, for the sink bench and the sink and audit tests.

Events are folded with the real core and written with ``agentruns.streams.records`` as Event,
Snapshot and Result records in Kafka transactions, with no processor in between.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from confluent_kafka import Producer

from agentruns.processors.effects import PublishResult
from agentruns.processors.events import Event
from agentruns.processors.transition import Artifact, transition
from agentruns.streams.codec import encode
from agentruns.streams.kafka_defaults import TRANSACTIONAL_PRODUCER, client_settings
from agentruns.streams.partitioning import event_key, partition_for, run_key
from agentruns.streams.records import RunSlot, event_record, input_digest, result_record
from agentruns.streams.topics import EVENTS, RESULTS, STATE, topic_name

Record = tuple[str, bytes, bytes, int]  # topic, key, value, partition


@dataclass
class LogWriter:
    """Writes events the way the processor does: fold, then one transaction per batch holding
    the Event records, the Result records of runs that became terminal, and one Snapshot per
    run touched."""

    bootstrap: str
    prefix: str
    partitions: int
    transactional_id: str = field(default_factory=lambda: f"log-writer-{uuid.uuid4().hex[:8]}")
    slots: dict[str, RunSlot] = field(default_factory=dict)
    # Called with the artifacts of a transaction BEFORE it commits, as the processor does (R2);
    # e.g. `PostgresArtifactStore.put_many`. None: artifacts are not stored (the benchmark).
    write_artifacts: Callable[[Sequence[Artifact]], object] | None = None

    def __post_init__(self) -> None:
        self.events_topic = topic_name(EVENTS, self.prefix)
        self.state_topic = topic_name(STATE, self.prefix)
        self.results_topic = topic_name(RESULTS, self.prefix)
        self._producer = Producer(
            {
                "bootstrap.servers": self.bootstrap,
                **client_settings(),
                "transactional.id": self.transactional_id,
                **TRANSACTIONAL_PRODUCER,
                "linger.ms": 2,
                "compression.type": "lz4",
                "log_level": 3,
            }
        )
        self._producer.init_transactions(30)

    def plan(self, events: Iterable[Event]) -> list[Record]:
        """Fold `events` and return the records of one transaction (snapshots last)."""
        self.planned: list[tuple[str, int]] = []
        self.artifacts: list[Artifact] = []
        records: list[Record] = []
        dirty: dict[str, RunSlot] = {}
        for event in events:
            slot = self.slots.get(event.run_id) or RunSlot(event.run_id)
            result = transition(slot.state, event)
            if result.state is None:
                continue  # the processor refuses it to the DLQ; nothing is logged
            seq = slot.last_seq + 1
            self.artifacts.extend(result.artifacts)
            part = partition_for(event.run_id, self.partitions)
            record = event_record(event.run_id, seq, event, result, input_id=event.event_id)
            records.append(
                (self.events_topic, event_key(event.run_id, seq), encode("Event", record), part)
            )
            self.planned.append((event.run_id, seq))
            for effect in result.effects:
                if isinstance(effect, PublishResult):
                    value = encode("Result", result_record(effect, seq=seq, at=event.at))
                    records.append((self.results_topic, run_key(event.run_id), value, part))
            slot.state = result.state
            slot.last_seq = seq
            slot.updated_at = max(slot.updated_at, event.at)
            # the processor remembers each applied input for dedupe: its snapshots carry the
            # last RECENT_INPUTS of them, and so do these
            slot.remember(f"i:{event.event_id}", input_digest(event.type, record["body"]))
            self.slots[event.run_id] = slot
            dirty[event.run_id] = slot
        for run_id, slot in dirty.items():
            slot.version += 1
            value = encode("Snapshot", slot.to_record())
            part = partition_for(run_id, self.partitions)
            records.append((self.state_topic, run_key(run_id), value, part))
        return records

    def send(self, records: Sequence[Record]) -> float:
        """One transaction; returns the wall time (time.time()) it committed."""
        if self.write_artifacts is not None and self.artifacts:
            self.write_artifacts(self.artifacts)
        self._producer.begin_transaction()
        for topic, key, value, part in records:
            while True:
                try:
                    self._producer.produce(topic, key=key, value=value, partition=part)
                    break
                except BufferError:
                    self._producer.poll(0.01)
        self._producer.commit_transaction(60)
        return time.time()

    def write(self, events: Sequence[Event], per_transaction: int = 500) -> int:
        for start in range(0, len(events), per_transaction):
            self.send(self.plan(events[start : start + per_transaction]))
        return len(events)

    def close(self) -> None:
        """Flush and let the producer go (it would keep reconnecting to a stopped broker)."""
        self._producer.flush(10)
        del self._producer
