"""`agentruns api`: the HTTP API (Starlette on uvicorn) over the inbox and the projection.

Reads come only from committed data: the Postgres projection (`runs`, `events`, `operations`,
written by `agentruns sink` from read_committed Kafka transactions) and the artifact store. So a
run is shown SUCCEEDED only after its terminal state and result are committed (R20); nothing is
kept in memory between requests.

Writes are inputs produced to `<prefix>.inbox` (key run_id, explicit partition from
`partition_for`), each carrying a trace_id. Every input is first recorded in `api_inputs`
(migration 0005) with its exact bytes, so a repeated request returns the same outcome and a
retry after a lost Kafka acknowledgement re-produces a byte-identical record, which the
processor drops as an exact duplicate.

Replies are checked here synchronously against the projection (signature, run, expiry, the
run's open question, single use, response schema) and then produced; the core re-checks them
and stays the final judge (R15, R30).

Hostile input is refused at the door, before anything is stored or produced: a body over
`max_body_bytes` (413, by Content-Length at once, or counted while read), a record over
`max_record_bytes` (413), a body that is not UTF-8 JSON, nests deeper than the limits, carries an
integer a bigint cannot hold, or a task the core would refuse (422 with the reason
`invalid_input:<what>: ...`), a header or query that is not UTF-8 or holds a control character
(400). Endpoints, auth, limits and the resume-token format are documented in docs/api.md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
import psycopg
from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.postgres.artifacts import StoredArtifact
from agentruns.processors.events import (
    CancelConfirmed,
    CancelRequested,
    Event,
    RunSubmitted,
    ToolCallFailed,
    ToolCallSucceeded,
    UserReplied,
)
from agentruns.processors.ids import canonical_json
from agentruns.processors.limits import MAX_DURATION_MS, MAX_JSON_DEPTH, json_depth
from agentruns.processors.state import SETTLED, TERMINAL, ErrorClass, RunState, RunStatus
from agentruns.processors.summary import summarize
from agentruns.processors.validation import schema_problem, task_problem
from agentruns.streams.codec import decode, encode
from agentruns.streams.kafka_defaults import NO_DELAY, partition_count, release
from agentruns.streams.partitioning import partition_for
from agentruns.streams.records import input_record, parse_state
from agentruns.streams.topics import DEFAULT_PREFIX, INBOX, topic_name
from confluent_kafka import KafkaError, KafkaException, Message, Producer
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("agentruns.api")

Conn = psycopg.Connection[tuple[Any, ...]]

#: uuid5 namespace of run ids derived from Idempotency-Keys (shared with
# agentruns.connectors.api.client).
RUN_NAMESPACE = uuid.UUID("6f1d3a52-2b8e-5c1e-9a43-61676e747275")
TOKEN_PREFIX = "art1"
API_PRODUCER_ID = "api"
PUBLIC_PATHS = frozenset({"/healthz", "/metrics", "/openapi.json"})
#: Largest request body read (a named default of `ApiConfig.max_body_bytes`).
MAX_BODY_BYTES = 1_048_576
#: Largest encoded input record produced (`ApiConfig.max_record_bytes`, and the client's):
#: 1 MiB, the broker's default `message.max.bytes`, less 64 KiB for the key, headers and batch
#: framing; also below librdkafka's own default (1,000,000 bytes).
MAX_RECORD_BYTES = 1_048_576 - 65_536
#: How deep a request body may nest: a JSON document the core bounds at MAX_JSON_DEPTH (a tool
#: schema, a reply) sits at most three levels down in it ({"tools": [{"parameters": ...}]}).
MAX_BODY_DEPTH = MAX_JSON_DEPTH + 3
#: Longest Idempotency-Key (it becomes part of the input's id).
MAX_KEY_CHARS = 200
#: The integers a task may carry: what Avro `long` and a Postgres bigint hold.
INT64 = range(-(2**63), 2**63)
CALLBACK_MEDIA_TYPE = "application/vnd.agentruns.tool-result+json"
LARGE_OUTPUT_BYTES = 16_384

REQUESTS = Counter(
    "agentruns_api_requests_total", "HTTP requests answered", ["method", "route", "status"]
)
LATENCY = Histogram(
    "agentruns_api_request_seconds",
    "HTTP request latency",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
INPUTS = Counter("agentruns_api_inputs_total", "Inputs produced to the inbox", ["kind"])
REPLIES_REJECTED = Counter(
    "agentruns_api_replies_rejected_total", "Replies refused before reaching the core", ["error"]
)


class ApiError(AgentrunsError):
    """An HTTP-level refusal: status code, machine-readable ``code`` and a message."""

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.extra = extra

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": self.code, "detail": str(self), **self.extra}, status_code=self.status
        )


def invalid_input(status: int, code: str, reason: str, **extra: Any) -> ApiError:
    """A refusal of hostile or invalid input: `reason` is `invalid_input:<what>: detail`, the
    same reason the core gives a run it fails for it."""
    return ApiError(status, code, reason, reason=reason, **extra)


class InvalidInputError(AgentrunsError):
    """An input refused before it is produced (the API answers 413/422 with it, RunsProducer
    raises it): `reason` is `invalid_input:<what>: detail`, what the core would fail the run
    with."""

    def __init__(self, reason: str, *, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.errors = errors or []


def submitted_task(fields: Mapping[str, Any], **ids: Any) -> RunSubmitted:
    """The RunSubmitted of a task (its fields, `ids` the run_id, event_id, at, trace_id), or
    InvalidInputError: nested too deep, an integer a bigint cannot hold, outside the core's
    decode bounds, refused by `agentruns.processors.validation.task_problem`, or not UTF-8."""
    if json_depth(fields, MAX_BODY_DEPTH) > MAX_BODY_DEPTH:
        raise InvalidInputError(f"invalid_input:json_too_deep: nested deeper than {MAX_BODY_DEPTH}")
    big = _outsized_int(fields)
    if big is not None:
        raise InvalidInputError(f"invalid_input:integer_out_of_range: {big} is not a bigint")
    try:
        event = RunSubmitted.model_validate({**fields, **ids})
    except msgspec.ValidationError as exc:
        raise InvalidInputError(
            f"invalid_input:task: {exc}", errors=_validation_detail(exc)
        ) from None
    problem = task_problem(event)
    if problem is not None:
        raise InvalidInputError(problem)
    try:
        event.model_dump_json()  # text Python holds but UTF-8 cannot (a lone surrogate)
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"invalid_input:encoding: {exc}") from None
    return event


def encoded_input(record: dict[str, Any], limit: int) -> bytes:
    """The Input record's bytes, or InvalidInputError when they cannot be produced: text that
    is not UTF-8 (a lone surrogate), or more than `limit` bytes (the broker would refuse it on
    every retry)."""
    try:
        value = encode("Input", record)
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"invalid_input:encoding: {exc}") from None
    if len(value) > limit:
        raise InvalidInputError(
            f"invalid_input:record_too_large: the input record is {len(value)} bytes, over {limit}"
        )
    return value


def now_ms() -> int:
    return int(time.time() * 1000)


def run_id_for_key(idempotency_key: str) -> str:
    """The run a submission with this Idempotency-Key creates (same key -> same run)."""
    return "run-" + uuid.uuid5(RUN_NAMESPACE, idempotency_key).hex


def trace_id_for(run_id: str) -> str:
    return uuid.uuid5(RUN_NAMESPACE, "trace:" + run_id).hex


def submit_event_id(run_id: str) -> str:
    """The RunSubmitted event id: the core drops a second RunSubmitted with it as DUPLICATE."""
    return f"{run_id}:submit"


def request_hash(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


# --------------------------------------------------------------------------- resume tokens


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class ResumeToken:
    """What a signed resume token binds: run, question, token id, state version, expiry (ms)."""

    run_id: str
    question_id: str
    token_id: str
    state_version: int
    expires_at: int


class TokenError(ApiError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(409, code, message)


def sign_token(secret: bytes, token: ResumeToken) -> str:
    """``art1.<base64url JSON claims>.<base64url HMAC-SHA256(secret, "art1." + claims)>``."""
    claims = {
        "r": token.run_id,
        "q": token.question_id,
        "t": token.token_id,
        "v": token.state_version,
        "e": token.expires_at,
    }
    body = _b64(canonical_json(claims).encode())
    mac = hmac.new(secret, f"{TOKEN_PREFIX}.{body}".encode(), hashlib.sha256).digest()
    return f"{TOKEN_PREFIX}.{body}.{_b64(mac)}"


def verify_token(secret: bytes, text: str) -> ResumeToken:
    """The claims of a token whose signature is valid; TokenError("token_forged") otherwise.

    Expiry and freshness are checked by the caller against the clock and the projection."""
    parts = text.split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise TokenError("token_forged", "not an agentruns resume token")
    expected = hmac.new(secret, f"{TOKEN_PREFIX}.{parts[1]}".encode(), hashlib.sha256).digest()
    try:
        given = _unb64(parts[2])
        claims = json.loads(_unb64(parts[1]))
    except (ValueError, UnicodeDecodeError):
        raise TokenError("token_forged", "resume token is malformed") from None
    if not hmac.compare_digest(expected, given):
        raise TokenError("token_forged", "resume token signature does not verify")
    try:
        return ResumeToken(
            run_id=str(claims["r"]),
            question_id=str(claims["q"]),
            token_id=str(claims["t"]),
            state_version=int(claims["v"]),
            expires_at=int(claims["e"]),
        )
    except (KeyError, TypeError, ValueError):
        raise TokenError("token_forged", "resume token claims are incomplete") from None


def callback_signature(secret: bytes, operation_key: str) -> str:
    """The ``sig`` query parameter that authenticates a callback for one operation."""
    return _b64(hmac.new(secret, f"callback.{operation_key}".encode(), hashlib.sha256).digest())


def callback_url(base_url: str, operation_key: str, secret: bytes) -> str:
    """A callback URL a tool backend can POST to without the bearer token."""
    sig = callback_signature(secret, operation_key)
    return f"{base_url.rstrip('/')}/operations/{operation_key}/callback?sig={sig}"


# --------------------------------------------------------------------------- configuration


@dataclass
class ApiConfig:
    bootstrap: str
    database_url: str
    api_token: str
    secret: bytes
    prefix: str = DEFAULT_PREFIX
    #: Partitions of the inbox; None: read from the broker at start.
    partitions: int | None = None
    db_pool_size: int = 8
    produce_timeout_s: float = 15.0
    max_body_bytes: int = MAX_BODY_BYTES
    max_record_bytes: int = MAX_RECORD_BYTES
    clock: Callable[[], int] = now_ms
    extra_producer: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_env(
        cls,
        bootstrap: str,
        database_url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        production: bool = False,
        environ: Mapping[str, str] = os.environ,
    ) -> ApiConfig:
        """Token and secret from AGENTRUNS_API_TOKEN / AGENTRUNS_API_SECRET.

        In production both are required; otherwise a random value is generated for this
        process with a warning (tokens then do not survive a restart)."""
        token = environ.get("AGENTRUNS_API_TOKEN", "")
        secret = environ.get("AGENTRUNS_API_SECRET", "")
        if production and (not token or not secret):
            raise AgentrunsError(
                "AGENTRUNS_API_TOKEN and AGENTRUNS_API_SECRET must be set in production",
                hint="set both to long random strings (e.g. `openssl rand -hex 32`)",
            )
        if not token:
            token = secrets.token_urlsafe(24)
            log.warning(
                "AGENTRUNS_API_TOKEN is not set: generated a development bearer token "
                "(written to stderr once); set it for anything but local development"
            )
            print(f"agentruns api: development bearer token: {token}", file=sys.stderr)
        if not secret:
            log.warning(
                "AGENTRUNS_API_SECRET is not set: resume tokens are signed with a random "
                "per-process key and become invalid when the API restarts"
            )
        return cls(
            bootstrap=bootstrap,
            database_url=database_url,
            api_token=token,
            secret=secret.encode() if secret else secrets.token_bytes(32),
            prefix=prefix,
        )


# --------------------------------------------------------------------------- I/O edges


class _Pool:
    """A small blocking pool of autocommit Postgres connections (psycopg_pool is not a
    dependency); a broken connection is dropped instead of returned."""

    def __init__(self, url: str, size: int) -> None:
        self._url = url
        self._idle: queue.LifoQueue[Conn] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(size)
        self._closed = False

    @contextlib.contextmanager
    def connection(self) -> Iterator[Conn]:
        if not self._slots.acquire(timeout=30):
            raise ApiError(503, "database_busy", "no database connection free within 30 s")
        conn: Conn | None = None
        try:
            with contextlib.suppress(queue.Empty):
                conn = self._idle.get_nowait()
            if conn is None or conn.closed:
                try:
                    conn = psycopg.connect(self._url, autocommit=True, connect_timeout=10)
                except psycopg.OperationalError as exc:
                    raise ApiError(503, "database_unavailable", f"Postgres: {exc}") from exc
            healthy = False
            try:
                yield conn
                healthy = True
            except psycopg.OperationalError as exc:
                raise ApiError(503, "database_unavailable", f"Postgres: {exc}") from exc
            except BaseException:
                # A refusal raised inside the block leaves the connection usable unless a
                # transaction is still open on it.
                status = conn.info.transaction_status
                healthy = status == psycopg.pq.TransactionStatus.IDLE
                raise
            finally:
                if healthy and not self._closed and not conn.closed:
                    self._idle.put(conn)
                else:
                    conn.close()
        finally:
            self._slots.release()

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


class _Inbox:
    """Produces encoded inputs to the run's inbox partition and waits for the broker's ack."""

    def __init__(self, config: ApiConfig) -> None:
        self.topic = topic_name(INBOX, config.prefix)
        self.timeout = config.produce_timeout_s
        self._producer = Producer(
            {
                "bootstrap.servers": config.bootstrap,
                "enable.idempotence": True,
                "linger.ms": 1,
                **NO_DELAY,
                "log_level": 3,
                **config.extra_producer,
            }
        )
        self.partitions = config.partitions or partition_count(self._producer, self.topic)

    def produce(self, run_id: str, value: bytes) -> None:
        done = threading.Event()
        failure: list[KafkaError] = []

        def delivered(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                failure.append(err)
            done.set()

        try:
            self._producer.produce(
                self.topic,
                key=run_id.encode(),
                value=value,
                partition=partition_for(run_id, self.partitions),
                on_delivery=delivered,
            )
            deadline = time.monotonic() + self.timeout
            while not done.is_set() and time.monotonic() < deadline:
                self._producer.poll(0.05)
        except (KafkaException, BufferError) as exc:
            raise ApiError(503, "kafka_unavailable", f"producing to {self.topic}: {exc}") from exc
        if not done.is_set():
            raise ApiError(503, "kafka_unavailable", f"no ack from {self.topic} in time")
        if failure:
            raise ApiError(503, "kafka_unavailable", f"producing to {self.topic}: {failure[0]}")

    def close(self) -> None:
        release(self._producer, 5)


# --------------------------------------------------------------------------- the service


def _ms(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp() * 1000)


def _too_large(limit: int) -> ApiError:
    return invalid_input(
        413, "body_too_large", f"invalid_input:body_too_large: request body over {limit} bytes"
    )


async def _body(request: Request, limit: int) -> bytes:
    """The request body, read as it streams in and never past `limit` bytes: a Content-Length
    over it is refused before reading, a chunked body as soon as it grows over it."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "invalid_header", "Content-Length is not a number")
        if int(declared) > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object: UTF-8, nested at most MAX_BODY_DEPTH deep (a deeper one is
    refused without recursing into it)."""
    try:
        value = msgspec.json.decode(raw or b"{}")
    except UnicodeDecodeError:
        raise invalid_input(
            422, "invalid_encoding", "invalid_input:encoding: request body is not UTF-8"
        ) from None
    except RecursionError:
        value = None
        depth = MAX_BODY_DEPTH + 1
    except msgspec.DecodeError as exc:
        raise ApiError(400, "invalid_json", f"request body is not JSON: {exc}") from None
    else:
        depth = json_depth(value, MAX_BODY_DEPTH)
    if depth > MAX_BODY_DEPTH:
        raise invalid_input(
            422, "too_deep", f"invalid_input:json_too_deep: nested deeper than {MAX_BODY_DEPTH}"
        )
    if not isinstance(value, dict):
        raise ApiError(400, "invalid_json", "request body must be a JSON object")
    return value


def _outsized_int(value: Any) -> int | None:
    """The first integer in a parsed JSON value that a bigint cannot hold, or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, int) and item not in INT64:
            return item
    return None


