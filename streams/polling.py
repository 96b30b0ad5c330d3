"""Take what a consumer has: wake on the first record, then drain without waiting."""

from __future__ import annotations

from collections import deque

from confluent_kafka import Consumer, KafkaError, Message

from agentruns.streams.authorization import REFUSALS, refused
from agentruns.streams.transaction import fatal_error, is_fatal


def check_fatal(messages: list[Message], group: str = "") -> list[Message]:
    """`messages`, unless one carries a fatal consumer error: then raise FatalConsumerError.
    Logged and skipped like any consumer error, it left a process that consumed nothing while
    its transactions could still commit: a zombie beside the member that took its partitions.
    A refusal for want of an ACL (on a topic, or on ``group``) raises one error naming it: no
    retry grants an ACL."""
    for message in messages:
        error = message.error()
        if is_fatal(error):
            raise fatal_error(error)
        if error is not None and error.code() in REFUSALS:
            group_refused = error.code() == KafkaError.GROUP_AUTHORIZATION_FAILED
            name = group if group_refused else (message.topic() or "")
            denied = refused(error, name=name, operation="Read")
            assert denied is not None
            raise denied
    return messages


def poll_batch(
    consumer: Consumer, limit: int, timeout: float, gather: float = 0.0, group: str = ""
) -> list[Message]:
    """Up to `limit` records: wait at most `timeout` for the first, then take what has already
    arrived, or with `gather` (seconds) what arrives that much longer: a consumer-side linger.
    (librdkafka's `consume(n, timeout)` returns only when it has n records or the timeout
    passed: as the first wait, under light load, it held every record for the whole timeout.)
    A fatal consumer error raises FatalConsumerError (see `check_fatal`)."""
    first = consumer.poll(timeout)
    if first is None:
        return []
    if limit <= 1:
        return check_fatal([first], group)
    return check_fatal([first, *consumer.consume(limit - 1, gather)], group)


class Linger:
    """Whether a poll should linger for company (`poll_batch`'s ``gather``): only while records
    come fast enough that the window is expected to bring another, at least one per window
    over the last `HORIZON_S`. A lone record of a quiet or trickling stream (the one call that
    is the whole of a run's step, beside slow calls that answer seconds apart) is on its run's
    critical path and nothing would join it; under load, records gather as before."""

    HORIZON_S = 1.0

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._seen: deque[tuple[float, int]] = deque()
        self._count = 0

    def observe(self, records: int, now: float) -> None:
        """``records`` polled at ``now`` (monotonic seconds)."""
        if records:
            self._seen.append((now, records))
            self._count += records
        while self._seen and self._seen[0][0] < now - self.HORIZON_S:
            self._count -= self._seen.popleft()[1]

    def window(self, now: float) -> float:
        """How long the next poll gathers: the window, or 0 when it would bring no one."""
        self.observe(0, now)
        expected = self._count / self.HORIZON_S * self.window_s
        return self.window_s if self.window_s > 0 and expected >= 1.0 else 0.0
