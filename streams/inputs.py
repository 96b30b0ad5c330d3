"""The processor's per-input path: one inbox record -> decode -> seq protocol -> transition ->
the records it adds to the open batch. Plain values in (`Inbound`), a `Batch` out: no Kafka
client here, so it runs (and is tested) without a broker.

`InputPath.handle` is the one guard of the processor loop: whatever the handling of one input
raises (a refusal, a record over the size limit, a bug), the input ends in exactly one of

* applied (its events, effects, results and slot changes join the batch);
* rejected by the core or the seq protocol (an event with disposition REJECTED, DUPLICATE or
  LATE, or a counted duplicate; any input of a run evicted after its end is LATE, found in
  memory or in the processor's store of ended runs, never the start of a new run);
* refused: its half-emitted records, artifacts and slot changes are rolled back and
  `InputRefused` (reason `invalid_input:<what>: detail`) fails its run, when the run exists and
  is not terminal;
* dead-lettered (original bytes, headers, source topic/partition/offset, reason), when the run
  is not identifiable or cannot take the refusal;

and the next input is processed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from confluent_kafka import Message

from agentruns.processors import catalog, versions
from agentruns.processors.catalog import Catalog
from agentruns.processors.effects import PublishResult, ScheduleTimer
from agentruns.processors.events import Event, GapTimedOut, InputRefused, RunSubmitted
from agentruns.processors.ids import derive_key
from agentruns.processors.limits import MAX_ID_CHARS
from agentruns.processors.state import RunState, RunStatus, TimerPurpose
from agentruns.processors.tenants import DEFAULT_TENANT, stored
from agentruns.processors.transition import Artifact, Disposition, Transition
from agentruns.streams import dlq, dlq_metrics, metrics, tenant_headers, tracing
from agentruns.streams.codec import CodecError, decode, decode_fields, encode
from agentruns.streams.partitioning import event_key
from agentruns.streams.records import (
    EFFECT_TOPIC_KIND,
    Parked,
    RunSlot,
    effect_record,
    ended_run_record,
    event_record,
    input_digest,
    parse_event_body,
    result_record,
)
from agentruns.streams.sequencing import (
    MAX_PRODUCER_MARKS,
    Apply,
    ArmGapTimer,
    BufferFull,
    Conflict,
    Duplicate,
    Ended,
    GapExpired,
    Hold,
    Sequencer,
    next_seq,
)
from agentruns.streams.topics import TopicNames
from agentruns.streams.transaction import Headers, Record

log = logging.getLogger("agentruns.processor")

#: The statuses a run waits in, and the name of the span of such a wait (made when it ends).
_WAITS = {RunStatus.WAITING_USER: "wait for a person", RunStatus.WAITING_TOOL: "wait for a tool"}

#: Bytes kept free under a topic's record limit for what our size count leaves out: the record
#: batch header and per-record overhead the broker counts (our count is key + value + headers).
RECORD_MARGIN = 1024
#: The record limit when the broker's cannot be read: Kafka's default `message.max.bytes`.
DEFAULT_RECORD_LIMIT = 1 << 20

#: A snapshot is re-encoded to check its size only when its estimate (the size at the last seal
#: plus SNAPSHOT_GROWTH times every input body applied since, plus SNAPSHOT_SLACK) is over this
#: share of the limit; see `InputPath._check_snapshot`.
SNAPSHOT_GROWTH = 4
SNAPSHOT_SLACK = 16 << 10
SNAPSHOT_CHECK_SHARE = 0.5

#: Reasons are stored in events and dead letters: bounded.
MAX_REASON_CHARS = 300


@dataclass(frozen=True)
class Inbound:
    """One consumed inbox record as plain values (or a buffered input, offset -1)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers
    timestamp: int | None

    @classmethod
    def of(cls, message: Message) -> Inbound:
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
    def of_record(cls, topic: str, partition: int, record: dict[str, Any]) -> Inbound:
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


@dataclass
class Batch:
    """What the inputs applied since the last seal add to the next transaction."""

    started: float = 0.0
    inputs: int = 0
    artifacts: list[Artifact] = field(default_factory=list)
    dirty: dict[str, tuple[int, RunSlot]] = field(default_factory=dict)
    positions: dict[int, int] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    model_partition: int | None = None  # where this batch's model effects go


@dataclass
class RecordLimits:
    """The largest record (key + value + headers, bytes) each output topic takes."""

    by_topic: dict[str, int] = field(default_factory=dict)
    default: int = DEFAULT_RECORD_LIMIT - RECORD_MARGIN

    def of(self, topic: str) -> int:
        return self.by_topic.get(topic, self.default)


