"""The consumer lag read from librdkafka's statistics: the assigned partitions alone, their
lag from the service's position, and reports of any shape ignored without raising."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from agentruns.streams import consumer_lag
from agentruns.streams.consumer_lag import MAX_PARTITIONS, LagTracker, Position, StatsError, parse
from agentruns.streams.kafka_defaults import GROUP_CONSUMER_LOG_LEVEL, group_consumer


def _partition(number: int, **fields: Any) -> dict[str, Any]:
    entry = {
        "partition": number,
        "fetch_state": "active",
        "app_offset": 10,
        "committed_offset": 8,
        "next_offset": 12,
        "hi_offset": 40,
        "ls_offset": 30,
    }
    return {**entry, **fields}


_OFFSETS = ("app_offset", "committed_offset", "next_offset")


def _report(*partitions: dict[str, Any], topic: str = "p.inbox") -> str:
    entries = {str(p["partition"]): p for p in partitions}
    return json.dumps({"name": "rdkafka#consumer-1", "type": "consumer", "topics": {
        topic: {"topic": topic, "partitions": entries}
    }})  # fmt: skip


def test_the_lag_runs_from_the_services_position_to_the_last_stable_offset() -> None:
    assert parse(_report(_partition(0), _partition(1, app_offset=30))) == {
        ("p.inbox", 0): Position(offset=10, lag=20),
        ("p.inbox", 1): Position(offset=30, lag=0),
    }


def test_before_the_first_record_the_committed_offset_then_the_fetcher_position() -> None:
    report = _report(
        _partition(0, app_offset=-1001),
        _partition(1, app_offset=-1001, committed_offset=-1001),
        _partition(2, app_offset=-1001, committed_offset=-1001, next_offset=-1001),
    )
    assert parse(report) == {("p.inbox", 0): Position(8, 22), ("p.inbox", 1): Position(12, 18)}


def test_without_a_last_stable_offset_the_high_watermark() -> None:
    assert parse(_report(_partition(0, ls_offset=-1001))) == {("p.inbox", 0): Position(10, 30)}


def test_the_internal_partition_and_partitions_not_fetched_are_left_out() -> None:
    report = _report(
        _partition(-1),
        _partition(1, fetch_state="none"),
        _partition(2, fetch_state="stopped"),
        _partition(3, fetch_state="offset-query"),
    )
    assert parse(report) == {("p.inbox", 3): Position(10, 20)}


def test_a_position_past_the_end_is_no_negative_lag() -> None:
    assert parse(_report(_partition(0, app_offset=99))) == {("p.inbox", 0): Position(99, 0)}


@pytest.mark.parametrize(
    "report",
    [
        "",
        "not json",
        "[1, 2]",
        "null",
        '{"topics": []}',
        "[" * 100_000 + "]" * 100_000,
        "x" * (consumer_lag.MAX_STATS_CHARS + 1),
    ],
)
def test_a_report_of_another_shape_is_refused(report: str) -> None:
    with pytest.raises(StatsError):
        parse(report)


@pytest.mark.parametrize(
    "topics",
    [
        {"p.inbox": []},
        {"p.inbox": {"partitions": []}},
        {"p.inbox": {"partitions": {"0": "active"}}},
        {"p.inbox": {"partitions": {"0": _partition("0")}}},  # type: ignore[arg-type]
        {"p.inbox": {"partitions": {"0": _partition(True)}}},  # type: ignore[arg-type]
        {"p.inbox": {"partitions": {"0": _partition(1 << 40)}}},
        {"p.inbox": {"partitions": {"0": _partition(0, **dict.fromkeys(_OFFSETS, "10"))}}},
        {"p.inbox": {"partitions": {"0": _partition(0, **dict.fromkeys(_OFFSETS, 1.5))}}},
        {"p.inbox": {"partitions": {"0": _partition(0, **dict.fromkeys(_OFFSETS, None))}}},
        {"p.inbox": {"partitions": {"0": _partition(0, ls_offset=1 << 70, hi_offset=None)}}},
        {"p.inbox": {"partitions": {"0": _partition(0, fetch_state=["active"])}}},
        {"bad topic/\u00e9": {"partitions": {"0": _partition(0)}}},
        {"t" * 250: {"partitions": {"0": _partition(0)}}},
    ],
)
def test_malformed_entries_are_skipped(topics: dict[str, Any]) -> None:
    assert parse(json.dumps({"topics": topics})) == {}


def test_a_report_with_too_many_partitions_is_cut() -> None:
    many = {str(n): _partition(n) for n in range(MAX_PARTITIONS + 50)}
    report = json.dumps({"topics": {"p.inbox": {"partitions": many}}})
    assert len(parse(report)) == MAX_PARTITIONS


def _samples(group: str) -> dict[tuple[str, str, str], float]:
    return {
        (s.name, s.labels["topic"], s.labels["partition"]): s.value
        for family in REGISTRY.collect()
        if family.name in ("agentruns_consumer_lag", "agentruns_consumer_offset")
        for s in family.samples
        if s.labels["group"] == group
    }


def test_the_metrics_follow_the_latest_report_and_a_silent_tracker_goes() -> None:
    tracker = LagTracker("g-unit-follow")
    tracker.on_stats(_report(_partition(0), _partition(1)))
    assert _samples("g-unit-follow") == {
        ("agentruns_consumer_lag", "p.inbox", "0"): 20,
        ("agentruns_consumer_lag", "p.inbox", "1"): 20,
        ("agentruns_consumer_offset", "p.inbox", "0"): 10,
        ("agentruns_consumer_offset", "p.inbox", "1"): 10,
    }
    tracker.on_stats(_report(_partition(1, app_offset=25)))  # partition 0 revoked
    assert _samples("g-unit-follow") == {
        ("agentruns_consumer_lag", "p.inbox", "1"): 5,
        ("agentruns_consumer_offset", "p.inbox", "1"): 25,
    }
    tracker.on_stats("{broken")  # ignored: the last report stands
    assert len(_samples("g-unit-follow")) == 2
    at, _ = tracker.positions()
    assert tracker.positions(at + consumer_lag.STALE_AFTER_S + 1) == (at, {})
    del tracker  # its consumer is gone: so are its series
    assert _samples("g-unit-follow") == {}


def test_two_consumers_of_a_group_the_freshest_report_wins() -> None:
    old, new = LagTracker("g-unit-two"), LagTracker("g-unit-two")
    old.on_stats(_report(_partition(0, app_offset=1)))
    new.on_stats(_report(_partition(0, app_offset=7)))
    assert _samples("g-unit-two")[("agentruns_consumer_offset", "p.inbox", "0")] == 7
    old.on_stats(_report(_partition(0, app_offset=9)))
    assert _samples("g-unit-two")[("agentruns_consumer_offset", "p.inbox", "0")] == 9


def test_every_group_consumer_reports_its_statistics() -> None:
    settings = group_consumer("g-unit-settings")
    assert settings["log_level"] == GROUP_CONSUMER_LOG_LEVEL
    assert settings["statistics.interval.ms"] == consumer_lag.STATS_INTERVAL_MS
    settings["stats_cb"](_report(_partition(4)))
    assert _samples("g-unit-settings")[("agentruns_consumer_lag", "p.inbox", "4")] == 20


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=30,
)
_FIELDS = st.sampled_from(
    ["partition", "fetch_state", "app_offset", "committed_offset", "next_offset", "ls_offset"]
)


@given(
    st.dictionaries(
        st.text(max_size=12),
        st.dictionaries(
            st.just("partitions"),
            st.dictionaries(st.text(max_size=3), st.dictionaries(_FIELDS, _JSON) | _JSON),
        )
        | _JSON,
        max_size=3,
    )
)
def test_any_json_report_gives_positions_or_stats_error(topics: dict[str, Any]) -> None:
    try:
        found = parse(json.dumps({"topics": topics}))
    except StatsError:
        return
    assert all(p.lag >= 0 and p.offset >= 0 and n >= 0 for (_, n), p in found.items())
