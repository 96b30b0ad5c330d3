"""Reading the run log for audits: every committed record of a topic, up to its current end.

`read_log` groups `<prefix>.events` by run in seq order (all runs, or some, read from their
partitions only), `read_snapshots` gives each run's latest `<prefix>.state` record; `AuditError`
says a topic or the database could not be read.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from agentruns.connectors.errors import AgentrunsError, AgentrunsKafkaError
from agentruns.streams.access import reader_group_prefix
from agentruns.streams.codec import CodecError, decode
from agentruns.streams.kafka_defaults import client_settings, close_consumer
from agentruns.streams.partitioning import partition_for
from agentruns.streams.topics import EVENTS, STATE, topic_name

log = logging.getLogger("agentruns.audit")

#: How often a long read says how far it got (through its ``say``, e.g. a line on stderr).
PROGRESS_EVERY_S = 5.0

Say = Callable[[str], None]


class AuditError(AgentrunsError):
    """The topics or the database could not be read for an audit."""


def read_topic(
    bootstrap: str,
    topic: str,
    expected_name: str,
    *,
    partitions: Sequence[int] | None = None,
    timeout_s: float = 120.0,
    say: Say | None = None,
) -> Iterator[dict[str, Any]]:
    """Every committed record of `topic` (or of some partitions), up to the current end."""
    for _, record in read_keyed(
        bootstrap, topic, expected_name, partitions=partitions, timeout_s=timeout_s, say=say
    ):
        if record is not None:
            yield record


def read_keyed(
    bootstrap: str,
    topic: str,
    expected_name: str,
    *,
    partitions: Sequence[int] | None = None,
    timeout_s: float = 120.0,
    say: Say | None = None,
) -> Iterator[tuple[bytes | None, dict[str, Any] | None]]:
    """Every committed record of `topic` with its key, tombstones (None) included, in each
    partition's order, up to the current end. A read that takes long tells ``say`` how far it
    got every PROGRESS_EVERY_S."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            **client_settings(),
            # never committed; its prefix is what the audit principal's group ACL grants
            "group.id": f"{reader_group_prefix(topic)}{uuid.uuid4().hex[:12]}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "fetch.wait.max.ms": 10,
            "log_level": 3,
        }
    )
    try:
        meta = consumer.list_topics(topic, timeout=30).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise AuditError(
                f"topic {topic} does not exist", hint="check --prefix (agentruns topics list)"
            )
        wanted = sorted(meta.partitions) if partitions is None else list(partitions)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in wanted])
        pending = set(wanted)
        deadline = time.monotonic() + timeout_s
        said, count = time.monotonic(), 0
        while pending:
            now = time.monotonic()
            if now > deadline:
                raise AuditError(f"reading {topic} partitions {sorted(pending)} timed out")
            if say is not None and now - said >= PROGRESS_EVERY_S:
                said = now
                say(
                    f"reading {topic}: {count} records, "
                    f"{len(pending)} of {len(wanted)} partitions to go"
                )
            for message in consumer.consume(1000, 0.5):
                count += 1
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        pending.discard(message.partition() or 0)
                        continue
                    raise AgentrunsKafkaError(f"reading {topic}: {error}")
                value = message.value()
                if value is None:
                    yield message.key(), None
                    continue
                try:
                    yield message.key(), decode(value, expected_name=expected_name).record
                except CodecError as exc:
                    log.error("undecodable record in %s: %s", topic, exc)
    except KafkaException as exc:
        raise AgentrunsKafkaError(f"reading {topic} failed: {exc}") from exc
    finally:
        close_consumer(consumer)


def partition_count(bootstrap: str, topic: str) -> int:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            **client_settings(),
            "group.id": f"{reader_group_prefix(topic)}meta",
        }
    )
    try:
        meta = consumer.list_topics(topic, timeout=30).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise AuditError(f"topic {topic} does not exist", hint="check --prefix")
        return len(meta.partitions)
    finally:
        close_consumer(consumer)


def read_log(
    bootstrap: str, prefix: str, run_ids: Sequence[str] | None = None, *, say: Say | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Event records per run, in seq order (only the partitions of `run_ids` when given)."""
    topic = topic_name(EVENTS, prefix)
    partitions = None
    if run_ids is not None:
        n = partition_count(bootstrap, topic)
        partitions = sorted({partition_for(r, n) for r in run_ids})
    wanted = None if run_ids is None else set(run_ids)
    logs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in read_topic(bootstrap, topic, "Event", partitions=partitions, say=say):
        if wanted is None or record["run_id"] in wanted:
            logs[record["run_id"]].append(record)
    for records in logs.values():
        records.sort(key=lambda r: r["seq"])
    return dict(logs)


def read_snapshots(
    bootstrap: str, prefix: str, *, say: Say | None = None
) -> dict[str, dict[str, Any] | None]:
    """The latest Snapshot record per run (highest version); None for a run whose last state
    record is a tombstone: the processor evicted it after it ended (its log stays whole)."""
    latest: dict[str, dict[str, Any] | None] = {}
    for key, record in read_keyed(bootstrap, topic_name(STATE, prefix), "Snapshot", say=say):
        if record is None:
            if key is not None:
                latest[key.decode("utf-8", "replace")] = None
            continue
        held = latest.get(record["run_id"])
        if held is None or held["version"] <= record["version"]:
            latest[record["run_id"]] = record
    return latest
