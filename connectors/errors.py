"""The root of every exception raised by agentruns' adapters.

Adapters convert outside exceptions at the edge (`raise ... from exc`); the CLI turns any
`AgentrunsError` into one clear line on stderr and a non-zero exit code, never a stack trace.
"""

from __future__ import annotations

from agentruns.streams.errors import AgentrunsError, AgentrunsKafkaError

__all__ = [
    "AgentrunsError",
    "AgentrunsKafkaError",
    "InvalidArgumentError",
    "MissingToolError",
    "NotConfiguredError",
    "PortInUseError",
    "ServiceStartError",
    "ServiceUnreachableError",
]


class InvalidArgumentError(AgentrunsError):
    """A command's argument is unusable: a file that cannot be read, JSON that does not parse."""


class MissingToolError(AgentrunsError):
    """A program the local launchers need (java, mvn, initdb) is not installed."""


class NotConfiguredError(AgentrunsError):
    """A client command found no service to talk to: none in the environment, none running
    locally (client commands never start one)."""


class PortInUseError(AgentrunsError):
    """A port the launcher wants to bind is taken by another process."""


class ServiceStartError(AgentrunsError):
    """A local service did not become ready; the message names its log file."""


class ServiceUnreachableError(AgentrunsError):
    """A configured service (KAFKA_BOOTSTRAP_SERVERS, DATABASE_URL) does not answer."""
