"""agentruns: durable, restartable LLM-agent runs on Apache Kafka.

The client API is exported here:

- `RunsProducer` submits tasks (and cancels) to the inbox topic, idempotently;
- `ResultsConsumer` reads terminal results, read_committed, as a consumer group;
- `ApiClient` talks to the HTTP API (submit, read, reply, cancel, operator actions);
- `Submission`, `RunResult` are what they return; `InvalidInputError` (a task refused before
  anything is produced) and `ClientError` (an HTTP call failed) what they raise.

Example:
    ```python
    from agentruns import ResultsConsumer, RunsProducer

    with RunsProducer("127.0.0.1:19092", producer_id="orders-service") as producer:
        producer.submit(task, idempotency_key="order-42")
    with ResultsConsumer("127.0.0.1:19092", group_id="billing") as results:
        for result in results.results(follow=True):
            print(result.run_id, result.status.value)
    ```

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
