"""The root of every exception raised by agentruns' adapters.

Adapters convert outside exceptions at the edge (`raise ... from exc`); the CLI turns any
`AgentrunsError` into one clear line on stderr and a non-zero exit code, never a stack trace.
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


class MissingToolError(AgentrunsError):
    """A program the local launchers need (java, mvn, initdb) is not installed."""


class PortInUseError(AgentrunsError):
    """A port the launcher wants to bind is taken by another process."""


class ServiceStartError(AgentrunsError):
    """A local service did not become ready; the message names its log file."""


class ServiceUnreachableError(AgentrunsError):
    """A configured service (KAFKA_BOOTSTRAP_SERVERS, DATABASE_URL) does not answer."""


class AgentrunsKafkaError(AgentrunsError):
    """A Kafka client call failed; `retryable` mirrors librdkafka's own classification."""
