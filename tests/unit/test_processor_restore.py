"""The processor's restore (`streams.restore.Restorer`) without a broker: the state and `runs`
topics are in memory (`tests.support.memory_kafka`), read through the reader the clients
factory hands out, into a real `InputPath`, `Evictor` and run store."""

from __future__ import annotations

from typing import Any

import pytest

from agentruns.processors.events import CancelRequested, GoalChanged
from agentruns.streams.codec import encode
from agentruns.streams.errors import AgentrunsKafkaError
from agentruns.streams.eviction import Evictor
from agentruns.streams.inputs import Batch, Ended, InputPath
from agentruns.streams.records import ended_run_record
from agentruns.streams.restore import Restorer
from agentruns.streams.run_store import RunStore
from tests.support.memory_kafka import MemoryClients, MemoryCluster
from tests.unit.test_processor_inputs import AT, TOPICS, new_path, of_event, submit

RETENTION_MS = 60_000


def snapshots(*steps: tuple[str, str]) -> list[tuple[str, bytes]]:
    """(run_id, snapshot) after each step, a step being (run_id, "submit" | "goal" | "cancel"),
    applied in order by a real input path: the snapshots a processor would have written."""
    path, batch = new_path(), Batch()
    out: list[tuple[str, bytes]] = []
    for offset, (run_id, what) in enumerate(steps):
        if what == "submit":
            event: Any = submit(run_id)
        elif what == "goal":
            event = GoalChanged(
                run_id=run_id, event_id=f"g{offset}", at=AT + offset, trace_id="t", step=1, goal="g"
            )
        else:
            event = CancelRequested(
                run_id=run_id, event_id=f"c{offset}", at=AT + offset, trace_id="t"
            )
        path.handle(of_event(event, offset), batch)
        slot = path.slots[0][run_id]
        out.append((run_id, encode("Snapshot", slot.to_record())))
    return out


class Rig:
    """A restorer over a memory cluster, with the path and evictor it fills."""

    def __init__(self, *, patience_s: float = 5.0) -> None:
        self.cluster = MemoryCluster()
        self.clients = MemoryClients(self.cluster)
        self.path: InputPath = new_path()
        self.evictor = Evictor(self.path, TOPICS.state, RETENTION_MS, self.path.stats)
        self.restorer = Restorer(
            self.clients,
            self.path,
            self.evictor,
            state_topic=TOPICS.state,
            runs_topic=TOPICS.runs,
            patience_s=patience_s,
        )
        self.store = RunStore(None)

    def state(self, partition: int, run_id: str, value: bytes | None, at: int = AT) -> None:
        self.cluster.append(TOPICS.state, partition, run_id.encode(), value, at)

    def ended_run(self, partition: int, run_id: str, ended: Ended) -> None:
        value = encode("EndedRun", ended_run_record(run_id, ended))
        self.cluster.append(TOPICS.runs, partition, run_id.encode(), value)

    def restore(self, partitions: set[int]) -> int:
        return self.restorer.restore(partitions, self.store)


def test_a_restore_holds_the_latest_snapshot_of_each_run_of_several_partitions() -> None:
    rig = Rig()
    made = dict.fromkeys(["r1", "r2", "r3", "r4"], b"")
    history = snapshots(
        ("r1", "submit"),
        ("r1", "goal"),  # r1's second snapshot: the one restored
        ("r2", "submit"),
        ("r2", "cancel"),  # r2 ended: held as its snapshot
        ("r3", "submit"),
        ("r4", "submit"),
    )
    first_r1 = history[0][1]
    for run_id, value in history:
        made[run_id] = value
    # partition 0: r1 twice, r2 ended; partition 1: r3 then its tombstone, r4; partition 2: none
    rig.state(0, "r1", first_r1)
    rig.state(0, "r1", made["r1"])
    rig.state(0, "r2", made["r2"])
    rig.state(1, "r3", made["r3"])
    evicted_at = AT + 5 * RETENTION_MS
    rig.state(1, "r3", None, at=evicted_at)
    rig.state(1, "r4", made["r4"])
    rig.ended_run(1, "r3", Ended("CANCELLED", 4, AT, None))

    held = rig.restore({0, 1, 2})

    path = rig.path
    assert held == 3
    assert set(path.slots[0]) == {"r1"} and path.slots[0]["r1"].last_seq == 2
    assert set(path.parked[0]) == {"r2"}
    parked = path.parked[0]["r2"]
    assert parked.status == "CANCELLED" and parked.last_seq == 2 and parked.value == made["r2"]
    assert set(path.slots[1]) == {"r4"} and path.parked[1] == {}
    assert path.slots[2] == {} and path.parked[2] == {} and path.stopped == {}
    # the tombstone: r3 is not held, its end is in the store, its time is the partition's
    assert rig.store.get(1, "r3") == Ended("CANCELLED", 4, AT, None)
    assert rig.store.checkpoint(1) == 1 and rig.store.checkpoint(0) == 0
    assert rig.evictor.watermark[1] == evicted_at
    # only the ended run is due for eviction, a retention after its last `at`
    assert rig.evictor.expiring[0] == [(parked.updated_at + RETENTION_MS, "r2")]
    assert rig.evictor.expiring[1] == [] and rig.evictor.expiring[2] == []
    (reader,) = rig.clients.readers
    assert reader.closed


