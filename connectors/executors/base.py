"""Shared executor plumbing: the consume loop, executed-action records, one transaction per batch.

An executor consumes one effects topic (read_committed, manual commits), carries out each effect
with a :class:`Handler` (in a thread pool: the calls are I/O bound) and answers with one core
event per effect, sent to the inbox as an ``Input`` record. What one batch does, in order
(:meth:`Executor._process`):

1. decode the batch; undecodable or invalid effects become dead letters (R30);
2. one statement reads the executed-action records of the batch's keys as they were and marks
   every key that is not completed ``started`` (``starts`` counts the beginnings);
3. keys with a ``completed`` record are answered by re-sending the stored input verbatim;
4. the others are executed in the pool; the handler sees the previous record, so a
   ``started`` row (a crash between the call and the commit) leads to reconciliation instead
   of a blind second call;
   Every effect goes through ONE guard (:meth:`Executor._answer`): whatever its handler does
   (raises, returns an artifact over the store's cap or an answer the codec cannot encode),
   the effect gets an answer: an exception that looks transient (``OSError``) is retried for
   that effect alone (``handler_attempts``, backing off), anything else, or the last attempt,
   becomes the handler's failure answer (:meth:`Handler.failure`); an effect started
   ``max_starts`` times without an answer (a crash loop) is answered with its failure without
   calling again. Only a database outage fails the batch;
5. the artifacts the handlers made are written (write-once, content-addressed) BEFORE anything
   references them (R2);
6. the records become ``completed`` with the exact input record (first writer wins: a row that
   is already completed is kept and its input is the one sent);
7. the batch is queued for the committer thread and the loop polls again (group commit,
   :class:`agentruns.streams.transaction.Committer`, shared with the processor): each
   transaction carries every batch that became ready while the previous one committed: the
   consumed offsets (``send_offsets_to_transaction``, first), the inputs (key run_id, partition
   ``partition_for(run_id, n)``), the dead letters, commit. One transaction at a time; if one
   fails, the batches queued behind it are dropped and the loop re-reads from the earliest of
   their offsets (every effect then comes back and is answered from its record).

A batch that fails (the database is down) is re-read after a back-off that doubles from
``retry_backoff_s`` to ``retry_backoff_max_s``.

A crash anywhere before 7 commits leaves the offsets where they were: the effects come back and
steps 2-3 answer every completed key from its record. Input ids are ``<effect key>:result``, so
the processor drops a re-sent input as an exact duplicate (same id, same bytes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol

import msgspec
import psycopg
from agentruns.connectors import health
from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.logs import setup_logging
from agentruns.connectors.postgres.artifacts import MAX_ARTIFACT_BYTES, StoredArtifact
from agentruns.connectors.postgres.bulk import Conn, RetryingConnection
from agentruns.connectors.settings import current
from agentruns.processors.effects import Effect
from agentruns.processors.events import Event
from agentruns.processors.limits import MAX_JSON_DEPTH, json_depth
from agentruns.streams import dlq, records, tracing
from agentruns.streams.clock import now_ms
from agentruns.streams.codec import CodecError, decode, encode
from agentruns.streams.kafka_defaults import close_consumer, partition_count
from agentruns.streams.membership import Membership
from agentruns.streams.partitioning import partition_for, run_key
from agentruns.streams.polling import poll_batch
from agentruns.streams.records import parse_effect_body
from agentruns.streams.topics import DLQ, INBOX, default_prefix, effect_suffix, topic_name
from agentruns.streams.transaction import Backoff, Clients, Committer, Record, Timings, seek
from confluent_kafka import Consumer, KafkaException, Message, Producer, TopicPartition
from prometheus_client import Counter, Histogram

log = logging.getLogger("agentruns.executor")

#: How long after a batch of more than one effect an executor keeps gathering (`gather_ms`):
#: a trickle keeps it going, each gathered batch renewing it; an idle pipeline's lone effects,
#: one per batch, are never held.
GATHER_AFTER_S = 1.0

# Labelled by `kind` (model, tool): both executors may share a process (`agentruns run`).
EXECUTOR_RECORDS = Counter(
    "agentruns_executor_records_total", "Effect records consumed by the executor", ["kind"]
)
EXECUTOR_EFFECTS = Counter(
    "agentruns_executor_effects_total",
    "Effects answered, by outcome: executed (the handler's answer), failed (a failure answer"
    " from the guard), replayed (the stored answer of a completed effect, sent again)",
    ["kind", "outcome"],
)
EXECUTOR_CALL_SECONDS = Histogram(
    "agentruns_executor_call_seconds",
    "Time of one handler call (the model or tool call), by outcome: ok or error (it raised)",
    ["kind", "outcome"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
EXECUTOR_HANDLER_ERRORS = Counter(
    "agentruns_executor_handler_errors_total", "Exceptions out of a handler, caught", ["kind"]
)
EXECUTOR_DEAD_LETTERS = Counter(
    "agentruns_executor_dead_letters_total", "Effect records sent to the DLQ", ["kind"]
)
EXECUTOR_TRANSACTIONS = Counter(
    "agentruns_executor_transactions_total",
    "Executor transactions, by outcome: committed or aborted (the loop rewinds)",
    ["kind", "outcome"],
)
EXECUTOR_BATCH_RETRIES = Counter(
    "agentruns_executor_batch_retries_total",
    "Batches re-read after a failure (the database down)",
    ["kind"],
)
EXECUTOR_COMMIT_SECONDS = Histogram(
    "agentruns_executor_commit_seconds",
    "Time of one executor transaction (offsets, produce, flush, commit)",
    ["kind"],
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)


class ExecutorError(AgentrunsError):
    """An executor cannot run (bad configuration, missing topic, database down)."""


def decode_json(body: bytes, depth: int = MAX_JSON_DEPTH) -> tuple[Any, str | None]:
    """A backend's JSON: (value, None), or (None, what is wrong: ``not_json``, ``not_utf8``,
    ``too_deep``). Never raises: msgspec stops at its own depth limit with RecursionError
    (no Python recursion), and the named limit is checked without recursion."""
    try:
        value = msgspec.json.decode(body)
    except RecursionError:
        return None, "too_deep"
    except UnicodeDecodeError:
        return None, "not_utf8"
    except (msgspec.DecodeError, ValueError):
        return None, "not_json"
    if json_depth(value, depth) > depth:
        return None, "too_deep"
    return value, None


def clean_text(text: str, limit: int | None = 1000) -> str:
    """Text for a Postgres ``text`` column: no NUL (which Postgres refuses, and would refuse
    on every retry of the batch), bounded by ``limit`` characters."""
    return text[:limit].replace("\x00", "\\0")


def result_input_id(effect: Effect) -> str:
    """The input id (and event id) of an effect's answer: deterministic from its key."""
    return f"{effect.idempotency_key}:result"


