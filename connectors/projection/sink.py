"""`agentruns sink`: the exactly-once Postgres projection of the run log (R27).

The sink consumes `<prefix>.events`, `<prefix>.state`, `<prefix>.results` and `<prefix>.dlq`
(read_committed) and folds every run's events with the CURRENT core
(`agentruns.processors.transition.transition`) into the tables of migration 0002: runs, events,
operations, questions, results, run_snapshots; the dead letters of every component go to
`dead_letters` (migration 0008), which the console reads.

Exactly once, in the order `_commit` writes it down, in ONE Postgres transaction per batch:

1. the states of the batch's runs that are not cached are read from `runs.state` (the fold at
   `runs.last_seq`, committed together with the offsets, so always consistent with them);
2. the batch's events are folded; an event whose seq is not above the run's last seq is skipped;
3. rows are upserted in bulk (one `INSERT ... SELECT FROM unnest(...)` per table), each upsert
   guarded by seq: a runs row never moves backwards (`WHERE runs.last_seq < EXCLUDED.last_seq`);
4. the consumed positions (`sink_offsets`: consumer, topic, partition, next offset);
5. COMMIT; only then does the in-memory state cache take the batch's new states.

On start and on every assignment the sink seeks to the offsets in Postgres (Kafka's committed
offsets are never used). A crash anywhere before 5 leaves rows and offsets as they were; a crash
after 5 but before Kafka hears anything changes nothing either. A lost connection (Postgres
restarting) is retried with backoff with the same messages; a commit whose outcome is unknown is
re-applied, which the guards make a no-op.

Hostile records never stop the projection. A record the sink cannot decode or fold becomes a
dead-letter record on `<prefix>.dlq` (its reason, bytes, headers, topic/partition/offset) and the
batch goes on; a record on the DLQ topic itself is never sent back to it (one that is not a
DeadLetter is stored as an undecodable dead letter). A batch whose SQL fails for any reason but a
lost connection is written again record by record, each in its own savepoint, once: the records
that fail alone are dead-lettered, the rest committed. Dead letters are flushed before the
transaction that moves the offsets past them commits. Times outside what datetime holds are
stored as the nearest bound (`clamp_ms`).

This module holds the loop (consumer, batching, retries, dead letters) and its command; the rows
come from `agentruns.connectors.projection.rows`, the statements from `.sql`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from prometheus_client import Counter, Gauge, Histogram

from agentruns.connectors import dead_letters, health
from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.postgres.bulk import prefer_lz4, write_rows
from agentruns.connectors.projection.rows import (
    OP_COLUMNS,
    QUESTION_COLUMNS,
    SNAPSHOT_COLUMNS,
    dead_letter_values,
    event_values,
    merge_op,
    merge_question,
    project_event,
    result_values,
    run_values,
    snapshot_values,
    undecodable_dead_letter_values,
)
from agentruns.connectors.projection.run_metrics import RunMeter
from agentruns.connectors.projection.sql import (
    DEAD_LETTERS_TABLE,
    EVENTS_TABLE,
    OPS_TABLE,
    QUESTIONS_TABLE,
    RESULTS_TABLE,
    RUNS_TABLE,
    SNAPSHOTS_TABLE,
    SQL_OFFSETS,
    TABLES,
    Conn,
    read_offsets,
)
from agentruns.connectors.service import run_service
from agentruns.processors.state import RunState
from agentruns.streams import tracing
from agentruns.streams.access import sink_group
from agentruns.streams.clock import now_ms
from agentruns.streams.codec import CodecError, decode, decode_fields
from agentruns.streams.dlq import INVALID_EVENT
from agentruns.streams.interpreter import tune_gc
from agentruns.streams.kafka_defaults import (
    KEYED_PARTITIONER,
    LONG_POLL_MS,
    NO_DELAY,
    client_settings,
    close_consumer,
    group_consumer,
    release,
)
from agentruns.streams.membership import Membership
from agentruns.streams.polling import poll_batch
from agentruns.streams.topics import (
    DEFAULT_PREFIX,
    DLQ,
    EVENTS,
    RESULTS,
    STATE,
    default_prefix,
    topic_name,
)

log = logging.getLogger("agentruns.sink")


SINK_EVENTS = Counter("agentruns_sink_events_total", "Events projected into Postgres")
SINK_SKIPPED = Counter(
    "agentruns_sink_skipped_total",
    "Records skipped: already projected, or refused to the dead-letter topic",
    ["why"],
)
SINK_RETRIES = Counter("agentruns_sink_retries_total", "Postgres batches retried after an error")
SINK_DIVERGENCES = Counter(
    "agentruns_sink_divergences_total",
    "Events whose disposition under the current core differs from the recorded one",
)
SINK_BATCH_SECONDS = Histogram(
    "agentruns_sink_batch_seconds",
    "Write + commit of one sink batch (the writer thread)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
SINK_CACHED_RUNS = Gauge("agentruns_sink_cached_runs", "Run states held in memory by the sink")


class SinkError(AgentrunsError):
    """The sink cannot go on (a database error that retrying does not fix)."""


# --------------------------------------------------------------------------- the sink


@dataclass
class SinkConfig:
    bootstrap: str
    database_url: str
    prefix: str = DEFAULT_PREFIX
    group_id: str = ""  # default "<prefix>-sink": one offset owner per deployment prefix
    # "group": subscribe as a consumer group (several sinks share the partitions);
    # "all": assign every partition to this one process (no group rebalancing at all).
    assign: str = "group"
    instance_id: str | None = None  # static group membership: a restart takes over at once
    batch_size: int = 5000
    poll_timeout_s: float = 0.05
    max_cached_runs: int = 100_000
    retry_max_delay_s: float = 5.0
    #: Attempts of a batch that fails on a live connection (a conflict, a cancelled statement)
    #: before its records are written one by one and the one that fails is dead-lettered.
    max_batch_retries: int = 5
    session_timeout_ms: int = 10_000
    extra_consumer: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.group_id = self.group_id or sink_group(self.prefix)


@dataclass
class SinkStats:
    batches: int = 0
    events: int = 0
    snapshots: int = 0
    results: int = 0
    skipped: int = 0
    dead_letters: int = 0  # records refused: undecodable, unfoldable or unwritable
    retries: int = 0
    divergences: int = 0
    gaps: int = 0
    fold_s: float = 0.0  # decoding and folding (the consumer thread)
    write_s: float = 0.0  # writing and committing (the writer thread, overlaps the next fold)


@dataclass
class CommitReport:
    """Passed to `on_commit` after a batch is durable (benchmarks measure lag with it)."""

    committed_at: float  # time.time()
    events: list[tuple[str, int]]


@dataclass
class _Part:
    """What one consumed record adds to a batch's rows: written alone (in its own savepoint)
    when the merged batch's SQL fails, to find the record that breaks it."""

    message: Message
    event: tuple[Any, ...] | None = None
    run: tuple[int, RunState] | None = None
    ops: list[dict[str, Any]] = field(default_factory=list)
    questions: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    snapshot: dict[str, Any] | None = None
    dead_letter: tuple[Any, ...] | None = None  # a dead_letters row (of a DLQ record)


