"""agentruns for Faust apps (faust-streaming): the codecs, the topics, task submission.

Installed with the `faust` extra (`pip install 'agentruns[faust]'`). What it gives:

- `InputCodec` and `ResultCodec`: Faust codecs for the Avro single-object records of the inbox
  and results topics (docs/contract.md, "Encoding"), registered through the `faust.codecs`
  entry point as ``agentruns_input`` and ``agentruns_result``. A decoded value is the record as
  a dict, resolved to the current schema version (a Result's `body` stays the JSON string);
  bytes that do not decode raise a `CodecError`, which Faust logs and skips.
- `inbox_topic` and `results_topic`: the topics under the configurable prefix
  (`agentruns.streams.topics`), keys as the raw UTF-8 run_id bytes.
- `submit_task`: a task onto the inbox through the app's producer.

The processor writes results in Kafka transactions, and Faust reads with `read_committed` only
when the app is made with ``processing_guarantee="exactly_once"``; `app` makes apps that way.
`examples/faust_app.py` is an app that submits tasks and consumes their terminal results.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

try:
    import faust
    from faust.serializers import codecs
except ImportError:  # the extra is optional; agentruns itself never imports this module
    raise ImportError(
        "agentruns.connectors.faust needs faust-streaming: pip install 'agentruns[faust]'"
    ) from None

from agentruns.connectors.api.client import Submission, task_input
from agentruns.connectors.api.inputs import MAX_RECORD_BYTES, encoded_input
from agentruns.streams.codec import decode, encode
from agentruns.streams.tenant_headers import signed_headers
from agentruns.streams.topics import INBOX, RESULTS, default_prefix, topic_name

__all__ = [
    "INPUT_CODEC",
    "RESULT_CODEC",
    "AvroRecordCodec",
    "InputCodec",
    "ResultCodec",
    "app",
    "inbox_topic",
    "results_topic",
    "submit_task",
]

#: The codec names of the `faust.codecs` entry points (pyproject.toml).
INPUT_CODEC = "agentruns_input"
RESULT_CODEC = "agentruns_result"


class AvroRecordCodec(codecs.Codec):
    """One record type in the single-object encoding (`agentruns.streams.codec`)."""

    record_name: ClassVar[str]

    def _dumps(self, obj: Any) -> bytes:
        return encode(self.record_name, obj)

    def _loads(self, s: bytes) -> Any:
        return decode(s, self.record_name).record


class InputCodec(AvroRecordCodec):
    """Input records of `<prefix>.inbox`; refuses one over the broker's record limit."""

    record_name = "Input"

    def _dumps(self, obj: Any) -> bytes:
        return encoded_input(obj, MAX_RECORD_BYTES)


class ResultCodec(AvroRecordCodec):
    """Result records of `<prefix>.results`."""

    record_name = "Result"


def app(app_id: str, bootstrap: str, **settings: Any) -> faust.App:
    """A Faust app that reads the processor's transactional topics read_committed: Faust sets
    `isolation_level=read_committed` on its consumer only with exactly_once processing."""
    settings.setdefault("processing_guarantee", "exactly_once")
    if settings["processing_guarantee"] != "exactly_once":
        raise ValueError(
            "agentruns topics are written in transactions: a Faust app must read them with"
            ' processing_guarantee="exactly_once" (read_committed)'
        )
    return faust.App(app_id, broker=f"kafka://{bootstrap}", **settings)


def inbox_topic(faust_app: faust.App, prefix: str | None = None) -> faust.TopicT:
    """`<prefix>.inbox` (prefix: $AGENTRUNS_TOPIC_PREFIX, else `agentruns`)."""
    return faust_app.topic(
        topic_name(INBOX, default_prefix() if prefix is None else prefix),
        key_serializer="raw",
        value_serializer=INPUT_CODEC,
    )


def results_topic(faust_app: faust.App, prefix: str | None = None) -> faust.TopicT:
    """`<prefix>.results`: one Result per terminal outcome, keyed by run_id."""
    return faust_app.topic(
        topic_name(RESULTS, default_prefix() if prefix is None else prefix),
        key_serializer="raw",
        value_serializer=RESULT_CODEC,
    )


async def submit_task(
    inbox: faust.TopicT,
    task: Mapping[str, Any],
    *,
    idempotency_key: str,
    producer_id: str,
    at: int | None = None,
    trace_id: str | None = None,
    tenant: str | None = None,
    tenant_key: bytes | None = None,
) -> Submission:
    """Produce a task to the inbox and wait for the broker's acknowledgement; with ``tenant``
    and its Kafka key ``tenant_key`` (`agentruns credentials kafka-key`), for that tenant, in a
    signed `agentruns-tenant` header (`agentruns.streams.tenant_headers`, docs/security.md).

    The record is `RunsProducer.submit`'s (same run id, same numbering), so a task submitted
    again, by this app or any other path, still runs once. It goes through the app's own
    producer, not `inbox.send`: with exactly_once, Faust sends from a transaction of a
    partition the worker consumes, and this app consumes results, not the inbox. The partition
    is the key's under aiokafka's default partitioner, which is Kafka's murmur2 (as
    `agentruns.streams.partitioning.partition_for`)."""
    if (tenant is None) != (tenant_key is None) or tenant_key == b"":
        raise ValueError("give tenant and tenant_key together (a tenant's signed header)")
    submission, record = task_input(
        task, idempotency_key=idempotency_key, producer_id=producer_id, at=at, trace_id=trace_id
    )
    value = InputCodec().dumps(record)
    key = submission.run_id.encode()
    headers = None
    if tenant is not None and tenant_key is not None:
        headers = signed_headers(tenant_key, tenant, key, value)
    producer = inbox.app.producer
    await producer.maybe_start()
    pending = await producer.send(inbox.get_topic_name(), key, value, None, None, headers)
    await pending
    return submission