def event_identity(effect: Effect, at: int | None = None) -> dict[str, Any]:
    """The EventBase fields of the answer to ``effect``."""
    return {
        "run_id": effect.run_id,
        "event_id": result_input_id(effect),
        "at": now_ms() if at is None else at,
        "trace_id": effect.trace_id,
    }


def input_record(effect: Effect, event: Event) -> dict[str, Any]:
    """The inbox ``Input`` record (schema v2) carrying ``event`` as the answer to ``effect``."""
    # `event` was built with `event_identity(effect)`: the effect's run, trace and result id.
    return records.input_record(event, input_id=result_input_id(effect))


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ActionRecord:
    """One row of ``executed_actions`` (migration 0003)."""

    key: str
    effect_type: str
    status: str  # started | completed
    starts: int
    input_json: str | None
    detail: str | None

    @property
    def completed(self) -> bool:
        return self.status == "completed" and self.input_json is not None

    def input(self) -> dict[str, Any]:
        assert self.input_json is not None
        value: dict[str, Any] = json.loads(self.input_json)
        return value


@dataclass(frozen=True)
class Completion:
    effect: Effect
    input: dict[str, Any]
    detail: str
    artifacts: tuple[StoredArtifact, ...] = ()
    failed: bool = False  # a failure answer of the guard, not the handler's own


def operation_key_of(effect: Effect) -> str | None:
    op = getattr(effect, "operation", None)
    if op is not None:
        return str(op.key)
    key = getattr(effect, "operation_key", None)
    return None if key is None else str(key)


