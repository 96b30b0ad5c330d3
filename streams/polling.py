"""Take what a consumer has: wake on the first record, then drain without waiting."""

from __future__ import annotations

from confluent_kafka import Consumer, Message


def poll_batch(
    consumer: Consumer, limit: int, timeout: float, gather: float = 0.0
) -> list[Message]:
    """Up to `limit` records: wait at most `timeout` for the first, then take what has already
    arrived, or with `gather` (seconds) what arrives that much longer: a consumer-side linger.
    (librdkafka's `consume(n, timeout)` returns only when it has n records or the timeout
    passed: as the first wait, under light load, it held every record for the whole timeout.)"""
    first = consumer.poll(timeout)
    if first is None:
        return []
    if limit <= 1:
        return [first]
    return [first, *consumer.consume(limit - 1, gather)]