def _validation_detail(exc: msgspec.ValidationError) -> list[dict[str, Any]]:
    """msgspec names the first problem as "<message> - at `$.path`"."""
    msg, _, where = str(exc).partition(" - at ")
    return [{"loc": where.strip("`").removeprefix("$").lstrip("."), "msg": msg}]


RUN_FIELDS = (
    "run_id, status, step, attempt, version, resolution, trace_id, goal, last_seq, input_tokens,"
    " output_tokens, cost_micros, tool_calls, started_at, last_event_at, ended_at, system_ms,"
    " tool_wait_ms, user_wait_ms, outcome, result_ref, state"
)


def _run_row(conn: Conn, run_id: str) -> dict[str, Any] | None:
    cur = conn.execute(f"SELECT {RUN_FIELDS} FROM runs WHERE run_id = %s", (run_id,))
    row = cur.fetchone()
    if row is None:
        return None
    names = [d.name for d in cur.description or ()]
    return dict(zip(names, row, strict=True))


def _state_of(run: dict[str, Any]) -> RunState:
    raw = run["state"]
    state = parse_state(raw if isinstance(raw, str) else json.dumps(raw))
    assert state is not None
    return state


def _waiting_for(status: RunStatus) -> str:
    """Whose time a resting status spends (the same split as the core's TimeAccount)."""
    if status in (RunStatus.WAITING_USER, RunStatus.PAUSED):
        return "user"
    if status in (RunStatus.TOOL_RUNNING, RunStatus.WAITING_TOOL):
        return "tool"
    return "system"


