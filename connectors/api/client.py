"""The users' Python API and the `agentruns submit | results | reply | cancel` commands.

Upstream (`RunsProducer`): idempotent task submission straight to `<prefix>.inbox`, for the
processor's default tenant or, with a tenant's Kafka key, for that tenant (a signed
`agentruns-tenant` header; docs/security.md).
Downstream (`ResultsConsumer`): terminal results from `<prefix>.results`, read_committed, with
committed consumer-group offsets. Over HTTP (`ApiClient`): submit, read, reply, cancel through
`agentruns api` (replies always go through the API: it verifies the signed resume token).

Numbering rule of `RunsProducer` (documented in docs/api.md): `producer_seq` is gapless per
(run_id, producer_id), starting at 1, so nothing needs to be stored to continue after a restart:

- a task's `RunSubmitted` is input 1 of its producer for its run (run_id derives from the
  idempotency key, event id ``<run_id>:submit``), so re-submitting the same key after a crash
  is dropped by the processor (seq already seen) and by the core (same event id);
- a follow-up input for a run the producer submitted (`cancel`) is numbered
  ``producer_seq = n`` by the caller, who knows how many it sent (2 for the first cancel).
  Inputs the producer does not number (producer_seq=None) are deduplicated by input_id.

Pass the same `at` when re-submitting the same task to make the retry byte-identical; with a new
`at` the processor still drops it, and records the difference as a conflicting duplicate on the
dead-letter topic (R5).

`RunsProducer` refuses what the API refuses, before anything is produced: a task the core would
fail (its decode bounds, `agentruns.processors.validation.task_problem`), one that widens the
operator's tool catalog it was given (`catalog=`), and a record over `max_record_bytes` raise
`InvalidInputError` with the reason `invalid_input:<what>: ...`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from agentruns.connectors.api.inputs import (
    MAX_RECORD_BYTES,
    InvalidInputError,
    encoded_input,
    submitted_task,
)
from agentruns.connectors.errors import AgentrunsError, InvalidArgumentError, NotConfiguredError
from agentruns.connectors.keys import TENANT_KAFKA_KEY_ENV, producer_tenant_key
from agentruns.connectors.lifecycle import stop_on_signals
from agentruns.connectors.settings import current
from agentruns.processors.catalog import Catalog
from agentruns.processors.events import CancelRequested, ForkedFrom
from agentruns.processors.ids import run_id_for_key, submit_event_id, trace_id_for
from agentruns.processors.state import TERMINAL, RunStatus
from agentruns.processors.tenants import valid_tenant
from agentruns.streams import tracing
from agentruns.streams.clock import now_ms
from agentruns.streams.codec import CodecError, decode
from agentruns.streams.errors import AgentrunsKafkaError
from agentruns.streams.kafka_defaults import (
    NO_DELAY,
    client_settings,
    close_consumer,
    partition_count,
    release,
)
from agentruns.streams.partitioning import partition_for
from agentruns.streams.records import input_record
from agentruns.streams.tenant_headers import signed_headers
from agentruns.streams.topics import DEFAULT_PREFIX, INBOX, RESULTS, default_prefix, topic_name

log = logging.getLogger("agentruns.client")

__all__ = [
    "ApiClient",
    "ClientError",
    "InvalidInputError",
    "ResultsConsumer",
    "RunResult",
    "RunsProducer",
    "Submission",
    "main_cancel",
    "main_redrive",
    "main_reopen",
    "main_reply",
    "main_resolve",
    "main_results",
    "main_submit",
    "task_input",
]


class ClientError(AgentrunsError):
    """A call through `ApiClient` failed.

    Attributes:
        status: The HTTP status of the answer, or None when no answer came (a connection
            error); the error is retryable when there was no answer or the status is 5xx.
        code: The API's error code (`error` of the answer's body), when it gave one.
        reason: `invalid_input:<what>: ...` when the API refused the input.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        reason: str | None = None,
    ):
        super().__init__(message, retryable=status is None or status >= 500)
        self.status = status
        self.code = code
        self.reason = reason  # `invalid_input:<what>: ...` when the API refused the input


@dataclass(frozen=True, slots=True)
class Submission:
    """What names a queued input: returned by `RunsProducer.submit` and `RunsProducer.cancel`.

    Attributes:
        run_id: The run's id, derived from the idempotency key (`run-<32 hex>`): the same key
            always names the same run.
        trace_id: The run's trace id.
        input_id: The input's id on the inbox (`<run_id>:submit` for a task).
    """

    run_id: str
    trace_id: str
    input_id: str


# --------------------------------------------------------------------------- upstream


