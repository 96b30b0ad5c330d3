"""Consumer lag per group, topic and partition, from librdkafka's statistics.

Every long-lived group consumer of ours (the processor's, the executors', the timer service's,
the sink's) is made with `kafka_defaults.group_consumer`, which turns librdkafka's statistics on
(``statistics.interval.ms``) and hands them to a `LagTracker` of the consumer's group. Each
report replaces what the tracker knew, so a partition the consumer no longer owns (revoked, or
the consumer closed) leaves the metrics with the next report; a tracker that stopped reporting
(its consumer closed) is dropped after `STALE_AFTER_S`. The series are those of the partitions
the consumer is fetching: at most the topic's partitions per group, never per record or run.

- ``agentruns_consumer_lag``: records between the consumer's position (the next record the
  service is handed, librdkafka's ``app_offset``; before the first, the committed offset, and
  without one the fetcher's ``next_offset``) and
  the end of the partition (its last stable offset: our consumers read committed records only).
  The position is the service's, not the group's committed offset: the processor and the
  executors commit their offsets inside Kafka transactions, which librdkafka's consumer does not
  see. The Java client's ``records-lag`` is measured the same way.
- ``agentruns_consumer_offset``: that position. A partition whose position does not move while
  its lag is above 0 is stalled (the alert ``AgentrunsPartitionStalled``).

Statistics come from outside this process's control (a newer librdkafka, a broken build): a
report that is not what this module expects is ignored, with one debug line, never raised into
the consumer's poll.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import REGISTRY, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("agentruns.kafka.stats")

#: How often librdkafka reports (``statistics.interval.ms``): also how often it asks the brokers
#: for the partitions' ends.
STATS_INTERVAL_MS = 5000
#: A tracker that has not reported for this long belongs to a consumer that is gone.
STALE_AFTER_S = 3 * STATS_INTERVAL_MS / 1000
#: Reports longer than this are ignored (ours are a few KiB: a handful of topics).
MAX_STATS_CHARS = 8 << 20
#: Partitions one report may give (more are ignored: the metrics stay bounded).
MAX_PARTITIONS = 4096
#: librdkafka's fetch states of a partition it fetches for the application.
_FETCHING = frozenset({"active", "offset-query", "offset-wait"})
# Kafka's rule for topic names (and its length limit)
_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")
_MAX_OFFSET = 1 << 63


@dataclass(frozen=True)
class Position:
    """One partition as a report gives it: the consumer's position and the lag behind the end."""

    offset: int
    lag: int


class StatsError(ValueError):
    """A statistics report that is not what `parse` expects."""


def _offset(value: Any) -> int | None:
    """An offset field: an int in [0, 2^63), else None (librdkafka's -1001: unknown)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_OFFSET:
        return None
    return value


def _position(entry: dict[str, Any]) -> Position | None:
    state = entry.get("fetch_state")
    if not isinstance(state, str) or state not in _FETCHING:
        return None  # not fetched for the application: revoked, paused for good, or unknown
    end = _offset(entry.get("ls_offset"))
    if end is None:
        end = _offset(entry.get("hi_offset"))
    # handed to the service; else (nothing handed yet) committed; else (no commit either: an
    # empty partition, a new group) where the fetcher starts
    position = _offset(entry.get("app_offset"))
    if position is None:
        position = _offset(entry.get("committed_offset"))
    if position is None:
        position = _offset(entry.get("next_offset"))
    if end is None or position is None:
        return None
    return Position(position, max(0, end - position))


def parse(text: str | bytes) -> dict[tuple[str, int], Position]:
    """The partitions a consumer's statistics report fetches, by (topic, partition): those
    whose fetch state is active (or looking up its offset) and whose position and end are
    known. The internal partition -1 (unassigned records) is never one of them.

    Raises `StatsError` for a report that is not a JSON object of librdkafka's shape."""
    if len(text) > MAX_STATS_CHARS:
        raise StatsError(f"statistics report of {len(text)} characters")
    try:
        report = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise StatsError(f"statistics report is not JSON: {exc}") from None
    if not isinstance(report, dict):
        raise StatsError("statistics report is not an object")
    topics = report.get("topics", {})
    if not isinstance(topics, dict):
        raise StatsError("statistics report: topics is not an object")
    found: dict[tuple[str, int], Position] = {}
    for name, topic in topics.items():
        if not _TOPIC.fullmatch(name) or not isinstance(topic, dict):
            continue
        partitions = topic.get("partitions", {})
        if not isinstance(partitions, dict):
            continue
        for entry in partitions.values():
            if not isinstance(entry, dict):
                continue
            number = entry.get("partition")
            if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < 1 << 31:
                continue  # -1: librdkafka's internal partition of records without one
            position = _position(entry)
            if position is None:
                continue
            if len(found) >= MAX_PARTITIONS:
                return found
            found[(name, number)] = position
    return found


class LagTracker:
    """What the latest statistics report of one consumer of ``group`` said. Its `on_stats` is
    the consumer's ``stats_cb``."""

    def __init__(self, group: str) -> None:
        self.group = group
        self._lock = threading.Lock()
        self._positions: dict[tuple[str, int], Position] = {}
        self._at = 0.0
        _TRACKERS.add(self)

    def on_stats(self, text: str) -> None:
        """A report from librdkafka (called from the consumer's poll): never raises."""
        try:
            positions = parse(text)
        except StatsError as exc:
            log.debug("consumer statistics of group %s ignored: %s", self.group, exc)
            return
        with self._lock:
            self._positions = positions
            self._at = time.monotonic()

    def positions(self, now: float | None = None) -> tuple[float, dict[tuple[str, int], Position]]:
        """When the last report came (monotonic) and what it said; nothing once stale."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._positions or now - self._at > STALE_AFTER_S:
                return self._at, {}
            return self._at, dict(self._positions)


_TRACKERS: weakref.WeakSet[LagTracker] = weakref.WeakSet()


def lag_settings(group: str) -> dict[str, Any]:
    """The client settings that report a consumer of ``group``'s lag (`group_consumer`)."""
    return {"statistics.interval.ms": STATS_INTERVAL_MS, "stats_cb": LagTracker(group).on_stats}


class _LagCollector(Collector):
    """The trackers' latest reports at each scrape; the freshest when two consumers of one
    group report the same partition (a rebalance in between)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = time.monotonic()
        latest: dict[tuple[str, str, int], tuple[float, Position]] = {}
        for tracker in list(_TRACKERS):
            at, positions = tracker.positions(now)
            for (topic, partition), position in positions.items():
                key = (tracker.group, topic, partition)
                if key not in latest or latest[key][0] < at:
                    latest[key] = (at, position)
        labels = ["group", "topic", "partition"]
        lag = GaugeMetricFamily(
            "agentruns_consumer_lag",
            "Records between the consumer's position and the end (last stable offset) of each"
            " partition it fetches, from librdkafka's statistics",
            labels=labels,
        )
        offset = GaugeMetricFamily(
            "agentruns_consumer_offset",
            "The consumer's position (the next record handed to the service) per partition",
            labels=labels,
        )
        for (group, topic, partition), (_, position) in sorted(latest.items()):
            values = [group, topic, str(partition)]  # names, as configured
            lag.add_metric(values, position.lag)
            offset.add_metric(values, position.offset)
        yield lag
        yield offset

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


REGISTRY.register(_LagCollector())

__all__ = [
    "MAX_PARTITIONS",
    "STATS_INTERVAL_MS",
    "LagTracker",
    "Position",
    "StatsError",
    "lag_settings",
    "parse",
]