def _submitted_record(conn: Conn, run_id: str) -> dict[str, Any] | None:
    """The RunSubmitted input this API produced for `run_id`, if any."""
    row = conn.execute(
        "SELECT record FROM api_inputs WHERE run_id = %s AND kind = 'RunSubmitted' LIMIT 1",
        (run_id,),
    ).fetchone()
    return None if row is None else decode(bytes(row[0]), "Input").record


def _operations(conn: Conn, run_id: str) -> list[dict[str, Any]]:
    cur = conn.execute(
        "SELECT op_key, step, tool, call_id, status, dispatch, retries, polls,"
        " policy_decision, result_ref, error_class, error_code, reconciliation,"
        " cancel_unconfirmed, seq FROM operations WHERE run_id = %s ORDER BY seq, op_key",
        (run_id,),
    )
    names = [d.name for d in cur.description or ()]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def _result(conn: Conn, run: dict[str, Any]) -> dict[str, Any]:
    row = conn.execute(
        "SELECT resolution, status, seq, summary FROM results WHERE run_id = %s"
        " ORDER BY resolution DESC LIMIT 1",
        (run["run_id"],),
    ).fetchone()
    ref = run["result_ref"]
    return {
        "status": run["status"],
        "resolution": run["resolution"],
        "result_ref": ref,
        "summary": None if row is None else row[3],
        "content": None if ref is None else _artifact_json(conn, ref),
    }


