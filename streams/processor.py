"""The run processor: inbox inputs -> pure transitions -> one Kafka transaction per batch.

Consume-transform-produce with one transaction at a time per process and KIP-447 fencing
(`send_offsets_to_transaction` with the consumer's group metadata). The loop thread applies
inputs and collects the encoded records of a batch; sealing the batch adds one snapshot per run
it touched and hands it to the committer thread. What one transaction holds, in the order
`_transact` writes it down:

1. the new events (`events`, key run_id:seq), effects (`effects.*`), terminal results
   (`results`) and dead letters (`dlq`) of the batch;
2. one snapshot per run touched by the batch (`state`): state, last seq, out-of-order buffer,
   producer marks, recent input digests;
3. the consumed inbox offsets (`send_offsets_to_transaction`);
4. the batch's artifacts are durable in the artifact store (Postgres; written on the artifact
   thread since the batch was sealed): nothing may reference an artifact before (R2);
5. `flush` (every record acknowledged), then `commit_transaction`.

Either all of it becomes visible to read_committed readers or none of it: a crash anywhere
before 5 leaves the inbox offsets where they were and the restarted processor re-applies the same
inputs to the same restored snapshots, producing the same events (the transition is pure).

Group commit: while one transaction commits, the loop applies the next inputs (in memory only:
nothing of them is produced before the previous transaction ended), and seals them as soon as
the committer is free. One transaction is in flight at a time. If it fails, the batch applied
behind it is dropped with the in-memory state, and the loop rewinds to the committed offsets and
snapshots, as for any abortable error.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from processors.effects import PublishResult, ScheduleTimer
from processors.events import Event, GapTimedOut, TimerFired
from processors.state import TimerPurpose
from processors.transition import Artifact, Disposition, Transition, transition
from streams import dlq, metrics
from streams.codec import CodecError, decode, encode
from streams.errors import AgentrunsKafkaError, FatalConsumerError
from streams.kafka_defaults import (
    NO_DELAY,
    TRANSACTIONAL_PRODUCER,
    ProducerPair,
    commit_timed,
    fetch_settings,
    partition_count,
)
from streams.partitioning import event_key
from streams.polling import check_fatal, fatal_error, is_fatal, poll_batch
from streams.records import (
    EFFECT_TOPIC_KIND,
    RunSlot,
    effect_record,
    event_record,
    input_digest,
    parse_event_body,
    result_record,
)
from streams.topics import DLQ, EVENTS, INBOX, RESULTS, STATE, effect_suffix, topic_name

log = logging.getLogger("agentruns.processor")

ArtifactWriter = Callable[[Sequence[Artifact]], object]
GAP_TIMER = ":gap:"
SLOW_COMMIT_S = 0.5  # a transaction slower than this is logged with its stages


@dataclass
class ProcessorConfig:
    bootstrap: str
    prefix: str = "agentruns"
    # Default "<prefix>-processor": deployments with different prefixes never share a group
    # (with static membership, a member rejoining with another subscription keeps its old
    # assignment).
    group_id: str = ""
    # Stable per process slot: a restarted processor with the same id aborts the transaction
    # its predecessor left open at once (instead of waiting for transaction.timeout.ms).
    instance_id: str = "0"
    commit_interval_ms: int = 50
    # The inbox is fetched in windows of this many ms (the broker holds each fetch until the
    # window ends or FETCH_WINDOW_BYTES, 8 KiB, wait): inputs trickling in from many producers
    # reach the loop together, so one transaction carries them (0: fetch each as it lands).
    fetch_window_ms: int = 20
    max_batch: int = 2000
    buffer_limit: int = 64  # out-of-order inputs held per run
    gap_timeout_ms: int = 30_000
    # A hard cap on the log of one run, beyond the core's own event cap (R21): protects the
    # log from a producer that keeps writing to a finished run.
    max_log_events: int = 1000
    transaction_timeout_ms: int = 10_000
    session_timeout_ms: int = 6000
    extra_consumer: dict[str, Any] = field(default_factory=dict)
    extra_producer: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.group_id = self.group_id or f"{self.prefix}-processor"


Headers = list[tuple[str, str | bytes | None]]
# topic, key, value, partition (None: the producer's partitioner), headers
_Record = tuple[str, bytes | None, bytes, int | None, Headers | None]


@dataclass
class _Batch:
    started: float = 0.0
    inputs: int = 0
    artifacts: list[Artifact] = field(default_factory=list)
    dirty: dict[str, tuple[int, RunSlot]] = field(default_factory=dict)
    positions: dict[int, int] = field(default_factory=dict)
    records: list[_Record] = field(default_factory=list)
    model_partition: int | None = None  # where this batch's model effects go


@dataclass
class _Sealed:
    """A batch handed to the committer: everything its transaction writes, already encoded."""

    records: list[_Record]
    offsets: list[TopicPartition]
    metadata: Any  # the consumer's group metadata when sealed (KIP-447 fencing)
    artifacts: Future[object] | None
    inputs: int
    started: float
    sealed: float


class Processor:
    """One processor process (or thread, in monolith mode). Not thread-safe: one loop owns it."""

    def __init__(self, config: ProcessorConfig, write_artifacts: ArtifactWriter) -> None:
        self.config = config
        self._write_artifacts = write_artifacts
        self._artifact_writer = ThreadPoolExecutor(1, thread_name_prefix="artifacts")
        p = config.prefix
        self.inbox = topic_name(INBOX, p)
        self.events = topic_name(EVENTS, p)
        self.state_topic = topic_name(STATE, p)
        self.results = topic_name(RESULTS, p)
        self.dlq = topic_name(DLQ, p)
        self._effect_topics = {
            kind: topic_name(effect_suffix(kind), p) for kind in set(EFFECT_TOPIC_KIND.values())
        }
        self._slots: dict[int, dict[str, RunSlot]] = {}  # partition -> run_id -> slot
        # Model effects partition count (read on first use) and the batches that had some.
        self._model_partitions = 0
        self._model_batches = 0
        self._batch: _Batch | None = None
        # The committer thread runs one transaction at a time (`_transact`); `_in_flight` is
        # the sealed batch it is committing, `_txn_open` whether a transaction is begun.
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="commit")
        self._in_flight: Future[None] | None = None
        self._txn_open = False
        self._consumer = self._new_consumer()
        self._producers = ProducerPair(self._new_producer)
        self._assigned: set[int] = set()
        # Set when the consumer was fenced: from then on nothing applied is committed, and the
        # rebalance callbacks that closing the consumer runs only drop state.
        self._fenced = False
        self.stats = metrics.ProcessorStats()

    # ------------------------------------------------------------------ clients

    def _new_consumer(self) -> Consumer:
        c = self.config
        return Consumer(
            {
                "bootstrap.servers": c.bootstrap,
                "group.id": c.group_id,
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
                "session.timeout.ms": c.session_timeout_ms,
                "heartbeat.interval.ms": max(500, c.session_timeout_ms // 6),
                # Static membership: a restarted slot gets its partitions back at once instead
                # of waiting for the group to notice that its predecessor died.
                "group.instance.id": f"{c.group_id}-{c.instance_id}",
                "partition.assignment.strategy": "range",
                **fetch_settings(c.fetch_window_ms),
                **NO_DELAY,
                "log_level": 3,
                **c.extra_consumer,
            }
        )

    def _new_producer(self, slot: str) -> Producer:
        c = self.config
        producer = Producer(
            {
                "bootstrap.servers": c.bootstrap,
                "transactional.id": f"{c.group_id}-{c.instance_id}-{slot}",
                "transaction.timeout.ms": c.transaction_timeout_ms,
                **TRANSACTIONAL_PRODUCER,
                # Each message enqueued to an empty partition queue wakes librdkafka's broker
                # thread with a write() syscall; at 2 ms nearly every produce paid one (~17% of
                # the processor's samples). commit_transaction flushes at once anyway.
                "linger.ms": 5,
                "compression.type": "lz4",
                "log_level": 3,
                **c.extra_producer,
            }
        )
        producer.init_transactions(30)
        return producer

    # ------------------------------------------------------------------ lifecycle

    def run(self, stop: threading.Event) -> None:
        """Process until `stop` is set; then commit what is pending and leave the group."""
        self._consumer.subscribe(
            [self.inbox],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        interval = self.config.commit_interval_ms / 1000
        limit = self.config.max_batch
        try:
            while not stop.is_set():
                # With a batch open, only look for what has already arrived. A batch is sealed
                # when the committer is free and the inbox is drained (low latency when lightly
                # loaded) or the batch is `interval` old; while a transaction commits, inputs
                # keep being applied into the next batch, up to `max_batch` (throughput under
                # load).
                if self._batch is None:
                    messages = poll_batch(self._consumer, limit, interval)
                else:
                    messages = check_fatal(self._consumer.consume(limit, 0.002))
                drained = len(messages) < limit
                try:
                    self._check_in_flight()  # a failed transaction: recover before applying more
                    for message in messages:
                        self._handle(message)
                    batch = self._batch
                    if batch is not None and (
                        batch.inputs >= limit
                        or (
                            self._committer_free()
                            and (drained or time.monotonic() - batch.started >= interval)
                        )
                    ):
                        self._commit()
                except KafkaException as exc:
                    self._recover(exc)
            self._commit(wait=True)
        except FatalConsumerError:
            # Fenced: the partitions are another member's now (or will be once our session
            # ends), so what was applied since the last commit is dropped, not committed. The
            # transaction in flight was sealed before; the broker accepts its offsets only if
            # the group still counts us, and a successor restores only after it has ended
            # (`_on_assign`).
            self._fenced = True
            self._batch = None
            log.error("the consumer was fenced; stopping without committing the open batch")
            raise
        finally:
            self.close()

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # already closed
            self._consumer.close()  # may revoke, and so commit, a batch: artifacts needed
        with contextlib.suppress(KafkaException):
            self._wait_in_flight()
        self._committer.shutdown(wait=True)
        self._artifact_writer.shutdown(wait=True)
        self._producers.close()  # the committer is idle: no transaction is open

    # ------------------------------------------------------------------ rebalance

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        mine = {tp.partition for tp in partitions}
        began = time.monotonic()
        self._await_stable_offsets(consumer, partitions)
        restored = self._restore(mine)
        self._assigned |= mine
        gc.freeze()  # the restored slots live long: out of the collector's way
        log.info(
            "assigned partitions %s: restored %d runs in %.2fs",
            sorted(mine),
            restored,
            time.monotonic() - began,
        )

    def _await_stable_offsets(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Wait until no transaction of a previous owner of `partitions` is still open.

        Its snapshots and its input offsets become visible (or are aborted) together, but a
        restore reads the snapshots only up to the open transaction, while the consumer's own
        offset fetch later waits for it: restored from before a transaction that then commits,
        the run states would miss inputs the consumer never delivers again (the chaos run that
        found it: a fenced processor committed seq 9 of a run while its successor, restored
        without it, wrote another seq 9). A read_committed consumer's `committed()` waits while
        offsets of an open transaction are pending (KIP-447 `require_stable`); one of a dead
        owner is aborted by the coordinator within its transaction timeout."""
        if not partitions:
            return
        bound = max(60.0, 2 * self.config.transaction_timeout_ms / 1000)
        deadline = time.monotonic() + bound
        wanted = [TopicPartition(tp.topic, tp.partition) for tp in partitions]
        while True:
            try:
                consumer.committed(wanted, timeout=min(10.0, bound))
                return
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                if isinstance(error, KafkaError) and is_fatal(error):
                    raise fatal_error(error) from exc
                if time.monotonic() > deadline:
                    numbers = sorted(tp.partition for tp in wanted)
                    raise AgentrunsKafkaError(
                        f"the committed offsets of {self.inbox} {numbers} stayed unstable for"
                        f" {bound:.0f}s: {exc}",
                        hint="a transaction of the previous owner is still open; see "
                        "kafka-transactions.sh --describe",
                    ) from exc
                log.warning("waiting for the previous owner's transaction to end: %s", exc)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        revoked = {tp.partition for tp in partitions}
        if self._fenced:  # nothing of ours may be committed any more
            self._drop(revoked)
            return
        # Commit what was applied so far: the next owner starts from these offsets and state.
        try:
            self._commit(wait=True)
        except KafkaException as exc:
            log.warning("commit on revoke failed, aborting: %s", exc)
            self._recover(exc, rewind=self._assigned - revoked)
        self._drop(revoked)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # The group moved on without us (a session that expired while the process stood still):
        # our offsets are refused now, so a transaction still in flight fails; drop everything.
        lost = sorted(tp.partition for tp in partitions)
        try:
            self._wait_in_flight()
        except KafkaException as exc:
            log.warning("partitions %s lost; the transaction in flight failed: %s", lost, exc)
        else:
            log.warning("partitions %s lost; dropping their state and the open batch", lost)
        self._batch = None
        self._abort_quietly()
        self._drop({tp.partition for tp in partitions})

    def _drop(self, partitions: set[int]) -> None:
        for p in partitions:
            self._slots.pop(p, None)
            self._assigned.discard(p)

    def _restore(self, partitions: set[int]) -> int:
        """Load the latest snapshot of every run on `partitions` (read_committed, to the end)."""
        for p in partitions:
            self._slots[p] = {}
        if not partitions:
            return 0
        reader = Consumer(
            {
                "bootstrap.servers": self.config.bootstrap,
                "group.id": f"{self.config.group_id}-restore",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "enable.partition.eof": True,
                "fetch.wait.max.ms": 10,
                "log_level": 3,
            }
        )
        try:
            reader.assign(
                [TopicPartition(self.state_topic, p, OFFSET_BEGINNING) for p in partitions]
            )
            pending = set(partitions)
            count = 0
            deadline = time.monotonic() + 120
            while pending:
                if time.monotonic() > deadline:
                    raise AgentrunsKafkaError(
                        f"restoring {self.state_topic} partitions {sorted(pending)} timed out"
                    )
                for message in reader.consume(1000, 0.5):
                    error = message.error()
                    if error is not None:
                        if error.code() == KafkaError._PARTITION_EOF:
                            pending.discard(message.partition() or 0)
                            continue
                        raise KafkaException(error)
                    value = message.value()
                    if value is None:
                        continue
                    runs = self._slots[message.partition() or 0]
                    slot = RunSlot.from_record(decode(value, expected_name="Snapshot").record)
                    count += slot.run_id not in runs
                    runs[slot.run_id] = slot
            return count
        finally:
            reader.close()

    # ------------------------------------------------------------------ applying inputs

    def _open_batch(self) -> _Batch:
        if self._batch is None:
            self._batch = _Batch(started=time.monotonic())
        return self._batch

    def _emit(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        partition: int | None = None,
        headers: Headers | None = None,
    ) -> None:
        """A record of the open batch (produced by the committer, in this order)."""
        self._open_batch().records.append((topic, key, value, partition, headers))

    def _handle(self, message: Message) -> None:
        error = message.error()
        if error is not None:
            if error.code() != KafkaError._PARTITION_EOF:
                log.warning("consume error: %s", error)
            return
        batch = self._open_batch()
        partition = message.partition()
        offset = message.offset()
        assert partition is not None and offset is not None
        batch.positions[partition] = offset + 1
        batch.inputs += 1
        value = message.value()
        key = message.key()
        try:
            if value is None:
                raise _Reject("null value", dlq.INVALID_EVENT)
            record = decode(value, expected_name="Input").record
            if key is not None and key != record["run_id"].encode():
                raise _Reject(f"record key {key!r} is not the run_id", dlq.INVALID_EVENT)
        except CodecError as exc:
            self._dead_letter(_Original.of(message), str(exc), exc.error_class)
            return
        except _Reject as exc:
            self._dead_letter(_Original.of(message), exc.reason, exc.error_class)
            return
        run_id = record["run_id"]
        slots = self._slots.setdefault(partition, {})
        slot = slots.get(run_id) or RunSlot(run_id)
        try:
            self._accept(partition, slot, record, message)
        except _Reject as exc:
            self._dead_letter(_Original.of(message), exc.reason, exc.error_class, run_id=run_id)
        if slot.state is not None or slot.buffer:
            slots[run_id] = slot

    def _accept(
        self, partition: int, slot: RunSlot, record: dict[str, Any], message: Message
    ) -> None:
        """The seq protocol (R5): dedupe, order per producer, buffer gaps, then apply."""
        digest = input_digest(record["kind"], record["body"])
        pid, pseq = record["producer_id"], record["producer_seq"]
        if pid is None or pseq is None:
            key = f"i:{record['input_id']}"
            known = slot.recalled(key)
            if known is not None:
                self._duplicate(known, digest, key)
                return
            event = self._parse(record)
            if isinstance(event, TimerFired) and GAP_TIMER in event.timer_id:
                self._gap_timer_fired(partition, slot, event)
                return
            self._apply(partition, slot, event, record["input_id"])
            slot.remember(key, digest)
            return
        mark = slot.producer_marks.get(pid, 0)
        if pseq <= mark:
            # Older than the window of remembered digests: cannot be compared, so it is
            # treated as the duplicate it almost surely is (and counted).
            key = f"p:{pid}:{pseq}"
            self._duplicate(slot.recalled(key) or digest, digest, key)
            return
        if pseq > mark + 1:
            self._buffer(partition, slot, record, digest)
            return
        self._apply_numbered(partition, slot, record, _Original.of(message))
        self._drain(partition, slot)

    def _apply_numbered(
        self, partition: int, slot: RunSlot, record: dict[str, Any], original: _Original
    ) -> None:
        """Apply the next input of a producer. Its seq is used up even if it is refused (to
        the DLQ), so a bad input never blocks the ones behind it."""
        pid, pseq = record["producer_id"], record["producer_seq"]
        slot.producer_marks[pid] = pseq
        slot.remember(f"p:{pid}:{pseq}", input_digest(record["kind"], record["body"]))
        self._touch(partition, slot)
        try:
            self._apply(partition, slot, self._parse(record), record["input_id"])
        except _Reject as exc:
            self._dead_letter(original, exc.reason, exc.error_class, run_id=slot.run_id)

    def _parse(self, record: dict[str, Any]) -> Event:
        try:
            event = parse_event_body(record["body"])
        except msgspec.DecodeError as exc:
            raise _Reject(f"invalid {record['kind']}: {exc}", dlq.INVALID_EVENT) from exc
        if event.type != record["kind"] or event.run_id != record["run_id"]:
            raise _Reject(
                f"envelope says {record['kind']} for {record['run_id']}, body is "
                f"{event.type} for {event.run_id}",
                dlq.INVALID_EVENT,
            )
        return event

    def _duplicate(self, known: str, digest: str, key: str) -> None:
        if known != digest:
            raise _Reject(
                f"conflicting duplicate: input {key} was applied with other content",
                dlq.CONFLICTING_DUPLICATE,
            )
        self.stats.duplicates += 1

    def _buffer(self, partition: int, slot: RunSlot, record: dict[str, Any], digest: str) -> None:
        pid, pseq = record["producer_id"], record["producer_seq"]
        for held in slot.buffer:
            if held["producer_id"] == pid and held["producer_seq"] == pseq:
                self._duplicate(input_digest(held["kind"], held["body"]), digest, f"p:{pid}:{pseq}")
                return
        if len(slot.buffer) >= self.config.buffer_limit:
            raise _Reject(
                f"out-of-order buffer of run {slot.run_id} is full "
                f"({self.config.buffer_limit} inputs waiting for a gap to fill)",
                "BUFFER_FULL",
            )
        slot.buffer.append(dict(record))
        if slot.gap_since is None:
            slot.gap_since = record["at"]
            expected = slot.producer_marks.get(pid, 0) + 1
            self._schedule_gap_timer(partition, slot, record, expected)
        self._touch(partition, slot)
        self.stats.buffered += 1

    def _drain(self, partition: int, slot: RunSlot) -> None:
        """Apply buffered inputs whose turn has come, in producer order."""
        progressed = True
        while progressed and slot.buffer:
            progressed = False
            for held in list(slot.buffer):
                if held["producer_seq"] == slot.producer_marks.get(held["producer_id"], 0) + 1:
                    slot.buffer.remove(held)
                    original = _Original.of_record(self.inbox, partition, held)
                    self._apply_numbered(partition, slot, held, original)
                    progressed = True
        slot.gap_since = min((h["at"] for h in slot.buffer), default=None)
        self._touch(partition, slot)

    def _schedule_gap_timer(
        self, partition: int, slot: RunSlot, record: dict[str, Any], expected: int
    ) -> None:
        state = slot.state
        timer_id = f"{slot.run_id}{GAP_TIMER}{record['producer_id']}:{expected}"
        effect = ScheduleTimer(
            idempotency_key=f"{timer_id}:schedule",
            run_id=slot.run_id,
            step=0 if state is None else state.step,
            attempt=0 if state is None else state.attempt,
            trace_id=record["trace_id"] if state is None else state.trace_id,
            timer_id=timer_id,
            due_at=record["at"] + self.config.gap_timeout_ms,
            purpose=TimerPurpose.GAP_TIMEOUT,
        )
        self._produce_effect(partition, effect, seq=slot.last_seq, at=record["at"])

    def _gap_timer_fired(self, partition: int, slot: RunSlot, fired: TimerFired) -> None:
        """The gap did not fill in time: record a diagnosis, skip the gap, apply what waits."""
        _, _, rest = fired.timer_id.partition(GAP_TIMER)
        pid, _, expected_text = rest.rpartition(":")
        expected = int(expected_text)
        waiting = sorted(
            (h for h in slot.buffer if h["producer_id"] == pid), key=lambda h: h["producer_seq"]
        )
        if slot.producer_marks.get(pid, 0) >= expected or not waiting:
            self.stats.stale_timers += 1
            return  # the gap filled before the timer fired
        first = waiting[0]["producer_seq"]
        diagnosis = (
            f"inputs {expected}..{first - 1} of producer {pid} did not arrive within "
            f"{self.config.gap_timeout_ms} ms; {len(waiting)} later inputs applied after the gap"
        )
        if slot.state is not None:
            event = GapTimedOut(
                run_id=slot.run_id,
                event_id=f"{fired.timer_id}:fired",
                at=fired.at,
                trace_id=slot.state.trace_id,
                expected_seq=expected,
                diagnosis=diagnosis,
            )
            self._apply(partition, slot, event, fired.event_id)
        log.warning("run %s: %s", slot.run_id, diagnosis, extra={"run_id": slot.run_id})
        slot.producer_marks[pid] = first - 1
        self._drain(partition, slot)

    def _apply(self, partition: int, slot: RunSlot, event: Event, input_id: str | None) -> None:
        if slot.last_seq >= self.config.max_log_events:
            raise _Reject(
                f"run {slot.run_id} has {slot.last_seq} events, the log cap is "
                f"{self.config.max_log_events}",
                "EVENT_CAP",
            )
        result = transition(slot.state, event)
        if slot.state is None and result.state is None:
            # Nothing to log for a run that does not exist: the input is refused as a whole.
            raise _Reject(result.reason or "no such run", dlq.INVALID_EVENT)
        seq = slot.last_seq + 1
        self._produce_event(partition, slot.run_id, seq, event, result, input_id)
        batch = self._open_batch()
        batch.artifacts.extend(result.artifacts)
        for effect in result.effects:
            if isinstance(effect, PublishResult):
                value = encode("Result", result_record(effect, seq=seq, at=event.at))
                self._emit(
                    self.results,
                    slot.run_id.encode(),
                    value,
                    partition,
                    _headers(effect.trace_id, slot.run_id, effect.step, effect.attempt),
                )
            else:
                self._produce_effect(partition, effect, seq=seq, at=event.at)
        slot.state = result.state
        slot.last_seq = seq
        slot.updated_at = max(slot.updated_at, event.at)
        self._touch(partition, slot)
        self.stats.count(result.disposition, len(result.effects))

    def _produce_event(
        self,
        partition: int,
        run_id: str,
        seq: int,
        event: Event,
        result: Transition,
        input_id: str | None,
    ) -> None:
        record = event_record(run_id, seq, event, result, input_id=input_id)
        self._emit(
            self.events,
            event_key(run_id, seq),
            encode("Event", record),
            partition,
            _headers(event.trace_id, run_id, record["step"], record["attempt"]),
        )
        if result.disposition is not Disposition.APPLIED:
            log.info(
                "run %s seq %d %s %s: %s",
                run_id,
                seq,
                event.type,
                result.disposition,
                result.reason,
                extra={"run_id": run_id, "seq": seq, "trace_id": event.trace_id},
            )

    def _produce_effect(self, partition: int, effect: Any, *, seq: int, at: int) -> None:
        kind = EFFECT_TOPIC_KIND[effect.type]
        topic = self._effect_topics[kind]
        if kind == "model":
            partition = self._model_partition(topic)
        self._emit(
            topic,
            effect.run_id.encode(),
            encode("Effect", effect_record(effect, seq=seq, at=at)),
            partition,
            [
                *_headers(effect.trace_id, effect.run_id, effect.step, effect.attempt),
                ("idempotency_key", effect.idempotency_key.encode()),
            ],
        )

    def _model_partition(self, topic: str) -> int:
        """One partition for all of a batch's model effects, the next one for the next batch.

        Every partition a transaction writes is one more produce request (librdkafka sends one
        partition per request) and one more commit marker, and the broker serves a connection's
        requests one at a time. With run partitions, a batch of new runs writes its model
        effects to every partition; on one, a transaction has 13 produce requests instead of 18
        at 1,000 new runs/s (flush 8-10 against 12-15 ms, latency p99 lower in 4 of 5 pairs).
        Over batches the partitions take turns, so the executors share the load as before.
        Model effects need no order per run: a run has one model call open at a time and emits
        the next only after the result of the last (a retry too: it follows a failed result or
        that failure's back-off timer). Tool and timer effects stay on the run's partition: a
        CancelTool or CancelTimer must not overtake the effect it cancels."""
        batch = self._open_batch()
        if batch.model_partition is None:
            if not self._model_partitions:
                self._model_partitions = partition_count(self._consumer, topic)
            batch.model_partition = self._model_batches % self._model_partitions
            self._model_batches += 1
        return batch.model_partition

    def _touch(self, partition: int, slot: RunSlot) -> None:
        self._open_batch().dirty[slot.run_id] = (partition, slot)

    def _dead_letter(
        self, original: _Original, reason: str, error_class: str, *, run_id: str | None = None
    ) -> None:
        record = dlq.dead_letter(
            reason=reason,
            error_class=error_class,
            topic=original.topic,
            partition=original.partition,
            offset=original.offset,
            key=original.key,
            value=original.value,
            headers=original.headers,
            at=int(time.time() * 1000),
            original_timestamp=original.timestamp,
            run_id=run_id,
        )
        self._emit(self.dlq, original.key, encode("DeadLetter", record))
        self.stats.dead_letters += 1
        log.warning("dead letter (%s): %s", error_class, reason, extra={"run_id": run_id})

    # ------------------------------------------------------------------ committing

    def _committer_free(self) -> bool:
        return self._in_flight is None or self._in_flight.done()

    def _wait_in_flight(self) -> None:
        """Wait for the transaction in flight; re-raise its error (then no longer in flight)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def _check_in_flight(self) -> None:
        """Raise the error of the in-flight transaction if it ended in one (for `_recover`)."""
        if self._in_flight is not None and self._in_flight.done():
            self._wait_in_flight()

    def _commit(self, *, wait: bool = False) -> None:
        """Seal the open batch and hand it to the committer, once the transaction before it
        committed; with `wait`, also wait until this one committed."""
        began = time.monotonic()
        self._wait_in_flight()
        batch = self._batch
        if batch is not None:
            self._batch = None
            self._in_flight = self._committer.submit(self._transact, self._seal(batch))
        self.stats.stage("wait", time.monotonic() - began)
        if wait:
            self._wait_in_flight()

    def _seal(self, batch: _Batch) -> _Sealed:
        """Everything the batch's transaction writes, encoded now: the slots move on."""
        began = time.monotonic()
        # Artifacts must be durable before the transaction commits (no read_committed reader
        # sees an event earlier), not before its records are produced: the write starts now,
        # on the artifact thread, and the committer waits for it before committing.
        written = (
            self._artifact_writer.submit(self._write_artifacts, batch.artifacts)
            if batch.artifacts
            else None
        )
        for run_id, (partition, slot) in batch.dirty.items():
            if slot.state is None and not slot.buffer:
                continue  # refused inputs of a run that does not exist leave no snapshot
            slot.version += 1
            value = encode("Snapshot", slot.to_record())
            batch.records.append((self.state_topic, run_id.encode(), value, partition, None))
        offsets = [TopicPartition(self.inbox, p, o) for p, o in batch.positions.items()]
        self.stats.publish(sum(len(slots) for slots in self._slots.values()))
        sealed = time.monotonic()
        self.stats.stage("seal", sealed - began)
        self.stats.stage("batch_open", began - batch.started)
        return _Sealed(
            records=batch.records,
            offsets=offsets,
            metadata=self._consumer.consumer_group_metadata(),
            artifacts=written,
            inputs=batch.inputs,
            started=batch.started,
            sealed=sealed,
        )

    def _transact(self, batch: _Sealed) -> None:
        """The committer thread: one transaction for one sealed batch."""
        began = time.monotonic()
        producer = self._producers.current
        produce = producer.produce
        producer.begin_transaction()
        self._txn_open = True
        for topic, key, value, partition, headers in batch.records:
            if partition is None:
                produce(topic, key=key, value=value, headers=headers)
            else:
                produce(topic, key=key, value=value, partition=partition, headers=headers)
        produced = time.monotonic()
        producer.send_offsets_to_transaction(batch.offsets, batch.metadata, 30)
        sent = time.monotonic()
        if batch.artifacts is not None:
            batch.artifacts.result()  # re-raises the store's error: nothing is committed then
        wrote = time.monotonic()
        flushed = commit_timed(producer, 30)
        self._txn_open = False
        self._producers.committed()
        ended = time.monotonic()
        if ended - batch.sealed > SLOW_COMMIT_S:
            log.warning(
                "slow transaction: %.0f ms for %d inputs (queued %.0f, produce %.0f, offsets %.0f,"
                " artifacts %.0f, flush %.0f, commit %.0f ms)",
                1000 * (ended - batch.sealed),
                batch.inputs,
                1000 * (began - batch.sealed),
                1000 * (produced - began),
                1000 * (sent - produced),
                1000 * (wrote - sent),
                1000 * (flushed - wrote),
                1000 * (ended - flushed),
            )
        self.stats.stage("queued", began - batch.sealed)
        self.stats.stage("produce", produced - began)
        self.stats.stage("offsets", sent - produced)
        self.stats.stage("artifacts_wait", wrote - sent)
        self.stats.stage("flush", flushed - wrote)
        self.stats.stage("commit", ended - flushed)
        self.stats.committed(batch.inputs, ended - batch.sealed)

    def _abort_quietly(self) -> None:
        """Abort the transaction the committer began, if any (the committer is idle)."""
        if not self._txn_open:
            return
        self._txn_open = False
        try:
            self._producers.current.abort_transaction(30)
        except KafkaException as exc:
            log.warning("abort failed: %s", exc)

    def _recover(self, exc: KafkaException, rewind: set[int] | None = None) -> None:
        """Abortable: abort and rewind. Fatal/fenced: a new producer. Then reload state.

        The batch applied behind the failed transaction is dropped with it: the rewind to the
        committed offsets and snapshots brings its inputs back."""
        with contextlib.suppress(KafkaException):
            self._wait_in_flight()  # the committer is idle from here on
        self._batch = None
        error = exc.args[0] if exc.args else None
        fatal = bool(error is not None and hasattr(error, "fatal") and error.fatal())
        log.warning("transaction failed (%s): %s", "fatal" if fatal else "abortable", exc)
        self.stats.aborts += 1
        if fatal:
            self._txn_open = False
            self._producers.replace_current()
        else:
            self._abort_quietly()
        self._rewind(set(self._assigned) if rewind is None else rewind)

    def _rewind(self, partitions: set[int]) -> None:
        """Drop in-memory state and seek back to the committed offsets of `partitions`."""
        if not partitions:
            return
        committed = self._consumer.committed(
            [TopicPartition(self.inbox, p) for p in partitions], timeout=30
        )
        for tp in committed:
            offset = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
            self._consumer.seek(TopicPartition(self.inbox, tp.partition, offset))
        self._restore(partitions)

    # ------------------------------------------------------------------ inspection (tests)

    def slots(self) -> Iterable[RunSlot]:
        for runs in self._slots.values():
            yield from runs.values()