class ActionRecords:
    """The executed-action records in Postgres. One connection; the loop thread only.

    Every statement here finds rows by primary key, so the session plans no sequential scan
    (``enable_seqscan = off``): psycopg prepares a statement on its fifth run, and Postgres
    then keeps the generic plan it chose while the table was small, a sequential scan that
    grows with the table until autovacuum analyzes it (8.8 ms a statement at 9,000 rows on a
    fresh database, where the index takes 0.3 ms)."""

    _COLUMNS = "idempotency_key, effect_type, status, starts, input_json, detail"

    def __init__(self, database_url: str, executor: str, *, retries: int = 30) -> None:
        self._executor = executor
        self._db = RetryingConnection(
            database_url, ExecutorError, retries=retries, settings={"enable_seqscan": "off"}
        )

    def fetch(self, keys: Sequence[str]) -> dict[str, ActionRecord]:
        if not keys:
            return {}

        def read(conn: Conn) -> dict[str, ActionRecord]:
            rows = conn.execute(
                f"SELECT {self._COLUMNS} FROM executed_actions WHERE idempotency_key = ANY(%s)",
                (list(keys),),
            ).fetchall()
            return {r[0]: ActionRecord(*r) for r in rows}

        result: dict[str, ActionRecord] = self._db.run("reading executed actions", read)
        return result

    def begin(self, effects: Sequence[Effect]) -> dict[str, ActionRecord]:
        """One statement: return the records as they were, and mark every key that is not
        completed ``started`` (new rows, or ``starts + 1`` for a started one: a restart).

        The outer SELECT reads the snapshot from before the INSERT of its own statement,
        so it returns the previous records, exactly what the handlers must see."""
        if not effects:
            return {}
        columns = (
            [e.idempotency_key for e in effects],
            [e.type for e in effects],
            [clean_text(e.run_id, None) for e in effects],  # informational: a run id from outside
            [e.step for e in effects],
            [e.attempt for e in effects],
            [operation_key_of(e) for e in effects],
        )

        def write(conn: Conn) -> dict[str, ActionRecord]:
            rows = conn.execute(
                "WITH started AS ("
                " INSERT INTO executed_actions (idempotency_key, effect_type, run_id, step,"
                " attempt, operation_key, status, executor)"
                " SELECT k, t, r, s, a, o, 'started', %s FROM unnest("
                " %b::text[], %b::text[], %b::text[], %b::int[], %b::int[], %b::text[])"
                " AS v(k, t, r, s, a, o)"
                " ON CONFLICT (idempotency_key) DO UPDATE"
                " SET starts = executed_actions.starts + 1, executor = EXCLUDED.executor"
                " WHERE executed_actions.status = 'started')"
                f" SELECT {self._COLUMNS} FROM executed_actions"
                " WHERE idempotency_key = ANY(%b::text[])",
                (self._executor, *columns, columns[0]),
            ).fetchall()
            return {r[0]: ActionRecord(*r) for r in rows}

        result: dict[str, ActionRecord] = self._db.run("starting actions", write)
        return result

    def complete(
        self, completions: Sequence[Completion], artifacts: Sequence[StoredArtifact] = ()
    ) -> dict[str, dict[str, Any]]:
        """Write the artifacts and record the inputs, in ONE statement (atomic, one round trip).

        Returns key -> the input to send: ours, or the first writer's when another executor
        completed the key first (a row already completed is never overwritten)."""
        if not completions:
            return {}
        unique: dict[str, StoredArtifact] = {}
        for artifact in artifacts:
            unique.setdefault(artifact.ref, artifact)
        blobs = [a.content.encode() for a in unique.values()]
        for ref, blob in zip(unique, blobs, strict=True):
            if len(blob) > MAX_ARTIFACT_BYTES:
                raise ExecutorError(f"artifact {ref} is {len(blob)} bytes, over the limit")
        params = (
            list(unique),
            [a.media_type for a in unique.values()],
            [len(b) for b in blobs],
            blobs,
            [c.effect.idempotency_key for c in completions],
            [c.input["kind"] for c in completions],
            [c.input["input_id"] for c in completions],
            [json.dumps(c.input, sort_keys=True, separators=(",", ":")) for c in completions],
            [c.detail for c in completions],
        )

        def write(conn: Conn) -> set[str]:
            rows = conn.execute(
                "WITH stored AS ("
                " INSERT INTO artifacts (ref, media_type, size_bytes, content)"
                " SELECT * FROM unnest(%b::text[], %b::text[], %b::int[], %b::bytea[])"
                " ON CONFLICT (ref) DO NOTHING)"
                " UPDATE executed_actions AS a SET status = 'completed', result_kind = v.kind,"
                " input_id = v.input_id, input_json = v.input_json, detail = v.detail,"
                " completed_at = now()"
                " FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], %b::text[])"
                " AS v(key, kind, input_id, input_json, detail)"
                " WHERE a.idempotency_key = v.key AND a.status = 'started'"
                " RETURNING a.idempotency_key",
                params,
            ).fetchall()
            return {str(r[0]) for r in rows}

        updated: set[str] = self._db.run("completing actions", write)
        chosen = {c.effect.idempotency_key: c.input for c in completions}
        raced = [k for k in chosen if k not in updated]
        if raced:
            for key, record in self.fetch(raced).items():
                if record.completed:
                    chosen[key] = record.input()
        return chosen

    def close(self) -> None:
        self._db.close()


# --------------------------------------------------------------------------- handlers


@dataclass(frozen=True)
class Outcome:
    """What a handler made of one effect: the answer event, the artifacts it references."""

    event: Event
    artifacts: tuple[StoredArtifact, ...] = ()
    detail: str = ""


class Handler(Protocol):
    """Carries out effects of some types. ``execute`` runs in a pool thread and classifies
    outside failures into the answer event; if it raises anyway, the executor's guard asks
    ``failure`` for the effect's failure answer (which must not raise: no I/O)."""

    effect_types: frozenset[str]

    def execute(self, effect: Effect, previous: ActionRecord | None) -> Outcome: ...

    def prepare(self, effects: Sequence[Effect]) -> None:
        """Before a batch's effects are executed (in the loop thread): read ahead, in a few
        statements, what their ``execute`` calls will read. Only a read ahead: an error here
        other than a database outage is logged, and each call reads what it needs itself."""
        ...

    def failure(self, effect: Effect, code: str, message: str) -> Outcome:
        """The answer to an effect that cannot be carried out: one the core classifies as
        not worth retrying as is. ``code``: ``executor_error`` (the handler raised),
        ``executor_error:restarts`` (a crash loop), ``invalid_output:<what>``."""
        ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- the loop