def test_a_restore_reads_each_partition_to_its_end_and_no_further() -> None:
    rig = Rig()
    many = snapshots(*[(f"r{n}", "submit") for n in range(2500)])
    for run_id, value in many:  # more than one consume call takes
        rig.state(0, run_id, value)
    for n in range(3):
        rig.ended_run(0, f"e{n}", Ended("COMPLETED", 3, AT, None))

    assert rig.restore({0, 1}) == 2500

    (reader,) = rig.clients.readers
    ends = {
        (TOPICS.state, 0): 2500,
        (TOPICS.state, 1): 0,
        (TOPICS.runs, 0): 3,
        (TOPICS.runs, 1): 0,
    }
    assert reader.ends == ends and reader.positions == ends and reader.closed
    assert rig.store.checkpoint(0) == 3 and rig.store.count(0) == 3
    # A record written after the restore is not held; the next restore reads `runs` from the
    # store's checkpoint on, and the state topic again from the start.
    rig.ended_run(0, "e3", Ended("COMPLETED", 3, AT, None))
    rig.state(1, "late", many[0][1])
    assert "late" not in rig.path.slots[1]
    assert rig.restore({0}) == 2500
    second = rig.clients.readers[1]
    assert second.ends == {(TOPICS.state, 0): 2500, (TOPICS.runs, 0): 4}
    assert rig.store.checkpoint(0) == 4 and rig.store.get(0, "e3") is not None


def test_a_store_checkpoint_outside_the_topic_is_read_again_from_the_start() -> None:
    rig = Rig()
    rig.ended_run(0, "e0", Ended("COMPLETED", 3, AT, None))
    rig.store.put([(0, "gone", Ended("FAILED", 9, AT, None))], {0: 50})  # of a recreated topic
    rig.restore({0})
    assert rig.store.get(0, "gone") is None  # reset: the topic is the truth
    assert rig.store.get(0, "e0") == Ended("COMPLETED", 3, AT, None)
    assert rig.store.checkpoint(0) == 1
    assert rig.clients.readers[0].ends[(TOPICS.runs, 0)] == 1


def test_a_partition_that_never_reaches_its_end_fails_the_restore_with_its_name() -> None:
    rig = Rig(patience_s=0.3)
    rig.clients.never_ends = frozenset({(TOPICS.state, 1)})
    with pytest.raises(
        AgentrunsKafkaError, match=r"restoring t\.state partitions \[\('t\.state', 1\)\]"
    ):
        rig.restore({0, 1})
    assert rig.clients.readers[0].closed


def test_a_snapshot_this_build_cannot_read_stops_its_partition_and_not_the_others() -> None:
    rig = Rig()
    (_, r1), _, (_, r3) = snapshots(("r1", "submit"), ("r2", "submit"), ("r2", "cancel"))
    rig.state(0, "r1", r1)
    rig.state(1, "r2", r3)  # an ended run, parked, then a snapshot that cannot be read
    rig.state(1, "bad", b"\x00 not a snapshot")

    assert rig.restore({0, 1}) == 1

    assert set(rig.path.slots[0]) == {"r1"}
    assert rig.path.slots[1] == {} and rig.path.parked[1] == {}
    assert set(rig.path.stopped) == {1}
    assert rig.path.stopped[1].startswith("a snapshot this build cannot continue")
    assert rig.evictor.expiring[1] == []  # nothing of the stopped partition is evicted
    # restored again (a new build, the record compacted away): it goes on
    rig.cluster.logs[(TOPICS.state, 1)].pop()
    assert rig.restore({1}) == 1 and rig.path.stopped == {} and "r2" in rig.path.parked[1]