def task_input(
    task: Mapping[str, Any],
    *,
    idempotency_key: str,
    producer_id: str,
    at: int | None = None,
    trace_id: str | None = None,
    catalog: Catalog | None = None,
) -> tuple[Submission, dict[str, Any]]:
    """The inbox record of a task (input 1 of `producer_id` for its run) and what names it;
    InvalidInputError for a task the core would refuse, or the operator's tool `catalog`
    (a tool field the task leaves out is the catalog's). Every producer of tasks builds its
    record here (RunsProducer, agentruns.connectors.faust)."""
    run_id = run_id_for_key(idempotency_key)
    event = submitted_task(
        {k: v for k, v in task.items() if k != "trace_id"},
        catalog=catalog,
        run_id=run_id,
        event_id=submit_event_id(run_id),
        at=now_ms() if at is None else at,
        trace_id=trace_id or task.get("trace_id") or trace_id_for(run_id),
    )
    record = input_record(event, input_id=event.event_id, producer_id=producer_id, producer_seq=1)
    return Submission(run_id, event.trace_id, event.event_id), record


class RunsProducer:
    """Submits tasks (and cancels) straight to the `<prefix>.inbox` topic.

    Submission is idempotent: the idempotency key names the run, and a task is input 1 of its
    producer for that run, so submitting the same key again (after a crash, from another
    process with the same `producer_id`) never starts a second run. A task the API would
    refuse is refused here too, before anything is produced. Use it as a context manager:
    leaving the block waits for every queued input to be acknowledged.

    Args:
        bootstrap: Kafka bootstrap servers, `host:port[,...]`.
        producer_id: A stable, non-empty name of this producer (a service name): inputs are
            numbered per run and producer.
        prefix: The topic prefix of the deployment (`agentruns` by default).
        partitions: The inbox's partition count; None reads it from the broker.
        max_record_bytes: The largest record to produce; a larger one raises
            `InvalidInputError`.
        extra: librdkafka settings added to the producer's (security: `security.protocol`,
            `sasl.*`, `ssl.*`).
        catalog: The operator's tool catalog (`agentruns.connectors.catalog.catalog_of`); a
            task that widens it is refused. None: no catalog check here (the processor still
            makes it when it holds one).
        tenant: The tenant this producer submits for, named in each task's signed
            `agentruns-tenant` header (docs/security.md, "Tenants"); None: no header (the
            processor's default tenant).
        tenant_key: That tenant's Kafka key (32 bytes; `agentruns credentials kafka-key
            --tenant T` prints it in hex, `agentruns.connectors.keys.producer_tenant_key`
            reads it from `AGENTRUNS_TENANT_KAFKA_KEY`): each task's record is signed with it
            (`agentruns.streams.tenant_headers.signed_headers`).

    Raises:
        ValueError: `producer_id` is empty, or `tenant` and `tenant_key` are not given
            together (or `tenant` is no tenant name).
        AgentrunsKafkaError: the inbox's partition count could not be read.

    Example:
        ```python
        from agentruns import RunsProducer

        with RunsProducer("127.0.0.1:19092", producer_id="orders-service") as producer:
            submission = producer.submit(
                {
                    "goal": "Tell the customer of order 42 when it ships.",
                    "messages": [{"role": "user", "content": "When does order 42 ship?"}],
                },
                idempotency_key="order-42",
            )
        print(submission.run_id)  # the same for every submission of "order-42"
        ```
    """

    def __init__(
        self,
        bootstrap: str,
        *,
        producer_id: str,
        prefix: str = DEFAULT_PREFIX,
        partitions: int | None = None,
        max_record_bytes: int = MAX_RECORD_BYTES,
        extra: Mapping[str, Any] | None = None,
        catalog: Catalog | None = None,
        tenant: str | None = None,
        tenant_key: bytes | None = None,
    ) -> None:
        if not producer_id:
            raise ValueError("producer_id must be a stable, non-empty name")
        if (tenant is None) != (tenant_key is None) or tenant_key == b"":
            raise ValueError("give tenant and tenant_key together (a tenant's signed header)")
        if tenant is not None and not valid_tenant(tenant):
            raise ValueError(f"{tenant!r} is not a tenant name")
        self.tenant = tenant
        self._tenant_key = tenant_key
        self.producer_id = producer_id
        # the operator's tool catalog (agentruns.connectors.catalog.catalog_of): a task that
        # widens it is refused here, as the processor would fail its run
        self.catalog = catalog
        self.max_record_bytes = max_record_bytes
        self.topic = topic_name(INBOX, prefix)
        self._producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                **client_settings(),
                "enable.idempotence": True,
                "linger.ms": 5,
                **NO_DELAY,
                "log_level": 3,
                **(extra or {}),
            }
        )
        self.partitions = partitions or partition_count(self._producer, self.topic)
        self._errors: list[KafkaError] = []

    def submit(
        self,
        task: Mapping[str, Any],
        *,
        idempotency_key: str,
        at: int | None = None,
        trace_id: str | None = None,
        traceparent: str | None = None,
    ) -> Submission:
        """Queue a task for its run; `flush()` (or leaving the `with` block) waits for it.

        Args:
            task: The task (`schemas/json/task.schema.json`): `goal`, `messages`, `tools`
                and optionally `policy`, `budgets`, `loop`, `model_route`, `trace_id`.
            idempotency_key: Names the run: the same key never starts a second run.
            at: The submission time in ms since the epoch; None: now. Pass the same `at` when
                submitting a task again to make the retry byte-identical.
            trace_id: The run's trace id; None: the task's, else one derived from the run id.
            traceparent: A W3C `traceparent` to continue as the run's trace; None or a
                malformed one: a new trace starts.

        Returns:
            The run id, trace id and input id of the submission.

        Raises:
            InvalidInputError: The core would refuse the task, it widens the catalog, or its
                record is over `max_record_bytes`; `reason` is `invalid_input:<what>: ...`
                and nothing is produced.
            AgentrunsKafkaError: The record could not be queued (the local queue is full).
        """
        context = tracing.parse(traceparent)
        if not tracing.enabled():
            return self._submit(task, idempotency_key, at, trace_id, context)
        if context is None:  # the run's span is the root of its trace (streams/tracing.py)
            own = trace_id or task.get("trace_id")
            context = tracing.run_context(
                run_id_for_key(idempotency_key), own if isinstance(own, str) else None, None
            )
        span = tracing.start("submit", context, tracing.sent(self.topic), kind="PRODUCER")
        try:
            out = self._submit(task, idempotency_key, at, trace_id, tracing.traceparent_of(span))
        except BaseException as exc:
            tracing.end(span, f"{type(exc).__name__}: {exc}")
            raise
        span.set_attribute("agentruns.run_id", out.run_id)
        tracing.end(span)
        return out

    def _submit(
        self,
        task: Mapping[str, Any],
        idempotency_key: str,
        at: int | None,
        trace_id: str | None,
        traceparent: str | None,
    ) -> Submission:
        submission, record = task_input(
            task,
            idempotency_key=idempotency_key,
            producer_id=self.producer_id,
            at=at,
            trace_id=trace_id,
            catalog=self.catalog,
        )
        self._send(record, tracing.headers_of(traceparent), signed=True)
        return submission

    def cancel(
        self,
        run_id: str,
        *,
        producer_seq: int | None = None,
        reason: str = "requested",
        trace_id: str | None = None,
        at: int | None = None,
    ) -> Submission:
        """Queue a request to cancel a run.

        Args:
            run_id: The run to cancel.
            producer_seq: This producer's number of the input for the run (2 for the first
                cancel of a run it submitted); None: deduplicated by its input id alone.
            reason: Recorded with the cancellation.
            trace_id: The run's trace id; None: derived from the run id.
            at: The request time in ms since the epoch; None: now.

        Returns:
            The run id, trace id and input id of the request.

        Raises:
            AgentrunsKafkaError: The record could not be queued.
        """
        tag = producer_seq if producer_seq is not None else "x"
        input_id = f"cancel:{run_id}:{self.producer_id}:{tag}"
        event = CancelRequested(
            run_id=run_id,
            event_id=input_id,
            at=now_ms() if at is None else at,
            trace_id=trace_id or trace_id_for(run_id),
            reason=reason,
        )
        pid = self.producer_id if producer_seq is not None else None
        record = input_record(event, input_id=input_id, producer_id=pid, producer_seq=producer_seq)
        self._send(record)
        return Submission(run_id, event.trace_id, input_id)

    def fork(self, record: ForkedFrom) -> Submission:
        """Queue the first record of a fork (`agentruns.connectors.forks.plan` makes it): input
        1 of this producer for the fork's run, like a task, so the same fork twice is one.

        Raises:
            InvalidInputError: Its record is over `max_record_bytes`; nothing is produced.
            AgentrunsKafkaError: The record could not be queued.
        """
        self._send(
            input_record(
                record, input_id=record.event_id, producer_id=self.producer_id, producer_seq=1
            )
        )
        return Submission(record.run_id, record.trace_id, record.event_id)

    def _send(
        self,
        record: dict[str, Any],
        headers: list[tuple[str, str | bytes | None]] | None = None,
        *,
        signed: bool = False,
    ) -> None:
        def delivered(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                self._errors.append(err)

        run_id = record["run_id"]
        value = encoded_input(record, self.max_record_bytes)
        if signed and self.tenant is not None and self._tenant_key is not None:
            # the task's tenant, bound to this record by its tenant's key
            headers = [
                *(headers or ()),
                *signed_headers(self._tenant_key, self.tenant, run_id.encode(), value),
            ]
        try:
            self._producer.produce(
                self.topic,
                key=run_id.encode(),
                value=value,
                partition=partition_for(run_id, self.partitions),
                headers=headers or None,
                on_delivery=delivered,
            )
        except (KafkaException, BufferError) as exc:
            raise AgentrunsKafkaError(f"producing to {self.topic}: {exc}", retryable=True) from exc
        self._producer.poll(0)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued input is acknowledged by the broker.

        Args:
            timeout_s: How long to wait.

        Raises:
            AgentrunsKafkaError: An input was not acknowledged in time or not delivered
                (retryable: submitting the same task again is safe).
        """
        left = self._producer.flush(timeout_s)
        if left:
            raise AgentrunsKafkaError(f"{left} inputs not acknowledged in time", retryable=True)
        if self._errors:
            first, self._errors = self._errors[0], []
            raise AgentrunsKafkaError(f"an input was not delivered: {first}", retryable=True)

    def close(self) -> None:
        """Wait for every queued input, then release the client.

        Inputs still unacknowledged when it raises are dropped, never sent later.

        Raises:
            AgentrunsKafkaError: As `flush` does.
        """
        try:
            self.flush()
        finally:
            release(self._producer, 0)

    def __enter__(self) -> RunsProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- downstream


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run's terminal result, as read from `<prefix>.results`.

    Attributes:
        run_id: The run.
        status: Its terminal status (`SUCCEEDED`, `FAILED`, `CANCELLED`, `EXPIRED`, ...).
        version: The run's state version at its end.
        seq: The run's last seq at its end.
        result_ref: The content-addressed artifact of the final answer, if any.
        summary: A short text of the outcome (the failure reason for a failed run).
        trace_id: The run's trace id.
        at: The event time of the end, ms since the epoch.
        body: The whole result record's body.
        partition: The record's partition on the results topic.
        offset: The record's offset there.
    """

    run_id: str
    status: RunStatus
    version: int
    seq: int
    result_ref: str | None
    summary: str | None
    trace_id: str
    at: int
    body: dict[str, Any]
    partition: int
    offset: int

    def as_json(self) -> dict[str, Any]:
        """The result's fields as a JSON object (what `agentruns results` prints a line of)."""
        return {
            "run_id": self.run_id,
            "status": self.status.value,
            "version": self.version,
            "seq": self.seq,
            "result_ref": self.result_ref,
            "summary": self.summary,
            "trace_id": self.trace_id,
            "at": self.at,
        }


class ResultsConsumer:
    """Reads terminal results from `<prefix>.results` as a member of a consumer group.

    It reads read_committed, so it never sees a result whose run's events were not committed.
    Offsets are committed for the group: a result's offset is stored once the caller asks for
    the next one (it has handled this one), and committed every `commit_interval_ms` and at
    `close()`. So a restarted consumer resumes after the last handled result: at least once.
    A record that cannot be decoded is logged, counted in `skipped` and passed over.

    Args:
        bootstrap: Kafka bootstrap servers, `host:port[,...]`.
        group_id: The consumer group; a service keeps one stable id to resume where it
            stopped, and several members of one group share the partitions.
        prefix: The topic prefix of the deployment (`agentruns` by default).
        from_beginning: Where a group without committed offsets starts: the oldest result
            (True) or only new ones (False).
        commit_interval_ms: How often stored offsets are committed.
        extra: librdkafka settings added to the consumer's (security settings).

    Example:
        ```python
        from agentruns import ResultsConsumer

        with ResultsConsumer("127.0.0.1:19092", group_id="billing") as results:
            for result in results.results(follow=True):
                print(result.run_id, result.status.value, result.result_ref)
        ```
    """

    def __init__(
        self,
        bootstrap: str,
        *,
        group_id: str,
        prefix: str = DEFAULT_PREFIX,
        from_beginning: bool = True,
        commit_interval_ms: int = 1000,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        self.topic = topic_name(RESULTS, prefix)
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                **client_settings(),
                "group.id": group_id,
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest" if from_beginning else "latest",
                "enable.auto.commit": True,
                "auto.commit.interval.ms": commit_interval_ms,
                "enable.auto.offset.store": False,
                "enable.partition.eof": True,
                **NO_DELAY,
                "log_level": 3,
                **(extra or {}),
            }
        )
        self._assigned: set[int] = set()
        self._at_end: set[int] = set()
        self._lock = threading.Lock()
        self._consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke)
        self.skipped = 0

    def _on_assign(self, _c: Consumer, partitions: list[TopicPartition]) -> None:
        with self._lock:
            self._assigned |= {p.partition for p in partitions}

    def _on_revoke(self, _c: Consumer, partitions: list[TopicPartition]) -> None:
        with self._lock:
            gone = {p.partition for p in partitions}
            self._assigned -= gone
            self._at_end -= gone

    def results(
        self,
        *,
        follow: bool = False,
        idle_timeout_s: float = 30.0,
        stop: threading.Event | None = None,
    ) -> Iterator[RunResult]:
        """Iterate over terminal results, in order within each partition.

        Args:
            follow: False: stop at the end of every assigned partition. True: wait for new
                results until `stop` is set or the caller stops iterating.
            idle_timeout_s: Without `follow`, stop after this long with no partition assigned
                and no record.
            stop: An event that ends the iteration when set (from another thread).

        Yields:
            Each result; its offset is stored for the group when the next one is asked for.

        Raises:
            AgentrunsKafkaError: Consuming failed (retryable: a new consumer of the same
                group resumes after the last handled result).
        """
        idle_since = time.monotonic()
        while stop is None or not stop.is_set():
            msg = self._consumer.poll(0.2)
            if msg is None:
                with self._lock:
                    done = bool(self._assigned) and self._assigned <= self._at_end
                if not follow and (done or time.monotonic() - idle_since > idle_timeout_s):
                    return
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    with self._lock:
                        self._at_end.add(msg.partition() or 0)
                    continue
                raise AgentrunsKafkaError(f"consuming {self.topic}: {err}", retryable=True)
            idle_since = time.monotonic()
            with self._lock:
                self._at_end.discard(msg.partition())
            value = msg.value()
            try:
                record = decode(value or b"", "Result").record
                result = RunResult(
                    run_id=record["run_id"],
                    status=RunStatus(record["status"]),
                    version=record["version"],
                    seq=record["seq"],
                    result_ref=record["result_ref"],
                    summary=record["summary"],
                    trace_id=record["trace_id"],
                    at=record["at"],
                    body=json.loads(record["body"]),
                    partition=msg.partition() or 0,
                    offset=msg.offset() or 0,
                )
            except (CodecError, ValueError) as exc:
                # Never lost, never fatal (R30): the bytes stay on the topic; report and go on.
                self.skipped += 1
                log.error(
                    "undecodable result at %s[%s]@%s: %s",
                    self.topic,
                    msg.partition(),
                    msg.offset(),
                    exc,
                )
                self._consumer.store_offsets(msg)
                continue
            yield result
            self._consumer.store_offsets(msg)

    def ack(self, result: RunResult) -> None:
        """Mark `result` handled now.

        Call it before breaking out of the loop on a result: otherwise the result a loop stops
        on is delivered to the group again (at least once).

        Args:
            result: A result this consumer yielded.
        """
        tp = TopicPartition(self.topic, result.partition, result.offset + 1)
        self._consumer.store_offsets(offsets=[tp])

    def commit(self) -> None:
        """Commit the stored offsets now (also done periodically and at close).

        Raises:
            AgentrunsKafkaError: The commit failed.
        """
        try:
            self._consumer.commit(asynchronous=False)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._NO_OFFSET:
                raise AgentrunsKafkaError(f"committing offsets: {exc}", retryable=True) from exc

    def close(self) -> None:
        """Commit the stored offsets and leave the group.

        Raises:
            AgentrunsKafkaError: The final commit failed (the consumer is closed anyway).
        """
        try:
            self.commit()
        finally:
            close_consumer(self._consumer)

    def __enter__(self) -> ResultsConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- over HTTP


