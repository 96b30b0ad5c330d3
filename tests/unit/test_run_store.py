"""The processor's store of ended runs: lookups, checkpoints, and updates that only move a
run's last seq forward, whatever the order writers apply them in."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from agentruns.streams.run_store import RunStore
from agentruns.streams.sequencing import Ended


def test_a_stored_run_is_found_by_partition_and_id(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db", "topic-a")
    store.put([(2, "r1", Ended("SUCCEEDED", 9, 1_700, "sha256:x"))], {2: 15})
    assert store.get(2, "r1") == Ended("SUCCEEDED", 9, 1_700, "sha256:x")
    assert store.get(1, "r1") is None and store.get(2, "r2") is None
    assert store.checkpoint(2) == 15 and store.checkpoint(0) == 0
    store.close()
    reopened = RunStore(tmp_path / "runs.db", "topic-a")
    assert reopened.get(2, "r1") == Ended("SUCCEEDED", 9, 1_700, "sha256:x")
    assert reopened.count() == 1 and reopened.checkpoint(2) == 15


def test_a_store_kept_for_another_topic_of_the_same_name_starts_empty(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs.db", "topic-a")
    store.put([(0, "r1", Ended("FAILED", 3))], {0: 4})
    store.close()
    other = RunStore(tmp_path / "runs.db", "topic-b")  # the topic was recreated
    assert other.get(0, "r1") is None and other.checkpoint(0) == 0 and other.count() == 0


def test_a_damaged_file_is_moved_aside_and_a_new_store_made(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    path.write_bytes(b"not a database, " * 512)
    store = RunStore.opened(path, "t")
    assert store.count() == 0 and store.checkpoint(0) == 0
    store.put([(0, "r1", Ended("FAILED", 2))], {0: 3})
    assert store.get(0, "r1") == Ended("FAILED", 2)
    assert [p.name.startswith("runs.db.damaged-") for p in tmp_path.iterdir()].count(True) == 1


def test_an_older_update_never_undoes_a_newer_one_and_checkpoints_only_advance() -> None:
    store = RunStore(None)
    store.put([(0, "r1", Ended("SUCCEEDED", 8))], {0: 20})
    store.put([(0, "r1", Ended("SUCCEEDED", 6))], {0: 12})  # a late writer sharing the file
    assert store.get(0, "r1") == Ended("SUCCEEDED", 8) and store.checkpoint(0) == 20


def test_a_partition_reset_forgets_it_alone() -> None:
    store = RunStore(None)
    store.put([(0, "a", Ended("SUCCEEDED", 2)), (1, "b", Ended("FAILED", 4))], {0: 3, 1: 5})
    store.reset(0)
    assert store.get(0, "a") is None and store.checkpoint(0) == 0
    assert store.get(1, "b") == Ended("FAILED", 4) and store.count(1) == 1


def test_two_connections_to_one_file_see_each_others_runs(tmp_path: Path) -> None:
    """Processors of one group on one host share the file."""
    first, second = RunStore(tmp_path / "r.db", "t"), RunStore(tmp_path / "r.db", "t")
    first.put([(0, "r1", Ended("SUCCEEDED", 3))], {0: 1})
    assert second.get(0, "r1") == Ended("SUCCEEDED", 3)
    second.put([(0, "r1", Ended("SUCCEEDED", 4))], {0: 2})
    assert first.get(0, "r1") == Ended("SUCCEEDED", 4)


@given(st.permutations(list(range(1, 12))))
def test_updates_in_any_order_leave_the_highest_last_seq(order: list[int]) -> None:
    store = RunStore(None)
    for seq in order:
        store.put([(0, "r", Ended("SUCCEEDED", seq, seq))], {0: seq})
    assert store.get(0, "r") == Ended("SUCCEEDED", 11, 11) and store.checkpoint(0) == 11