@dataclass
class _Batch:
    """One consumed batch, decoded and folded: everything its transaction writes."""

    positions: dict[tuple[str, int], int]
    snapshots: dict[str, dict[str, Any]]
    results: dict[tuple[str, int], dict[str, Any]]
    events: list[tuple[Any, ...]] = field(default_factory=list)  # event_values() rows
    runs: dict[str, tuple[int, RunState]] = field(default_factory=dict)  # last state per run
    ops: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    questions: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    parts: list[_Part] = field(default_factory=list)  # the same rows, per record, in order
    dead: list[dict[str, Any]] = field(default_factory=list)  # records refused while folding
    dead_letters: list[tuple[Any, ...]] = field(default_factory=list)  # rows of DLQ records
    ended: list[tuple[str, str]] = field(default_factory=list)  # runs ended: (status, reason)
    steps: list[float] = field(default_factory=list)  # seconds of the steps it closed
    spans: list[Any] = field(default_factory=list)  # one per event when tracing is on


class _Retry(Exception):
    pass


#: Failures a retry may cure: Postgres away (retried for as long as it is away), the broker away
#: (dead letters are flushed inside the transaction), and on a live connection a conflict with
#: another transaction or a cancelled statement (retried `max_batch_retries` times, then the
#: batch's records are written one by one).
_TRANSIENT = (
    psycopg.OperationalError,
    psycopg.errors.SerializationFailure,
    psycopg.errors.DeadlockDetected,
    KafkaException,
)