@dataclass(frozen=True)
class PathSettings:
    buffer_limit: int = 64  # out-of-order inputs held per run
    gap_timeout_ms: int = 30_000
    max_log_events: int = 1000
    # The artifact store refuses larger artifacts
    # (agentruns.connectors.postgres.artifacts.MAX_ARTIFACT_BYTES);
    # refused at apply time, such an artifact cannot fail the batch's write.
    max_artifact_bytes: int = 16 << 20
    # The rules version new runs are submitted under (agentruns.processors.versions); None:
    # the newest this build has. An older one keeps a rollback possible while a new rule set
    # rolls out (docs/operations.md).
    rules_version: int | None = None
    # The operator's tool catalog every new run's task is checked against
    # (agentruns.processors.catalog), stamped on its submission; None: tasks declare their
    # own tools.
    catalog: Catalog | None = None
    # The processor's consumer group (the spans' messaging.consumer.group.name)
    group: str = ""
    # The tenant of a submission that names none (a task produced straight to Kafka), how
    # its TENANT_HEADER header is taken (ignored, trusted, or signed), and, when signed, each
    # tenant's Kafka key (agentruns.streams.tenant_headers; docs/security.md).
    default_tenant: str = DEFAULT_TENANT
    tenant_header: tenant_headers.Mode = "default"
    tenant_key: Callable[[str], bytes] | None = None

    def __post_init__(self) -> None:
        if self.tenant_header not in tenant_headers.MODES:
            raise ValueError(f"tenant header mode {self.tenant_header!r} is not one of MODES")
        if self.tenant_header == "signed" and self.tenant_key is None:
            raise ValueError("signed tenant headers need the tenant keys")


def record_size(record: Record) -> int:
    """What a record weighs against the limit: key + value + header keys and values."""
    _, key, value, _, headers = record
    size = (len(value) if value is not None else 0) + (len(key) if key is not None else 0)
    for name, hv in headers or ():
        size += len(name) + (len(hv) if hv is not None else 0)
    return size


