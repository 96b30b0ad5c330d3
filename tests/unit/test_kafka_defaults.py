"""`commit_timed`: one timeout bounds the flush and the commit together. `release`: a producer
stops at once, and never waits without bound for records no broker acknowledges.
`close_consumer`: a consumer whose coordinator cannot be reached does not hold its caller."""

from __future__ import annotations

import time
from typing import Any, cast

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from agentruns.streams.kafka_defaults import (
    FETCH_WINDOW_BYTES,
    LONG_POLL_MS,
    close_consumer,
    commit_timed,
    fetch_settings,
    release,
)


class _Recorder:
    """Stands in for a transactional producer: records the calls and their timeouts."""

    def __init__(self, flush_s: float) -> None:
        self.flush_s = flush_s
        self.calls: list[tuple[str, float]] = []

    def flush(self, timeout: float) -> int:
        self.calls.append(("flush", timeout))
        time.sleep(self.flush_s)
        return 0

    def commit_transaction(self, timeout: float) -> None:
        self.calls.append(("commit", timeout))


def test_the_commit_gets_what_the_flush_left_of_the_timeout() -> None:
    producer = _Recorder(flush_s=0.2)
    began = time.monotonic()
    flushed = commit_timed(cast(Producer, producer), 1.0)
    assert began + 0.2 <= flushed <= time.monotonic()
    (flush, flush_timeout), (commit, commit_timeout) = producer.calls
    assert (flush, commit) == ("flush", "commit") and flush_timeout == 1.0
    assert 0 < commit_timeout <= 0.8


def test_a_flush_that_used_up_the_timeout_leaves_the_commit_a_token_one() -> None:
    producer: Any = _Recorder(flush_s=0.05)
    commit_timed(producer, 0.01)
    assert producer.calls[1] == ("commit", 0.001)


def test_release_purges_what_no_broker_acknowledged_and_closes_the_producer() -> None:
    # nothing listens on port 1: the record can never be acknowledged
    producer = Producer({"bootstrap.servers": "127.0.0.1:1", "log_level": 0})
    producer.produce("t", b"never delivered")
    began = time.monotonic()
    assert release(producer, 0.2) == 1
    assert time.monotonic() - began < 10  # Producer.close() alone would wait for ever
    if hasattr(producer, "close"):  # closed: its threads and connection attempts are gone
        with pytest.raises(RuntimeError):
            producer.produce("t", b"after release")


def test_release_of_an_idle_producer_drops_nothing_and_may_be_repeated() -> None:
    producer = Producer({"bootstrap.servers": "127.0.0.1:1", "log_level": 0})
    assert release(producer, 0.1) == 0
    assert release(producer, 0.1) == 0  # a second close() of its owner


class _Fenced:
    """Stands in for a fenced transactional producer: each call that would end its open
    transaction raises the fatal error librdkafka raises."""

    def __init__(self) -> None:
        self.purged = False
        self.closed = False

    def _fatal(self) -> KafkaException:
        return KafkaException(
            KafkaError(KafkaError.INVALID_TXN_STATE, "Failed to end transaction", fatal=True)
        )

    def __len__(self) -> int:
        return 2

    def flush(self, timeout: float) -> int:
        raise self._fatal()

    def purge(self) -> None:
        self.purged = True

    def poll(self, timeout: float) -> int:
        return 0

    def close(self) -> None:
        self.closed = True
        raise self._fatal()


def test_release_of_a_fenced_producer_raises_nothing_over_the_callers_error() -> None:
    producer = _Fenced()
    assert release(cast(Producer, producer), 0.1) == 2
    assert producer.purged and producer.closed


def test_fetch_settings_window_or_long_poll() -> None:
    # a window: the broker answers when it ends (min bytes out of reach) or a backlog waits
    assert fetch_settings(20) == {"fetch.wait.max.ms": 20, "fetch.min.bytes": FETCH_WINDOW_BYTES}
    # no window: each record answers the held fetch as it lands
    assert fetch_settings(0) == {"fetch.wait.max.ms": LONG_POLL_MS}


def _unreachable_consumer() -> Consumer:
    """A real consumer of a group whose brokers (and so its coordinator) cannot be reached."""
    return Consumer(
        {
            "bootstrap.servers": "127.0.0.1:1",
            "group.id": "unreachable",
            "enable.auto.commit": False,
            "log_level": 0,
        }
    )


def test_close_of_a_consumer_with_a_commit_no_coordinator_takes_returns_in_its_bound() -> None:
    # librdkafka's own close looks for the coordinator without end here
    consumer = _unreachable_consumer()
    consumer.assign([TopicPartition("t", 0, 5)])
    consumer.commit(offsets=[TopicPartition("t", 0, 5)], asynchronous=True)
    began = time.monotonic()
    assert close_consumer(consumer, 1.0) is False
    assert time.monotonic() - began < 3.0


def test_close_of_an_idle_consumer_closes_it_and_may_be_repeated() -> None:
    consumer = _unreachable_consumer()
    consumer.assign([TopicPartition("t", 0, 5)])
    assert close_consumer(consumer, 10.0) is True
    with pytest.raises(RuntimeError):
        consumer.poll(0)  # closed
    assert close_consumer(consumer, 10.0) is True


def test_close_raises_what_the_close_raised_in_the_callers_thread() -> None:
    class Failing:
        def close(self) -> None:
            raise KafkaException(KafkaError(KafkaError._FENCED))

    with pytest.raises(KafkaException):
        close_consumer(cast(Consumer, Failing()), 5.0)
