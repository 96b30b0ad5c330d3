"""The root exception of agentruns' adapters, and the Kafka runtime's own errors.

It lives in `streams` (not `connectors`) because imports go one way, processors <- streams <-
connectors, and both outer layers raise it. The CLI prints `one_line()` and exits 2.
"""

from __future__ import annotations


class AgentrunsError(Exception):
    """Base of all adapter errors. `hint` says what the user can do about it."""

    def __init__(self, message: str, *, hint: str | None = None, retryable: bool = False) -> None:
        super().__init__(message)
        self.hint = hint
        self.retryable = retryable

    def one_line(self) -> str:
        text = str(self)
        return f"{text} — {self.hint}" if self.hint else text


class AgentrunsKafkaError(AgentrunsError):
    """A Kafka client call failed; `retryable` mirrors librdkafka's own classification."""


class FatalConsumerError(AgentrunsKafkaError):
    """The consumer hit a fatal error and will get nothing more: another member registered its
    ``group.instance.id`` (librdkafka can also fence itself this way when it rejoins after a
    broker restart). The partitions belong to somebody else from now on, so the process must
    stop without committing what it holds; its supervisor starts it again."""


class StuckClientError(FatalConsumerError):
    """A Kafka client call has not finished long past its own timeout: stuck inside librdkafka
    where nothing the loop does reaches it, or a commit resumed for minutes whose outcome is
    still unknown. The process stops as after a fatal consumer error, for its supervisor to
    start it again (the successor's transactional producer fences this one's and completes or
    aborts what it left open; the successor restores from what was committed)."""
