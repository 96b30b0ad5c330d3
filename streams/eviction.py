"""Eviction after the end: runs that ended `terminal_retention_ms` ago leave the processor.

A run's time is event time: its last `at`, against the latest `at` its partition has seen (at
most the wall clock), so a processor restarted after a pause does not evict every run at once
and a partition that receives nothing keeps its ended runs. An evicted run leaves memory, and the
state topic with a tombstone after its last snapshot (the event log keeps it); what is kept of it
(`Ended`) goes to the `runs` topic in the same transaction and, once committed, to the run store
(`streams.run_store`), which answers any later input LATE.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from agentruns.streams.inputs import Batch, Ended, InputPath
from agentruns.streams.metrics import ProcessorStats

EVICT_PER_SEAL = 1000  # ended runs evicted (tombstoned) per transaction at most


class Evictor:
    """Per inbox partition, the ended runs due for eviction (a heap of (due at, run_id)) and
    the partition's event time; evicts from the run tables of `path`. The loop thread's."""

    def __init__(
        self,
        path: InputPath,
        state_topic: str,
        retention_ms: int | None,
        stats: ProcessorStats,
        *,
        per_seal: int = EVICT_PER_SEAL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._path = path
        self._state_topic = state_topic
        self.retention_ms = retention_ms  # None: never evicted
        self._stats = stats
        self._per_seal = per_seal
        self._clock = clock
        self.expiring: dict[int, list[tuple[int, str]]] = {}
        self.watermark: dict[int, int] = {}  # partition -> latest event time applied

    def reset(self, partition: int) -> None:
        """`partition` is restored: nothing of it is due, its event time starts over."""
        self.expiring[partition] = []
        self.watermark[partition] = 0

    def clear(self, partition: int) -> None:
        """`partition`'s runs are dropped (a snapshot this build cannot continue): none due."""
        self.expiring[partition] = []

    def drop(self, partition: int) -> None:
        """`partition` went to another member."""
        self.expiring.pop(partition, None)
        self.watermark.pop(partition, None)

    def saw(self, partition: int, at: int) -> None:
        """The partition's event time was at least `at`."""
        if at > self.watermark.get(partition, 0):
            self.watermark[partition] = at

    def track(self, partition: int, run_id: str, updated_at: int, *, terminal: bool) -> None:
        """Note the event time a run reached and, if it ended, when it may be evicted."""
        self.saw(partition, updated_at)
        retention = self.retention_ms
        if retention is not None and terminal:
            heap = self.expiring.setdefault(partition, [])
            heapq.heappush(heap, (updated_at + retention, run_id))

    def evict(self, batch: Batch) -> int:
        """Evict into `batch` the runs whose retention has passed (a tombstone on the state
        topic, an `EndedRun` on `runs`); how many. At most `per_seal` a seal keeps transactions
        small after a restore with many of them."""
        retention = self.retention_ms
        if retention is None:
            return 0
        now = int(self._clock() * 1000)
        path = self._path
        evicted = 0
        for partition, heap in self.expiring.items():
            horizon = min(self.watermark.get(partition, 0), now)
            runs = path.slots.get(partition, {})
            parked = path.parked.get(partition, {})
            while heap and heap[0][0] <= horizon and evicted < self._per_seal:
                _, run_id = heapq.heappop(heap)
                held = parked.get(run_id)
                if held is not None:
                    if held.updated_at + retention > horizon:
                        continue  # parked again since: pushed again with its new time
                    del parked[run_id]
                    ended = Ended(held.status, held.last_seq, held.updated_at, held.result_ref)
                else:
                    slot = runs.get(run_id)
                    if slot is None or slot.state is None or not slot.state.terminal:
                        continue
                    if slot.buffer or slot.updated_at + retention > horizon:
                        continue  # touched since: pushed again with its new time
                    del runs[run_id]  # decoded again for a late input, not parked since
                    state = slot.state
                    ended = Ended(
                        str(state.status), slot.last_seq, slot.updated_at, state.result_ref
                    )
                batch.records.append((self._state_topic, run_id.encode(), None, partition, None))
                path.keep_ended(partition, run_id, ended, batch)
                evicted += 1
        self._stats.evicted += evicted
        return evicted

    def held(self) -> int:
        """Runs held: in slots, and parked after their end."""
        path = self._path
        return sum(len(runs) for runs in path.slots.values()) + sum(
            len(runs) for runs in path.parked.values()
        )


__all__ = ["EVICT_PER_SEAL", "Evictor"]
