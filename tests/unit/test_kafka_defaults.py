"""`commit_timed`: one timeout bounds the flush and the commit together."""

from __future__ import annotations

import time
from typing import Any, cast

from confluent_kafka import Producer

from streams.kafka_defaults import commit_timed


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