def _artifact_json(conn: Conn, ref: str) -> Any:
    row = conn.execute("SELECT content FROM artifacts WHERE ref = %s", (ref,)).fetchone()
    if row is None:
        return None
    text = bytes(row[0]).decode()
    try:
        return json.loads(text)
    except ValueError:
        return text


class ApiService:
    """The endpoints' logic: blocking (Postgres, Kafka), called from the threadpool."""

    def __init__(self, config: ApiConfig) -> None:
        self.config = config
        self.clock = config.clock
        self.db = _Pool(config.database_url, config.db_pool_size)
        self.inbox = _Inbox(config)

    def close(self) -> None:
        self.inbox.close()
        self.db.close()

    # ------------------------------------------------------------------ produce once

    def _encoded(self, record: dict[str, Any]) -> bytes:
        """The record's bytes; one the broker would refuse on every retry is never stored."""
        try:
            return encoded_input(record, self.config.max_record_bytes)
        except InvalidInputError as exc:
            if exc.reason.startswith("invalid_input:record_too_large"):
                raise invalid_input(413, "record_too_large", exc.reason) from None
            raise invalid_input(422, "invalid_encoding", exc.reason) from None

    def _produce_once(
        self,
        input_id: str,
        run_id: str,
        kind: str,
        req_hash: str,
        value: bytes,
        *,
        conflict: ApiError | None = None,
        single_use: bool = False,
        claim: Callable[[Conn], None] | None = None,
    ) -> bool:
        """Produce the input `input_id` once; True if THIS call produced it.

        1. The row with the exact record (and `claim`, in the same transaction) is committed
           before anything reaches Kafka, so a crash later leaves a record to re-produce.
        2. Under the row's lock: produce the stored bytes unless already produced, then mark
           it. Concurrent requests for one input serialize here; exactly one produces.

        A request whose hash differs from the stored one raises `conflict` (422 by default),
        as does any repeat of a `single_use` input (a resume token) once it was produced. A
        repeat of an input that never reached Kafka re-produces the byte-identical record,
        which the processor drops as an exact duplicate if it did arrive after all.
        """
        conflict = conflict or ApiError(
            422, "idempotency_key_reused", "this idempotency key was used with another request"
        )
        with self.db.connection() as conn:
            with conn.transaction():
                row = conn.execute(
                    "INSERT INTO api_inputs (input_id, run_id, kind, request_hash, record)"
                    " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (input_id) DO NOTHING RETURNING 1",
                    (input_id, run_id, kind, req_hash, value),
                ).fetchone()
                if row is not None and claim is not None:
                    claim(conn)
            with conn.transaction():
                stored = conn.execute(
                    "SELECT request_hash, record, produced FROM api_inputs"
                    " WHERE input_id = %s FOR UPDATE",
                    (input_id,),
                ).fetchone()
                assert stored is not None
                if stored[0] != req_hash or (stored[2] and single_use):
                    raise conflict
                if stored[2]:
                    return False
                self.inbox.produce(run_id, bytes(stored[1]))
                conn.execute(
                    "UPDATE api_inputs SET produced = true WHERE input_id = %s", (input_id,)
                )
        INPUTS.labels(kind).inc()
        return True

    # ------------------------------------------------------------------ runs

    def submit(self, key: str, body: dict[str, Any], trace_header: str | None) -> dict[str, Any]:
        if not key or len(key) > MAX_KEY_CHARS:
            raise ApiError(400, "idempotency_key_required", "send an Idempotency-Key header")
        run_id = run_id_for_key(key)
        trace_id = trace_header or str(body.get("trace_id") or "") or trace_id_for(run_id)
        fields = {k: v for k, v in body.items() if k != "trace_id"}
        at = self.clock()
        try:
            event = submitted_task(
                fields,
                run_id=run_id,
                event_id=submit_event_id(run_id),
                at=at,
                trace_id=trace_id,
            )
        except InvalidInputError as exc:
            extra = {"errors": exc.errors} if exc.errors else {}
            raise invalid_input(422, "invalid_task", exc.reason, **extra) from None
        record = input_record(
            event, input_id=submit_event_id(run_id), producer_id=API_PRODUCER_ID, producer_seq=1
        )
        created = self._produce_once(
            record["input_id"], run_id, event.type, request_hash(body), self._encoded(record)
        )
        run = self.run_row(run_id)
        return {
            "run_id": run_id,
            "trace_id": trace_id if run is None else run["trace_id"],
            "created": created,
            "status": "PENDING" if run is None else run["status"],
        }

    def run_row(self, run_id: str) -> dict[str, Any] | None:
        with self.db.connection() as conn:
            return _run_row(conn, run_id)

    def get_run(self, run_id: str) -> dict[str, Any]:
        """The run as committed. All of it is read in ONE snapshot: the sink commits a run's
        rows (runs, operations, results) together, so they agree with each other."""
        with self.db.connection() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            run = _run_row(conn, run_id)
            if run is None:
                if _submitted_record(conn, run_id) is None:
                    raise ApiError(404, "run_not_found", f"no run {run_id}")
                # Accepted by the API, not yet in the committed projection.
                return {
                    "run_id": run_id,
                    "status": "PENDING",
                    "terminal": False,
                    "operations": [],
                    "question": None,
                    "result": None,
                }
            return self._run_view(conn, run)

    def _run_view(self, conn: Conn, run: dict[str, Any]) -> dict[str, Any]:
        run_id = run["run_id"]
        state = _state_of(run)
        status = RunStatus(run["status"])
        terminal = status in TERMINAL
        waits: dict[str, Any] = {
            "system_ms": run["system_ms"],
            "tool_wait_ms": run["tool_wait_ms"],
            "user_wait_ms": run["user_wait_ms"],
        }
        if not terminal:
            # R16: the wait in progress, not yet folded into the totals above.
            waits["current"] = {
                "waiting_for": _waiting_for(status),
                "since": state.time.last_at,
                "ms": max(0, self.clock() - state.time.last_at),
            }
        out: dict[str, Any] = {
            "run_id": run_id,
            "status": status.value,
            "terminal": terminal,
            "trace_id": run["trace_id"],
            "goal": run["goal"],
            "step": run["step"],
            "attempt": run["attempt"],
            "version": run["version"],
            "resolution": run["resolution"],
            "last_seq": run["last_seq"],
            "started_at": _ms(run["started_at"]),
            "last_event_at": _ms(run["last_event_at"]),
            "ended_at": _ms(run["ended_at"]),
            "waits": waits,
            "usage": {
                "input_tokens": run["input_tokens"],
                "output_tokens": run["output_tokens"],
                "cost_micros": run["cost_micros"],
                "tool_calls": run["tool_calls"],
            },
            "cancel_requested": state.cancel_requested,
            "warnings": list(state.warnings),
            "operations": _operations(conn, run_id),
            "question": None,
            "result": None,
        }
        if status is RunStatus.WAITING_USER and state.question is not None:
            out["question"] = self._question(conn, state)
        if terminal:
            out["outcome"] = run["outcome"]
            out["result"] = _result(conn, run)
        return out

    def _question(self, conn: Conn, state: RunState) -> dict[str, Any]:
        q = state.question
        assert q is not None
        token = ResumeToken(state.run_id, q.question_id, q.token_id, q.version, q.expires_at)
        return {
            "question_id": q.question_id,
            "kind": q.kind,
            "artifact_ref": q.artifact_ref,
            "content": _artifact_json(conn, q.artifact_ref),
            "response_schema": q.response_schema,
            "expires_at": q.expires_at,
            "state_version": q.version,
            "token_id": q.token_id,
            "resume_token": sign_token(self.config.secret, token),
        }

    def events(self, run_id: str, after_seq: int, limit: int) -> dict[str, Any]:
        with self.db.connection() as conn:
            cur = conn.execute(
                "SELECT seq, event_id, type, step, attempt, trace_id, at, disposition, reason,"
                " input_id, status, payload FROM events WHERE run_id = %s AND seq > %s"
                " ORDER BY seq LIMIT %s",
                (run_id, after_seq, limit),
            )
            names = [d.name for d in cur.description or ()]
            rows = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
            if not rows and after_seq == 0:
                known = conn.execute("SELECT 1 FROM runs WHERE run_id = %s", (run_id,)).fetchone()
                if known is None:
                    raise ApiError(404, "run_not_found", f"no events for run {run_id}")
        for r in rows:
            r["at"] = _ms(r["at"])
        next_after = rows[-1]["seq"] if rows else after_seq
        return {"run_id": run_id, "events": rows, "next_after_seq": next_after}

    # ------------------------------------------------------------------ replies

    def reply(self, run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._reply(run_id, body)
        except ApiError as exc:
            REPLIES_REJECTED.labels(exc.code).inc()
            raise

    def _reply(self, run_id: str, body: dict[str, Any]) -> dict[str, Any]:
        text = body.get("resume_token")
        response = body.get("response")
        if not isinstance(text, str) or not isinstance(response, dict):
            raise ApiError(400, "invalid_reply", "send {resume_token: string, response: object}")
        if json_depth(response) > MAX_JSON_DEPTH:
            raise invalid_input(
                422,
                "response_invalid",
                f"invalid_input:response_too_deep: nested deeper than {MAX_JSON_DEPTH}",
            )
        token = verify_token(self.config.secret, text)
        if token.run_id != run_id:
            raise TokenError("token_forged", "resume token was issued for another run")
        now = self.clock()
        if now >= token.expires_at:
            raise TokenError("token_expired", "the question expired; the reply is too late")
        input_id = f"reply:{token.token_id}"
        req_hash = request_hash({"token_id": token.token_id, "response": response})
        with self.db.connection() as conn:
            applied = conn.execute(
                "SELECT seq FROM events WHERE run_id = %s AND type = 'UserReplied'"
                " AND disposition = 'APPLIED' AND payload->>'token_id' = %s LIMIT 1",
                (run_id, token.token_id),
            ).fetchone()
            used = conn.execute(
                "SELECT i.produced, i.request_hash FROM api_used_tokens t"
                " JOIN api_inputs i USING (input_id) WHERE t.token_id = %s",
                (token.token_id,),
            ).fetchone()
        # A used token is refused, except the retry of the very same reply whose input never
        # reached Kafka (then the stored record is produced again, below).
        if applied is not None or (used is not None and (used[0] or used[1] != req_hash)):
            raise TokenError("token_used", "this resume token was already used")
        run = self.run_row(run_id)
        if run is None:
            raise ApiError(404, "run_not_found", f"no run {run_id}")
        state = _state_of(run)
        q = state.question
        if (
            state.status is not RunStatus.WAITING_USER
            or q is None
            or q.question_id != token.question_id
            or q.token_id != token.token_id
            or q.version != token.state_version
        ):
            raise TokenError(
                "token_stale",
                f"the run is {state.status.value} and no longer waits for this question",
            )
        problem = schema_problem(q.response_schema, response)
        if problem is not None:
            raise ApiError(
                422,
                "response_invalid",
                f"response does not match the expected schema: {problem}",
                response_schema=q.response_schema,
            )
        event = UserReplied(
            run_id=run_id,
            event_id=input_id,
            at=now,
            trace_id=state.trace_id,
            question_id=q.question_id,
            token_id=q.token_id,
            state_version=q.version,
            response=response,
        )
        record = input_record(event, input_id=input_id)

        def claim(conn: Conn) -> None:
            conn.execute(
                "INSERT INTO api_used_tokens (token_id, run_id, question_id, input_id)"
                " VALUES (%s, %s, %s, %s)",
                (q.token_id, run_id, q.question_id, input_id),
            )

        self._produce_once(
            input_id,
            run_id,
            event.type,
            req_hash,
            self._encoded(record),
            conflict=TokenError("token_used", "this resume token was already used"),
            single_use=True,
            claim=claim,
        )
        return {"run_id": run_id, "question_id": q.question_id, "accepted": True}

    # ------------------------------------------------------------------ cancel, callbacks

    def cancel(self, run_id: str, body: dict[str, Any], key: str | None) -> dict[str, Any]:
        """CancelRequested for the run (R24: the core handles it at the next transition).

        Without an Idempotency-Key, one cancel per run resolution: a repeat is answered as
        already requested (the core would record it as a DUPLICATE anyway)."""
        if key is not None and len(key) > MAX_KEY_CHARS:
            raise ApiError(400, "invalid_header", f"Idempotency-Key over {MAX_KEY_CHARS} chars")
        with self.db.connection() as conn:
            run = _run_row(conn, run_id)
            submitted = _submitted_record(conn, run_id) if run is None else None
        if run is None and submitted is None:
            raise ApiError(404, "run_not_found", f"no run {run_id}")
        if run is not None and run["status"] in {s.value for s in TERMINAL}:
            raise ApiError(409, "run_terminal", f"the run is already {run['status']}")
        source = run if run is not None else submitted
        assert source is not None
        trace_id = str(source["trace_id"])
        reason = str(body.get("reason") or "requested")[:200]
        resolution = 0 if run is None else run["resolution"]
        input_id = f"cancel:{run_id}:" + (f"key:{key}" if key else str(resolution))
        event = CancelRequested(
            run_id=run_id, event_id=input_id, at=self.clock(), trace_id=trace_id, reason=reason
        )
        record = input_record(event, input_id=input_id)
        req_hash = request_hash({"reason": reason} if key else {"cancel": run_id})
        created = self._produce_once(input_id, run_id, event.type, req_hash, self._encoded(record))
        return {"run_id": run_id, "cancel_requested": True, "created": created}

    def callback(self, op_key: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.db.connection() as conn:
            row = conn.execute(
                "SELECT o.run_id, o.step, o.dispatch, o.status, o.tool, r.trace_id"
                " FROM operations o JOIN runs r USING (run_id) WHERE o.op_key = %s"
                " ORDER BY o.seq DESC LIMIT 1",
                (op_key,),
            ).fetchone()
        if row is None:
            raise ApiError(404, "operation_not_found", f"no operation {op_key}")
        run_id, step, dispatch, op_status, tool, trace_id = row
        status = str(body.get("status", ""))
        if op_status in {s.value for s in SETTLED}:
            return 200, {"operation_key": op_key, "accepted": False, "reason": op_status}
        if status in ("running", "accepted"):
            return 200, {"operation_key": op_key, "accepted": False, "reason": "still running"}
        input_id = f"{op_key}:{dispatch}:callback"
        ids: dict[str, Any] = {
            "run_id": run_id,
            "event_id": input_id,
            "at": self.clock(),
            "trace_id": trace_id,
            "step": step,
            "operation_key": op_key,
            "dispatch": dispatch,
        }
        event: Event
        artifact: StoredArtifact | None = None
        if status == "succeeded":
            output = body.get("result")
            artifact = StoredArtifact.of(
                canonical_json(
                    {
                        "type": "tool_result",
                        "operation_key": op_key,
                        "tool": tool,
                        "status": "succeeded",
                        "via": "callback",
                        "output": output,
                    }
                ),
                CALLBACK_MEDIA_TYPE,
            )
            text = output if isinstance(output, str) else canonical_json(output)
            size = len(text.encode())
            event = ToolCallSucceeded(
                **ids,
                result_ref=artifact.ref,
                result_bytes=size,
                summary=summarize(text) if size > LARGE_OUTPUT_BYTES else None,
            )
        elif status == "failed":
            result = body.get("result")
            code = body.get("error_code") or (
                result.get("error") if isinstance(result, dict) else None
            )
            try:
                error_class = ErrorClass(str(body.get("error_class") or "UNKNOWN"))
            except ValueError:
                error_class = ErrorClass.UNKNOWN
            retry = body.get("retry_after_ms")
            if retry is not None and not (
                isinstance(retry, int)
                and not isinstance(retry, bool)
                and 0 <= retry <= MAX_DURATION_MS
            ):
                raise invalid_input(
                    422,
                    "invalid_callback",
                    f"invalid_input:retry_after_ms: {str(retry)[:40]} is not an integer"
                    f" from 0 to {MAX_DURATION_MS}",
                )
            event = ToolCallFailed(
                **ids,
                error_class=error_class,
                error_code=str(code or "failed")[:200],
                message=str(body.get("message") or "")[:1000],
                retry_after_ms=retry,
            )
        elif status == "cancelled":
            event = CancelConfirmed(**ids)
        else:
            raise ApiError(
                422,
                "invalid_callback",
                "status must be one of succeeded, failed, cancelled, running, accepted",
            )
        if artifact is not None:
            # R2: the result artifact is durable before the input that references it.
            with self.db.connection() as conn:
                conn.execute(
                    "INSERT INTO artifacts (ref, media_type, size_bytes, content)"
                    " VALUES (%s, %s, %s, %s) ON CONFLICT (ref) DO NOTHING",
                    (
                        artifact.ref,
                        artifact.media_type,
                        len(artifact.content.encode()),
                        artifact.content.encode(),
                    ),
                )
        record = input_record(event, input_id=input_id)
        self._produce_once(
            input_id,
            run_id,
            event.type,
            request_hash({"status": status, "body": body}),
            self._encoded(record),
            conflict=ApiError(409, "callback_conflict", "another outcome was already reported"),
        )
        return 202, {"operation_key": op_key, "run_id": run_id, "accepted": True}

    def health(self) -> dict[str, Any]:
        with self.db.connection() as conn:
            conn.execute("SELECT 1")
        return {"status": "ok", "inbox": self.inbox.topic, "partitions": self.inbox.partitions}


# --------------------------------------------------------------------------- HTTP layer


#: Bytes no header value or query string may hold: a header is one line, and what is read from
#: one becomes ids and trace ids in records.
_CONTROL = (frozenset(range(0x20)) - {0x09}) | {0x7F}  # a tab is whitespace in a header


def _clean(value: bytes) -> bool:
    if _CONTROL.intersection(value):
        return False
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class _Guard:
    """The outermost check of every request: header values and the query string must be UTF-8
    without control characters (400 otherwise). The HTTP server already refuses a header line
    broken by CR or LF; this also covers what it lets through (obs-text, NUL, DEL)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            bad = next((k for k, v in scope["headers"] if not _clean(v)), None)
            if bad is None and not _clean(scope.get("query_string", b"")):
                bad = b"query string"
            if bad is not None:
                what = bad.decode("latin-1")
                response = JSONResponse(
                    {
                        "error": "invalid_header",
                        "detail": f"{what} is not UTF-8 or holds a control character",
                    },
                    status_code=400,
                )
                REQUESTS.labels(scope["method"], "invalid_header", "400").inc()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Auth:
    """Bearer-token check for every path but PUBLIC_PATHS; a callback may instead carry the
    operation's HMAC ``sig`` query parameter (see `callback_url`)."""

    def __init__(self, app: ASGIApp, token: str, secret: bytes) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()
        self._secret = secret

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected) or self._callback_signed(scope):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            {"error": "unauthorized", "detail": "send Authorization: Bearer <AGENTRUNS_API_TOKEN>"},
            status_code=401,
            headers={"WWW-Authenticate": 'Bearer realm="agentruns"'},
        )
        REQUESTS.labels(scope["method"], "unauthorized", "401").inc()
        await response(scope, receive, send)

    def _callback_signed(self, scope: Scope) -> bool:
        parts = str(scope["path"]).strip("/").split("/")
        if len(parts) != 3 or parts[0] != "operations" or parts[2] != "callback":
            return False
        query = dict(
            p.split("=", 1) for p in scope.get("query_string", b"").decode().split("&") if "=" in p
        )
        sig = query.get("sig", "")
        return hmac.compare_digest(sig, callback_signature(self._secret, parts[1]))


