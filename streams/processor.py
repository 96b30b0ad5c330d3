"""The run processor: inbox inputs -> pure transitions -> one Kafka transaction per batch.

Consume-transform-produce with one transaction at a time per process and KIP-447 fencing
(`send_offsets_to_transaction` with the consumer's group metadata). The loop thread applies
inputs (`agentruns.streams.inputs.InputPath`: one guard per input, so no input stops the loop; an
input
whose records would be over the broker's record limit is refused) and collects the encoded
records of a batch; sealing the batch adds one snapshot per run it touched and hands it to the
committer thread (`agentruns.streams.transaction.Committer`, shared with the executors). What one
transaction holds, in the order the committer writes it down (`Committer._transact`):

1. the new events (`events`, key run_id:seq), effects (`effects.*`), terminal results
   (`results`) and dead letters (`dlq`) of the batch, in the order its inputs were applied;
2. one snapshot per run touched by the batch (`state`): state, last seq, out-of-order buffer,
   producer marks, recent input digests; then a tombstone (null value) per run evicted at this
   seal, which ended `terminal_retention_ms` ago, with what is kept of it on `runs`
   (`Evictor.evict`);
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
snapshots, as for any abortable error, after a back-off that doubles with each failure in a row.
A batch that keeps failing is retried one input per transaction; an input whose own transaction
keeps failing is dead-lettered with the broker's error (`_recover`, `_isolate`).

The processor keeps the loop, the committing and the recovery; its collaborators hold the rest,
each given the clients it needs by one factory (`streams.clients.KafkaClients`): the restore
(`streams.restore.Restorer`), the rebalance callbacks and paused partitions
(`streams.rebalance.Rebalancer`) and the eviction of ended runs (`streams.eviction.Evictor`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from agentruns.processors.catalog import Catalog
from agentruns.processors.tenants import DEFAULT_TENANT
from agentruns.processors.transition import Artifact
from agentruns.streams import metrics
from agentruns.streams.access import processor_group
from agentruns.streams.clients import ConfluentClients, KafkaClients
from agentruns.streams.codec import encode
from agentruns.streams.errors import FatalConsumerError
from agentruns.streams.eviction import Evictor
from agentruns.streams.inputs import (
    DEFAULT_RECORD_LIMIT,
    RECORD_MARGIN,
    Batch,
    Ended,
    Inbound,
    InputPath,
    PathSettings,
    RecordLimits,
)
from agentruns.streams.kafka_defaults import close_consumer, partition_count
from agentruns.streams.membership import Membership
from agentruns.streams.polling import check_fatal, poll_batch
from agentruns.streams.rebalance import Rebalancer
from agentruns.streams.records import Parked, RunSlot
from agentruns.streams.restore import Restorer, has_ended, stored_runs
from agentruns.streams.run_store import RunStore
from agentruns.streams.tenant_headers import Mode
from agentruns.streams.topics import TopicNames
from agentruns.streams.transaction import (
    Backoff,
    Committer,
    Fault,
    Record,
    Timings,
    classify,
    committed_offsets,
    seek,
)

log = logging.getLogger("agentruns.processor")

ArtifactWriter = Callable[[Sequence[Artifact]], object]
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
    # window ends or FETCH_WINDOW_BYTES, 8 KiB, wait), or with 0 each input as it lands. A
    # window is on every lone step's path, twice a step (docs/benchmarks.md, "Lingers on a lone
    # step's path"); under load inputs gather anyway while a transaction commits.
    fetch_window_ms: int = 0
    max_batch: int = 2000
    buffer_limit: int = 64  # out-of-order inputs held per run
    gap_timeout_ms: int = 30_000
    # A hard cap on the log of one run, beyond the core's own event cap (R21): protects the
    # log from a producer that keeps writing to a finished run.
    max_log_events: int = 1000
    transaction_timeout_ms: int = 10_000
    session_timeout_ms: int = 6000
    # The largest record (key + value + headers, bytes) the processor writes to any topic.
    # None: derived once at start from each output topic's `max.message.bytes` (the broker's
    # `message.max.bytes` when a topic's cannot be read, else 1 MiB) and the producer's own
    # `message.max.bytes`, less RECORD_MARGIN. An input whose records would be larger is
    # refused (`invalid_input:record_too_large`) instead of failing every transaction.
    max_record_bytes: int | None = None
    # A failed transaction is retried (rewind, re-apply) after a back-off that doubles from
    # retry_backoff_ms to retry_backoff_max_ms, back to the start after a commit. After
    # isolate_after failures in a row, the inputs of the failing batch are retried one per
    # transaction, and one whose own transaction fails isolate_after times is dead-lettered
    # with the broker's error.
    # (A retriable error, an outage of the broker or of the artifact store, is retried with
    # the same back-off but never dead-letters an input.)
    retry_backoff_ms: int = 100
    retry_backoff_max_ms: int = 5000
    isolate_after: int = 3
    # A run that ended this long ago (event time: the latest `at` its partition has seen, at
    # most the wall clock, against the run's last `at`) leaves memory and the state topic (a
    # tombstone), so memory and restore scale with live runs. What is kept of it (status, last
    # seq, result ref) goes to the `runs` topic and the run store, and answers any later input
    # LATE, across restarts. None: never evicted.
    terminal_retention_ms: int | None = 600_000
    # Where the run store keeps its file (`streams.run_store`), one per processor group; None:
    # in memory, read again from the `runs` topic at every restore.
    store_dir: str | None = None
    # The rules version new runs are submitted under (agentruns.processors.versions); None:
    # the newest this build has (docs/operations.md, rolling out new rules).
    rules_version: int | None = None
    # The operator's tool catalog new runs' tasks must keep within (docs/tools.md); None: none.
    catalog: Catalog | None = None
    # The tenant of a task produced straight to Kafka that names none, how its
    # `agentruns-tenant` header is taken, and each tenant's Kafka key when it must be signed
    # (streams.inputs.PathSettings, streams.tenant_headers).
    default_tenant: str = DEFAULT_TENANT
    tenant_header: Mode = "default"
    tenant_key: Callable[[str], bytes] | None = None
    extra_consumer: dict[str, Any] = field(default_factory=dict)
    extra_producer: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.group_id = self.group_id or processor_group(self.prefix)


@dataclass
class _Sealed:
    """A batch handed to the committer (`Outgoing`): everything its transaction writes, already
    encoded."""

    outputs: list[Record]
    offsets: dict[int, int]  # inbox partition -> next offset
    metadata: Any  # the consumer's group metadata when sealed (KIP-447 fencing)
    artifacts: Future[object] | None
    inputs: int
    started: float
    sealed: float

    @property
    def offset_notes(self) -> Mapping[int, str]:
        return {}

    def records(self) -> list[Record]:
        return self.outputs

    def durable(self) -> None:
        """The batch's artifacts are in the store (R2); if they cannot be, nothing commits and
        the batch is retried, as after an outage of the broker."""
        if self.artifacts is None:
            return
        try:
            self.artifacts.result()
        except Exception as exc:  # the store's error
            raise KafkaException(
                KafkaError(
                    KafkaError._FAIL,
                    f"artifact store: {type(exc).__name__}: {exc}",
                    retriable=True,
                    txn_requires_abort=True,
                )
            ) from exc


class Processor:
    """One processor process (or thread, in monolith mode). Not thread-safe: one loop owns it.

    `clients`: where its Kafka clients come from (default: confluent-kafka's, made from
    `config`); the restore, the rebalance callbacks and the committer get theirs from it."""

    def __init__(
        self,
        config: ProcessorConfig,
        write_artifacts: ArtifactWriter,
        clients: KafkaClients | None = None,
    ) -> None:
        self.config = config
        self._write_artifacts = write_artifacts
        self._artifact_writer = ThreadPoolExecutor(1, thread_name_prefix="artifacts")
        self.topics = TopicNames.for_prefix(config.prefix)
        self.inbox, self.events = self.topics.inbox, self.topics.events
        self.state_topic, self.runs_topic = self.topics.state, self.topics.runs
        self.results, self.dlq = self.topics.results, self.topics.dlq
        self.stats = metrics.ProcessorStats()
        self._clients = clients or ConfluentClients.of(config, config.group_id)
        self._model_partitions = 0  # of the model effects topic, read on first use
        self._path = InputPath(
            self.topics,
            PathSettings(
                buffer_limit=config.buffer_limit,
                gap_timeout_ms=config.gap_timeout_ms,
                max_log_events=config.max_log_events,
                rules_version=config.rules_version,
                catalog=config.catalog,
                group=config.group_id,
                default_tenant=config.default_tenant,
                tenant_header=config.tenant_header,
                tenant_key=config.tenant_key,
            ),
            self.stats,
            limits=self._record_limits(),
            model_partitions=self._model_partition_count,
            recall=self._recall,
        )
        self._slots = self._path.slots  # partition -> run_id -> slot (the path's, shared)
        self._batch: Batch | None = None
        # Failed transactions since the last commit (the back-off grows with them); inbox
        # partition -> end offset of the batch being retried one input per transaction.
        self._backoff = Backoff(config.retry_backoff_ms / 1000, config.retry_backoff_max_ms / 1000)
        self._isolating: dict[int, int] = {}
        self._single_failures: dict[tuple[int, int], int] = {}
        self._stop: threading.Event | None = None
        # Eviction after the end: per partition, ended runs due and the event time applied.
        self._evictor = Evictor(
            self._path, self.state_topic, config.terminal_retention_ms, self.stats
        )
        self._restorer = Restorer(
            self._clients,
            self._path,
            self._evictor,
            state_topic=self.state_topic,
            runs_topic=self.runs_topic,
        )
        self._consumer = self._clients.consumer(
            {
                # Static membership: a restarted slot gets its partitions back at once instead
                # of waiting for the group to notice that its predecessor died.
                "group.instance.id": self._clients.member,
                "partition.assignment.strategy": "range",
            },
            config.fetch_window_ms,
        )
        self.membership = Membership()  # what /healthz reports
        # The assigned and paused inbox partitions, kept by the rebalance callbacks.
        self._rebalance = Rebalancer(
            self._consumer,
            self.inbox,
            self._path,
            self._evictor,
            self,
            self.membership,
            transaction_timeout_ms=config.transaction_timeout_ms,
        )
        # The committer thread runs one transaction at a time, one sealed batch each (the loop
        # seals the next once it is free); `_in_flight`: a batch was handed to it and its end
        # not yet waited for; `_in_flight_batch`: that batch (kept for `_recover` if it failed).
        self._committer: Committer[_Sealed] = Committer(
            self._new_producer,
            self.inbox,
            self._on_commit,
            logger=log,
            on_delivery={self.runs_topic: self._delivered_run},
        )
        # The run store (opened by `run`), the `runs` offsets the open transaction's records
        # got (the committer thread's), and committed `runs` records the loop thread has yet
        # to write to the store, with those offsets.
        self._store: RunStore | None = None
        self._delivered: dict[int, int] = {}
        self._committed_runs: deque[tuple[list[tuple[int, bytes, bytes]], dict[int, int]]] = deque()
        self._in_flight = False
        self._in_flight_batch: _Sealed | None = None

    @property
    def _assigned(self) -> set[int]:
        """The inbox partitions assigned (the rebalance callbacks')."""
        return self._rebalance.assigned

    # ------------------------------------------------------------------ clients

    def _new_producer(self, slot: str) -> Producer:
        return self._clients.producer(
            slot,
            {
                # Each message enqueued to an empty partition queue wakes librdkafka's broker
                # thread with a write() syscall; at 2 ms nearly every produce paid one (~17% of
                # the processor's samples). commit_transaction flushes at once anyway.
                "linger.ms": 5,
                "compression.type": "lz4",
            },
        )

    def _record_limits(self) -> RecordLimits:
        """Each output topic's record limit, read from the broker once (see max_record_bytes)."""
        c = self.config
        if c.max_record_bytes is not None:
            return RecordLimits(default=c.max_record_bytes)
        producer_max = int(c.extra_producer.get("message.max.bytes", 1_000_000))
        found = self._clients.record_limits(self.topics.outputs())
        fallback = found.get("", DEFAULT_RECORD_LIMIT)
        if not found:
            log.warning("the broker's record limits cannot be read; assuming %d bytes", fallback)

        def usable(limit: int) -> int:
            return min(limit, producer_max) - RECORD_MARGIN

        return RecordLimits(
            by_topic={t: usable(found.get(t, fallback)) for t in self.topics.outputs()},
            default=usable(fallback),
        )

    def _model_partition_count(self) -> int:
        if not self._model_partitions:
            self._model_partitions = partition_count(self._consumer, self.topics.effects["model"])
        return self._model_partitions

    # ------------------------------------------------------------------ lifecycle

    def set_catalog(self, catalog: Catalog | None) -> None:
        """Hold new runs' tasks to ``catalog`` from now on (a refresh of the operator's
        catalog: `agentruns.connectors.catalog.CatalogRefresher`). Safe from another thread:
        the settings are replaced whole, and a submission is checked against the catalog
        they hold when it is applied; the runs already submitted keep their stamp."""
        self._path.settings = replace(self._path.settings, catalog=catalog)

    def run(self, stop: threading.Event) -> None:
        """Process until `stop` is set; then commit what is pending and leave the group."""
        self._stop = stop
        self._model_partition_count()  # read here: the per-input path does no I/O
        self._open_store()
        rebalance = self._rebalance
        self._consumer.subscribe(
            [self.inbox],
            on_assign=rebalance.on_assign,
            on_revoke=rebalance.on_revoke,
            on_lost=rebalance.on_lost,
        )
        interval = self.config.commit_interval_ms / 1000
        try:
            while not stop.is_set():
                # One input per transaction while a failing batch is isolated (`_recover`).
                limit = 1 if self._isolating else self.config.max_batch
                # With a batch open, only look for what has already arrived. A batch is sealed
                # when the committer is free and the inbox is drained (low latency when lightly
                # loaded) or the batch is `interval` old; while a transaction commits, inputs
                # keep being applied into the next batch, up to `max_batch` (throughput under
                # load).
                if self._batch is None:
                    messages = poll_batch(
                        self._consumer, limit, interval, group=self.config.group_id
                    )
                else:
                    messages = check_fatal(
                        self._consumer.consume(limit, 0.002), self.config.group_id
                    )
                drained = len(messages) < limit
                try:
                    self._check_in_flight()  # a failed transaction: recover before applying more
                    if self._committed_runs:
                        self._store_committed()
                    for message in messages:
                        self._handle(message)
                    if self._path.stopped.keys() != rebalance.paused:
                        rebalance.sync_stopped()
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
            # (`Rebalancer.on_assign`).
            rebalance.fenced = True
            self._batch = None
            log.error("the consumer was fenced; stopping without committing the open batch")
            raise
        finally:
            self.close()

    def close(self) -> None:
        try:
            # may revoke, and so commit, a batch (artifacts needed): time for its bounded commit
            close_consumer(self._consumer, 60)
        except KafkaException as exc:  # fenced: the error the process stops for is raised
            log.info("closing the consumer in a failed state: %s", exc)
        with contextlib.suppress(KafkaException):
            self._wait_in_flight()
        self._artifact_writer.shutdown(wait=True)
        self._committer.close()  # it is idle: no transaction is open
        if self._store is not None:
            self._store_committed()
            self._store.close()
            self._store = None

    # ------------------------------------------------------------------ the run store

    def _open_store(self) -> None:
        """The run store of this group's `runs` topic, emptied if it was kept for another
        topic of that name (`RunStore._adopt`)."""
        if self._store is not None:
            return
        path = None
        if self.config.store_dir is not None:
            path = Path(self.config.store_dir) / self.config.group_id / f"{self.runs_topic}.db"
        self._store = RunStore.opened(path, self._clients.topic_id(self.runs_topic))

    def _recall(self, partition: int, run_id: str) -> Ended | None:
        return None if self._store is None else self._store.get(partition, run_id)

    def _delivered_run(self, error: KafkaError | None, message: Message) -> None:
        """The committer thread, as the open transaction's `runs` records are acknowledged."""
        if error is None:
            p, offset = message.partition() or 0, (message.offset() or 0) + 1
            self._delivered[p] = max(offset, self._delivered.get(p, 0))

    def _store_committed(self) -> None:
        """Write the `runs` records of committed transactions to the run store; what it holds
        from then on leaves the path's memory."""
        store = self._store
        while self._committed_runs:
            records, delivered = self._committed_runs.popleft()
            if store is None:
                continue
            runs = list(stored_runs(records))
            store.put(runs, delivered)
            for p, run_id, stored in runs:
                held = self._path.ended.get(p, {})
                kept = held.get(run_id)
                if kept is not None and kept.last_seq <= stored.last_seq:
                    del held[run_id]

    # ------------------------------------------------------------------ the rebalancer's owner
    # What the rebalance callbacks ask of the loop (`rebalance.Owner`; see there for each).

    @property
    def stopping(self) -> threading.Event | None:
        return self._stop

    def restore(self, partitions: set[int]) -> int:
        """Load the latest snapshot of every run on `partitions` (`Restorer`), once the run
        store has every committed `runs` record."""
        if partitions and self._committed_runs:
            self._store_committed()
        return self._restorer.restore(partitions, self._store, self._stop)

    def commit_pending(self) -> None:
        self._commit(wait=True)

    def recover(self, exc: KafkaException, rewind: set[int]) -> None:
        self._recover(exc, rewind)

    def wait_in_flight(self) -> None:
        self._wait_in_flight()

    def discard_open(self) -> None:
        self._batch = None
        self._committer.abort()

    def forget(self, partition: int) -> None:
        self._isolating.pop(partition, None)

    # ------------------------------------------------------------------ applying inputs

    def _open_batch(self) -> Batch:
        if self._batch is None:
            self._batch = Batch(started=time.monotonic())
        return self._batch

    def _handle(self, message: Message) -> None:
        error = message.error()
        if error is not None:
            if error.code() != KafkaError._PARTITION_EOF:
                log.warning("consume error: %s", error)
            return
        self._path.handle(Inbound.of(message), self._open_batch())

    # ------------------------------------------------------------------ committing

    def _committer_free(self) -> bool:
        return self._committer.settled()

    def _wait_in_flight(self) -> None:
        """Wait for the transaction in flight; re-raise its error (then no longer in flight)."""
        in_flight, self._in_flight = self._in_flight, False
        if in_flight:
            self._committer.wait()
            failure = self._committer.take_failure()
            if failure is not None:
                raise failure.error  # `_in_flight_batch` stays for `_recover`
            batch, self._in_flight_batch = self._in_flight_batch, None
            self._committed(batch)

    def _committed(self, batch: _Sealed | None) -> None:
        """A transaction committed: the back-off starts over; a batch retried one input per
        transaction is isolated once the transactions passed its end."""
        self._backoff.succeeded()
        if batch is None or not self._isolating:
            return
        for partition, offset in batch.offsets.items():
            end = self._isolating.get(partition)
            if end is not None and offset >= end:
                del self._isolating[partition]
        if not self._isolating:
            self._single_failures.clear()
            log.info("the failing batch is isolated; back to batches")

    def _check_in_flight(self) -> None:
        """Raise the error of the in-flight transaction if it ended in one (for `_recover`)."""
        if self._in_flight and self._committer.settled():
            self._wait_in_flight()

    def _commit(self, *, wait: bool = False) -> None:
        """Seal the open batch and hand it to the committer, once the transaction before it
        committed; with `wait`, also wait until this one committed."""
        began = time.monotonic()
        self._wait_in_flight()
        batch = self._batch
        if batch is not None:
            self._batch = None
            sealed = self._seal(batch)
            self._in_flight_batch = sealed
            self._committer.submit(sealed)  # it is free: no failure held
            self._in_flight = True
        self.stats.stage("wait", time.monotonic() - began)
        if wait:
            self._wait_in_flight()

    def _seal(self, batch: Batch) -> _Sealed:
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
            key = run_id.encode()
            slot.size_estimate = len(key) + len(value)
            batch.records.append((self.state_topic, key, value, partition, None))
            ended = has_ended(slot)
            self._evictor.track(partition, run_id, slot.updated_at, terminal=ended)
            if ended and not slot.buffer and self._slots.get(partition, {}).get(run_id) is slot:
                state = slot.state
                status = str(state.status) if state is not None else ""
                result_ref = state.result_ref if state is not None else None
                held = Parked(value, status, slot.last_seq, slot.updated_at, result_ref)
                self._path.park(partition, run_id, held)
        self._evictor.evict(batch)
        self.stats.publish(self._evictor.held())
        sealed = time.monotonic()
        self.stats.stage("seal", sealed - began)
        self.stats.stage("batch_open", began - batch.started)
        return _Sealed(
            outputs=batch.records,
            offsets=dict(batch.positions),
            metadata=self._consumer.consumer_group_metadata(),
            artifacts=written,
            inputs=batch.inputs,
            started=batch.started,
            sealed=sealed,
        )

    def _on_commit(self, batches: list[_Sealed], t: Timings) -> None:
        """The committer thread, once a transaction committed: the times of its stages; a
        slow one is logged with them."""
        batch = batches[0]  # the only one: the loop seals a batch once the committer is free
        inputs = sum(b.inputs for b in batches)
        if t.ended - batch.sealed > SLOW_COMMIT_S:
            log.warning(
                "slow transaction: %.0f ms for %d inputs (queued %.0f, produce %.0f, offsets %.0f,"
                " artifacts %.0f, flush %.0f, commit %.0f ms)",
                1000 * (t.ended - batch.sealed),
                inputs,
                1000 * (t.began - batch.sealed),
                1000 * (t.produced - t.began),
                1000 * (t.sent - t.produced),
                1000 * (t.durable - t.sent),
                1000 * (t.flushed - t.durable),
                1000 * (t.ended - t.flushed),
            )
        self.stats.stage("queued", t.began - batch.sealed)
        self.stats.stage("produce", t.produced - t.began)
        self.stats.stage("offsets", t.sent - t.produced)
        self.stats.stage("artifacts_wait", t.durable - t.sent)
        self.stats.stage("flush", t.flushed - t.durable)
        self.stats.stage("commit", t.ended - t.flushed)
        self.stats.committed(inputs, t.ended - batch.sealed)
        runs = self.runs_topic
        records = [
            (p or 0, k or b"", v)
            for b in batches
            for (topic, k, v, p, _) in b.outputs
            if topic == runs and v is not None
        ]
        delivered, self._delivered = self._delivered, {}
        if records or delivered:
            self._committed_runs.append((records, delivered))

    def _recover(self, exc: KafkaException, rewind: set[int] | None = None) -> None:
        """Abortable: abort and rewind. Fatal/fenced: a new producer. Then reload state.

        The batch applied behind the failed transaction is dropped with it: the rewind to the
        committed offsets and snapshots brings its inputs back. Each retry waits a back-off
        that doubles with the failures in a row; after `isolate_after` of them the failing
        batch is retried one input per transaction (`_isolate`)."""
        with contextlib.suppress(KafkaException):
            self._wait_in_flight()  # the committer is idle from here on
        failed, self._in_flight_batch = self._in_flight_batch, None
        self._batch = None
        fault = self._committer.recover(exc)  # logged: an abort, or a new producer if fatal
        self._delivered = {}  # offsets of aborted records
        self.stats.aborts += 1
        if fault is not Fault.FATAL:
            self._backoff.failed()
            if failed is not None:
                self._isolate(failed, exc)
        if rewind is None:  # not in a rebalance callback, which must not stall
            self._backoff.wait(self._stop)
        self.stats.retries += 1
        self._rewind(set(self._assigned) if rewind is None else rewind)

    def _isolate(self, failed: _Sealed, exc: KafkaException) -> None:
        """Find the input a batch keeps failing on (one the size checks let through, a record
        the broker refuses for a reason of its own): retry the batch's inputs one per
        transaction; one whose own transaction keeps failing is dead-lettered with the error."""
        if classify(exc) is Fault.RETRIABLE:
            return  # an outage (of the broker, of the store), not an input's fault: retried
        failures = self._backoff.failures
        if self._isolating and failed.inputs == 1 and len(failed.offsets) == 1:
            ((partition, offset),) = failed.offsets.items()
            where = (partition, offset - 1)
            count = self._single_failures.get(where, 0) + 1
            self._single_failures[where] = count
            if count >= self.config.isolate_after:
                reason = f"its transaction failed {count} times on its own: {exc}"
                self._path.poisoned[where] = reason[:2000]
                log.error("inbox %d@%d is dead-lettered: %s", *where, reason)
            return
        if failures >= self.config.isolate_after and failed.offsets:
            for partition, offset in failed.offsets.items():
                self._isolating[partition] = max(offset, self._isolating.get(partition, 0))
            self.stats.isolations += 1
            log.warning(
                "a batch of %d inputs failed %d times: retrying them one per transaction",
                failed.inputs,
                failures,
            )

    def _rewind(self, partitions: set[int]) -> None:
        """Drop in-memory state and seek back to the committed offsets of `partitions`."""
        if not partitions:
            return
        offsets = committed_offsets(self._consumer, self.inbox, partitions, stop=self._stop)
        seek(self._consumer, self.inbox, offsets)
        self.restore(partitions)

    # ------------------------------------------------------------------ inspection (tests)

    def slots(self) -> Iterable[RunSlot]:
        """Every run held, parked ones decoded (copies). Lists taken first: the loop thread
        may change the tables while a test reads them."""
        for runs in list(self._slots.values()):
            yield from list(runs.values())
        for parked in list(self._path.parked.values()):
            for held in list(parked.values()):
                yield held.slot()


__all__ = ["Processor", "ProcessorConfig"]
