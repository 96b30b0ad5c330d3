"""Dead letters of the adapters that consume a topic outside a Kafka transaction (the timer
service, the sink): a record built from the consumed message (agentruns.streams.dlq), produced to
`<prefix>.dlq` and flushed BEFORE the consumer's position is committed, so a crash in between
re-reads the record and writes its dead letter again (at least once), never loses it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from confluent_kafka import KafkaException, Message, Producer

from agentruns.streams import dlq, dlq_metrics
from agentruns.streams.clock import now_ms
from agentruns.streams.codec import encode

#: How long a flush of dead letters may wait for the broker before the caller retries.
FLUSH_TIMEOUT_S = 30.0


def of_message(
    message: Message, reason: str, error_class: str = dlq.INVALID_EVENT, *, record: str = ""
) -> dict[str, Any]:
    """The DeadLetter record of one consumed message: reason, bytes, headers and position, and
    its run when the message is a `record` (Effect, Event, Result, Snapshot) whose envelope
    names one."""
    partition, offset = message.partition(), message.offset()
    headers = message.headers()
    pairs = list(headers.items()) if isinstance(headers, dict) else list(headers or ())
    _, timestamp = message.timestamp()
    return dlq.dead_letter(
        reason,
        error_class,
        message.topic() or "",
        -1 if partition is None else partition,
        -1 if offset is None else offset,
        message.key(),
        message.value(),
        pairs,
        now_ms(),
        original_timestamp=timestamp if timestamp > 0 else None,
        run_id=dlq.run_of(message.value(), record) if record else None,
    )


def send(
    producer: Producer, topic: str, records: Sequence[dict[str, Any]], *, component: str
) -> None:
    """Produce `records` to the DLQ topic and wait for them. Each is keyed by its run when the
    run is known, else by the original key (`dlq.key_of`); `producer` partitions by the key
    (`KEYED_PARTITIONER`). Once delivered they are counted as ``component``'s
    (`agentruns_dlq_records_total`)."""
    if not records:
        return
    for record in records:
        producer.produce(topic, key=dlq.key_of(record), value=encode("DeadLetter", record))
    if producer.flush(FLUSH_TIMEOUT_S) != 0:
        raise KafkaException(f"{len(records)} dead letters not delivered to {topic} in time")
    for record in records:
        dlq_metrics.dead_lettered(component, record["error_class"])


def first_line(exc: BaseException) -> str:
    """An exception as one short line for a reason (Postgres errors span several lines)."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}"[:500]
