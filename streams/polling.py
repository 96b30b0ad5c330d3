"""Take what a consumer has: wake on the first record, then drain without waiting."""

from __future__ import annotations

from confluent_kafka import Consumer, Message


def poll_batch(consumer: Consumer, limit: int, timeout: float) -> list[Message]:
    """Up to `limit` records: wait at most `timeout` for the first, then take only what has
    already arrived. (librdkafka's `consume(n, timeout)` returns only when it has n records or
    the timeout passed: under light load it held every record for the whole timeout.)"""
    first = consumer.poll(timeout)
    if first is None:
        return []
    if limit <= 1:
        return [first]
    return [first, *consumer.consume(limit - 1, 0)]
