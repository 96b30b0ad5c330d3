"""Restore: the run state of assigned inbox partitions, read back from the `state` and `runs`
topics (read_committed, each partition to its end) into the processor's memory and run store.

Snapshots are committed in the same transaction as the events they cover, so the latest
committed snapshot of a run is all of it: a restore keeps the latest value per run of the
`state` partition (a tombstone: the run was evicted after its end). Live runs are decoded into
slots, ended ones held as their snapshot (`Parked`), each tracked for eviction
(`streams.eviction`). `runs` is read from the run store's checkpoint on (`streams.run_store`),
into the store. A partition holding a snapshot this build cannot continue stops
(`InputPath.stopped`); the others go on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import msgspec
from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition

from agentruns.processors import versions
from agentruns.processors.state import TERMINAL
from agentruns.streams.clients import KafkaClients, Reader
from agentruns.streams.codec import CodecError, decode
from agentruns.streams.errors import AgentrunsKafkaError
from agentruns.streams.eviction import Evictor
from agentruns.streams.inputs import InputPath
from agentruns.streams.records import Parked, RunSlot, ended_run_of, result_ref_of
from agentruns.streams.run_store import RunStore, StoredRun
from agentruns.streams.transaction import watermarks

log = logging.getLogger("agentruns.processor")

STORE_CHUNK = 10_000  # `runs` records written to the run store per SQLite transaction at restore
RESTORE_PATIENCE_S = 120.0  # a restore that has not reached every partition's end by then fails


class Restorer:
    """Reads the state of inbox partitions back into `path`'s run tables and `evictor`, with a
    reader the clients factory makes for each restore. The loop thread's (the rebalance
    callbacks run on it)."""

    def __init__(
        self,
        clients: KafkaClients,
        path: InputPath,
        evictor: Evictor,
        *,
        state_topic: str,
        runs_topic: str,
        patience_s: float = RESTORE_PATIENCE_S,
    ) -> None:
        self._clients = clients
        self._path = path
        self._evictor = evictor
        self.state_topic = state_topic
        self.runs_topic = runs_topic
        self._patience_s = patience_s

    def restore(
        self,
        partitions: set[int],
        store: RunStore | None,
        stop: threading.Event | None = None,
    ) -> int:
        """Load the latest snapshot of every run on `partitions` (read_committed, to the end),
        and the `runs` records the store does not hold yet; return how many runs are held."""
        path = self._path
        for p in partitions:
            path.stopped.pop(p, None)  # tried again: stopped again if it must
            path.slots[p] = {}
            path.parked[p] = {}
            path.ended[p] = {}
            self._evictor.reset(p)
        if not partitions:
            return 0
        reader = self._clients.reader()
        try:
            latest = self._read(reader, partitions, store, stop)
        finally:
            reader.close()
        for p, values in latest.items():
            try:
                self._load(p, values)
            except (CodecError, msgspec.DecodeError, versions.UnknownRulesVersionError) as exc:
                # A snapshot a newer build wrote that this one cannot continue: the partition
                # stops here, the others go on (`InputPath.stopped`).
                path.slots[p].clear()
                path.parked[p].clear()
                self._evictor.clear(p)
                path.stop(p, f"a snapshot this build cannot continue: {exc}")
            values.clear()
        return sum(len(path.slots[p]) + len(path.parked[p]) for p in partitions)

    def _read(
        self,
        reader: Reader,
        partitions: set[int],
        store: RunStore | None,
        stop: threading.Event | None,
    ) -> dict[int, dict[bytes, bytes]]:
        """partition -> run key -> its latest snapshot, read to each partition's end; the
        `runs` records read go to `store` (its checkpoint to each partition's end)."""
        runs_from = {} if store is None else self._runs_from(reader, store, partitions, stop)
        reader.assign(
            [TopicPartition(self.state_topic, p, OFFSET_BEGINNING) for p in partitions]
            + [TopicPartition(self.runs_topic, p, o) for p, o in runs_from.items()]
        )
        pending = {(self.state_topic, p) for p in partitions} | {
            (self.runs_topic, p) for p in runs_from
        }
        stored: list[tuple[int, bytes, bytes]] = []
        deadline = time.monotonic() + self._patience_s
        # The latest value of each run, decoded once the end is reached: an uncompacted
        # topic holds every snapshot a run had and the tombstone of every evicted run.
        latest: dict[int, dict[bytes, bytes]] = {p: {} for p in partitions}
        while pending:
            if time.monotonic() > deadline:
                raise AgentrunsKafkaError(
                    f"restoring {self.state_topic} partitions {sorted(pending)} timed out"
                )
            for message in reader.consume(1000, 0.5):
                error = message.error()
                topic = message.topic()
                partition = message.partition() or 0
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        pending.discard((topic or "", partition))
                        if topic == self.runs_topic and store is not None:
                            # everything before the end is read: the checkpoint moves there
                            store.put(stored_runs(stored), {partition: message.offset() or 0})
                            stored.clear()
                        continue
                    raise KafkaException(error)
                value = message.value()
                key = message.key() or b""
                if topic == self.runs_topic:
                    if value is not None and store is not None:
                        stored.append((partition, key, value))
                        if len(stored) >= STORE_CHUNK:
                            store.put(stored_runs(stored), {})
                            stored.clear()
                    continue
                if value is None:  # a tombstone: the run was evicted after its end
                    latest[partition].pop(key, None)
                    # written once event time was past the run's end plus the retention: the
                    # partition's event time was at least this
                    self._evictor.saw(partition, message.timestamp()[1])
                    continue
                latest[partition][key] = value
        return latest

    def _runs_from(
        self,
        reader: Reader,
        store: RunStore,
        partitions: set[int],
        stop: threading.Event | None,
    ) -> dict[int, int]:
        """Where a restore reads each partition of `runs` from: the store's checkpoint, or the
        start for a checkpoint outside the topic (a topic recreated, records deleted)."""
        start: dict[int, int] = {}
        for p in partitions:
            low, high = watermarks(reader, self.runs_topic, p, stop=stop)
            at = store.checkpoint(p)
            if at < low or at > high:
                log.warning(
                    "run store of %s partition %d is at offset %d, outside the topic's [%d, %d]:"
                    " read again from the start",
                    self.runs_topic,
                    p,
                    at,
                    low,
                    high,
                )
                store.reset(p)
                at = 0
            start[p] = at if at > 0 else OFFSET_BEGINNING
        return start

    def _load(self, p: int, values: dict[bytes, bytes]) -> None:
        """Hold the latest snapshots of partition `p`'s runs: live ones decoded, ended ones as
        they are (`Parked`). Raises what a snapshot this build cannot read raises."""
        runs, parked = self._path.slots[p], self._path.parked[p]
        for value in values.values():
            record = decode(value, expected_name="Snapshot").record
            run_id = record["run_id"]
            if record["status"] in TERMINAL and not record["buffer"]:
                held = Parked(
                    value,
                    record["status"],
                    record["last_seq"],
                    record["updated_at"],
                    result_ref_of(record["state"]),
                )
                parked[run_id] = held
                self._evictor.track(p, run_id, held.updated_at, terminal=True)
                continue
            slot = RunSlot.from_record(record)
            if slot.state is not None:
                versions.transition_for(versions.of_state(slot.state))
            slot.size_estimate = len(value) + len(run_id)
            runs[run_id] = slot
            self._evictor.track(p, run_id, slot.updated_at, terminal=has_ended(slot))


def stored_runs(records: Iterable[tuple[int, bytes, bytes]]) -> Iterable[StoredRun]:
    """The run store's rows of `runs` records. One that cannot be decoded (written by no
    processor of ours) is logged and left out: skipping it loses one run's end, where failing
    would stop every restore of its partition."""
    for partition, key, value in records:
        try:
            yield partition, key.decode(), ended_run_of(decode(value, "EndedRun").record)
        except (CodecError, UnicodeDecodeError, KeyError) as exc:
            log.error("runs record of %r on partition %d left out: %s", key[:200], partition, exc)


def has_ended(slot: RunSlot) -> bool:
    """The run reached a terminal state."""
    return slot.state is not None and slot.state.terminal


__all__ = ["RESTORE_PATIENCE_S", "STORE_CHUNK", "Restorer", "has_ended", "stored_runs"]