@dataclass
class ExecutorConfig:
    bootstrap: str
    database_url: str
    kind: str  # "model" or "tool": which effects topic
    prefix: str = "agentruns"
    group_id: str | None = None  # default: <prefix>-executor-<kind>
    # Stable per process slot: a restarted executor with the same id aborts the transaction
    # its predecessor left open at once (instead of waiting for transaction.timeout.ms).
    instance_id: str = "0"
    workers: int = 32
    max_batch: int = 256
    # effects executed but not yet in a transaction before the loop stops polling
    max_backlog: int = 1024
    poll_timeout_s: float = 0.1
    # After the first effect of a batch, wait this long for more (a producer's linger on the
    # consuming side), within GATHER_AFTER_S of a batch that held more than one: effects
    # trickling in share a batch's two statements, its thread-pool round and its transaction,
    # while a lone effect of an idle pipeline is not held (docs/design.md, "Fetching"). Unlike a
    # fetch window (fetch.min.bytes) it costs an idle executor no extra fetches.
    gather_ms: int = 10
    # The guard around each effect's handler (one place, Executor._answer): an exception that
    # looks transient (OSError) is retried for that effect alone, up to `handler_attempts` in
    # all, waiting `handler_backoff_ms`, doubling; then the effect gets its failure answer.
    handler_attempts: int = 3
    handler_backoff_ms: int = 200
    # An effect started this many times without an answer (its handler kills the process, or
    # the batch around it keeps failing) is answered with its failure instead of run again.
    max_starts: int = 5
    # An artifact a handler returns over this size becomes the failure
    # `invalid_output:too_large` (the store refuses more than MAX_ARTIFACT_BYTES).
    max_artifact_bytes: int = MAX_ARTIFACT_BYTES
    # An answer whose Input record encodes to more than this becomes the failure
    # `invalid_output:too_large`: the broker refuses a record over its message.max.bytes
    # (1 MiB by default), and a refused record would fail every transaction it is in.
    max_input_bytes: int = 1_000_000
    # A batch that fails (the database is down) is re-read after this back-off, doubling up to
    # the maximum while it keeps failing.
    retry_backoff_s: float = 0.5
    retry_backoff_max_s: float = 10.0
    transaction_timeout_ms: int = 10_000
    session_timeout_ms: int = 6000
    max_poll_interval_ms: int = 300_000
    extra_consumer: dict[str, Any] = field(default_factory=dict)
    extra_producer: dict[str, Any] = field(default_factory=dict)

    @property
    def group(self) -> str:
        return self.group_id or f"{self.prefix}-executor-{self.kind}"


@dataclass
class ExecutorStats:
    batches: int = 0  # batches executed by the loop
    transactions: int = 0  # committed transactions (each carries every batch ready at its start)
    effects: int = 0
    executed: int = 0
    replayed: int = 0
    dead_letters: int = 0
    aborts: int = 0
    batch_retries: int = 0  # batches re-read after a failure (database down)
    handler_errors: int = 0  # exceptions out of a handler, caught by the guard
    gave_up: int = 0  # effects answered with their failure by the guard
    execute_s: float = 0.0  # records + outside calls
    wait_s: float = 0.0  # the loop waiting for the committer (back-pressure, drains)
    produce_s: float = 0.0  # begin + produce
    offsets_s: float = 0.0  # send_offsets_to_transaction
    flush_s: float = 0.0  # flush: the records' acknowledgements
    commit_s: float = 0.0  # commit_transaction (EndTxn)
    # the durations of the latest transactions (seconds), for percentiles in the summary
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    # per batch, from the oldest effect's record timestamp (the producer's wall clock):
    # until the loop polled it, and until its transaction committed
    polled_after: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    committed_after: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))

    def summary(self) -> dict[str, Any]:
        """Counters and mean milliseconds per batch / per transaction (logged at close)."""
        batches, txns = max(1, self.batches), max(1, self.transactions)
        return {
            "batches": self.batches,
            "transactions": self.transactions,
            "effects": self.effects,
            "executed": self.executed,
            "replayed": self.replayed,
            "dead_letters": self.dead_letters,
            "aborts": self.aborts,
            "batch_retries": self.batch_retries,
            "handler_errors": self.handler_errors,
            "gave_up": self.gave_up,
            "ms_per_batch": {
                "execute": round(self.execute_s * 1000 / batches, 2),
                "wait": round(self.wait_s * 1000 / batches, 2),
            },
            "ms_per_transaction": {
                "produce": round(self.produce_s * 1000 / txns, 2),
                "offsets": round(self.offsets_s * 1000 / txns, 2),
                "flush": round(self.flush_s * 1000 / txns, 2),
                "commit": round(self.commit_s * 1000 / txns, 2),
            },
            "transaction_ms": _percentiles(self.recent),
            "effect_age_ms": {
                "polled": _percentiles(self.polled_after),
                "committed": _percentiles(self.committed_after),
            },
        }


