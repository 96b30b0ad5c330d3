"""The executor: effects consumed, carried out many at once, each answered as soon as it is done.

An executor consumes one effects topic (read_committed, manual commits, the cooperative-sticky
assignor) and carries out each effect with a :class:`~agentruns.connectors.executors.base.
Handler`. Real calls take seconds and vary, so no effect waits for another: every call is a task
of its own on one event loop, and its answer is committed in the next transaction once it is
ready. The work is shared by five threads:

- the **loop thread** (`Executor.run`) polls, decodes and admits effects, and never waits for a
  call: an undecodable or invalid record becomes a dead letter (R30), a key already held gets
  the new record's position, any other key waits for its route. It pauses the partitions while
  the held effects reach ``max_held`` or their bytes ``max_held_bytes`` and resumes them below
  nine tenths, so the consumer keeps polling (its poll interval is never exceeded by a call);
- the **dispatch thread** starts the effects whose routes allow them (`RouteLimiter`: calls at
  once, requests and tokens per minute, a backend's ``Retry-After``), oldest first, at most
  ``max_in_flight`` at once: one statement reads the executed-action records of the group as
  they were and marks every key not completed ``started``; a completed key is answered from its
  record, the others become tasks on the calls thread with what the handler read ahead for the
  group. An effect waiting for its route holds nothing, and no other route's effects;
- the **calls thread** runs the event loop of every call in flight (the handlers are
  coroutines; docs/benchmarks.md, "Calls in flight", measured a task per call at half the CPU
  and an eighth of the memory of a thread per call). Each call runs inside the one guard
  (`Executor._answer`): whatever the handler does, the effect gets an answer; an exception that
  looks transient is retried for that effect alone, anything else becomes the handler's failure
  answer, and an effect started ``max_starts`` times without an answer (a crash loop) is
  answered with its failure without calling again;
- the **answer thread** takes the answers as they come, writes their artifacts and records in
  one statement (the artifacts before anything references them, R2; first writer wins), then
  hands them to the committer with the consumed offsets: per partition the low-water mark of
  the records not yet answered (`OffsetTracker`), so an offset never passes an effect still in
  flight;
- the **committer thread** (`agentruns.streams.transaction.Committer`, shared with the
  processor) commits every hand-over that became ready while the previous transaction ran, in
  one transaction: the offsets (first), the answers, the dead letters.

What can go wrong, and what then:

- a crash: everything from the committed offsets on is read again; completed keys are answered
  from their records, started ones are reconciled by their handler, never sent blindly again;
- a transaction that fails: it is aborted (or its producer replaced) and its answers, recorded
  already, are handed over again with the current offsets in the next one (after a back-off);
- a database outage: the effects that could not begin wait (the dispatch thread backs off), the
  answers that could not be recorded wait (the answer thread backs off); nothing is dropped;
- a rebalance: a partition that moves away first waits, up to ``revoke_wait_s``, for its
  effects in flight, whose answers are committed before it goes; its effects waiting for their
  route are dropped (its next owner reads them again); an effect still running after the wait
  is its next owner's to answer: this member records its answer but does not send it, and the
  next owner does not start it while that call may still be running (the start's lease,
  `ActionRecords.begin`): it waits for the recorded answer, or the lease's end, then
  reconciles. The
  partition's last offset carries a note of the records above it already answered (offsets are
  committed to the lowest one still running), and the next owner skips those instead of
  answering them again; after a crash or a lost partition there is no note, and an answer read
  again from its record is sent again (byte-identical: the processor drops the copy);
- a stop: no more effects are started; those running get ``stop_wait_s`` to end and be
  committed, the rest are cancelled (their next reader reconciles them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import psycopg
from confluent_kafka import Consumer, KafkaException, Message, Producer, TopicPartition

from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.executors import spans
from agentruns.connectors.executors.base import (
    NOTHING_AHEAD,
    ActionRecord,
    Ahead,
    ExecutorError,
    Handler,
    Outcome,
    clean_text,
    input_record,
)
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.executors.limits import Permit, RouteLimiter
from agentruns.connectors.executors.metrics import (
    EXECUTOR_BATCH_RETRIES,
    EXECUTOR_CALL_SECONDS,
    EXECUTOR_COMMIT_SECONDS,
    EXECUTOR_DEAD_LETTERS,
    EXECUTOR_EFFECTS,
    EXECUTOR_HANDLER_ERRORS,
    EXECUTOR_IN_FLIGHT,
    EXECUTOR_PAUSES,
    EXECUTOR_RECORDS,
    EXECUTOR_ROUTE_WAIT_SECONDS,
    EXECUTOR_THROTTLES,
    EXECUTOR_TRANSACTIONS,
    route_label,
)
from agentruns.connectors.executors.records import ActionRecords, Completion, operation_key_of
from agentruns.connectors.postgres.artifacts import MAX_ARTIFACT_BYTES
from agentruns.processors.effects import Effect
from agentruns.streams import dlq, dlq_metrics, tracing
from agentruns.streams.clock import now_ms
from agentruns.streams.codec import CodecError, decode, encode
from agentruns.streams.errors import AgentrunsKafkaError, FatalConsumerError
from agentruns.streams.inflight import OffsetTracker, answered_note, parse_answered_note
from agentruns.streams.kafka_defaults import close_consumer, partition_count
from agentruns.streams.membership import Membership
from agentruns.streams.partitioning import partition_for, run_key
from agentruns.streams.polling import Linger, poll_batch
from agentruns.streams.records import parse_effect_body
from agentruns.streams.topics import DLQ, INBOX, effect_suffix, topic_name
from agentruns.streams.transaction import (
    Backoff,
    Clients,
    Committer,
    Record,
    Timings,
    committed_positions,
)

log = logging.getLogger("agentruns.executor")

#: Held effects under this share of ``max_held`` (and their bytes of ``max_held_bytes``)
#: resume paused partitions: a margin, so that one batch does not pause them again at once.
RESUME_BELOW = 0.9
#: At most this many effects start in one group (one records statement, one read-ahead).
MAX_START_GROUP = 256
#: A key another member's start may still be running is looked at again this often: its answer
#: may be recorded long before its lease ends.
ELSEWHERE_RECHECK_S = 1.0
#: Added to a lease: the time between a call's end and its record (a slow statement, a pause).
LEASE_SLACK_S = 5.0
#: No lease is longer, whatever a registry's timeout says (a day: an interval the database takes).
MAX_LEASE_S = 86_400.0


# --------------------------------------------------------------------------- statistics


@dataclass
class ExecutorStats:
    batches: int = 0  # poll batches admitted
    lingered: int = 0  # polls that waited `gather_ms` for company (`Linger`)
    starts: int = 0  # groups of effects started (one records statement each)
    transactions: int = 0  # committed transactions (each carries every hand-over ready)
    effects: int = 0  # distinct effect keys answered
    executed: int = 0
    replayed: int = 0
    dead_letters: int = 0
    aborts: int = 0  # failed transactions (their answers handed over again)
    batch_retries: int = 0  # records statements retried after a failure (database down)
    handler_errors: int = 0  # exceptions out of a handler, caught by the guard
    gave_up: int = 0  # effects answered with their failure by the guard
    pauses: int = 0  # times the partitions were paused (held effects or bytes at the limit)
    handed_back: int = 0  # effects of a revoked partition left running: their next owner's
    # effects put off: another member's start of the key may still be running (its lease)
    held_elsewhere: int = 0
    revoked: int = 0  # partitions revoked or lost (rebalances, or a poll interval exceeded)
    answered_before: int = 0  # records passed over: their previous owner's note named them
    wait_s: float = 0.0  # the answer thread waiting for the committer (back-pressure)
    produce_s: float = 0.0  # begin + produce
    offsets_s: float = 0.0  # send_offsets_to_transaction
    flush_s: float = 0.0  # flush: the records' acknowledgements
    commit_s: float = 0.0  # commit_transaction (EndTxn)
    # the durations of the latest transactions (seconds), for percentiles in the summary
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    # from an effect's record timestamp (the producer's wall clock): until the loop polled it,
    # and until the transaction with its answer committed (its whole time in the executor)
    polled_after: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    committed_after: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    # from the admission of an effect to the start of its call (its route, free calls)
    waited: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    # from the end of a call to its transaction's commit (records statement, hand-over, commit)
    answered_after: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    # effects running, sampled each time the loop polls
    in_flight: deque[int] = field(default_factory=lambda: deque(maxlen=10_000))

    def summary(self) -> dict[str, Any]:
        """Counters, mean milliseconds per transaction, percentiles (logged at close)."""
        txns = max(1, self.transactions)
        return {
            "batches": self.batches,
            "lingered": self.lingered,
            "starts": self.starts,
            "transactions": self.transactions,
            "effects": self.effects,
            "executed": self.executed,
            "replayed": self.replayed,
            "dead_letters": self.dead_letters,
            "aborts": self.aborts,
            "batch_retries": self.batch_retries,
            "handler_errors": self.handler_errors,
            "gave_up": self.gave_up,
            "pauses": self.pauses,
            "handed_back": self.handed_back,
            "held_elsewhere": self.held_elsewhere,
            "answered_before": self.answered_before,
            "revoked": self.revoked,
            "wait_ms": round(self.wait_s * 1000, 1),
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
            "waited_ms": _percentiles(self.waited),
            "answered_after_ms": _percentiles(self.answered_after),
            "in_flight": _counts(self.in_flight),
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


def _counts(values: Iterable[int]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    return {
        "p50": ordered[len(ordered) // 2],
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max": ordered[-1],
    }


# --------------------------------------------------------------------------- held effects


@dataclass(eq=False)
class _Held:
    """One effect key the executor holds, from its first record until its answer is handed to
    the committer: waiting for its route, running, or answered."""

    effect: Effect
    route: str
    context: str | None  # the trace context its record carried (replaced by its span's)
    seq: int  # admission order: the oldest waiting effect starts first
    admitted: float  # monotonic
    created: float | None  # its record's timestamp (epoch seconds)
    # (partition, offset) of every tracked record that carried this key: all answered at once
    positions: list[tuple[int, int]] = field(default_factory=list)
    size: int = 0  # bytes of its records, then of its answer too
    permit: Permit | None = None
    running: bool = False
    ended: float = 0.0  # monotonic, when its call ended
    orphan: bool = False  # its partitions moved away while it ran: recorded, not answered
    put_off: bool = False  # another member's start of it may still be running (a lease)
    group: _Group | None = None  # the calls started with it

    @property
    def key(self) -> str:
        return self.effect.idempotency_key

    @property
    def partition(self) -> int:
        return self.positions[0][0] if self.positions else -1


@dataclass(eq=False)
class _Group:
    """Calls started together (one records statement): the answer thread waits a moment for
    the rest of a group whose calls are instant, so that they share a records statement and a
    transaction as they would have in one batch."""

    started: float  # monotonic
    running: int


@dataclass
class _Answered:
    """An effect's answer on its way to the answer thread: one the handler (or the guard) made
    now, or the stored input of a completed record."""

    held: _Held
    completion: Completion | None = None
    stored: dict[str, Any] | None = None


@dataclass
class _Dead:
    """A dead letter and the record it stands for."""

    record: dict[str, Any]
    partition: int
    offset: int
    tracked: bool


@dataclass(frozen=True)
class _Route:
    """Where an executor's answers go: the inbox (by run) and the dead letter topic."""

    inbox: str
    partitions: int  # of the inbox
    dlq: str


