"""agentruns: durable, restartable LLM-agent runs on Apache Kafka.

The installed package holds four layers, imported one way:
``agentruns.processors`` (the pure core) <- ``agentruns.streams`` (Kafka plumbing)
<- ``agentruns.connectors`` (services, adapters, CLI); ``agentruns.schemas`` holds the Avro
contracts. The client API is re-exported here and imported on first use, so that
``import agentruns.processors`` stays free of Kafka and HTTP.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentruns.connectors.api.client import (
        ApiClient,
        ClientError,
        InvalidInputError,
        ResultsConsumer,
        RunResult,
        RunsProducer,
        Submission,
    )

__all__ = [
    "ApiClient",
    "ClientError",
    "InvalidInputError",
    "ResultsConsumer",
    "RunResult",
    "RunsProducer",
    "Submission",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(import_module("agentruns.connectors.api.client"), name)
    raise AttributeError(f"module 'agentruns' has no attribute {name!r}")