def _percentiles(values: Iterable[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    at = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
    out = {
        k: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)
        for k, q in at.items()
    }
    out["max"] = round(ordered[-1] * 1000, 2)
    return out


@dataclass(frozen=True)
class _Route:
    """Where an executor's answers go: the inbox (by run) and the dead letter topic."""

    inbox: str
    partitions: int  # of the inbox
    dlq: str


@dataclass
class _Ready:
    """An executed batch waiting for its transaction (`Outgoing`): its answers, dead letters
    and offsets."""

    inputs: list[tuple[str, dict[str, Any], str | None]]  # run_id, record, traceparent
    dead: list[dict[str, Any]]
    first: dict[int, int]  # partition -> first offset (where to rewind to)
    offsets: dict[int, int]  # partition -> next offset to commit
    metadata: Any  # the consumer's group metadata when the batch was read
    route: _Route
    created: float | None = None  # the oldest record timestamp in the batch (epoch seconds)

    def records(self) -> Iterator[Record]:
        """The answers, then the dead letters, encoded as the committer produces them."""
        route = self.route
        for run_id, record, traceparent in self.inputs:
            yield (
                route.inbox,
                run_key(run_id),
                encode("Input", record),
                partition_for(run_id, route.partitions),
                [
                    ("trace_id", record["trace_id"].encode()),
                    ("run_id", run_id.encode()),
                    *tracing.headers_of(traceparent),
                ],
            )
        for record in self.dead:
            yield route.dlq, record["original_key"], encode("DeadLetter", record), None, None

    def durable(self) -> None:
        """Nothing to wait for: artifacts and records were written before the hand-over."""


def _earliest(*positions: dict[int, int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for position in positions:
        for partition, offset in position.items():
            out[partition] = min(offset, out.get(partition, offset))
    return out


class Executor:
    """The consume-execute-produce loop around one handler. One thread owns it (``run``)."""

    def __init__(self, config: ExecutorConfig, handler: Handler) -> None:
        self.config = config
        self.handler = handler
        self.stats = ExecutorStats()
        c = config
        self.effects_topic = topic_name(effect_suffix(c.kind), c.prefix)
        self.inbox = topic_name(INBOX, c.prefix)
        self.dlq = topic_name(DLQ, c.prefix)
        self._clients = Clients.of(c, c.group)
        self._name = self._clients.member
        self._records = ActionRecords(c.database_url, self._name)
        self._pool = ThreadPoolExecutor(max(1, c.workers), thread_name_prefix=f"exec-{c.kind}")
        self._consumer = self._clients.consumer({"max.poll.interval.ms": c.max_poll_interval_ms})
        self.membership = Membership()  # what /healthz reports
        # Group commit: the loop hands executed batches to one committer thread, which commits
        # EVERY batch ready when its previous transaction ended in one transaction. So a batch
        # never waits for a transaction that started before it was ready, and the loop never
        # waits for a commit (unless the backlog is over `max_backlog`).
        self._committer: Committer[_Ready] = Committer(
            self._new_producer,
            self.effects_topic,
            self._on_commit,
            name=f"commit-{c.kind}",
            offsets_first=True,
            logger=log,
        )
        self._route = _Route(
            self.inbox, partition_count(self._committer.producer, self.inbox), self.dlq
        )
        self._closed = False
        self._stop = threading.Event()
        self._stats_lock = threading.Lock()  # counters the pool threads update
        self._backoff = Backoff(c.retry_backoff_s, c.retry_backoff_max_s)

    @property
    def retry_backoff_s(self) -> float:
        """How long the loop waits before re-reading the next batch that fails."""
        return self._backoff.next_s

    def _new_producer(self, slot: str) -> Producer:
        return self._clients.producer(slot, {"linger.ms": 0})

    # ------------------------------------------------------------------ lifecycle

    def run(self, stop: threading.Event) -> None:
        """Execute effects until ``stop`` is set; the batch in hand is finished first."""
        self._stop = stop
        self._consumer.subscribe(
            [self.effects_topic], on_assign=self._on_assign, on_revoke=self._on_revoke
        )
        c = self.config
        gathering_until = 0.0  # monotonic: effects came more than one to a batch until then
        try:
            while not stop.is_set():
                self._recover_if_failed()
                # Gather only within GATHER_AFTER_S of a batch of more than one effect: a lone
                # effect of an idle pipeline is on its run's critical path, and nothing would
                # join it.
                now = time.monotonic()
                gather = c.gather_ms / 1000 if now < gathering_until else 0.0
                batch = poll_batch(self._consumer, c.max_batch, c.poll_timeout_s, gather=gather)
                if len(batch) > 1:
                    gathering_until = time.monotonic() + GATHER_AFTER_S
                if batch:
                    self._process(batch)
            self._drain()
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._drain()
        self._committer.stop()
        log.info("executor stats %s", json.dumps(self.stats.summary()))
        with contextlib.suppress(KafkaException):
            close_consumer(self._consumer)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.handler.close()
        self._records.close()
        with contextlib.suppress(Exception):
            self._committer.close()

    # ------------------------------------------------------------------ one batch

    def _process(self, messages: list[Message]) -> None:
        effects: list[Effect] = []
        contexts: dict[str, str] = {}  # effect key -> the trace context its record carried
        dead: list[dict[str, Any]] = []
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for message in messages:
            if message.error() is not None:
                log.warning("consumer error: %s", message.error())
                continue
            partition, offset = message.partition() or 0, message.offset() or 0
            first.setdefault(partition, offset)
            last[partition] = offset + 1
            effect = self._decode(message, dead)
            if effect is not None:
                effects.append(effect)
                context = tracing.from_headers(message.headers())
                if context is not None:
                    contexts[effect.idempotency_key] = context
        if not first:
            return
        EXECUTOR_RECORDS.labels(self.config.kind).inc(sum(last[p] - first[p] for p in first))
        created = _oldest(messages)
        if created is not None:
            self.stats.polled_after.append(time.time() - created)
        began = time.monotonic()
        try:
            inputs = self._execute(effects, contexts)
            self.stats.execute_s += time.monotonic() - began
            self.stats.batches += 1
            self._backoff.succeeded()
        except Exception as exc:  # database down (handlers' own errors end in the guard)
            delay = self._backoff.failed()
            if isinstance(exc, ExecutorError | psycopg.Error):
                log.error("batch failed, retrying it in %.1f s: %s", delay, exc)
            else:
                log.exception("batch failed unexpectedly, retrying it")
            self.stats.aborts += 1
            self.stats.batch_retries += 1
            EXECUTOR_BATCH_RETRIES.labels(self.config.kind).inc()
            if self._drain(also_rewind=first):  # else already rewound to the failed batch
                seek(self._consumer, self.effects_topic, first, lenient=True)
            self._backoff.wait(self._stop)
            return
        metadata = self._consumer.consumer_group_metadata()
        ready = _Ready(inputs, dead, first, last, metadata, self._route, _oldest(messages))
        self._hand_over(ready)

    # ------------------------------------------------------------------ group commit

    def _hand_over(self, ready: _Ready) -> None:
        """Queue an executed batch for the committer (waiting while the backlog is full).

        If a transaction failed meanwhile, this batch is not queued: the loop rewinds to the
        failed transaction's first offsets (and this batch's); everything comes back and is
        answered from its records."""
        began = time.monotonic()
        queued = self._committer.submit(ready, self._full)
        self.stats.wait_s += time.monotonic() - began
        if not queued:
            self._recover_if_failed(also_rewind=ready.first)

    def _full(self, queued: list[_Ready]) -> bool:
        """Whether the effects queued for the committer (not counting the transaction in
        flight) reach `max_backlog`."""
        return sum(len(r.inputs) + len(r.dead) for r in queued) >= self.config.max_backlog

    def _drain(self, also_rewind: dict[int, int] | None = None) -> bool:
        """Wait until every queued batch is committed. False (after recovering and rewinding
        to the failed batches, and to ``also_rewind``) when a transaction failed."""
        began = time.monotonic()
        self._committer.wait()
        self.stats.wait_s += time.monotonic() - began
        return not self._recover_if_failed(also_rewind)

    def _recover_if_failed(self, also_rewind: dict[int, int] | None = None) -> bool:
        """After a failed transaction (the committer is then idle): abort it or replace its
        producer, drop the batches queued behind it, and rewind to the earliest first offset
        of all of them. True if there was a failure."""
        failure = self._committer.take_failure()
        if failure is None:
            return False
        rewind = _earliest(*(b.first for b in failure.units), also_rewind or {})
        self._committer.recover(failure.error)  # logged: an abort, or a new producer if fatal
        self.stats.aborts += 1
        EXECUTOR_TRANSACTIONS.labels(self.config.kind, "aborted").inc()
        # the effects come back and are answered from their records
        seek(self._consumer, self.effects_topic, rewind, lenient=True)
        return True

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.membership.assigned(partitions)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Before partitions move: commit what is queued (its offsets are theirs)."""
        self.membership.revoked()
        self._drain()

    def _decode(self, message: Message, dead: list[dict[str, Any]]) -> Effect | None:
        value = message.value() or b""
        try:
            record = decode(value, expected_name="Effect").record
            effect = parse_effect_body(record["body"])
        except CodecError as exc:
            dead.append(self._dead_letter(message, str(exc), exc.error_class))
            return None
        except msgspec.DecodeError as exc:
            reason = f"invalid effect body: {exc}"
            dead.append(self._dead_letter(message, reason, dlq.INVALID_EVENT))
            return None
        if effect.type not in self.handler.effect_types:
            reason = f"{effect.type} is not executed by the {self.config.kind} executor"
            dead.append(self._dead_letter(message, reason, dlq.INVALID_EVENT))
            return None
        if "\x00" in effect.idempotency_key + (operation_key_of(effect) or ""):
            # the record of a key Postgres cannot store would fail the batch on every retry
            reason = "invalid_input:key_with_nul: an effect key holds a NUL character"
            dead.append(self._dead_letter(message, reason, dlq.INVALID_EVENT))
            return None
        return effect

    def _dead_letter(self, message: Message, reason: str, error_class: str) -> dict[str, Any]:
        self.stats.dead_letters += 1
        EXECUTOR_DEAD_LETTERS.labels(self.config.kind).inc()
        log.warning("dead letter (%s): %s", error_class, reason)
        _, timestamp = message.timestamp()
        return dlq.dead_letter(
            reason,
            error_class,
            message.topic() or self.effects_topic,
            message.partition() or 0,
            message.offset() or 0,
            message.key(),
            message.value(),
            _header_list(message),
            now_ms(),
            original_timestamp=timestamp if timestamp > 0 else None,
        )

    def _execute(
        self, effects: list[Effect], contexts: dict[str, str]
    ) -> list[tuple[str, dict[str, Any], str | None]]:
        """(run_id, input record, trace context) per distinct effect key, in batch order: the
        context of the effect's execution span, else the one the effect came with."""
        unique: dict[str, Effect] = {}
        for effect in effects:
            unique.setdefault(effect.idempotency_key, effect)
        records = self._records.begin(list(unique.values()))
        answers: dict[str, dict[str, Any]] = {}
        todo: list[Effect] = []
        for key, effect in unique.items():
            record = records.get(key)
            if record is not None and record.completed:
                answers[key] = record.input()
            else:
                todo.append(effect)
        self.stats.replayed += len(answers)
        kind = self.config.kind
        if answers:
            EXECUTOR_EFFECTS.labels(kind, "replayed").inc(len(answers))
        if todo:
            self._prepare(todo)
            futures = [
                self._pool.submit(
                    self._traced, e, records.get(e.idempotency_key), contexts, e.idempotency_key
                )
                for e in todo
            ]
            completions = [f.result() for f in futures]
            # artifacts and records in one statement, before any input referencing them (R2)
            artifacts = [a for c in completions for a in c.artifacts]
            answers.update(self._records.complete(completions, artifacts))
            self.stats.executed += len(todo)
            failed = sum(c.failed for c in completions)
            if failed:
                EXECUTOR_EFFECTS.labels(kind, "failed").inc(failed)
            if failed < len(completions):
                EXECUTOR_EFFECTS.labels(kind, "executed").inc(len(completions) - failed)
        self.stats.effects += len(unique)
        return [(unique[k].run_id, answers[k], contexts.get(k)) for k in unique]

    def _prepare(self, effects: list[Effect]) -> None:
        try:
            self.handler.prepare(effects)
        except Exception as exc:
            if _outage(exc):
                raise
            log.warning("reading ahead for %d effects failed: %s", len(effects), exc)

    def _traced(
        self, effect: Effect, previous: ActionRecord | None, contexts: dict[str, str], key: str
    ) -> Completion:
        """`_answer` in the effect's trace: a span when tracing is on (its context replaces
        the effect's in `contexts`), and the context on the handler's HTTP calls."""
        context = contexts.get(key)
        span = None
        if tracing.enabled():
            span = tracing.start(
                f"execute {effect.type}",
                context,
                {"agentruns.run_id": effect.run_id, "agentruns.step": effect.step},
            )
            context = contexts[key] = tracing.traceparent_of(span)
        token = tracing.OUTGOING.set(context)
        error = None
        try:
            completion = self._answer(effect, previous)
            kind = str(completion.input["kind"])
            if kind.endswith("Failed"):  # the backend's failure, answered to the run
                error = kind
            return completion
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            tracing.OUTGOING.reset(token)
            if span is not None:
                tracing.end(span, error)

    def _answer(self, effect: Effect, previous: ActionRecord | None) -> Completion:
        """The one guard around a handler (a pool thread): the effect's answer, always.

        A database outage is re-raised (the batch is retried); any other exception out of
        the handler is this effect's alone: retried a few times if it looks transient, then
        answered with the handler's failure, so one bad backend answer never fails a batch."""
        c = self.config
        if previous is not None and previous.starts >= c.max_starts:
            reason = f"started {previous.starts} times without an answer"
            return self._give_up(effect, "executor_error:restarts", reason)
        delay = c.handler_backoff_ms / 1000
        attempt = 0
        while True:
            attempt += 1
            began, called = time.monotonic(), False
            try:
                outcome = self.handler.execute(effect, previous)
                called = True
                EXECUTOR_CALL_SECONDS.labels(c.kind, "ok").observe(time.monotonic() - began)
                # in the guard too: an answer the codec cannot encode is this effect's failure
                return self._checked(effect, outcome)
            except Exception as exc:
                if not called:
                    EXECUTOR_CALL_SECONDS.labels(c.kind, "error").observe(time.monotonic() - began)
                if _outage(exc):
                    raise
                with self._stats_lock:
                    self.stats.handler_errors += 1
                text = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, OSError) and attempt < c.handler_attempts:
                    log.warning("%s %s: %s; again", effect.type, effect.idempotency_key, text)
                    time.sleep(delay)  # short and bounded: a stop finishes the batch in hand
                    delay *= 2
                    continue
                log.warning(
                    "%s %s failed in its handler: %s",
                    effect.type,
                    effect.idempotency_key,
                    text,
                    exc_info=not isinstance(exc, OSError),
                )
                return self._give_up(effect, "executor_error", text)

    def _checked(self, effect: Effect, outcome: Outcome) -> Completion:
        """The completion of a handler's outcome, if the store and the codec can take it."""
        limit = min(self.config.max_artifact_bytes, MAX_ARTIFACT_BYTES)
        for artifact in outcome.artifacts:
            size = len(artifact.content.encode())
            if size > limit:
                message = f"an artifact of {size} bytes, over the limit of {limit}"
                return self._give_up(effect, "invalid_output:too_large", message)
        record = input_record(effect, outcome.event)
        # An answer the committer could not encode or send would fail every transaction.
        size = len(encode("Input", record))
        if size > self.config.max_input_bytes:
            message = f"an answer of {size} bytes, over the limit of {self.config.max_input_bytes}"
            return self._give_up(effect, "invalid_output:too_large", message)
        return Completion(effect, record, clean_text(outcome.detail), outcome.artifacts)

    def _give_up(self, effect: Effect, code: str, message: str) -> Completion:
        with self._stats_lock:
            self.stats.gave_up += 1
        outcome = self.handler.failure(effect, code, clean_text(message, 500))
        record = input_record(effect, outcome.event)
        detail = clean_text(f"{code}: {message}")
        return Completion(effect, record, detail, outcome.artifacts, failed=True)

    def _on_commit(self, batches: list[_Ready], t: Timings) -> None:
        """The committer thread, once a transaction committed (its offsets went first:
        measured on the dev box, AddOffsetsToTxn/TxnOffsetCommit then no longer queue behind
        the partition registrations of the produced records)."""
        stats = self.stats
        stats.offsets_s += t.sent - t.began
        stats.produce_s += t.produced - t.sent
        stats.flush_s += t.flushed - t.durable
        stats.commit_s += t.ended - t.flushed
        stats.recent.append(t.ended - t.began)
        wall = time.time()
        stats.committed_after.extend(wall - b.created for b in batches if b.created is not None)
        stats.transactions += 1
        EXECUTOR_TRANSACTIONS.labels(self.config.kind, "committed").inc()
        EXECUTOR_COMMIT_SECONDS.labels(self.config.kind).observe(t.ended - t.began)


def _outage(exc: Exception) -> bool:
    """The database is down (after the connection's own retries): retry the whole batch."""
    if isinstance(exc, psycopg.OperationalError):
        return True
    return isinstance(exc, AgentrunsError) and exc.retryable


def _oldest(messages: list[Message]) -> float | None:
    """The oldest record timestamp of a batch (epoch seconds), if the records carry one."""
    stamps = [m.timestamp()[1] for m in messages if m.error() is None]
    valid = [t for t in stamps if t > 0]
    return min(valid) / 1000 if valid else None


def _header_list(message: Message) -> list[tuple[str, str | bytes | None]]:
    headers = message.headers()
    if headers is None:
        return []
    if isinstance(headers, dict):
        return list(headers.items())
    return list(headers)


# --------------------------------------------------------------------------- process mains


def run_until_signal(executor: Executor, args: Any = None) -> int:
    """Run in this thread until SIGTERM/SIGINT; finish the batch in hand, then exit 0.

    With the command's ``args``: serve its health endpoints meanwhile (`health.serving`)."""
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    c = executor.config
    serving = (
        health.serving(
            args, f"executor-{c.kind}", bootstrap=c.bootstrap, database_url=c.database_url
        )
        if args is not None
        else contextlib.nullcontext(None)
    )
    try:
        with serving as status:
            if status is not None:
                status.watch_consumer(executor.membership, c.group)
                status.watch_loop(stop, threading.current_thread())
            executor.run(stop)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def add_common_arguments(parser: Any, kind: str) -> None:
    parser.add_argument("--bootstrap", default=current().kafka_bootstrap_servers)
    parser.add_argument("--database-url", default=current().database_url)
    parser.add_argument(
        "--prefix",
        default=default_prefix(),
        help="topic prefix",
    )
    parser.add_argument("--group", default=None, help=f"consumer group (<prefix>-executor-{kind})")
    parser.add_argument(
        "--instance", default="0", help="stable instance id (transactional.id suffix)"
    )
    parser.add_argument("--workers", type=int, default=32 if kind == "tool" else 16)
    parser.add_argument("--max-batch", type=int, default=256 if kind == "tool" else 32)
    parser.add_argument(
        "--gather-ms",
        type=int,
        default=ExecutorConfig.gather_ms,
        help="after a batch's first effect, wait this long for more (0: take what is there)",
    )
    parser.add_argument("--log-level", default="WARNING")
    health.add_arguments(parser)


def config_from_args(args: Any, kind: str) -> tuple[ExecutorConfig, Any]:
    """The executor config; resolves Kafka/Postgres like every command when not given.

    Returns the config and the ServiceStack to close (or None)."""
    setup_logging(args.log_level, component=f"executor-{kind}")
    tracing.configure_from_env(f"executor-{kind}")
    stack = None
    bootstrap, database = args.bootstrap, args.database_url
    if not bootstrap or not database:
        from agentruns.connectors.devstack.services import SERVICE_PATIENCE_S, ServiceStack

        stack = ServiceStack(patience_s=SERVICE_PATIENCE_S)
        endpoints = stack.start()
        bootstrap = bootstrap or endpoints.kafka_bootstrap
        database = database or endpoints.database_url
    else:
        from agentruns.connectors.devstack.services import check_kafka

        check_kafka(bootstrap)  # unreachable, or the credentials refused: one line, at once
    from agentruns.connectors.postgres.migrate import migrate

    migrate(database)
    config = ExecutorConfig(
        bootstrap=bootstrap,
        database_url=database,
        kind=kind,
        prefix=args.prefix,
        group_id=args.group,
        instance_id=args.instance,
        workers=args.workers,
        max_batch=args.max_batch,
        gather_ms=args.gather_ms,
    )
    return config, stack


__all__ = [
    "ActionRecord",
    "ActionRecords",
    "Executor",
    "ExecutorConfig",
    "ExecutorError",
    "Handler",
    "Outcome",
    "add_common_arguments",
    "clean_text",
    "config_from_args",
    "decode_json",
    "event_identity",
    "input_record",
    "result_input_id",
    "run_until_signal",
]