class _Reject(Exception):
    """An input the seq protocol or the core refuses as a whole: dead-lettered."""

    def __init__(self, reason: str, error_class: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error_class = error_class


class PartitionStopped(Exception):
    """An input this build must not apply and must not skip: a run of a rules version it does
    not have (a newer build submitted it). The input stays unconsumed and its partition stops
    until a build that can apply it takes the partition (`InputPath.stopped`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RecordTooLarge(Exception):
    def __init__(self, topic: str, size: int, limit: int) -> None:
        super().__init__(f"{topic} record of {size} bytes, limit {limit}")
        self.topic = topic


@dataclass
class _Mark:
    """Where the batch stood before one input: what a rollback restores."""

    records: int
    artifacts: int
    run_id: str | None = None
    dirty: tuple[int, RunSlot] | None = None
    ended: tuple[Ended, int] | None = None  # an evicted run's entry and its last seq before


class InputPath:
    """Applies inputs to the run slots it holds and adds their records to a batch. One loop
    owns it; `handle` never raises for any input."""

    def __init__(
        self,
        topics: TopicNames,
        settings: PathSettings,
        stats: metrics.ProcessorStats,
        *,
        limits: RecordLimits | None = None,
        model_partitions: Callable[[], int] = lambda: 1,
        clock: Callable[[], float] = time.time,
        recall: Callable[[int, str], Ended | None] = lambda partition, run_id: None,
    ) -> None:
        self.topics = topics
        self.settings = settings
        self.stats = stats
        self.limits = limits or RecordLimits()
        self.slots: dict[int, dict[str, RunSlot]] = {}  # partition -> run_id -> slot
        # partition -> run_id -> a run held after its end, encoded (`park`)
        self.parked: dict[int, dict[str, Parked]] = {}
        # partition -> run_id -> what is kept of a run evicted after its end, written in a batch
        # (`Evictor.evict`, `_after_end`) and not yet in the processor's store of ended runs
        self.ended: dict[int, dict[str, Ended]] = {}
        # An ended run in that store (`streams.run_store`): looked up for a run id not held
        self._recall = recall
        # Inputs a transaction of their own failed on (see Processor._recover), by (partition,
        # offset): dead-lettered with that error when they come again.
        self.poisoned: dict[tuple[int, int], str] = {}
        self._model_partitions = model_partitions
        self._model_batches = 0
        self._clock = clock
        self._batch = Batch()
        self._incoming: str | None = None  # the trace context of the input in hand
        self._inbound: Inbound | None = None  # the input in hand (its span's attributes)
        self._before: RunState | None = None  # the state before the transition being traced
        # the record whose tenant headers a submission being applied is read with: the input
        # in hand; None for a held input (its headers are not kept, as its trace context)
        self._tenant_source: Inbound | None = None
        # partition -> why it stopped (PartitionStopped, or a snapshot this build cannot read
        # at restore): its inputs are left where they are, for a build that can apply them
        self.stopped: dict[int, str] = {}
        version = settings.rules_version
        self.rules_version = versions.current() if version is None else version
        if not versions.known(self.rules_version):
            raise ValueError(str(versions.UnknownRulesVersionError(self.rules_version)))
        self.sequencer = Sequencer(settings.buffer_limit, settings.gap_timeout_ms, input_digest)

    # ------------------------------------------------------------------ the guard

    def handle(self, inbound: Inbound, batch: Batch) -> None:
        """Apply one input into `batch`. Never raises: see the module doc."""
        self._batch = batch
        if inbound.partition in self.stopped:
            return  # left unconsumed: its offset is not committed past the stop
        self._incoming = tracing.from_headers(inbound.headers)
        self._inbound = inbound
        self._tenant_source = inbound
        if inbound.offset >= 0:
            batch.positions[inbound.partition] = inbound.offset + 1
        batch.inputs += 1
        poison = self.poisoned.pop((inbound.partition, inbound.offset), None)
        if poison is not None:
            run_id = _run_of(inbound)
            self._dead_letter(inbound, poison, dlq.TRANSACTION_FAILED, run_id=run_id)
            return
        mark = _Mark(len(batch.records), len(batch.artifacts))
        counted = self.stats.counts()
        record: dict[str, Any] | None = None
        try:
            record = self._decode(inbound)
            if record is None:
                return
            work = self._accept(inbound, record, mark)
            self._check_sizes(mark, work, inbound)
        except PartitionStopped as exc:
            self._rollback(mark)
            self.stats.recount(counted)
            batch.inputs -= 1
            self.stop(inbound.partition, exc.reason)
            if inbound.offset >= 0:
                batch.positions[inbound.partition] = inbound.offset
            return
        except Exception as exc:  # the one guard: see the module doc
            self._rollback(mark)
            self.stats.recount(counted)
            try:
                self._refuse(inbound, record, exc)
            except Exception:
                log.exception("input %s:%d@%d cannot be refused", *_where(inbound))
                self._rollback(mark)
                self._last_resort(inbound)
            return
        if work is not None:
            self._keep(inbound.partition, work)

    def stop(self, partition: int, reason: str) -> None:
        """Stop applying the inputs of `partition` (until it is restored again)."""
        if partition not in self.stopped:
            self.stopped[partition] = reason
            log.error("partition %d stopped: %s", partition, reason)

    def _last_resort(self, inbound: Inbound) -> None:
        """A dead letter that carries only where the input was: nothing of it can be written."""
        record = dlq.dead_letter(
            reason="invalid_input:unprocessable: the input and its refusal could not be written",
            error_class=dlq.PROCESSING_ERROR,
            topic=dlq.text(inbound.topic),
            partition=inbound.partition,
            offset=inbound.offset,
            key=None,
            value=None,
            headers=None,
            at=int(self._clock() * 1000),
            run_id=_run_of(inbound),
        )
        self._emit(self.topics.dlq, dlq.key_of(record), encode("DeadLetter", record))
        self.stats.dead_letters += 1
        dlq_metrics.dead_lettered("processor", dlq.PROCESSING_ERROR)

    def _rollback(self, mark: _Mark) -> None:
        batch = self._batch
        del batch.records[mark.records :]
        del batch.artifacts[mark.artifacts :]
        if mark.ended is not None:
            mark.ended[0].last_seq = mark.ended[1]
        if mark.run_id is not None:
            if mark.dirty is None:
                batch.dirty.pop(mark.run_id, None)
            else:
                batch.dirty[mark.run_id] = mark.dirty

    def _keep(self, partition: int, work: RunSlot) -> None:
        """The input is in: its copy of the slot becomes the slot."""
        slots = self.slots.setdefault(partition, {})
        if work.state is not None or work.buffer:
            slots[work.run_id] = work
        else:
            slots.pop(work.run_id, None)

    def _refuse(self, inbound: Inbound, record: dict[str, Any] | None, exc: Exception) -> None:
        """The input's own records are gone: fail its run with the reason, or dead-letter it."""
        if isinstance(exc, RecordTooLarge):
            self.stats.too_large += 1
            what, error_class = "record_too_large", dlq.RECORD_TOO_LARGE
            level = logging.WARNING
        else:
            what, error_class = "unprocessable", dlq.PROCESSING_ERROR
            level = logging.ERROR
        detail = str(exc) if isinstance(exc, RecordTooLarge) else f"{type(exc).__name__}: {exc}"
        reason = f"invalid_input:{what}: {detail}"[:MAX_REASON_CHARS]
        log.log(
            level,
            "input %s:%d@%d refused: %s",
            *_where(inbound),
            reason,
            exc_info=not isinstance(exc, RecordTooLarge),
        )
        run_id = None if record is None else str(record["run_id"])
        slot = None if run_id is None else self.slots.get(inbound.partition, {}).get(run_id)
        refused = False
        if record is not None and slot is not None and _live(slot):
            refused = self._fail_run(inbound, record, slot, reason)
        if not refused or error_class == dlq.PROCESSING_ERROR:
            # A processing error keeps the bytes for whoever fixes the bug.
            self._dead_letter(inbound, reason, error_class, run_id=_bounded_id(run_id))

    def _fail_run(
        self, inbound: Inbound, record: dict[str, Any], slot: RunSlot, reason: str
    ) -> bool:
        """Apply InputRefused to the run (its records are small: the run's own trace id, a
        derived event id); False if even that cannot be written."""
        assert slot.state is not None
        mark = _Mark(len(self._batch.records), len(self._batch.artifacts))
        input_id = _bounded_id(str(record["input_id"])) or ""
        event = InputRefused(
            run_id=slot.run_id,
            event_id="refused-" + derive_key("refused", input_id)[:32],
            at=int(record["at"]),
            trace_id=slot.state.trace_id,
            reason=reason,
            input_id=input_id,
        )
        try:
            work = self._work_on(slot, mark)
            self.sequencer.refused(work, record, input_id)
            self._apply(inbound.partition, work, event, input_id)
            self._check_sizes(mark, work, inbound)
        except Exception as exc:
            log.warning("run %s: the refusal itself cannot be written: %s", slot.run_id, exc)
            self._rollback(mark)
            return False
        self._keep(inbound.partition, work)
        self.stats.refused += 1
        return True

    # ------------------------------------------------------------------ sizes

    def _check_sizes(self, mark: _Mark, work: RunSlot | None, inbound: Inbound) -> None:
        """Raise RecordTooLarge if a record this input added, or the snapshot it leaves, is over
        its topic's limit."""
        for record in self._batch.records[mark.records :]:
            size, limit = record_size(record), self.limits.of(record[0])
            if size > limit:
                raise RecordTooLarge(record[0], size, limit)
        limit = self.settings.max_artifact_bytes
        for artifact in self._batch.artifacts[mark.artifacts :]:
            content = artifact.content
            # UTF-8 takes at most 4 bytes a character: encode only what may be over
            if len(content) * 4 > limit and len(content.encode()) > limit:
                raise RecordTooLarge(f"artifact {artifact.ref}", len(content.encode()), limit)
        if work is not None:
            self._check_snapshot(work, inbound)

    def _check_snapshot(self, work: RunSlot, inbound: Inbound) -> None:
        """Encoding every touched run's snapshot per input would double the hot path's encoding
        (a snapshot is encoded once per batch, at seal). A snapshot grows only by what inputs
        bring in: the core copies a body's text into the state a bounded number of times (a
        goal, a message, a tool spec), a buffered input is held whole. So the slot carries an
        upper estimate, the exact size at the last seal plus SNAPSHOT_GROWTH times each body
        since plus SNAPSHOT_SLACK, and only when that passes SNAPSHOT_CHECK_SHARE of the limit
        is the snapshot encoded and measured exactly (then the estimate is exact again). A
        snapshot that still came out over the limit at seal fails that transaction, which the
        processor's isolation (one input per transaction) turns into a dead letter."""
        if work.state is None and not work.buffer:
            return
        work.size_estimate += SNAPSHOT_GROWTH * len(inbound.value or b"") + SNAPSHOT_SLACK
        limit = self.limits.of(self.topics.state)
        if work.size_estimate <= SNAPSHOT_CHECK_SHARE * limit:
            return
        size = len(encode("Snapshot", work.to_record())) + len(work.run_id.encode())
        work.size_estimate = size
        if size > limit:
            raise RecordTooLarge(self.topics.state, size, limit)

    # ------------------------------------------------------------------ one input

    def _decode(self, inbound: Inbound) -> dict[str, Any] | None:
        """The Input record, or None when it was dead-lettered as undecodable."""
        value, key = inbound.value, inbound.key
        try:
            if value is None:
                raise _Reject("null value", dlq.INVALID_EVENT)
            record = decode(value, expected_name="Input").record
            if key is not None and key != record["run_id"].encode():
                shown = key[:64] + (b"..." if len(key) > 64 else b"")
                raise _Reject(f"record key {shown!r} is not the run_id", dlq.INVALID_EVENT)
        except CodecError as exc:
            self._dead_letter(inbound, str(exc), exc.error_class)
            return None
        except _Reject as exc:
            self._dead_letter(inbound, exc.reason, exc.error_class)
            return None
        return record

    def _work_on(self, slot: RunSlot, mark: _Mark) -> RunSlot:
        """A copy of `slot` for one input to change (the slot stays as it was until the input
        is in); `mark` remembers the batch's entry for the run."""
        mark.run_id = slot.run_id
        mark.dirty = self._batch.dirty.get(slot.run_id)
        return slot.copy()

    def park(self, partition: int, run_id: str, parked: Parked) -> None:
        """Hold an ended run as its snapshot until an input for it arrives (`_held`)."""
        self.slots.get(partition, {}).pop(run_id, None)
        self.parked.setdefault(partition, {})[run_id] = parked

    def _held(self, partition: int, run_id: str) -> RunSlot | None:
        """The slot of a run held on `partition`, decoded again if it was parked."""
        slot = self.slots.get(partition, {}).get(run_id)
        if slot is None:
            parked = self.parked.get(partition, {})
            held = parked.get(run_id)
            if held is not None:
                try:
                    unparked = held.slot()
                except (msgspec.DecodeError, CodecError) as exc:
                    raise PartitionStopped(
                        f"run {run_id}: its snapshot cannot be read: {exc}"
                    ) from None
                slot = self.slots.setdefault(partition, {})[run_id] = unparked
                del parked[run_id]
        return slot

    def _accept(self, inbound: Inbound, record: dict[str, Any], mark: _Mark) -> RunSlot | None:
        run_id = record["run_id"]
        partition = inbound.partition
        slot = self._held(partition, run_id)
        ended = None
        if slot is None:
            ended = self.ended.get(partition, {}).get(run_id) or self._recall(partition, run_id)
        work = None if ended is not None else self._work_on(slot or RunSlot(run_id), mark)
        try:
            if work is not None:
                self._sequence(partition, work, record, inbound)
            elif ended is not None:
                mark.ended = (ended, ended.last_seq)
                self._after_end(partition, run_id, ended, record)
        except _Reject as exc:
            self._dead_letter(inbound, exc.reason, exc.error_class, run_id=_bounded_id(run_id))
        return work

    def _after_end(self, partition: int, run_id: str, ended: Ended, record: dict[str, Any]) -> None:
        """An input of a run evicted after its end: LATE, as the core answers any input of an
        ended run, appended to the run's log (its state is no longer held, nor its snapshot),
        whatever the input (a submission of the same id again is no new run). The run's new
        last seq goes to the `runs` topic with the event, so no restart writes that seq twice."""
        seq = next_seq(ended.last_seq, self.settings.max_log_events)
        if seq is None:
            raise _Reject(f"run {run_id} has {ended.last_seq} events", "EVENT_CAP")
        event = self._parse(record)
        result = Transition(
            state=None, disposition=Disposition.LATE, reason=f"run is {ended.status}"
        )
        ended.last_seq = seq
        self._produce_event(partition, run_id, seq, event, result, record["input_id"])
        self.keep_ended(partition, run_id, ended)
        self.stats.count(result.disposition, 0)

    def keep_ended(
        self, partition: int, run_id: str, ended: Ended, batch: Batch | None = None
    ) -> None:
        """Write what is kept of an evicted run to the `runs` topic in `batch` (the open one by
        default), and hold it until the processor's store has it."""
        self.ended.setdefault(partition, {})[run_id] = ended
        if batch is not None:
            self._batch = batch
        self._emit(
            self.topics.runs,
            run_id.encode(),
            encode("EndedRun", ended_run_record(run_id, ended)),
            partition,
            None,
        )

    def _sequence(
        self, partition: int, slot: RunSlot, record: dict[str, Any], inbound: Inbound
    ) -> None:
        """Carry out the seq protocol's steps for one input (streams/sequencing.py)."""
        for step in self.sequencer.admit(slot, record, lambda: self._parse(record)):
            if isinstance(step, Apply):
                if step.numbered:
                    self._apply_numbered(partition, slot, step, inbound)
                else:
                    assert step.event is not None
                    self._apply(partition, slot, step.event, record["input_id"])
            elif isinstance(step, Duplicate):
                self.stats.duplicates += 1
            elif isinstance(step, Conflict):
                raise _Reject(
                    f"conflicting duplicate: input {step.key} was applied with other content",
                    dlq.CONFLICTING_DUPLICATE,
                )
            elif isinstance(step, Hold):
                self._touch(partition, slot)
                self.stats.buffered += 1
            elif isinstance(step, BufferFull):
                raise _Reject(
                    f"out-of-order buffer of run {slot.run_id} is full "
                    f"({step.limit} inputs waiting for a gap to fill)",
                    "BUFFER_FULL",
                )
            elif isinstance(step, ArmGapTimer):
                self._arm_gap_timer(partition, slot, step)
            elif isinstance(step, GapExpired):
                self._gap_expired(partition, slot, step)
            else:
                self.stats.stale_timers += 1

    def _apply_numbered(
        self, partition: int, slot: RunSlot, step: Apply, original: Inbound
    ) -> None:
        """Apply the next input of a producer. Its seq is used up already, so a refusal of it
        (to the DLQ) never blocks the ones behind it."""
        record = step.record
        incoming, source = self._incoming, self._tenant_source
        if step.held:
            original = Inbound.of_record(self.topics.inbox, partition, record)
            self._incoming = None  # a held input's headers are not kept: the run's context
            self._tenant_source = None  # nor its tenant header: never another record's
        self._touch(partition, slot)
        try:
            self._apply(partition, slot, self._parse(record), record["input_id"])
        except _Reject as exc:
            self._dead_letter(original, exc.reason, exc.error_class, run_id=slot.run_id)
        finally:
            self._incoming, self._tenant_source = incoming, source

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

    def _tenant_stamped(self, event: RunSubmitted) -> RunSubmitted:
        """A new run's submission with its tenant: the one its body names, its producer's
        tenant header as the settings take it, else the configured default
        (`tenant_headers.tenant_of_submission`); a header refused there refuses the input. A
        held submission has no headers: of the default tenant unless its body names one."""
        inbound = self._tenant_source
        named = None if isinstance(event.tenant, msgspec.UnsetType) else event.tenant
        try:
            tenant = tenant_headers.tenant_of_submission(
                self.settings.tenant_header,
                inbound.headers or () if inbound is not None else (),
                inbound.key if inbound is not None else None,
                inbound.value if inbound is not None else None,
                named=named,
                default=self.settings.default_tenant,
                key_of=self.settings.tenant_key,
            )
        except tenant_headers.TenantHeaderRefused as exc:
            raise _Reject(f"invalid_input:tenant: {exc}", dlq.INVALID_EVENT) from None
        if tenant == named:
            return event
        stamped = stored(tenant)
        if isinstance(stamped, msgspec.UnsetType):
            return event
        return msgspec.structs.replace(event, tenant=stamped)

    def _arm_gap_timer(self, partition: int, slot: RunSlot, step: ArmGapTimer) -> None:
        state = slot.state
        effect = ScheduleTimer(
            idempotency_key=f"{step.timer_id}:schedule",
            run_id=slot.run_id,
            step=0 if state is None else state.step,
            attempt=0 if state is None else state.attempt,
            trace_id=step.trace_id if state is None else state.trace_id,
            timer_id=step.timer_id,
            due_at=step.due_at,
            purpose=TimerPurpose.GAP_TIMEOUT,
        )
        self._produce_effect(partition, effect, seq=slot.last_seq, at=step.at)
        self._touch(partition, slot)

    def _gap_expired(self, partition: int, slot: RunSlot, step: GapExpired) -> None:
        """Record the diagnosis in the run's log (the core fails the run)."""
        fired = step.fired
        if slot.state is not None:
            event = GapTimedOut(
                run_id=slot.run_id,
                event_id=f"{fired.timer_id}:fired",
                at=fired.at,
                trace_id=slot.state.trace_id,
                expected_seq=step.expected,
                diagnosis=step.diagnosis,
            )
            self._apply(partition, slot, event, fired.event_id)
        log.warning("run %s: %s", slot.run_id, step.diagnosis, extra={"run_id": slot.run_id})
        self._touch(partition, slot)

    def _apply(self, partition: int, slot: RunSlot, event: Event, input_id: str | None) -> None:
        seq = next_seq(slot.last_seq, self.settings.max_log_events)
        if seq is None:
            raise _Reject(
                f"run {slot.run_id} has {slot.last_seq} events, the log cap is "
                f"{self.settings.max_log_events}",
                "EVENT_CAP",
            )
        if slot.state is None and isinstance(event, RunSubmitted):
            event = catalog.stamped(
                versions.stamped(event, self.rules_version), self.settings.catalog
            )
            event = self._tenant_stamped(event)
        span = None
        context = self._incoming or slot.traceparent
        if tracing.enabled():
            span = self._span(partition, slot, event, seq)
            context = tracing.traceparent_of(span)
        try:
            self._transition(partition, slot, event, input_id, seq, context)
        except BaseException as exc:
            if span is not None:
                tracing.end(span, f"{type(exc).__name__}: {exc}")
            raise
        if span is not None:
            self._spans_after(span, slot, event)
            tracing.end(span)

    def _span(self, partition: int, slot: RunSlot, event: Event, seq: int) -> Any:
        """The CONSUMER span of one input (tracing is on): the child of the run's span, linked
        to the span that produced the input (its record's context, when it came with one)."""
        if slot.traceparent is None:  # the first context a run sees becomes the run's
            slot.traceparent = self._incoming or tracing.run_context(
                slot.run_id, event.trace_id, None
            )
        parent = tracing.run_context(slot.run_id, event.trace_id, slot.traceparent)
        inbound = self._inbound
        attributes = tracing.consumed(
            self.topics.inbox,
            partition,
            inbound.offset if inbound is not None else -1,
            self.settings.group,
        )
        attributes.update(
            {
                "gen_ai.conversation.id": slot.run_id,  # the run id
                "agentruns.seq": seq,
                "agentruns.event": event.type,
            }
        )
        self._before = slot.state
        return tracing.start(
            f"process {event.type}", parent, attributes, kind="CONSUMER", links=[self._incoming]
        )

    def _spans_after(self, span: Any, slot: RunSlot, event: Event) -> None:
        """What the transition did, on its span; a wait that ended, as a span of its own; the
        run's span when the run ended."""
        before, after = self._before, slot.state
        if after is None:
            return
        span.set_attribute("agentruns.status", after.status.value)
        waited = before.status if before is not None else None
        if waited in _WAITS and after.status is not waited and before is not None:
            parent = tracing.run_context(slot.run_id, after.trace_id, slot.traceparent)
            wait = tracing.start(
                _WAITS[waited],
                parent,
                {"agentruns.run_id": slot.run_id, "agentruns.ended_by": event.type},
                start_ms=before.time.last_at,
            )
            tracing.end_at(wait, max(event.at, before.time.last_at))
        if after.status in _WAITS and waited is not after.status:
            span.add_event(_WAITS[after.status], {"agentruns.status": after.status.value})
        if after.terminal and (before is None or not before.terminal):
            usage = after.usage
            error = None if after.status is RunStatus.SUCCEEDED else after.status.value
            tracing.record_run(
                slot.run_id,
                after.trace_id,
                slot.traceparent,
                after.time.started_at,
                event.at,
                {
                    "gen_ai.operation.name": "invoke_agent",
                    "gen_ai.agent.name": "agentruns",
                    "gen_ai.conversation.id": slot.run_id,
                    "gen_ai.usage.input_tokens": usage.input_tokens,
                    "gen_ai.usage.output_tokens": usage.output_tokens,
                    "agentruns.run_id": slot.run_id,
                    "agentruns.status": after.status.value,
                    "agentruns.outcome": after.outcome or "",
                    "agentruns.steps": after.step,
                    "agentruns.tool_calls": after.tool_calls,
                    "agentruns.cost_micros": usage.cost_micros,
                },
                error,
            )

    def _transition(
        self,
        partition: int,
        slot: RunSlot,
        event: Event,
        input_id: str | None,
        seq: int,
        context: str | None,
    ) -> None:
        try:
            rules = versions.transition_for(versions.version_of(slot.state, event))
        except versions.UnknownRulesVersionError as exc:
            raise PartitionStopped(f"run {slot.run_id}: {exc}") from None
        result = rules(slot.state, event)
        if slot.state is None and result.state is None:
            # Nothing to log for a run that does not exist: the input is refused as a whole.
            raise _Reject(result.reason or "no such run", dlq.INVALID_EVENT)
        if slot.traceparent is None:
            slot.traceparent = self._incoming or context
        trace = tracing.headers_of(context)
        self._produce_event(partition, slot.run_id, seq, event, result, input_id, trace)
        batch = self._batch
        batch.artifacts.extend(result.artifacts)
        for effect in result.effects:
            if isinstance(effect, PublishResult):
                value = encode("Result", result_record(effect, seq=seq, at=event.at))
                self._emit(
                    self.topics.results,
                    slot.run_id.encode(),
                    value,
                    partition,
                    [*_headers(effect.trace_id, slot.run_id, effect.step, effect.attempt), *trace],
                )
            else:
                self._produce_effect(partition, effect, seq=seq, at=event.at, trace=trace)
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
        trace: Sequence[tuple[str, str | bytes | None]] = (),
    ) -> None:
        record = event_record(run_id, seq, event, result, input_id=input_id)
        self._emit(
            self.topics.events,
            event_key(run_id, seq),
            encode("Event", record),
            partition,
            [*_headers(event.trace_id, run_id, record["step"], record["attempt"]), *trace],
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

    def _produce_effect(
        self,
        partition: int,
        effect: Any,
        *,
        seq: int,
        at: int,
        trace: Sequence[tuple[str, str | bytes | None]] = (),
    ) -> None:
        kind = EFFECT_TOPIC_KIND[effect.type]
        topic = self.topics.effects[kind]
        if kind == "model":
            partition = self._model_partition()
        self._emit(
            topic,
            effect.run_id.encode(),
            encode("Effect", effect_record(effect, seq=seq, at=at)),
            partition,
            [
                *_headers(effect.trace_id, effect.run_id, effect.step, effect.attempt),
                ("idempotency_key", effect.idempotency_key.encode()),
                *trace,
            ],
        )

    def _model_partition(self) -> int:
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
        batch = self._batch
        if batch.model_partition is None:
            batch.model_partition = self._model_batches % self._model_partitions()
            self._model_batches += 1
        return batch.model_partition

    def _emit(
        self,
        topic: str,
        key: bytes | None,
        value: bytes,
        partition: int | None = None,
        headers: Headers | None = None,
    ) -> None:
        """A record of the open batch (produced by the committer, in this order)."""
        self._batch.records.append((topic, key, value, partition, headers))

    def _touch(self, partition: int, slot: RunSlot) -> None:
        self._batch.dirty[slot.run_id] = (partition, slot)

    def _dead_letter(
        self, original: Inbound, reason: str, error_class: str, *, run_id: str | None = None
    ) -> None:
        """A DeadLetter record for `original`, cut to fit the DLQ topic's record limit."""
        limit = self.limits.of(self.topics.dlq)
        record = dlq.dead_letter(
            reason=reason[: dlq.MAX_REASON_CHARS],
            error_class=error_class,
            topic=original.topic,
            partition=original.partition,
            offset=original.offset,
            key=original.key,
            value=original.value,
            headers=original.headers,
            at=int(self._clock() * 1000),
            original_timestamp=original.timestamp,
            run_id=run_id,
        )
        key = dlq.key_of(record)  # the run's, when known: on the run's partition of the DLQ
        value, notes = dlq.fit(record, limit - len(key or b"") - dlq.NOTES_BYTES)
        headers: Headers = list(notes)
        self._emit(self.topics.dlq, key, value, None, headers or None)
        self.stats.dead_letters += 1
        dlq_metrics.dead_lettered("processor", error_class)
        log.warning("dead letter (%s): %s", error_class, reason[:500], extra={"run_id": run_id})


def _run_of(inbound: Inbound) -> str | None:
    """The run an input names, if it decodes that far (for a dead letter's run_id)."""
    try:
        run_id = decode_fields(inbound.value or b"", "Input", ("input_id", "run_id"))["run_id"]
    except CodecError:
        return None
    return _bounded_id(str(run_id))


def _live(slot: RunSlot) -> bool:
    return slot.state is not None and not slot.state.terminal


def _where(inbound: Inbound) -> tuple[str, int, int]:
    return inbound.topic, inbound.partition, inbound.offset


def _bounded_id(value: str | None) -> str | None:
    """An id from outside, as it may be written into our records: a digest when too long."""
    if value is None or len(value) <= MAX_ID_CHARS:
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()


def _headers(trace_id: str, run_id: str, step: int, attempt: int) -> Headers:
    return [
        ("trace_id", trace_id.encode()),
        ("run_id", run_id.encode()),
        ("step", str(step).encode()),
        ("attempt", str(attempt).encode()),
    ]


__all__ = [
    "MAX_PRODUCER_MARKS",
    "Batch",
    "Ended",
    "Inbound",
    "InputPath",
    "PathSettings",
    "Record",
    "RecordLimits",
    "RecordTooLarge",
    "record_size",
]
