"""One record produced and its acknowledgement waited for: what a door that answers only once
the broker has the record (the API's inbox producer, a child run's submission) shares."""

from __future__ import annotations

import threading
import time

from confluent_kafka import KafkaError, Message, Producer

Headers = list[tuple[str, str | bytes | None]]


class NotAcknowledgedError(Exception):
    """The broker did not acknowledge the record in time (it may still be written)."""


def produce_acked(
    producer: Producer,
    topic: str,
    *,
    key: bytes,
    value: bytes,
    partition: int,
    headers: Headers | None,
    timeout_s: float,
) -> KafkaError | None:
    """Produce one record and poll until it is acknowledged: None when written, the broker's
    error when refused; NotAcknowledgedError after ``timeout_s``. KafkaException and
    BufferError from `Producer.produce` propagate."""
    done = threading.Event()
    failure: list[KafkaError] = []

    def delivered(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            failure.append(err)
        done.set()

    producer.produce(
        topic, key=key, value=value, partition=partition, headers=headers or None,
        on_delivery=delivered,
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not done.is_set() and time.monotonic() < deadline:
        producer.poll(0.05)
    if not done.is_set():
        raise NotAcknowledgedError(f"no acknowledgement from {topic} in {timeout_s:g} s")
    return failure[0] if failure else None