Handler = Callable[[Request], Awaitable[Response]]


def _endpoint(route: str, fn: Callable[[ApiService, Request], Awaitable[Response]]) -> Any:
    def bind(service: ApiService) -> Handler:
        async def handle(request: Request) -> Response:
            started = time.perf_counter()
            try:
                response = await fn(service, request)
            except ApiError as exc:
                response = exc.response()
            except AgentrunsError as exc:
                log.warning("%s %s failed: %s", request.method, route, exc)
                response = JSONResponse(
                    {"error": "unavailable", "detail": exc.one_line()}, status_code=503
                )
            REQUESTS.labels(request.method, route, str(response.status_code)).inc()
            LATENCY.labels(route).observe(time.perf_counter() - started)
            return response

        return handle

    return bind


async def _submit(s: ApiService, r: Request) -> Response:
    body = _json_object(await _body(r, s.config.max_body_bytes))
    key = r.headers.get("idempotency-key", "")
    out = await run_in_threadpool(s.submit, key, body, r.headers.get("x-trace-id"))
    return JSONResponse(
        out,
        status_code=202 if out["created"] else 200,
        headers={"Location": f"/runs/{out['run_id']}"},
    )


async def _get_run(s: ApiService, r: Request) -> Response:
    return JSONResponse(await run_in_threadpool(s.get_run, r.path_params["run_id"]))