@dataclass(frozen=True)
class _Original:
    """Where a refused input came from, and its bytes, for its dead-letter record (R30)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers
    timestamp: int | None

    @classmethod
    def of(cls, message: Message) -> _Original:
        partition, offset = message.partition(), message.offset()
        return cls(
            topic=message.topic() or "",
            partition=-1 if partition is None else partition,
            offset=-1 if offset is None else offset,
            key=message.key(),
            value=message.value(),
            headers=list(_header_pairs(message)),
            timestamp=message.timestamp()[1],
        )

    @classmethod
    def of_record(cls, topic: str, partition: int, record: dict[str, Any]) -> _Original:
        """A buffered input: its offset was committed long ago, its content is the record."""
        return cls(
            topic=topic,
            partition=partition,
            offset=-1,
            key=record["run_id"].encode(),
            value=encode("Input", record),
            headers=[],
            timestamp=record["at"],
        )


def _header_pairs(message: Message) -> Iterable[tuple[str, str | bytes | None]]:
    headers = message.headers()
    if isinstance(headers, dict):
        return headers.items()
    return headers or []


class _Reject(Exception):
    def __init__(self, reason: str, error_class: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error_class = error_class


def _headers(trace_id: str, run_id: str, step: int, attempt: int) -> Headers:
    return [
        ("trace_id", trace_id.encode()),
        ("run_id", run_id.encode()),
        ("step", str(step).encode()),
        ("attempt", str(attempt).encode()),
    ]


__all__ = ["Processor", "ProcessorConfig"]