class ApiClient:
    """A synchronous client of the HTTP API (`agentruns api`).

    Every method returns the API's JSON answer as a dict and raises `ClientError` on a
    connection error or an answer of 400 or more. Replies to a run's question always go
    through the API, which checks the signed resume token.

    Args:
        base_url: The API's URL, e.g. `http://127.0.0.1:8080`.
        token: A bearer token: the API token, or an operator token for `resolve`, `reopen`
            and `redrive`.
        timeout_s: The deadline of each request.

    Example:
        ```python
        from agentruns import ApiClient

        api = ApiClient("http://127.0.0.1:8080", token)
        run = api.submit(task, idempotency_key="order-42")
        print(api.wait(run["run_id"])["status"])
        api.close()
        ```
    """

    def __init__(self, base_url: str, token: str, *, timeout_s: float = 30.0) -> None:
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
        )

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ClientError(f"{method} {path}: {exc}") from exc
        try:
            payload = response.json()
        except ValueError:
            payload = {"detail": response.text}
        if not isinstance(payload, dict):
            payload = {"detail": response.text}
        if response.status_code >= 400:
            raise ClientError(
                f"{method} {path}: HTTP {response.status_code} "
                f"{payload.get('error', '')}: {payload.get('detail', '')}",
                status=response.status_code,
                code=payload.get("error"),
                reason=payload.get("reason"),
            )
        return dict(payload)

    def submit(self, task: Mapping[str, Any], *, idempotency_key: str) -> dict[str, Any]:
        """Submit a task (`POST /runs`); the same key never starts a second run.

        Raises:
            ClientError: 422 with `reason` `invalid_input:<what>: ...` for a refused task.
        """
        return self._call(
            "POST", "/runs", json=dict(task), headers={"Idempotency-Key": idempotency_key}
        )

    def get(self, run_id: str) -> dict[str, Any]:
        """A run as the projection holds it (`GET /runs/{id}`); 404 until it is projected."""
        return self._call("GET", f"/runs/{run_id}")

    def events(self, run_id: str, *, after_seq: int = 0) -> dict[str, Any]:
        """A run's events after `after_seq` (`GET /runs/{id}/events`)."""
        return self._call("GET", f"/runs/{run_id}/events", params={"after_seq": after_seq})

    def reply(self, run_id: str, resume_token: str, response: Mapping[str, Any]) -> dict[str, Any]:
        """Answer a run's question with the resume token of its `GET /runs/{id}`.

        Raises:
            ClientError: 409 for a forged, expired or used token; 422 for a response nested
                too deep.
        """
        body = {"resume_token": resume_token, "response": dict(response)}
        return self._call("POST", f"/runs/{run_id}/replies", json=body)

    def cancel(self, run_id: str, *, reason: str = "requested") -> dict[str, Any]:
        """Ask for a run to be cancelled (`POST /runs/{id}/cancel`)."""
        return self._call("POST", f"/runs/{run_id}/cancel", json={"reason": reason})

    def resolve(
        self,
        run_id: str,
        action: str,
        *,
        reason: str = "operator",
        outcome: str | None = None,
        operation_key: str | None = None,
        result: Any = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Resolve a PAUSED run (needs an operator token): ``action`` is ``continue``,
        ``fail``, ``succeed`` or ``reconcile`` (with ``outcome`` ``found_succeeded`` or
        ``not_executed``, ``operation_key`` when several calls wait, ``result`` with
        ``found_succeeded``). Returns the API's answer; raises `ClientError` (409 when the
        run's status does not allow it, 403 without the operator scope)."""
        body: dict[str, Any] = {"action": action, "reason": reason}
        extra = {"outcome": outcome, "operation_key": operation_key, "result": result}
        body.update({k: v for k, v in extra.items() if v is not None})
        return self._operator(run_id, "resolve", body, idempotency_key)

    def reopen(
        self,
        run_id: str,
        *,
        reason: str = "operator",
        goal: str | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Reopen an ended run to READY (needs an operator token); raises `ClientError`."""
        body: dict[str, Any] = {"reason": reason}
        if goal is not None:
            body["goal"] = goal
        return self._operator(run_id, "reopen", body, idempotency_key)

    def redrive(
        self, run_id: str, *, reason: str = "operator", idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """Drive a run stuck without a pending timer (needs an operator token); raises
        `ClientError`."""
        return self._operator(run_id, "redrive", {"reason": reason}, idempotency_key)

    def fork(
        self,
        run_id: str,
        at: int,
        *,
        model_route: str | None = None,
        budgets: dict[str, int] | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Start a new run from the run's state after its record ``at`` (needs an operator
        token), optionally with another ``model_route`` and raised ``budgets`` (``max_steps``,
        ``max_tokens``, ``max_cost_micros``, ``max_tool_calls``, ``deadline_at``). The same key
        (by default one derived from the run, the seq and the edits) gives the same fork.
        Returns the API's answer (the fork's ``run_id``, ``source_run_id``, ``source_seq``,
        ``created``); raises `ClientError` (404 for an unknown run, 409 for a seq outside its
        log or a lowered budget)."""
        body: dict[str, Any] = {"at": at}
        if model_route is not None:
            body["model_route"] = model_route
        if budgets:
            body["budgets"] = budgets
        return self._operator(run_id, "fork", body, idempotency_key)

    def resume(
        self,
        run_id: str,
        *,
        from_seq: int | None = None,
        cancelled: bool = False,
        budgets: dict[str, int] | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """Resume a failed run after a fix: a fork at the last step before its failure (or at
        ``from_seq``, before it), so the failed call runs again and nothing before it does,
        with raised ``budgets`` as in `fork` (needs an operator token). ``cancelled`` resumes a
        cancelled run too. Raises `ClientError` (409 when the run did not fail)."""
        body: dict[str, Any] = {}
        if from_seq is not None:
            body["from_seq"] = from_seq
        if cancelled:
            body["cancelled"] = True
        if budgets:
            body["budgets"] = budgets
        return self._operator(run_id, "resume", body, idempotency_key)

    def _operator(
        self, run_id: str, action: str, body: dict[str, Any], key: str | None
    ) -> dict[str, Any]:
        headers = {} if key is None else {"Idempotency-Key": key}
        return self._call("POST", f"/runs/{run_id}/{action}", json=body, headers=headers)

    def wait(
        self, run_id: str, *, timeout_s: float = 60.0, every_s: float = 0.25
    ) -> dict[str, Any]:
        """Poll until the run is terminal (as committed) and return it.

        Raises:
            ClientError: The run is not terminal after `timeout_s`, or a call failed.
        """
        deadline = time.monotonic() + timeout_s
        terminal = {s.value for s in TERMINAL}
        while True:
            try:
                run = self.get(run_id)
                if run.get("status") in terminal:
                    return run
            except ClientError as exc:
                if exc.status != 404:
                    raise
            if time.monotonic() > deadline:
                raise ClientError(f"run {run_id} not terminal after {timeout_s:.0f}s")
            time.sleep(every_s)

    def close(self) -> None:
        """Close the client's connections."""
        self._http.close()


# --------------------------------------------------------------------------- commands


def _api_client(args: argparse.Namespace) -> ApiClient | None:
    if not args.api_url:
        return None
    token = current().api_token
    if not token:
        raise ClientError("AGENTRUNS_API_TOKEN is not set", status=401)
    return ApiClient(args.api_url, token)


def _common(parser: argparse.ArgumentParser, *, api: bool) -> None:
    parser.add_argument("--prefix", default=default_prefix())
    if api:
        parser.add_argument(
            "--api-url",
            default=current().api_url,
            help="use the HTTP API (token from AGENTRUNS_API_TOKEN) instead of Kafka",
        )


def _bootstrap() -> str:
    from agentruns.connectors.endpoints import configured_kafka

    return configured_kafka()


def _json_object(text: str, what: str) -> dict[str, Any]:
    """``text`` parsed as the JSON object an argument must be."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidArgumentError(f"{what} is not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"{what} is not a JSON object")
    return value


def _read_task(path: str) -> dict[str, Any]:
    """The task of ``--task``: a JSON file, or stdin for ``-``."""
    if path == "-":
        return _json_object(sys.stdin.read(), "the task on stdin")
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InvalidArgumentError(f"cannot read the task file {path}: {reason}") from exc
    return _json_object(text, f"the task file {path}")


def _print(value: Any) -> None:
    print(json.dumps(value, sort_keys=True, default=str), flush=True)


def main_submit(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns submit", description="Submit a task.")
    parser.add_argument("--key", required=True, help="idempotency key (same key -> same run)")
    parser.add_argument("--goal", help="the task's goal (or give --task)")
    parser.add_argument("--task", help="a JSON file with the task (RunSubmitted fields); - = stdin")
    parser.add_argument("--producer-id", default=current().producer_id)
    parser.add_argument(
        "--tenant",
        help="the tenant to submit for: straight to Kafka, signed with the tenant's key in"
        " $AGENTRUNS_TENANT_KAFKA_KEY (`agentruns credentials kafka-key`); through the API, the"
        " task's `tenant` (an admin's credential may name another)",
    )
    _common(parser, api=True)
    args = parser.parse_args(list(argv) if argv is not None else None)
    task: dict[str, Any] = {}
    if args.task:
        task = _read_task(args.task)
    if args.goal:
        task["goal"] = args.goal
    if "goal" not in task:
        parser.error("give --goal or a --task with a goal")
    if args.tenant is not None and not valid_tenant(args.tenant):
        parser.error(f"--tenant {args.tenant!r} is not a tenant name")
    client = _api_client(args)
    if client is not None:
        if args.tenant is not None:
            task["tenant"] = args.tenant
        try:
            _print(client.submit(task, idempotency_key=args.key))
        finally:
            client.close()
        return 0
    # the operator's registry, when this machine has it: its catalog fills and checks the task
    registry = current().tool_registry
    catalog = None
    if registry is not None:
        from agentruns.connectors.catalog import catalog_of
        from agentruns.connectors.executors.tool import ToolRegistry

        catalog = catalog_of(ToolRegistry.load(registry))
    tenant_key = producer_tenant_key()
    if args.tenant is not None and tenant_key is None:
        raise AgentrunsError(
            f"--tenant {args.tenant} straight to Kafka needs {TENANT_KAFKA_KEY_ENV}",
            hint=f"agentruns credentials kafka-key --tenant {args.tenant} (where the secret is)",
        )
    with RunsProducer(
        _bootstrap(),
        producer_id=args.producer_id,
        prefix=args.prefix,
        catalog=catalog,
        tenant=args.tenant,
        tenant_key=tenant_key if args.tenant is not None else None,
    ) as p:
        sub = p.submit(task, idempotency_key=args.key)
    _print({"run_id": sub.run_id, "trace_id": sub.trace_id, "input_id": sub.input_id})
    return 0


def main_results(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentruns results", description="Print terminal results, one JSON line each."
    )
    parser.add_argument("--follow", action="store_true", help="keep waiting for new results")
    parser.add_argument("--group", default=None, help="consumer group (<prefix>-results-<random>)")
    _common(parser, api=False)
    args = parser.parse_args(list(argv) if argv is not None else None)
    args.group = args.group or f"{args.prefix}-results-{uuid.uuid4().hex[:8]}"
    # Ctrl-C or SIGTERM ends a follow cleanly (offsets committed), also when the shell that
    # started it in the background left SIGINT ignored.
    stop = stop_on_signals()
    with ResultsConsumer(_bootstrap(), group_id=args.group, prefix=args.prefix) as consumer:
        for result in consumer.results(follow=args.follow, stop=stop):
            _print(result.as_json())
    return 0


def main_reply(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentruns reply", description="Answer a run's open question (through the API)."
    )
    parser.add_argument("run_id")
    parser.add_argument("--token", help="the resume token (default: read it from the run)")
    parser.add_argument(
        "--response", required=True, help="JSON object, e.g. '{\"approved\": true}'"
    )
    _common(parser, api=True)
    args = parser.parse_args(list(argv) if argv is not None else None)
    response = _json_object(args.response, "--response")
    client = _api_client(args)
    if client is None:
        raise NotConfiguredError(
            "replies go through the API, and none is configured",
            hint="set --api-url or AGENTRUNS_API_URL",
        )
    try:
        token = args.token
        if token is None:
            question = client.get(args.run_id).get("question") or {}
            token = question.get("resume_token")
            if not token:
                raise ClientError(f"run {args.run_id} has no open question")
        _print(client.reply(args.run_id, token, response))
    finally:
        client.close()
    return 0


def main_cancel(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns cancel", description="Cancel a run.")
    parser.add_argument("run_id")
    parser.add_argument("--reason", default="requested")
    parser.add_argument("--producer-id", default=current().producer_id)
    _common(parser, api=True)
    args = parser.parse_args(list(argv) if argv is not None else None)
    client = _api_client(args)
    if client is not None:
        try:
            _print(client.cancel(args.run_id, reason=args.reason))
        finally:
            client.close()
        return 0
    with RunsProducer(_bootstrap(), producer_id=args.producer_id, prefix=args.prefix) as p:
        sub = p.cancel(args.run_id, reason=args.reason)
    _print({"run_id": sub.run_id, "input_id": sub.input_id})
    return 0


# --------------------------------------------------------------------------- operator commands


def _operator_client(args: argparse.Namespace) -> ApiClient:
    """Operator actions go through the API, which checks the operator scope and records who
    acted; the operator's token is AGENTRUNS_OPERATOR_TOKEN."""
    if not args.api_url:
        raise NotConfiguredError(
            "operator actions go through the API, and none is configured",
            hint="set --api-url or AGENTRUNS_API_URL",
        )
    token = current().operator_token
    if not token:
        raise NotConfiguredError(
            "AGENTRUNS_OPERATOR_TOKEN is not set",
            hint="set it to an operator's token (AGENTRUNS_API_OPERATOR_TOKENS of the API)",
        )
    return ApiClient(args.api_url, token)


def _operator_parser(name: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"agentruns {name}", description=description)
    parser.add_argument("run_id")
    parser.add_argument("--reason", default="operator", help="why (kept in the run's log)")
    parser.add_argument("--key", help="Idempotency-Key: a retry with it never acts twice")
    _common(parser, api=True)
    return parser


def main_resolve(argv: Sequence[str] | None = None) -> int:
    parser = _operator_parser(
        "resolve",
        "Resolve a PAUSED run through the API: continue it, fail it, succeed it, or give the"
        " verdict on a tool call whose outcome is unknown (reconcile).",
    )
    parser.add_argument("action", choices=["continue", "fail", "succeed", "reconcile"])
    parser.add_argument("--outcome", choices=["found_succeeded", "not_executed"])
    parser.add_argument("--operation-key", help="the tool call, when several wait")
    parser.add_argument("--result", help="with found_succeeded: the call's output (JSON)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    result = None if args.result is None else _json_value(args.result, "--result")
    client = _operator_client(args)
    try:
        _print(
            client.resolve(
                args.run_id,
                args.action,
                reason=args.reason,
                outcome=args.outcome,
                operation_key=args.operation_key,
                result=result,
                idempotency_key=args.key,
            )
        )
    finally:
        client.close()
    return 0


def main_reopen(argv: Sequence[str] | None = None) -> int:
    parser = _operator_parser("reopen", "Reopen an ended run to READY through the API.")
    parser.add_argument("--goal", help="a new goal for the reopened run")
    args = parser.parse_args(list(argv) if argv is not None else None)
    client = _operator_client(args)
    try:
        _print(
            client.reopen(args.run_id, reason=args.reason, goal=args.goal, idempotency_key=args.key)
        )
    finally:
        client.close()
    return 0


def main_redrive(argv: Sequence[str] | None = None) -> int:
    parser = _operator_parser(
        "redrive",
        "Drive a run waiting for a model or tool answer that is not coming (no pending timer)"
        " through the API: the model is called again, a tool call is looked up.",
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    client = _operator_client(args)
    try:
        _print(client.redrive(args.run_id, reason=args.reason, idempotency_key=args.key))
    finally:
        client.close()
    return 0


def _json_value(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidArgumentError(f"{what} is not valid JSON ({exc})") from exc