def _int_param(r: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = r.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, "invalid_parameter", f"{name} must be an integer") from None
    return max(lo, min(hi, value))


async def _events(s: ApiService, r: Request) -> Response:
    after = _int_param(r, "after_seq", 0, 0, 2**62)
    limit = _int_param(r, "limit", 500, 1, 1000)
    out = await run_in_threadpool(s.events, r.path_params["run_id"], after, limit)
    return JSONResponse(out)


async def _reply(s: ApiService, r: Request) -> Response:
    body = _json_object(await _body(r, s.config.max_body_bytes))
    out = await run_in_threadpool(s.reply, r.path_params["run_id"], body)
    return JSONResponse(out, status_code=202)


async def _cancel(s: ApiService, r: Request) -> Response:
    body = _json_object(await _body(r, s.config.max_body_bytes))
    key = r.headers.get("idempotency-key")
    out = await run_in_threadpool(s.cancel, r.path_params["run_id"], body, key)
    return JSONResponse(out, status_code=202)


async def _callback(s: ApiService, r: Request) -> Response:
    body = _json_object(await _body(r, s.config.max_body_bytes))
    status, out = await run_in_threadpool(s.callback, r.path_params["key"], body)
    return JSONResponse(out, status_code=status)


async def _health(s: ApiService, r: Request) -> Response:
    return JSONResponse(await run_in_threadpool(s.health))