@dataclass(frozen=True)
class _Answer:
    run_id: str
    record: dict[str, Any]
    traceparent: str | None
    partition: int  # of the effects topic: whose member sends it


@dataclass
class _Ready:
    """Answers and dead letters handed to the committer (`Outgoing`), with the offsets they
    let the group commit."""

    answers: list[_Answer]
    dead: list[_Dead]
    offsets: dict[int, int]  # partition -> next offset to commit (the low-water marks)
    metadata: Any  # the consumer's group metadata when it was handed over
    route: _Route
    created: list[float]  # the record timestamps of its effects (epoch seconds)
    ended: list[float]  # when their calls ended (monotonic), for answered_after
    # partition -> the records above its offset answered already (a hand-over's last commit)
    offset_notes: dict[int, str] = field(default_factory=dict)

    def records(self) -> Iterator[Record]:
        """The answers, then the dead letters, encoded as the committer produces them."""
        route = self.route
        for answer in self.answers:
            run_id, record = answer.run_id, answer.record
            yield (
                route.inbox,
                run_key(run_id),
                encode("Input", record),
                partition_for(run_id, route.partitions),
                [
                    ("trace_id", record["trace_id"].encode()),
                    ("run_id", run_id.encode()),
                    *tracing.headers_of(answer.traceparent),
                ],
            )
        for dead in self.dead:
            record = dead.record
            yield route.dlq, dlq.key_of(record), encode("DeadLetter", record), None, None

    def durable(self) -> None:
        """Nothing to wait for: artifacts and records were written before the hand-over."""


