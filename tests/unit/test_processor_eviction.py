"""Eviction after the end (`streams.eviction.Evictor`) on a real input path, no broker: ended
runs past their retention leave memory with a tombstone and an `EndedRun`, a bounded number per
seal; live runs, runs not yet due and runs touched since stay."""

from __future__ import annotations

from agentruns.processors.events import CancelRequested
from agentruns.streams.codec import decode
from agentruns.streams.eviction import Evictor
from agentruns.streams.inputs import Batch, Ended, InputPath
from agentruns.streams.records import Parked
from tests.unit.test_processor_inputs import AT, TOPICS, new_path, of_event, submit

RETENTION_MS = 1000
NOW = (AT + 10 * RETENTION_MS) / 1000  # the wall clock, past every retention here


def ended_runs(path: InputPath, run_ids: list[str], *, at: int = AT) -> None:
    """Submit and cancel each run on partition 0, then park it as the processor's seal does."""
    batch = Batch()
    for n, run_id in enumerate(run_ids):
        path.handle(of_event(submit(run_id), 2 * n), batch)
        cancel = CancelRequested(run_id=run_id, event_id=f"c{n}", at=at, trace_id="t")
        path.handle(of_event(cancel, 2 * n + 1), batch)
        slot = path.slots[0][run_id]
        assert slot.state is not None and slot.state.terminal
        path.park(0, run_id, Parked(b"snapshot", "CANCELLED", slot.last_seq, at))


def evictor(path: InputPath, retention_ms: int | None = RETENTION_MS, **kw: int) -> Evictor:
    return Evictor(path, TOPICS.state, retention_ms, path.stats, clock=lambda: NOW, **kw)


def tombstones(batch: Batch) -> list[str]:
    return [r[1].decode() for r in batch.records if r[0] == TOPICS.state and r[2] is None and r[1]]


def test_ended_runs_past_the_retention_are_evicted_a_bounded_number_per_seal() -> None:
    path = new_path()
    runs = [f"e{n}" for n in range(5)]
    ended_runs(path, runs)
    path.handle(of_event(submit("live"), 100), Batch())
    ev = evictor(path, per_seal=2)
    for run_id in runs:
        ev.track(0, run_id, AT, terminal=True)
    ev.track(0, "live", AT, terminal=False)
    ev.saw(0, AT + 2 * RETENTION_MS)  # the partition's event time is past every retention

    seals = []
    for _ in range(4):
        batch = Batch()
        assert ev.evict(batch) == len(tombstones(batch))
        seals.append(tombstones(batch))

    assert [len(s) for s in seals] == [2, 2, 1, 0]
    assert sorted(r for s in seals for r in s) == runs
    assert path.parked[0] == {} and set(path.slots[0]) == {"live"}
    assert path.stats.evicted == 5
    # what is kept of each: in the path until the store has it, and on `runs` in its batch
    assert path.ended[0]["e0"] == Ended("CANCELLED", 2, AT, None)
    # each seal's batch carries the EndedRun records of the runs it evicted
    batch = Batch()
    ended_runs(path, ["e5"])
    ev.track(0, "e5", AT, terminal=True)
    ev.evict(batch)
    (kept,) = [decode(r[2], "EndedRun").record for r in batch.records if r[0] == TOPICS.runs]
    assert kept["run_id"] == "e5" and kept["last_seq"] == 2 and kept["status"] == "CANCELLED"


def test_a_run_is_kept_until_its_partitions_event_time_passes_its_retention() -> None:
    path = new_path()
    ended_runs(path, ["e0"])
    ev = evictor(path)
    ev.track(0, "e0", AT, terminal=True)
    ev.saw(0, AT + RETENTION_MS - 1)
    assert ev.evict(Batch()) == 0 and "e0" in path.parked[0]
    ev.saw(0, AT + RETENTION_MS)
    assert ev.evict(Batch()) == 1 and "e0" not in path.parked[0]


def test_a_run_touched_since_it_was_tracked_is_evicted_only_after_its_new_time() -> None:
    path = new_path()
    ended_runs(path, ["e0"])
    ev = evictor(path)
    ev.track(0, "e0", AT, terminal=True)
    later = AT + RETENTION_MS
    path.park(0, "e0", Parked(b"snapshot", "CANCELLED", 3, later))  # a late input since
    ev.track(0, "e0", later, terminal=True)
    ev.saw(0, later + 1)
    assert ev.evict(Batch()) == 0 and "e0" in path.parked[0]  # its first entry is stale
    ev.saw(0, later + RETENTION_MS)
    batch = Batch()
    assert ev.evict(batch) == 1 and tombstones(batch) == ["e0"]
    assert path.ended[0]["e0"].last_seq == 3


def test_without_a_retention_nothing_is_tracked_or_evicted() -> None:
    path = new_path()
    ended_runs(path, ["e0"])
    ev = evictor(path, retention_ms=None)
    ev.track(0, "e0", AT, terminal=True)
    ev.saw(0, AT + 100 * RETENTION_MS)
    assert ev.expiring == {} and ev.evict(Batch()) == 0 and "e0" in path.parked[0]
    assert ev.held() == 1


def test_the_wall_clock_bounds_the_partitions_event_time() -> None:
    """An input stamped far in the future evicts nothing before the clock gets there."""
    path = new_path()
    ended_runs(path, ["e0"])
    ev = Evictor(path, TOPICS.state, RETENTION_MS, path.stats, clock=lambda: AT / 1000)
    ev.track(0, "e0", AT, terminal=True)
    ev.saw(0, AT + 100 * RETENTION_MS)
    assert ev.evict(Batch()) == 0 and "e0" in path.parked[0]