async def _metrics(s: ApiService, r: Request) -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def _openapi(s: ApiService, r: Request) -> Response:
    return JSONResponse(OPENAPI)


ROUTES: tuple[tuple[str, str, str, Callable[[ApiService, Request], Awaitable[Response]]], ...] = (
    ("POST", "/runs", "submit", _submit),
    ("GET", "/runs/{run_id}", "get_run", _get_run),
    ("GET", "/runs/{run_id}/events", "events", _events),
    ("POST", "/runs/{run_id}/replies", "reply", _reply),
    ("POST", "/runs/{run_id}/cancel", "cancel", _cancel),
    ("POST", "/operations/{key}/callback", "callback", _callback),
    ("GET", "/healthz", "healthz", _health),
    ("GET", "/metrics", "metrics", _metrics),
    ("GET", "/openapi.json", "openapi", _openapi),
)


def create_app(config: ApiConfig) -> Starlette:
    """The ASGI app. Connects to Kafka (inbox metadata) at once; Postgres lazily."""
    service = ApiService(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await run_in_threadpool(service.close)

    routes = [
        Route(path, _endpoint(name, fn)(service), methods=[method], name=name)
        for method, path, name, fn in ROUTES
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(_Auth, token=config.api_token, secret=config.secret)
    app.add_middleware(_Guard)  # added last: runs first
    app.state.service = service
    return app


# --------------------------------------------------------------------------- OpenAPI

_ERROR = {"$ref": "#/components/schemas/Error"}


def _resp(description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description}
    if schema is not None:
        out["content"] = {"application/json": {"schema": schema}}
    return out


_RUN_ID = {"name": "run_id", "in": "path", "required": True, "schema": {"type": "string"}}
_ERRS = {
    "400": _resp("a header or the query string is not UTF-8 or holds a control character", _ERROR),
    "401": _resp("missing or wrong bearer token", _ERROR),
    "503": _resp("Kafka or Postgres unavailable; retry", _ERROR),
}
_TOO_LARGE = {
    "413": _resp("body over max_body_bytes, or its input record over max_record_bytes", _ERROR)
}

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "agentruns API",
        "version": "1",
        "description": "Durable LLM-agent runs on Kafka: submit, read, reply, cancel. "
        "Every endpoint but /healthz, /metrics and /openapi.json needs "
        "`Authorization: Bearer <AGENTRUNS_API_TOKEN>`.",
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": {
                "type": "object",
                "required": ["error", "detail"],
                "properties": {
                    "error": {"type": "string"},
                    "detail": {"type": "string"},
                    "reason": {
                        "type": "string",
                        "description": "invalid_input:<what>: ... when the input is refused",
                    },
                },
            },
            "Task": {
                "type": "object",
                "required": ["goal"],
                "description": "The fields of the core's RunSubmitted event but the ids and "
                "the time: goal, messages, tools, policy, model_route, budgets, loop, "
                "memory_ref, evidence_refs, validator_version; optional trace_id.",
                "properties": {
                    "goal": {"type": "string"},
                    "messages": {"type": "array", "items": {"type": "object"}},
                    "tools": {"type": "array", "items": {"type": "object"}},
                    "policy": {"type": "object"},
                    "model_route": {"type": "string"},
                    "budgets": {"type": "object"},
                    "loop": {"type": "object"},
                    "memory_ref": {"type": ["string", "null"]},
                    "evidence_refs": {"type": "array", "items": {"type": "string"}},
                    "trace_id": {"type": "string"},
                },
            },
            "Submitted": {
                "type": "object",
                "properties": {
                    "run_id": {"type": "string"},
                    "trace_id": {"type": "string"},
                    "created": {"type": "boolean"},
                    "status": {"type": "string"},
                },
            },
            "Run": {
                "type": "object",
                "description": "The committed projection of a run. `result` is set only "
                "when `terminal`; `question` (with `resume_token`) only in WAITING_USER.",
                "properties": {
                    "run_id": {"type": "string"},
                    "status": {"type": "string"},
                    "terminal": {"type": "boolean"},
                    "waits": {
                        "type": "object",
                        "properties": {
                            "system_ms": {"type": "integer"},
                            "tool_wait_ms": {"type": "integer"},
                            "user_wait_ms": {"type": "integer"},
                        },
                    },
                    "operations": {"type": "array", "items": {"type": "object"}},
                    "question": {"type": ["object", "null"]},
                    "result": {"type": ["object", "null"]},
                },
            },
            "Reply": {
                "type": "object",
                "required": ["resume_token", "response"],
                "properties": {
                    "resume_token": {"type": "string"},
                    "response": {"type": "object"},
                },
            },
            "Callback": {
                "type": "object",
                "required": ["status"],
                "properties": {
                    "status": {"enum": ["succeeded", "failed", "cancelled", "running", "accepted"]},
                    "result": {},
                    "error_class": {"type": "string"},
                    "error_code": {"type": "string"},
                    "message": {"type": "string"},
                    "retry_after_ms": {"type": "integer"},
                },
            },
        },
    },
    "security": [{"bearer": []}],
    "paths": {
        "/runs": {
            "post": {
                "summary": "Submit a task (idempotent by Idempotency-Key)",
                "parameters": [
                    {
                        "name": "Idempotency-Key",
                        "in": "header",
                        "required": True,
                        "schema": {"type": "string", "maxLength": 200},
                    },
                    {"name": "X-Trace-Id", "in": "header", "schema": {"type": "string"}},
                ],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Task"}}
                    },
                },
                "responses": {
                    "202": _resp("submitted", {"$ref": "#/components/schemas/Submitted"}),
                    "200": _resp(
                        "a repeat: the same run", {"$ref": "#/components/schemas/Submitted"}
                    ),
                    "400": _resp("no Idempotency-Key or not JSON", _ERROR),
                    "422": _resp(
                        "invalid task (with its invalid_input reason), or the key was used for"
                        " another task",
                        _ERROR,
                    ),
                    **_TOO_LARGE,
                    **_ERRS,
                },
            }
        },
        "/runs/{run_id}": {
            "get": {
                "summary": "The run as committed: state, waits, operations, question, result",
                "parameters": [_RUN_ID],
                "responses": {
                    "200": _resp("the run", {"$ref": "#/components/schemas/Run"}),
                    "404": _resp("unknown run", _ERROR),
                    **_ERRS,
                },
            }
        },
        "/runs/{run_id}/events": {
            "get": {
                "summary": "The run's event log (projected), in seq order",
                "parameters": [
                    _RUN_ID,
                    {"name": "after_seq", "in": "query", "schema": {"type": "integer"}},
                    {"name": "limit", "in": "query", "schema": {"type": "integer"}},
                ],
                "responses": {"200": _resp("events"), "404": _resp("unknown run", _ERROR)},
            }
        },
        "/runs/{run_id}/replies": {
            "post": {
                "summary": "Answer the open question with its resume token (single use)",
                "parameters": [_RUN_ID],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Reply"}}
                    },
                },
                "responses": {
                    "202": _resp("accepted; the core applies it"),
                    "409": _resp("token forged, expired, stale or already used", _ERROR),
                    "422": _resp(
                        "response does not match the expected schema, or nests too deep", _ERROR
                    ),
                    **_TOO_LARGE,
                    **_ERRS,
                },
            }
        },
        "/runs/{run_id}/cancel": {
            "post": {
                "summary": "Request cancellation (handled at the run's next transition)",
                "parameters": [_RUN_ID],
                "responses": {
                    "202": _resp("cancel requested"),
                    "404": _resp("unknown run", _ERROR),
                    "409": _resp("the run is already terminal", _ERROR),
                    **_TOO_LARGE,
                    **_ERRS,
                },
            }
        },
        "/operations/{key}/callback": {
            "post": {
                "summary": "Completion of an async tool operation (bearer token or ?sig=)",
                "parameters": [
                    {"name": "key", "in": "path", "required": True, "schema": {"type": "string"}},
                    {"name": "sig", "in": "query", "schema": {"type": "string"}},
                ],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Callback"}}
                    },
                },
                "responses": {
                    "202": _resp("accepted; the core applies it"),
                    "200": _resp("nothing to do (already settled, or still running)"),
                    "404": _resp("unknown operation", _ERROR),
                    "422": _resp("unknown status", _ERROR),
                    **_TOO_LARGE,
                    **_ERRS,
                },
            }
        },
        "/healthz": {"get": {"summary": "Liveness", "security": [], "responses": {"200": {}}}},
        "/metrics": {
            "get": {"summary": "Prometheus metrics", "security": [], "responses": {"200": {}}}
        },
        "/openapi.json": {
            "get": {"summary": "This document", "security": [], "responses": {"200": {}}}
        },
    },
}


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentruns api", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default=os.environ.get("AGENTRUNS_API_HOST", "127.0.0.1"))
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get("AGENTRUNS_API_PORT", "8080"))
    )
    parser.add_argument("--prefix", default=os.environ.get("AGENTRUNS_TOPIC_PREFIX", "agentruns"))
    parser.add_argument(
        "--production",
        action="store_true",
        default=os.environ.get("AGENTRUNS_ENV", "") == "production",
        help="refuse to start without AGENTRUNS_API_TOKEN and AGENTRUNS_API_SECRET "
        "(also AGENTRUNS_ENV=production)",
    )
    parser.add_argument("--log-level", default=os.environ.get("AGENTRUNS_LOG_LEVEL", "INFO"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn
    from agentruns.connectors.devstack.services import ServiceStack
    from agentruns.connectors.logs import setup_logging
    from agentruns.connectors.postgres.migrate import migrate

    args = build_parser().parse_args(list(argv) if argv is not None else None)
    setup_logging(args.log_level, component="api")
    with ServiceStack() as stack:
        assert stack.endpoints is not None
        ep = stack.endpoints
        migrate(ep.database_url)
        config = ApiConfig.from_env(
            ep.kafka_bootstrap, ep.database_url, prefix=args.prefix, production=args.production
        )
        app = create_app(config)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


if __name__ == "__main__":
    import sys

    from agentruns.connectors.cli import main as cli_main

    raise SystemExit(cli_main(["api", *sys.argv[1:]]))
