"""`poll_batch`: wake on the first record, then take what is there or gather a little longer."""

from __future__ import annotations

from typing import Any, cast

from confluent_kafka import Consumer

from streams.polling import poll_batch


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


def test_no_first_record_no_second_wait() -> None:
    fake = FakeConsumer(None, ["b"])
    assert poll_batch(cast(Consumer, fake), 10, 0.1, gather=0.01) == []
    assert fake.calls == [("poll", 0.1)]


def test_the_rest_is_taken_without_waiting_or_gathered() -> None:
    fake = FakeConsumer("a", ["b", "c"])
    assert poll_batch(cast(Consumer, fake), 10, 0.1) == ["a", "b", "c"]
    assert fake.calls[-1] == ("consume", 0.0)
    assert poll_batch(cast(Consumer, fake), 2, 0.1, gather=0.01) == ["a", "b"]
    assert fake.calls[-1] == ("consume", 0.01)