_CONFLICTS = (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected)


def _away(exc: Exception, conn: Conn | None) -> bool:
    """Whether `exc` says Postgres or the broker is away (not what a statement did)."""
    if isinstance(exc, KafkaException):
        return True
    return isinstance(exc, psycopg.OperationalError) and (
        conn is None or conn.broken or conn.closed
    )


class _Pg:
    """One lazily (re)opened Postgres connection, and whether its stage tables exist."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn: Conn | None = None
        self.staged = False

    def connection(self) -> Conn:
        if self.conn is None or self.conn.closed:
            self.conn = psycopg.connect(self.url, connect_timeout=5)
            prefer_lz4(self.conn)
            self.staged = False
        return self.conn

    def drop(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None
            self.staged = False


class Sink:
    """One sink process (or thread in monolith mode): `run(stop)` until stop is set.

    Two threads, so that Postgres works on batch N while Python folds batch N+1: the consumer
    thread (`run`) polls, decodes and folds; one writer thread writes and commits each folded
    batch, in order, at most one in flight. `_cache` holds each run's state after every batch
    handed to the writer, committed or not; the next fold continues from it. That is safe
    because the writer commits batches in order and retries a failed one until it commits (or
    the sink stops, dropping the cache): a later batch never commits without the ones before.
    Everything that reads Postgres state or drops the cache (assignment changes, eviction)
    first waits for the batch in flight (`_drain`).
    """

    def __init__(
        self, config: SinkConfig, *, on_commit: Callable[[CommitReport], None] | None = None
    ) -> None:
        self.config = config
        self.on_commit = on_commit
        p = config.prefix
        self.events_topic = topic_name(EVENTS, p)
        self.state_topic = topic_name(STATE, p)
        self.results_topic = topic_name(RESULTS, p)
        self.dlq_topic = topic_name(DLQ, p)
        self.topics = [self.events_topic, self.state_topic, self.results_topic, self.dlq_topic]
        self.stats = SinkStats()
        self._runs = RunMeter()  # runs ended and step latency (run_metrics)
        self._cache: dict[str, tuple[int, RunState]] = {}
        self._writer_pg = _Pg(config.database_url)  # the writer thread's transactions
        self._reader_pg = _Pg(config.database_url)  # the consumer thread's reads
        self._stop = threading.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[None] | None = None
        self._consumer = Consumer(self._consumer_config())
        self.membership = Membership()  # what /healthz reports
        self._dlq = Producer(
            {
                "bootstrap.servers": config.bootstrap,
                **client_settings(),
                "enable.idempotence": True,
                **NO_DELAY,
                **KEYED_PARTITIONER,
                "log_level": 3,
            }
        )
        self._closed = False

    def _consumer_config(self) -> dict[str, Any]:
        c = self.config
        conf: dict[str, Any] = {
            "bootstrap.servers": c.bootstrap,
            **client_settings(),
            "group.id": c.group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
            "session.timeout.ms": c.session_timeout_ms,
            "heartbeat.interval.ms": max(500, c.session_timeout_ms // 5),
            # a commit on the events topic answers a held fetch at once (LONG_POLL_MS)
            "fetch.wait.max.ms": LONG_POLL_MS,
            **NO_DELAY,
            **group_consumer(c.group_id),
        }
        if c.instance_id:
            conf["group.instance.id"] = c.instance_id
        conf.update(c.extra_consumer)
        return conf

    # ------------------------------------------------------------------ Postgres

    def _with_retry(
        self, pg: _Pg, what: str, fn: Callable[[Conn], Any], *, transaction: bool = True
    ) -> Any:
        """Run `fn` (in a transaction), retrying with backoff: while Postgres (or the broker,
        for the dead letters `fn` flushes) is away, until stopped; a conflict or a cancelled
        statement `max_batch_retries` times. Any other failure is raised at once."""
        delay = 0.05
        attempts = 0
        while True:
            try:
                conn = pg.connection()
                if not transaction:
                    result = fn(conn)
                    conn.rollback()  # a read: end it, so no snapshot is held between batches
                    return result
                with conn.transaction():
                    return fn(conn)
            except _TRANSIENT as exc:
                away = _away(exc, pg.conn)
                pg.drop()
                attempts += 0 if away else 1
                if attempts >= self.config.max_batch_retries:
                    raise SinkError(f"{what} failed {attempts} times: {exc}") from exc
                self.stats.retries += 1
                SINK_RETRIES.inc()
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                log.warning("%s failed (%s); retrying in %.2fs", what, first, delay)
                if self._stop.wait(delay):
                    raise _Retry(what) from exc
                delay = min(delay * 2, self.config.retry_max_delay_s)
            except psycopg.Error as exc:
                pg.drop()
                raise SinkError(f"{what} failed: {dead_letters.first_line(exc)}") from exc
            except Exception:
                pg.drop()
                raise

    # ------------------------------------------------------------------ assignment

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._drain()
        self._cache.clear()  # another sink may have projected these runs meanwhile
        offsets = self._with_retry(
            self._reader_pg,
            "reading sink offsets",
            lambda conn: read_offsets(conn, self.config.group_id, self.topics),
            transaction=False,
        )
        for tp in partitions:
            tp.offset = offsets.get((tp.topic, tp.partition), OFFSET_BEGINNING)
        consumer.assign(partitions)
        self.membership.assigned(partitions)
        log.info(
            "assigned %d partitions, seeking to the offsets stored in Postgres", len(partitions)
        )

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.membership.revoked()
        self._drain()
        self._cache.clear()
        consumer.unassign()

    def _assign_all(self) -> None:
        metadata = self._consumer.list_topics(timeout=30)
        partitions: list[TopicPartition] = []
        for topic in self.topics:
            meta = metadata.topics.get(topic)
            if meta is None or meta.error is not None:
                raise SinkError(
                    f"topic {topic} does not exist",
                    hint="create the topics first: agentruns topics create",
                )
            partitions.extend(TopicPartition(topic, p) for p in sorted(meta.partitions))
        self._on_assign(self._consumer, partitions)

    # ------------------------------------------------------------------ loop

    def run(self, stop: threading.Event) -> None:
        """Project until `stop` is set, then close.

        A batch is the first record `poll` returns plus what has already arrived, up to
        `batch_size` records: a record is folded as soon as the previous batch is handed to the
        writer, and a backlog is projected in full-size batches.
        """
        self._stop = stop
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="sink-writer")
        try:
            if self.config.assign == "all":
                self._assign_all()
            else:
                self._consumer.subscribe(
                    self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke
                )
            while not stop.is_set():
                # While batch N commits, batch N+1 gathers in the consumer's queue: the batch
                # grows with the load.
                messages = poll_batch(
                    self._consumer,
                    self.config.batch_size,
                    self.config.poll_timeout_s,
                    group=self.config.group_id,
                )
                if messages:
                    batch = self._prepare(messages)
                    self._drain()  # the previous batch commits before this one is handed over
                    if batch is not None:
                        self._inflight = self._executor.submit(self._commit, batch)
                elif self._inflight is not None and self._inflight.done():
                    self._drain()  # surface its error, if any
            self._drain()
        except _Retry:
            log.info("stopped while Postgres was unavailable; the batch will be re-read")
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._inflight is not None:
            with contextlib.suppress(Exception):
                self._inflight.result(timeout=60)
            self._inflight = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        with contextlib.suppress(KafkaException):
            close_consumer(self._consumer)
        release(self._dlq, 10)
        self._writer_pg.drop()
        self._reader_pg.drop()

    def apply(self, messages: Sequence[Message]) -> None:
        """Project one batch of consumed messages in one database transaction, synchronously."""
        self._drain()
        batch = self._prepare(messages)
        if batch is not None:
            self._commit(batch)

    def _drain(self) -> None:
        """Wait until the batch in flight is committed; re-raise its failure (the cache holds
        states of a batch that never committed then, so it goes)."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        try:
            inflight.result()
        except BaseException:
            self._cache.clear()
            raise

    def _prepare(self, messages: Sequence[Message]) -> _Batch | None:
        """Decode and fold one batch (the consumer thread); the cache moves on to its states."""
        began = time.monotonic()
        batch = _Batch({}, {}, {})
        positions, snapshots, results = batch.positions, batch.snapshots, batch.results
        events: list[tuple[dict[str, Any], Message]] = []
        # Snapshots are keyed by run and written in version order within the run's partition,
        # so only the last one per key in the batch is decoded (the processor writes ~one per
        # event, each carrying the whole state), and of it only the leading fields the
        # run_snapshots row needs, not the state; the version guard still applies in Postgres.
        latest: dict[bytes | str | None, Message] = {}
        events_topic, state_topic, dlq_topic = self.events_topic, self.state_topic, self.dlq_topic
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("consume error: %s", error)
                continue
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            assert topic is not None and partition is not None and offset is not None
            positions[(topic, partition)] = offset + 1
            value = message.value()
            if value is None:
                continue
            if topic == state_topic:
                latest[message.key()] = message
                continue
            if topic == dlq_topic:
                row = self._dead_letter_row(message, value)
                batch.dead_letters.append(row)
                batch.parts.append(_Part(message, dead_letter=row))
                continue
            try:
                if topic == events_topic:
                    events.append((decode(value, expected_name="Event").record, message))
                else:
                    res = decode(value, expected_name="Result").record
                    results[(res["run_id"], res["version"])] = res
                    batch.parts.append(_Part(message, result=res))
            except CodecError as exc:
                batch.dead.append(self._refused(message, str(exc), exc.error_class))
        for message in latest.values():
            try:
                snap = decode_fields(message.value() or b"", "Snapshot", SNAPSHOT_COLUMNS)
            except CodecError as exc:
                batch.dead.append(self._refused(message, str(exc), exc.error_class))
                continue
            batch.parts.append(_Part(message, snapshot=snap))
            held = snapshots.get(snap["run_id"])
            if held is None or held["version"] < snap["version"]:
                snapshots[snap["run_id"]] = snap
        if not positions:
            return None
        if len(self._cache) > self.config.max_cached_runs:
            self._drain()  # what the cache forgets must be in Postgres first
            self._cache.clear()
        self._fold(events, batch)
        self._cache.update(batch.runs)
        SINK_CACHED_RUNS.set(len(self._cache))
        self.stats.fold_s += time.monotonic() - began
        return batch

    @staticmethod
    def _dead_letter_row(message: Message, value: bytes) -> tuple[Any, ...]:
        """The dead_letters row of a record on the DLQ topic."""
        partition, offset = message.partition() or 0, message.offset() or 0
        headers = message.headers()
        pairs = list(headers.items()) if isinstance(headers, dict) else list(headers or ())
        notes = [(k, v.encode() if isinstance(v, str) else v) for k, v in pairs]
        try:
            record = decode(value, expected_name="DeadLetter").record
        except CodecError as exc:
            log.error("record on %s[%s]@%s is not a dead letter: %s", message.topic(),
                      partition, offset, exc)  # fmt: skip
            return undecodable_dead_letter_values(
                message.topic() or "", partition, offset, message.key(), value,
                now_ms(), str(exc), exc.error_class,
            )  # fmt: skip
        return dead_letter_values(record, partition, offset, notes)

    def _refused(
        self, message: Message, reason: str, error_class: str = INVALID_EVENT
    ) -> dict[str, Any]:
        """The dead letter of a record the projection cannot represent (a foreign writer's, or
        hostile content); its offset still moves on, with the dead letter flushed first."""
        self.stats.dead_letters += 1
        SINK_SKIPPED.labels("dead_letter").inc()
        log.error(
            "record %s[%s]@%s refused: %s",
            message.topic(),
            message.partition(),
            message.offset(),
            reason,
        )
        record = {
            self.events_topic: "Event",
            self.state_topic: "Snapshot",
            self.results_topic: "Result",
        }.get(message.topic() or "", "")
        return dead_letters.of_message(message, reason, error_class, record=record)

    def _load(self, run_ids: list[str]) -> dict[str, tuple[int, RunState]]:
        """The committed states (`runs.state`, the fold at `runs.last_seq`) of runs the cache
        does not hold. Called with no batch of theirs in flight: a run with one is cached."""

        def read(conn: Conn) -> dict[str, tuple[int, RunState]]:
            rows = conn.execute(
                "SELECT run_id, last_seq, state FROM runs WHERE run_id = ANY(%s)",
                (run_ids,),
            )
            return {r: (int(s), RunState.from_json(j)) for r, s, j in rows}

        loaded: dict[str, tuple[int, RunState]] = self._with_retry(
            self._reader_pg, "reading run states", read, transaction=False
        )
        return loaded

    def _fold(self, events: list[tuple[dict[str, Any], Message]], batch: _Batch) -> None:
        cache = self._cache
        missing = list({e["run_id"] for e, _ in events if e["run_id"] not in cache})
        loaded = self._load(missing) if missing else {}
        for record, message in events:
            try:
                self._fold_one(record, message, batch, loaded)
            except Exception as exc:  # the one guard of the fold: this record is refused
                reason = f"invalid_input:unprojectable: {dead_letters.first_line(exc)}"
                batch.dead.append(self._refused(message, reason))

    def _fold_one(
        self,
        record: dict[str, Any],
        message: Message,
        batch: _Batch,
        loaded: dict[str, tuple[int, RunState]],
    ) -> None:
        cache, runs = self._cache, batch.runs
        run_id, seq = record["run_id"], record["seq"]
        current = runs.get(run_id) or cache.get(run_id) or loaded.get(run_id)
        last_seq, state = current if current is not None else (0, None)
        if seq <= last_seq:
            self.stats.skipped += 1
            SINK_SKIPPED.labels("already_projected").inc()
            return
        if seq != last_seq + 1:
            self.stats.gaps += 1
            log.error(
                "run %s: event seq %d follows %d; folding what the log holds",
                run_id,
                seq,
                last_seq,
                extra={"run_id": run_id, "seq": seq},
            )
        projected = project_event(state, record)
        if projected is None:
            raise ValueError(f"run {run_id} seq {seq}: the fold has no state")
        if str(projected.disposition) != record["disposition"]:
            self.stats.divergences += 1
            SINK_DIVERGENCES.inc()
        ended, step_s = self._runs.fold(state, projected.state, record["at"])
        if ended is not None:
            batch.ended.append(ended)
        if step_s is not None:
            batch.steps.append(step_s)
        row = event_values(record, projected.status)
        runs[run_id] = (seq, projected.state)
        batch.events.append(row)
        for op in projected.ops:
            merge_op(batch.ops, op)
        for q in projected.questions:
            merge_question(batch.questions, q)
        batch.parts.append(
            _Part(message, row, (seq, projected.state), projected.ops, projected.questions)
        )
        if tracing.enabled():  # from the fold of the event to the commit of its rows
            batch.spans.append(
                tracing.start(
                    f"project {record['type']}",
                    tracing.from_headers(message.headers()),
                    {"agentruns.run_id": run_id, "agentruns.seq": seq},
                )
            )

    def _commit(self, batch: _Batch) -> None:
        """Write and commit one folded batch (the writer thread), retrying a lost connection
        with the same rows: the guards make a re-applied batch a no-op. A batch that fails
        otherwise is written once more record by record (`_isolate`)."""
        try:
            self._write_batch(batch)
        except BaseException as exc:
            for span in batch.spans:
                tracing.end(span, f"{type(exc).__name__}: {exc}")
            raise
        for span in batch.spans:
            tracing.end(span)

    def _write_batch(self, batch: _Batch) -> None:
        began = time.monotonic()
        try:
            self._with_retry(
                self._writer_pg, "writing a sink batch", lambda c: self._write(c, batch)
            )
        except _Retry:
            raise
        except Exception as exc:  # not a lost connection: some record's rows break the SQL
            log.error("sink batch failed (%s); writing it record by record", exc)
            self._with_retry(
                self._writer_pg, "writing a sink batch by record", lambda c: self._isolate(c, batch)
            )
        self.stats.write_s += time.monotonic() - began
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.snapshots += len(batch.snapshots)
        self.stats.results += len(batch.results)
        SINK_EVENTS.inc(len(batch.events))
        RunMeter.committed(batch.ended, batch.steps)
        SINK_BATCH_SECONDS.observe(time.monotonic() - began)
        if self.on_commit is not None:
            self.on_commit(CommitReport(time.time(), [(e[0], e[1]) for e in batch.events]))

    def _write(self, conn: Conn, batch: _Batch) -> None:
        with conn.cursor() as cur:
            self._stage(cur)
            # Only the last state of each run in the batch is serialized and written.
            self._write_rows(
                cur,
                batch.events,
                batch.runs.values(),
                batch.ops.values(),
                batch.questions.values(),
                batch.results.values(),
                batch.snapshots.values(),
                batch.dead_letters,
            )
            self._finish(cur, batch, batch.dead)

    def _isolate(self, conn: Conn, batch: _Batch) -> None:
        """The batch again, each record's rows in a savepoint of their own: a record whose rows
        fail is dead-lettered, every other one is written, and the offsets move past both."""
        dead = list(batch.dead)
        with conn.cursor() as cur:
            self._stage(cur)
            for part in batch.parts:
                try:
                    with conn.transaction():
                        self._write_rows(
                            cur,
                            [part.event] if part.event is not None else [],
                            [part.run] if part.run is not None else [],
                            part.ops,
                            part.questions,
                            [part.result] if part.result is not None else [],
                            [part.snapshot] if part.snapshot is not None else [],
                            [part.dead_letter] if part.dead_letter is not None else [],
                            clear=True,
                        )
                except Exception as exc:  # the one guard of the write: this record is refused
                    if _away(exc, conn) or isinstance(exc, _CONFLICTS):
                        raise  # not this record's doing: the whole batch again, later
                    if part.dead_letter is not None:  # already a dead letter: not sent back
                        self._skip_dead_letter(part.message, exc)
                        continue
                    reason = f"invalid_input:unwritable: {dead_letters.first_line(exc)}"
                    dead.append(self._refused(part.message, reason))
            self._finish(cur, batch, dead)

    def _stage(self, cur: psycopg.Cursor[Any]) -> None:
        if not self._writer_pg.staged:
            for table in TABLES:
                cur.execute(table.create_stage())
            self._writer_pg.staged = True

    @staticmethod
    def _write_rows(
        cur: psycopg.Cursor[Any],
        events: Collection[tuple[Any, ...]],
        runs: Collection[tuple[int, RunState]],
        ops: Collection[dict[str, Any]],
        questions: Collection[dict[str, Any]],
        results: Collection[dict[str, Any]],
        snapshots: Collection[dict[str, Any]],
        dlq_rows: Collection[tuple[Any, ...]],
        *,
        clear: bool = False,
    ) -> None:
        if events:
            write_rows(cur, EVENTS_TABLE, events, clear=clear)
        if runs:
            rows = (run_values(state, seq) for seq, state in runs)
            write_rows(cur, RUNS_TABLE, rows, clear=clear)
        if ops:
            rows = (tuple(r[c] for c in OP_COLUMNS) for r in ops)
            write_rows(cur, OPS_TABLE, rows, clear=clear)
        if questions:
            rows = (tuple(r[c] for c in QUESTION_COLUMNS) for r in questions)
            write_rows(cur, QUESTIONS_TABLE, rows, clear=clear)
        if results:
            write_rows(cur, RESULTS_TABLE, map(result_values, results), clear=clear)
        if snapshots:
            write_rows(cur, SNAPSHOTS_TABLE, map(snapshot_values, snapshots), clear=clear)
        if dlq_rows:
            write_rows(cur, DEAD_LETTERS_TABLE, dlq_rows, clear=clear)

    def _skip_dead_letter(self, message: Message, exc: Exception) -> None:
        """A DLQ record whose row cannot be written: counted and logged, its offset moves on
        (a dead letter of a dead letter would come back here)."""
        self.stats.skipped += 1
        SINK_SKIPPED.labels("unwritable_dead_letter").inc()
        log.error("dead letter %s[%s]@%s not projected: %s", message.topic(),
                  message.partition(), message.offset(), dead_letters.first_line(exc))  # fmt: skip

    def _finish(self, cur: psycopg.Cursor[Any], batch: _Batch, dead: list[dict[str, Any]]) -> None:
        """The consumed positions, after the dead letters of the batch are flushed (inside
        the transaction: if the broker is away, nothing commits and the batch is retried)."""
        dead_letters.send(self._dlq, self.dlq_topic, dead, component="sink")
        keys = sorted(batch.positions)
        cur.execute(
            SQL_OFFSETS,
            (
                self.config.group_id,
                [t for t, _ in keys],
                [p for _, p in keys],
                [batch.positions[k] for k in keys],
            ),
        )


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentruns sink", description="project the run log into Postgres, exactly once"
    )
    parser.add_argument(
        "--prefix",
        default=default_prefix(),
        help="topic prefix",
    )
    parser.add_argument(
        "--group", default="", help="consumer group / offset owner (default <prefix>-sink)"
    )
    parser.add_argument(
        "--assign",
        choices=("group", "all"),
        default="group",
        help="group: share partitions with other sinks; all: this process takes every partition",
    )
    parser.add_argument("--instance-id", help="static group membership id (fast restarts)")
    parser.add_argument("--batch-size", type=int, default=5000, help="max records per batch")
    parser.add_argument("--poll-ms", type=int, default=50, help="max wait to fill a batch")
    health.add_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tune_gc()
    try:
        with run_service(args, "sink") as running:
            ep, status = running.endpoints, running.health
            assert status is not None
            sink = Sink(
                SinkConfig(
                    bootstrap=ep.kafka_bootstrap,
                    database_url=ep.database_url,
                    prefix=args.prefix,
                    group_id=args.group,
                    assign=args.assign,
                    instance_id=args.instance_id,
                    batch_size=args.batch_size,
                    poll_timeout_s=args.poll_ms / 1000,
                )
            )
            status.watch_consumer(sink.membership, sink.config.group_id)
            running.serving_loop()
            log.info("sink started: %s -> Postgres", ", ".join(sink.topics))
            sink.run(running.stop)
            log.info("sink stopped: %s", sink.stats)
    except AgentrunsError as exc:
        print(f"agentruns sink: {exc.one_line()}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from agentruns.connectors.lifecycle import run_command

    raise SystemExit(run_command(main))