# --------------------------------------------------------------------------- the executor


class Executor:
    """The consume-dispatch-answer-commit executor around one handler (see the module)."""

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
        # one connection for the dispatch thread (begin), one for the answer thread (complete)
        self._starting = ActionRecords(c.database_url, self._name)
        self._finishing = ActionRecords(c.database_url, self._name)
        # every call is a task on one event loop, in a thread of its own
        self._calls = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._calls_thread = threading.Thread(
            target=self._calls.run_forever, name=f"calls-{c.kind}", daemon=True
        )
        self._consumer = self._clients.consumer(
            {
                "max.poll.interval.ms": c.max_poll_interval_ms,
                # a rebalance moves only the partitions that change owner: the others keep
                # their effects in flight
                "partition.assignment.strategy": "cooperative-sticky",
            }
        )
        self.membership = Membership()  # what /healthz reports
        try:
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
        except BaseException:
            # No transactional producer (refused an ACL, say): the calls' event loop goes now,
            # not in the garbage collector at exit, where closing it printed a stack trace
            # after the one line the process ends with.
            self._calls.close()
            raise
        self._limiter = RouteLimiter(handler.limits)
        # Everything below is shared by the loop, dispatch, calls and answer threads: one lock,
        # three conditions on it (work to start, answers to hand over, held effects that left).
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._done = threading.Condition(self._lock)
        self._left = threading.Condition(self._lock)
        self._tracker = OffsetTracker()
        self._marks: dict[int, int] = {}  # partition -> the mark last handed to the committer
        self._held: dict[str, _Held] = {}  # by key
        self._waiting: dict[str, deque[_Held]] = {}  # by route, oldest first
        # key -> (when to look again, the effect): another member's start of it may still run
        self._elsewhere: dict[str, tuple[float, _Held]] = {}
        self._running = 0
        self._held_bytes = 0
        self._answered: list[_Answered] = []  # for the answer thread
        self._dead: list[_Dead] = []  # for the answer thread
        self._owned: set[int] = set()  # assigned partitions
        self._paused: set[int] = set()
        # partition -> offsets its previous owner answered above the committed offset
        self._answered_before: dict[int, set[int]] = {}
        self._seq = 0
        self._starting_ok = True  # False while the dispatch thread cannot begin (backing off)
        # the answer thread is the only one that hands over, except a revocation's drain
        self._handover = threading.RLock()
        self._stop = threading.Event()
        self._stop_starting = threading.Event()  # no more calls start (a stop in progress)
        self._stop_answering = threading.Event()
        self._closed = False
        self._stats_lock = threading.Lock()  # counters the calls thread updates too
        self._start_backoff = Backoff(c.retry_backoff_s, c.retry_backoff_max_s)
        self._finish_backoff = Backoff(c.retry_backoff_s, c.retry_backoff_max_s)
        self._commit_backoff = Backoff(c.retry_backoff_s, c.retry_backoff_max_s)
        self._dispatcher = threading.Thread(
            target=self._guarded, args=(self._dispatch,), name=f"start-{c.kind}", daemon=True
        )
        self._answerer = threading.Thread(
            target=self._guarded, args=(self._answer_loop,), name=f"answer-{c.kind}", daemon=True
        )
        self._failed: BaseException | None = None  # what ended a helper thread
        # The consumer's group metadata, read in the rebalance callbacks (every rebalance calls
        # one, an empty assignment included): the consumer's call waits for a poll in progress
        # in another thread, so the answer thread reads this copy.
        self._metadata: Any = None

    @property
    def retry_backoff_s(self) -> float:
        """How long the next failing records statement (starting effects) waits."""
        return self._start_backoff.next_s

    def _new_producer(self, slot: str) -> Producer:
        return self._clients.producer(slot, {"linger.ms": 0})

    # ------------------------------------------------------------------ lifecycle

    def run(self, stop: threading.Event) -> None:
        """Execute effects until ``stop`` is set; the calls in flight then get ``stop_wait_s``
        to end and be committed."""
        self._stop = stop
        self._consumer.subscribe(
            [self.effects_topic],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        self._calls_thread.start()
        self._dispatcher.start()
        self._answerer.start()
        c = self.config
        linger = Linger(c.gather_ms / 1000)
        try:
            while not stop.is_set():
                if self._failed is not None:
                    raise ExecutorError(f"an executor thread failed: {self._failed}")
                self._flow()
                # Gather only while effects come at least one a window (`Linger`): a lone
                # effect of a quiet or trickling stream is on its run's critical path, and
                # nothing would join it.
                gather = linger.window(time.monotonic())
                if gather:
                    self.stats.lingered += 1
                batch = poll_batch(
                    self._consumer, c.max_batch, c.poll_timeout_s, gather=gather, group=c.group
                )
                linger.observe(len(batch), time.monotonic())
                if batch:
                    self._admit(batch)
            self._finish()
            if self._failed is not None:
                raise ExecutorError(f"an executor thread failed: {self._failed}")
        finally:
            self.close()

    def _guarded(self, body: Callable[[], None]) -> None:
        """A helper thread's body: what escapes it stops the executor (the loop raises)."""
        try:
            body()
        except BaseException as exc:
            log.exception("%s failed", threading.current_thread().name)
            self._failed = exc
            self._stop.set()

    def _finish(self) -> None:
        """Stop starting calls, drop the effects that wait (their records come back to the
        partition's next reader), give the running ones ``stop_wait_s`` to end, and commit
        every answer there is."""
        self._stop_starting.set()
        deadline = time.monotonic() + self.config.stop_wait_s
        with self._lock:
            self._drop_waiting(lambda held: True)
            self._work.notify_all()
            while self._held and time.monotonic() < deadline:
                self._done.notify_all()
                self._left.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            if self._running:
                log.warning(
                    "stopping with %d calls in flight: their next owner reconciles them",
                    self._running,
                )
        with self._handover:  # the last hand-over is in the committer's queue
            self._drain()
            with self._lock:
                noted = self._noted(self._owned)
            if noted is not None:
                self._leave_notes(noted)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_starting.set()
        self._stop_answering.set()
        with self._lock:
            self._work.notify_all()
            self._done.notify_all()
        for thread in (self._dispatcher, self._answerer):
            if thread.is_alive():
                thread.join(30)
        self._committer.stop()
        log.info("executor stats %s", json.dumps(self.stats.summary()))
        with contextlib.suppress(KafkaException):
            close_consumer(self._consumer)
        self._close_calls()
        self._starting.close()
        self._finishing.close()
        with contextlib.suppress(Exception):
            self._committer.close()
        for state in ("waiting", "running", "answered"):
            EXECUTOR_IN_FLIGHT.labels(self.config.kind, state).set(0)

    # ------------------------------------------------------------------ the loop thread

    def _admit(self, messages: list[Message]) -> None:
        """Decode a poll's records and hold their effects (dead letters for the others)."""
        decoded: list[tuple[Message, Effect | None, dict[str, Any] | None]] = []
        for message in messages:
            if message.error() is not None:
                log.warning("consumer error: %s", message.error())
                continue
            dead: list[dict[str, Any]] = []
            effect = self._decode(message, dead)
            decoded.append((message, effect, dead[0] if dead else None))
        if not decoded:
            return
        kind = self.config.kind
        EXECUTOR_RECORDS.labels(kind).inc(len(decoded))
        created = _oldest(messages)
        if created is not None:
            self.stats.polled_after.append(time.time() - created)
        self.stats.batches += 1
        now = time.monotonic()
        with self._lock:
            for message, effect, letter in decoded:
                partition, offset = message.partition() or 0, message.offset() or 0
                tracked = self._tracker.take(partition, offset)
                if self._sent_before(partition, offset):
                    if tracked:
                        self._tracker.answer(partition, offset)
                    continue
                if effect is None:
                    assert letter is not None
                    self._dead.append(_Dead(letter, partition, offset, tracked))
                    continue
                held = self._held.get(effect.idempotency_key)
                size = len(message.value() or b"")
                if held is not None:  # the same key again (a redelivery): answered together
                    if tracked:
                        held.positions.append((partition, offset))
                        held.orphan = False  # its partition is back: this member answers it
                    continue
                self._seq += 1
                _, stamp = message.timestamp()
                held = _Held(
                    effect,
                    self.handler.route_of(effect),
                    tracing.from_headers(message.headers()),
                    self._seq,
                    now,
                    stamp / 1000 if stamp > 0 else None,
                    [(partition, offset)] if tracked else [],
                    size,
                )
                self._held[held.key] = held
                self._held_bytes += size
                self._waiting.setdefault(held.route, deque()).append(held)
            self._work.notify()
            if self._dead:
                self._done.notify()
            self._gauges()

    def _flow(self) -> None:
        """Pause the assigned partitions while the held effects (or their bytes) are at the
        limit; resume them below nine tenths of it."""
        c = self.config
        with self._lock:
            held, size, running = len(self._held), self._held_bytes, self._running
        self.stats.in_flight.append(running)
        over = held >= c.held_limit or size >= c.max_held_bytes
        under = held <= c.held_limit * RESUME_BELOW and size <= c.max_held_bytes * RESUME_BELOW
        if over:
            pause = self._owned - self._paused
            if pause:
                if not self._paused:
                    self.stats.pauses += 1
                    EXECUTOR_PAUSES.labels(c.kind).inc()
                    log.info("pausing: %d effects held (%d bytes)", held, size)
                self._consumer.pause([TopicPartition(self.effects_topic, p) for p in pause])
                self._paused |= pause
        elif under and self._paused:
            resume = self._paused & self._owned
            if resume:
                self._consumer.resume([TopicPartition(self.effects_topic, p) for p in resume])
            self._paused.clear()

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._metadata = consumer.consumer_group_metadata()  # the new generation's
        before = self._notes_of(consumer, [tp.partition for tp in partitions])
        with self._lock:
            self._owned |= {tp.partition for tp in partitions}
            self._answered_before.update(before)
            self.membership.assigned(self._owned)

    def _notes_of(self, consumer: Consumer, partitions: list[int]) -> dict[int, set[int]]:
        """partition -> the offsets above its committed one that its previous owner answered
        (the note committed with the offset when it let the partition go)."""
        if not partitions:
            return {}
        try:
            committed = committed_positions(
                consumer, self.effects_topic, partitions, patience_s=30.0, stop=self._stop
            )
        except FatalConsumerError:
            raise
        except AgentrunsKafkaError as exc:  # the consumer's own fetch waits it out; no note
            log.warning("the notes of %s were not readable: %s", sorted(partitions), exc)
            return {}
        out = {}
        for partition, (offset, note) in committed.items():
            answered = parse_answered_note(note, offset)
            if answered:
                out[partition] = answered
        return out

    def _sent_before(self, partition: int, offset: int) -> bool:
        """Whether the previous owner of ``partition`` answered the record at ``offset`` (the
        lock is held): it is passed over, once."""
        before = self._answered_before.get(partition)
        if not before or offset not in before:
            return False
        before.discard(offset)
        if not before:
            del self._answered_before[partition]
        self.stats.answered_before += 1
        return True

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Partitions move to another member: wait for their effects in flight (up to
        ``revoke_wait_s``), commit their answers, and leave the rest to the next owner."""
        # A cooperative rebalance revokes in the generation it has just joined: the answers
        # committed meanwhile carry that generation (a copy read before it is refused,
        # ILLEGAL_GENERATION).
        self._metadata = consumer.consumer_group_metadata()
        self._let_go({tp.partition for tp in partitions}, wait=not self._closed)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Partitions were taken away (this member was too late): nothing of theirs can be
        committed any more; their effects are their new owner's."""
        self._let_go({tp.partition for tp in partitions}, wait=False)

    def _let_go(self, gone: set[int], *, wait: bool) -> None:
        c = self.config
        self.stats.revoked += len(gone)
        with self._lock:
            self._drop_waiting(lambda held: _within(held, gone))
            deadline = time.monotonic() + c.revoke_wait_s
            while wait and self._holding(gone) and time.monotonic() < deadline:
                self._done.notify_all()
                self._left.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        with self._handover:  # nothing else is handed over until the partitions are gone
            if wait:  # what was handed over for these partitions is committed
                self._drain()
            with self._lock:
                # an effect sent back to wait meanwhile (its start failed) never starts here now
                self._drop_waiting(lambda held: _within(held, gone))
                noted = self._noted(gone) if wait else None
                left = 0
                for held in self._held.values():
                    if _within(held, gone):
                        held.positions = [p for p in held.positions if p[0] not in gone]
                        if not held.positions:
                            held.orphan = True
                            left += 1
                self._tracker.forget(gone)
                for partition in gone:
                    self._marks.pop(partition, None)
                    self._answered_before.pop(partition, None)
                self._owned -= gone
                self._paused -= gone
                self.membership.assigned(self._owned)
                self.stats.handed_back += left
            if noted is not None:
                self._leave_notes(noted)
        if left:
            log.warning(
                "partitions %s moved with %d calls still running: the next owner answers them",
                sorted(gone),
                left,
            )

    def _drain(self) -> None:
        """Wait until what was handed over is committed, handing a failed transaction's
        answers over again (a few times; the handover lock is held)."""
        for _ in range(3):
            self._committer.wait()
            if not self._recover_if_failed():
                break

    def _noted(self, partitions: set[int]) -> _Ready | None:
        """The offsets of ``partitions`` with notes of the records above them answered already
        (the lock is held), for their next reader; None if no partition has such records."""
        offsets: dict[int, int] = {}
        notes: dict[int, str] = {}
        for partition in partitions & self._owned:
            mark = self._tracker.low_water(partition)
            if mark is None:
                continue
            note = answered_note(mark, self._tracker.answered_above(partition))
            if note:
                offsets[partition], notes[partition] = mark, note
        if not notes:
            return None
        return _Ready([], [], offsets, None, self._route, [], [], notes)

    def _leave_notes(self, noted: _Ready) -> None:
        """Commit the notes after everything handed over (the handover lock is held). A note
        that fails is not sent again: its records are then answered twice, the copy dropped."""
        self._submit(noted)
        self._committer.wait()
        self._recover_if_failed()

    def _drop_waiting(self, which: Callable[[_Held], bool]) -> None:
        """Drop the waiting effects ``which`` selects (the lock is held): they never started,
        and their records come back to whoever reads their partition next."""
        for queue in self._waiting.values():
            for held in [h for h in queue if which(h)]:
                queue.remove(held)
                self._release(held)
        for key, (_, held) in list(self._elsewhere.items()):
            if which(held):
                del self._elsewhere[key]
                self._release(held)
        self._gauges()

    def _waiting_count(self) -> int:
        """Effects held that are not running and not answered (the lock is held)."""
        return sum(len(q) for q in self._waiting.values()) + len(self._elsewhere)

    def _holding(self, partitions: set[int]) -> bool:
        """Whether an effect of ``partitions`` is still held: running, or answered and not
        yet handed over (the lock is held)."""
        return any(_within(h, partitions) for h in self._held.values()) or any(
            d.partition in partitions for d in self._dead
        )

    def _release(self, held: _Held) -> None:
        """An effect that never started leaves (the lock is held); its records come back."""
        self._held.pop(held.key, None)
        self._held_bytes -= held.size
        self._left.notify_all()

    def _gauges(self) -> None:
        kind = self.config.kind
        waiting = self._waiting_count()
        answered = len(self._held) - waiting - self._running
        EXECUTOR_IN_FLIGHT.labels(kind, "waiting").set(waiting)
        EXECUTOR_IN_FLIGHT.labels(kind, "running").set(self._running)
        EXECUTOR_IN_FLIGHT.labels(kind, "answered").set(max(0, answered))

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
            # the record of a key Postgres cannot store would fail its statement on every retry
            reason = "invalid_input:key_with_nul: an effect key holds a NUL character"
            dead.append(self._dead_letter(message, reason, dlq.INVALID_EVENT))
            return None
        return effect

    def _dead_letter(self, message: Message, reason: str, error_class: str) -> dict[str, Any]:
        self.stats.dead_letters += 1
        EXECUTOR_DEAD_LETTERS.labels(self.config.kind).inc()
        dlq_metrics.dead_lettered(f"{self.config.kind}_executor", error_class)
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
            run_id=dlq.run_of(message.value(), "Effect"),
        )

    # ------------------------------------------------------------------ the dispatch thread

    def _dispatch(self) -> None:
        """Start the effects whose routes allow them, a group at a time."""
        while not self._stop_starting.is_set():
            with self._lock:
                group, wake = self._startable(time.monotonic())
                if not group:
                    self._work.wait(1.0 if wake is None else max(0.001, min(1.0, wake)))
                    continue
            self._begin(group)

    def _startable(self, now: float) -> tuple[list[_Held], float | None]:
        """The waiting effects that may start now, oldest first, each with its route's permit
        (the lock is held); and when to look again if one waits for a rate or a back-off."""
        wake = self._recheck_elsewhere(now)
        free = min(self.config.max_in_flight - self._running, MAX_START_GROUP)
        if free <= 0:
            return [], None  # woken when a call ends
        group: list[_Held] = []
        routes = sorted((q[0].seq, r) for r, q in self._waiting.items() if q)
        for _, route in routes:
            queue = self._waiting[route]
            while queue and len(group) < free:
                wait = self._limiter.wait_s(route, now)
                if wait is None:  # at its calls at once: woken when one of them ends
                    break
                if wait > 0:
                    wake = wait if wake is None else min(wake, wait)
                    break
                held = queue.popleft()
                held.permit = self._limiter.start(route, now)
                held.running = True
                group.append(held)
        for held in group:
            self.stats.waited.append(now - held.admitted)
            EXECUTOR_ROUTE_WAIT_SECONDS.labels(self.config.kind).observe(now - held.admitted)
        self._running += len(group)
        self._gauges()
        return group, wake

    def _recheck_elsewhere(self, now: float) -> float | None:
        """Put the effects whose look again is due back at the front of their routes (the lock
        is held); and in how long the next one is due."""
        wake: float | None = None
        for key, (due, held) in list(self._elsewhere.items()):
            if due <= now:
                del self._elsewhere[key]
                self._waiting.setdefault(held.route, deque()).appendleft(held)
            else:
                wake = due - now if wake is None else min(wake, due - now)
        return wake

    def _lease_s(self, effect: Effect) -> float:
        return lease_s(self.handler.exclusive_s(effect), self.config)

    def _begin(self, group: list[_Held]) -> None:
        """Read and mark the group's records, answer the completed keys from them, put off
        those another member may still be calling, and hand the others to the calls
        thread."""
        effects = [h.effect for h in group]
        try:
            begun = self._starting.begin(effects, [self._lease_s(e) for e in effects])
        except Exception as exc:
            delay = self._start_backoff.failed()
            self._count_retry(exc, delay, "starting effects")
            with self._lock:
                now = time.monotonic()
                for held in reversed(group):
                    self._unstart(held, now)
                    if held.key in self._held:  # not dropped meanwhile (a revocation)
                        self._waiting.setdefault(held.route, deque()).appendleft(held)
                self._gauges()
            self._start_backoff.wait(self._stop_starting)
            return
        self._start_backoff.succeeded()
        self.stats.starts += 1
        records = begun.records
        todo: list[tuple[_Held, ActionRecord | None]] = []
        replayed: list[_Answered] = []
        elsewhere: list[_Held] = []
        for held in group:
            record = records.get(held.key)
            if record is not None and record.completed:
                replayed.append(_Answered(held, stored=record.input()))
            elif held.key in begun.elsewhere:
                elsewhere.append(held)
            else:
                todo.append((held, record))
        if elsewhere:
            self._put_off(elsewhere, begun.elsewhere)
        if replayed:
            with self._lock:
                now = time.monotonic()
                for answered in replayed:
                    self._unstart(answered.held, now)
                    self._answered.append(answered)
                self._done.notify()
                self._work.notify()
        if todo:
            ahead = self._prepare([h.effect for h, _ in todo])
            if len(todo) > 1:
                together = _Group(time.monotonic(), len(todo))
                for held, _ in todo:
                    held.group = together
            self._calls.call_soon_threadsafe(self._spawn, todo, ahead)

    def _put_off(self, group: list[_Held], lease_left: Mapping[str, float]) -> None:
        """Effects another member started and may still be calling (a partition handed over
        with its call in flight): not started here until that start's answer is recorded
        (looked at again every `ELSEWHERE_RECHECK_S`) or its lease has ended. They hold
        nothing of their routes meanwhile."""
        first = [h for h in group if not h.put_off]
        with self._lock:
            now = time.monotonic()
            for held in group:
                self._unstart(held, now)
                held.put_off = True
                if held.key not in self._held:  # dropped meanwhile (a revocation)
                    continue
                wait = min(ELSEWHERE_RECHECK_S, lease_left[held.key])
                self._elsewhere[held.key] = (now + wait, held)
            self._gauges()
        if not first:  # looked at again, still within the lease
            return
        with self._stats_lock:
            self.stats.held_elsewhere += len(first)
        log.info(
            "%d effects put off: another member's start of each may still be running (%s)",
            len(first),
            ", ".join(f"{h.key} {lease_left[h.key]:.1f} s left" for h in first[:5]),
        )

    def _spawn(self, todo: list[tuple[_Held, ActionRecord | None]], ahead: Ahead) -> None:
        """Start a group's calls, a task each (the calls thread)."""
        for held, record in todo:
            task = self._calls.create_task(self._call(held, record, ahead))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _close_calls(self) -> None:
        """Cancel the calls still running (their records stay ``started``: the next reader of
        their partition reconciles them), close the handler in the calls thread, end it."""

        async def shut() -> None:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            closing = getattr(self.handler, "aclose", None)  # sessions ended on their loop
            if closing is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(closing(), 5)
            self.handler.close()
            for _ in range(2):  # a closed transport lets its socket go on the next iteration
                await asyncio.sleep(0)

        if self._calls_thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(shut(), self._calls).result(30)
            self._calls.call_soon_threadsafe(self._calls.stop)
            self._calls_thread.join(30)
        else:
            self.handler.close()
        if not self._calls.is_running():
            self._calls.close()

    def _unstart(self, held: _Held, now: float) -> None:
        """A started effect whose call is not made (the lock is held): its permit back."""
        if held.permit is not None:
            self._limiter.cancel(held.permit, now)
            held.permit = None
        held.running = False
        self._running -= 1
        self._work.notify()
        self._left.notify_all()

    def _prepare(self, effects: list[Effect]) -> Ahead:
        try:
            return self.handler.prepare(effects)
        except Exception as exc:
            if _outage(exc):
                log.warning("reading ahead for %d effects: the database is down", len(effects))
            else:
                log.warning("reading ahead for %d effects failed: %s", len(effects), exc)
            return NOTHING_AHEAD

    def _count_retry(self, exc: Exception, delay: float, what: str) -> None:
        if isinstance(exc, ExecutorError | psycopg.Error):
            log.error("%s failed, trying again in %.1f s: %s", what, delay, exc)
        else:
            log.exception("%s failed unexpectedly, trying again in %.1f s", what, delay)
        with self._stats_lock:
            self.stats.batch_retries += 1
        EXECUTOR_BATCH_RETRIES.labels(self.config.kind).inc()

    # ------------------------------------------------------------------ the calls thread

    async def _call(self, held: _Held, previous: ActionRecord | None, ahead: Ahead) -> None:
        """One effect's call, a task of its own; its answer goes to the answer thread."""
        try:
            completion = await self._traced(held, previous, ahead)
        except Exception as exc:  # a database outage inside the handler: start it again later
            log.warning("%s %s: %s; starting it again", held.effect.type, held.key, exc)
            await asyncio.sleep(self._start_backoff.next_s)
            with self._lock:
                self._unstart(held, time.monotonic())
                if held.key in self._held:
                    self._waiting.setdefault(held.route, deque()).appendleft(held)
                self._gauges()
            return
        with self._lock:
            now = time.monotonic()
            if held.permit is not None:
                throttle = completion.throttle_s
                if throttle is not None:
                    throttle = min(throttle, self.config.max_throttle_s)
                self._limiter.end(held.permit, now, tokens=completion.tokens, throttle_s=throttle)
                held.permit = None
            if completion.throttle_s is not None:
                EXECUTOR_THROTTLES.labels(self.config.kind, route_label(held.route)).inc()
            held.running = False
            held.ended = now
            self._running -= 1
            if held.group is not None:
                held.group.running -= 1
            self._answered.append(_Answered(held, completion=completion))
            self._done.notify()
            self._work.notify()
            self._left.notify_all()

    async def _traced(self, held: _Held, previous: ActionRecord | None, ahead: Ahead) -> Completion:
        """`_answer` in the effect's trace: a span when tracing is on (its context replaces
        the effect's), and the context on the handler's HTTP calls."""
        effect, context = held.effect, held.context
        span = None
        if tracing.enabled():
            position = held.positions[0] if held.positions else None
            span = spans.effect_span(
                effect, context, self.effects_topic, position, self.config.group
            )
            context = held.context = tracing.traceparent_of(span)
        token = tracing.OUTGOING.set(context)
        current = tracing.CURRENT.set(span)
        error = None
        try:
            completion = await self._answer(effect, previous, ahead)
            kind = str(completion.input["kind"])
            if kind.endswith("Failed"):  # the backend's failure, answered to the run
                error = kind
            if span is not None:
                spans.describe_outcome(span, completion.input)
            return completion
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            tracing.CURRENT.reset(current)
            tracing.OUTGOING.reset(token)
            if span is not None:
                tracing.end(span, error)

    async def _answer(
        self, effect: Effect, previous: ActionRecord | None, ahead: Ahead
    ) -> Completion:
        """The one guard around a handler (a task on the calls thread): the effect's answer,
        always.

        A database outage is re-raised (the effect starts again later); any other exception
        out of the handler is this effect's alone: retried a few times if it looks transient,
        then answered with the handler's failure, so one bad backend answer fails nothing
        else."""
        c = self.config
        if previous is not None and previous.starts >= c.max_starts:
            reason = f"started {previous.starts} times without an answer"
            return self._give_up(effect, "executor_error:restarts", reason)
        attempt = 0
        while True:
            attempt += 1
            began, called = time.monotonic(), False
            try:
                outcome = await self.handler.execute(effect, previous, ahead)
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
                EXECUTOR_HANDLER_ERRORS.labels(c.kind).inc()
                text = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, OSError) and attempt < c.handler_attempts:
                    log.warning("%s %s: %s; again", effect.type, effect.idempotency_key, text)
                    await asyncio.sleep(c.handler_backoff_s(attempt))
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
        return Completion(
            effect,
            record,
            clean_text(outcome.detail),
            outcome.artifacts,
            tokens=outcome.tokens,
            throttle_s=outcome.throttle_s,
        )

    def _give_up(self, effect: Effect, code: str, message: str) -> Completion:
        with self._stats_lock:
            self.stats.gave_up += 1
        outcome = self.handler.failure(effect, code, clean_text(message, 500))
        record = input_record(effect, outcome.event)
        detail = clean_text(f"{code}: {message}")
        return Completion(effect, record, detail, outcome.artifacts, failed=True)

    # ------------------------------------------------------------------ the answer thread

    def _answer_loop(self) -> None:
        """Record the answers as they come and hand them to the committer."""
        while True:
            with self._lock:
                while not (self._answered or self._dead or self._stop_answering.is_set()):
                    self._done.wait(1.0)
                self._gather_instant()
                answered, self._answered = self._answered, []
                dead, self._dead = self._dead, []
            if not answered and not dead:
                return  # stopping, nothing left
            stored = self._record(answered)
            if stored is None:  # stopping while the database is down: they stay unanswered
                return
            with self._handover:
                self._recover_if_failed()
                self._hand_over(answered, stored, dead)

    def _gather_instant(self) -> None:
        """Wait (the lock is held) until the groups of the answers in hand have ended, as long
        as they are younger than ``gather_ms``: instant calls started together are answered
        together (a records statement and a transaction for them all, not one each), and a call
        that takes longer is never held for its group."""
        limit = self.config.gather_ms / 1000
        while not self._stop_answering.is_set():
            groups = [a.held.group for a in self._answered if a.held.group is not None]
            started = [g.started for g in groups if g.running > 0]
            if not started:
                return
            remaining = min(started) + limit - time.monotonic()
            if remaining <= 0:
                return
            self._done.wait(remaining)

    def _record(self, answered: list[_Answered]) -> dict[str, dict[str, Any]] | None:
        """Write the artifacts and records of the answers made here (one statement), trying
        again while the database is down; key -> the input to send (None: stopping first)."""
        made = [a.completion for a in answered if a.completion is not None]
        out = {a.held.key: a.stored for a in answered if a.stored is not None}
        if not made:
            return out
        artifacts = [x for c in made for x in c.artifacts]
        while True:
            try:
                out.update(self._finishing.complete(made, artifacts))
                self._finish_backoff.succeeded()
                return out
            except Exception as exc:
                delay = self._finish_backoff.failed()
                self._count_retry(exc, delay, "recording answers")
                if self._stop_answering.is_set():
                    return None
                self._finish_backoff.wait(self._stop_answering)

    def _hand_over(
        self, answered: list[_Answered], stored: Mapping[str, dict[str, Any]], dead: list[_Dead]
    ) -> None:
        """Queue answers and dead letters for the next transaction with the offsets they let
        the group commit (the handover lock is held)."""
        kind = self.config.kind
        answers: list[_Answer] = []
        created: list[float] = []
        ended: list[float] = []
        executed = failed = replayed = 0
        with self._lock:
            for item in answered:
                held = item.held
                self._held.pop(held.key, None)
                self._held_bytes -= held.size
                if held.orphan:
                    continue  # its partition's new owner answers it
                for partition, offset in held.positions:
                    self._tracker.answer(partition, offset)
                record = stored[held.key]
                answers.append(_Answer(held.effect.run_id, record, held.context, held.partition))
                if held.created is not None:
                    created.append(held.created)
                if item.completion is None:
                    replayed += 1
                else:
                    ended.append(held.ended)
                    executed += 1
                    failed += item.completion.failed
            kept = [d for d in dead if d.partition in self._owned]
            for d in kept:
                if d.tracked:
                    self._tracker.answer(d.partition, d.offset)
            # only the partitions whose mark moved: every partition in a transaction's offsets
            # is one more offset record (and marker) the broker writes
            offsets = {}
            for partition, mark in self._tracker.positions(self._owned).items():
                if self._marks.get(partition) != mark:
                    offsets[partition] = self._marks[partition] = mark
            self._left.notify_all()
            self._gauges()
        with self._stats_lock:
            self.stats.effects += len(answers)
            self.stats.executed += executed
            self.stats.replayed += replayed
        if replayed:
            EXECUTOR_EFFECTS.labels(kind, "replayed").inc(replayed)
        if failed:
            EXECUTOR_EFFECTS.labels(kind, "failed").inc(failed)
        if executed - failed:
            EXECUTOR_EFFECTS.labels(kind, "executed").inc(executed - failed)
        if not answers and not kept and not offsets:
            return
        self._submit(_Ready(answers, kept, offsets, None, self._route, created, ended))

    def _submit(self, ready: _Ready) -> None:
        """Hand ``ready`` to the committer with the consumer's current group metadata; after a
        failed transaction, with the answers it carried (the handover lock is held)."""
        while True:
            ready.metadata = self._metadata
            began = time.monotonic()
            queued = self._committer.submit(ready, self._full)
            self.stats.wait_s += time.monotonic() - began
            if queued:
                return
            again = self._take_failure(also=ready)
            if again is None:
                return
            ready = again

    def _full(self, queued: list[_Ready]) -> bool:
        """Whether the answers queued for the committer (not counting the transaction in
        flight) reach the held limit: the answer thread waits (back-pressure)."""
        held = sum(len(r.answers) + len(r.dead) for r in queued)
        return held >= self.config.held_limit

    def _recover_if_failed(self) -> bool:
        """After a failed transaction: hand its answers over again (the handover lock is
        held). True if a transaction had failed."""
        again = self._take_failure()
        if again is None:
            return False
        self._submit(again)
        return True

    def _take_failure(self, also: _Ready | None = None) -> _Ready | None:
        """The failed transaction, if one failed (the committer is then idle): abort it or
        replace its producer, back off, and return its answers, those queued behind it and
        ``also`` as one hand-over with the current offsets, keeping what belongs to partitions
        still ours (their records are completed: nothing is called again). None if none
        failed, or if the executor is stopping (the answers are recorded: the effects come
        back to the partition's next reader and are answered from their records)."""
        failure = self._committer.take_failure()
        if failure is None:
            return None
        self._committer.recover(failure.error)  # logged: an abort, or a new producer if fatal
        self.stats.aborts += 1
        EXECUTOR_TRANSACTIONS.labels(self.config.kind, "aborted").inc()
        if self._stop_answering.is_set():
            return None
        units = [*failure.units, *([also] if also is not None else [])]
        self._commit_backoff.failed()
        self._commit_backoff.wait(self._stop_answering)
        with self._lock:
            owned = set(self._owned)
            offsets = self._tracker.positions(owned)
            self._marks.update(offsets)
        return _Ready(
            [a for u in units for a in u.answers if a.partition in owned],
            [d for u in units for d in u.dead if d.partition in owned],
            offsets,
            None,
            self._route,
            [t for u in units for t in u.created],
            [t for u in units for t in u.ended],
        )

    def _on_commit(self, batches: list[_Ready], t: Timings) -> None:
        """The committer thread, once a transaction committed (its offsets went first:
        measured on the dev box, AddOffsetsToTxn/TxnOffsetCommit then no longer queue behind
        the partition registrations of the produced records)."""
        self._commit_backoff.succeeded()
        stats = self.stats
        stats.offsets_s += t.sent - t.began
        stats.produce_s += t.produced - t.sent
        stats.flush_s += t.flushed - t.durable
        stats.commit_s += t.ended - t.flushed
        stats.recent.append(t.ended - t.began)
        wall = time.time()
        for b in batches:
            stats.committed_after.extend(wall - created for created in b.created)
            stats.answered_after.extend(t.ended - ended for ended in b.ended)
        stats.transactions += 1
        EXECUTOR_TRANSACTIONS.labels(self.config.kind, "committed").inc()
        EXECUTOR_COMMIT_SECONDS.labels(self.config.kind).observe(t.ended - t.began)

    # ------------------------------------------------------------------ introspection

    @property
    def member(self) -> str:
        """This member's name: the base of its transactional ids, and the ``executor`` of the
        records it starts (a restart under the same name takes its own starts over at once)."""
        return self._name

    def held(self) -> dict[str, int]:
        """Effects held now, by state (tests and the bench read it)."""
        with self._lock:
            waiting = self._waiting_count()
            return {
                "waiting": waiting,
                "running": self._running,
                "answered": len(self._held) - waiting - self._running,
                "tasks": len(self._tasks),
            }


def lease_s(exclusive_s: float, config: ExecutorConfig) -> float:
    """How long a start may still be calling its backend when one attempt may act on it for
    ``exclusive_s``: each of the guard's attempts, the back-offs between them, and a slack, at
    most `MAX_LEASE_S`; 0 when a second call beside it changes nothing outside."""
    if not exclusive_s > 0:  # 0, negative, NaN
        return 0.0
    attempts = max(1, config.handler_attempts)
    waits = sum(config.handler_backoff_s(a) for a in range(1, min(attempts, 64)))
    return min(attempts * exclusive_s + waits + LEASE_SLACK_S, MAX_LEASE_S)


def _within(held: _Held, partitions: set[int]) -> bool:
    return any(p in partitions for p, _ in held.positions)


def _outage(exc: Exception) -> bool:
    """The database is down (after the connection's own retries)."""
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


__all__ = ["Executor", "ExecutorStats", "lease_s"]
