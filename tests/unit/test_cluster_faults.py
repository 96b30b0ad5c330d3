"""The pure parts of the cluster faults: where a transactional id's coordinator is, how long a
fault stalled the log, the summary's percentiles."""

from __future__ import annotations

from agentruns.connectors.dev.demo.cluster_faults import (
    STALL_HORIZON_S,
    ProgressWatch,
    java_string_hash,
    percentiles,
    transaction_state_partition,
)


def test_java_string_hash_matches_the_jvm() -> None:
    # values of String.hashCode() on a JVM
    assert java_string_hash("") == 0
    assert java_string_hash("a") == 97
    assert java_string_hash("hello") == 99162322
    assert java_string_hash("polygenelubricants") == -(1 << 31)


def test_transaction_state_partition_is_the_brokers() -> None:
    # Utils.abs(Integer.MIN_VALUE) is 0 on the broker, not a negative number
    assert transaction_state_partition("polygenelubricants", 8) == 0
    assert transaction_state_partition("hello", 8) == 99162322 % 8
    assert all(0 <= transaction_state_partition(f"p-{i}-a", 50) < 50 for i in range(100))


def _watch(arrivals: list[float]) -> ProgressWatch:
    watch = ProgressWatch.__new__(ProgressWatch)  # no consumer: only the arrivals are read
    watch.arrivals = arrivals
    return watch


def test_stall_counts_the_gap_from_the_fault_to_the_first_record() -> None:
    watch = _watch([1.0, 2.0, 10.0, 10.5, 11.0])
    assert watch.stall(began=3.0, ended=5.0) == 7.0  # 3 -> 10
    assert watch.stall(began=1.5, ended=1.6) == 8.0  # 2 -> 10 is the longest gap


def test_stall_without_a_record_after_the_window_is_not_counted() -> None:
    # the pipeline had nothing left to do: no record came after the window
    assert _watch([1.0, 2.0]).stall(began=2.5, ended=3.0) == 0.0
    # a record long after: the gap counts up to the window's end
    far = 3.0 + STALL_HORIZON_S + 100
    assert _watch([1.0, far]).stall(began=2.5, ended=3.0) == STALL_HORIZON_S + 0.5


def test_percentiles() -> None:
    assert percentiles([]) == {}
    assert percentiles([3.0, 1.0, 2.0]) == {"p50": 2.0, "max": 3.0}
    assert percentiles([1.0, 4.0]) == {"p50": 1.0, "max": 4.0}
