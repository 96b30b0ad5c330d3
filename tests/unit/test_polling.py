"""`poll_batch`: wake on the first record, then take what is there or gather a little longer;
a fatal consumer error stops the caller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pytest
from confluent_kafka import Consumer, KafkaError

from agentruns.streams.errors import FatalConsumerError
from agentruns.streams.polling import check_fatal, poll_batch


@dataclass(frozen=True)
class FakeMessage:
    name: str
    err: KafkaError | None = None

    def error(self) -> KafkaError | None:
        return self.err


class FakeConsumer:
    """Records the waits it was asked for; `consume` returns what `later` holds."""

    def __init__(self, first: Any, later: list[Any]) -> None:
        self.first, self.later = first, later
        self.calls: list[tuple[str, float]] = []

    def poll(self, timeout: float) -> Any:
        self.calls.append(("poll", timeout))
        return self.first

    def consume(self, n: int, timeout: float) -> list[Any]:
        self.calls.append(("consume", timeout))
        return self.later[:n]


A, B, C = FakeMessage("a"), FakeMessage("b"), FakeMessage("c")


def test_no_first_record_no_second_wait() -> None:
    fake = FakeConsumer(None, [B])
    assert poll_batch(cast(Consumer, fake), 10, 0.1, gather=0.01) == []
    assert fake.calls == [("poll", 0.1)]


def test_the_rest_is_taken_without_waiting_or_gathered() -> None:
    fake = FakeConsumer(A, [B, C])
    assert poll_batch(cast(Consumer, fake), 10, 0.1) == [A, B, C]
    assert fake.calls[-1] == ("consume", 0.0)
    assert poll_batch(cast(Consumer, fake), 2, 0.1, gather=0.01) == [A, B]
    assert fake.calls[-1] == ("consume", 0.01)


def test_a_fatal_consumer_error_raises_and_others_pass() -> None:
    eof = FakeMessage("eof", KafkaError(KafkaError._PARTITION_EOF))
    fenced = FakeMessage(
        "fenced",
        KafkaError(KafkaError.FENCED_INSTANCE_ID, "fenced by other consumer", fatal=True),
    )
    assert check_fatal(cast(Any, [A, eof])) == [A, eof]  # the callers skip plain errors
    with pytest.raises(FatalConsumerError, match="fenced by other consumer"):
        poll_batch(cast(Consumer, FakeConsumer(A, [fenced])), 10, 0.1)
    with pytest.raises(FatalConsumerError):
        poll_batch(cast(Consumer, FakeConsumer(fenced, [])), 1, 0.1)
    # how librdkafka delivers it to a consumer: the code _FATAL, the flag not set
    event = FakeMessage("fatal", KafkaError(KafkaError._FATAL, "Fatal error: fenced"))
    with pytest.raises(FatalConsumerError, match="Fatal error: fenced"):
        check_fatal(cast(Any, [A, event]))
