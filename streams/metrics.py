"""Processor metrics: plain counters for tests and logs, mirrored to Prometheus.

`agentruns processor --metrics-address HOST:PORT` serves them (`connectors/health.py`; every
metric is listed in docs/metrics.md).
Module-level collectors because Prometheus' registry is per process; several processors in one
process (monolith mode, tests) add into the same series.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge, Histogram

TRANSITIONS = Counter(
    "agentruns_transitions_total",
    "Inputs given to the core, by disposition (duplicates: agentruns_duplicate_inputs_total)",
    ["disposition"],
)
EFFECTS = Counter("agentruns_effects_total", "Effects produced")
DUPLICATES = Counter("agentruns_duplicate_inputs_total", "Exact duplicate inputs dropped")
BUFFERED = Counter("agentruns_buffered_inputs_total", "Inputs held for a seq gap")
DEAD_LETTERS = Counter("agentruns_dead_letters_total", "Inputs sent to the DLQ")
ABORTS = Counter("agentruns_transaction_aborts_total", "Transactions aborted and rewound")
RETRIES = Counter(
    "agentruns_transaction_retries_total", "Rewinds retried after a back-off (one per abort)"
)
ISOLATIONS = Counter(
    "agentruns_transaction_isolations_total",
    "Times a repeatedly failing batch was retried one input per transaction",
)
REFUSED = Counter(
    "agentruns_refused_inputs_total", "Inputs refused with InputRefused (their run failed)"
)
TOO_LARGE = Counter(
    "agentruns_record_too_large_total", "Inputs whose records were over the record size limit"
)
BATCH_INPUTS = Histogram(
    "agentruns_batch_inputs",
    "Inputs per committed transaction",
    buckets=(1, 5, 10, 50, 100, 250, 500, 1000, 2000, 5000),
)
COMMIT_SECONDS = Histogram(
    "agentruns_commit_seconds",
    "Time to commit one transaction (artifacts, snapshots, offsets, commit)",
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
COMMIT_STAGE_SECONDS = Histogram(
    "agentruns_commit_stage_seconds",
    "Time per commit stage: batch_open (first input to sealing), wait, seal, queued, produce,"
    " offsets, artifacts_wait, flush (records acknowledged), commit (EndTxn)",
    ["stage"],
    buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
EVICTED = Counter(
    "agentruns_evicted_runs_total", "Ended runs evicted from memory and the state topic"
)
ACTIVE_RUNS = Gauge("agentruns_active_runs", "Runs held in memory by this process")
STOPPED_PARTITIONS = Gauge(
    "agentruns_stopped_partitions",
    "1 per inbox partition whose processing stopped: a run or snapshot this build cannot"
    " continue (a newer version's); the reason is logged and in /healthz",
    ["partition"],
)


def partition_stopped(partition: int) -> None:
    STOPPED_PARTITIONS.labels(str(partition)).set(1)


def partition_resumed(partition: int) -> None:
    with contextlib.suppress(KeyError):  # KeyError: not reported as stopped
        STOPPED_PARTITIONS.remove(str(partition))


# ProcessorStats field -> the Prometheus counter that mirrors it
_MIRRORED: dict[str, Counter] = {
    "effects": EFFECTS,
    "duplicates": DUPLICATES,
    "buffered": BUFFERED,
    "dead_letters": DEAD_LETTERS,
    "aborts": ABORTS,
    "retries": RETRIES,
    "isolations": ISOLATIONS,
    "refused": REFUSED,
    "too_large": TOO_LARGE,
    "evicted": EVICTED,
}
# ProcessorStats field -> the `disposition` label: label values are lower case (docs/metrics.md)
_BY_DISPOSITION = {"applied": "applied", "late": "late", "rejected": "rejected"}


@dataclass
class ProcessorStats:
    """Plain counters, updated per input; Prometheus gets the deltas once per transaction.

    (A labelled Prometheus ``inc`` per input costs a lock and a label lookup on the hot path.)
    """

    applied: int = 0
    late: int = 0
    duplicates: int = 0
    rejected: int = 0
    effects: int = 0
    buffered: int = 0
    dead_letters: int = 0
    stale_timers: int = 0
    aborts: int = 0
    retries: int = 0
    isolations: int = 0
    refused: int = 0
    too_large: int = 0
    evicted: int = 0
    commits: int = 0
    inputs_committed: int = 0
    last_commit_s: float = 0.0
    _published: dict[str, int] = field(default_factory=dict, repr=False)

    def stage(self, name: str, seconds: float) -> None:
        """Time of one commit stage (the `agentruns_commit_stage_seconds` histogram)."""
        COMMIT_STAGE_SECONDS.labels(name).observe(seconds)

    def count(self, disposition: str, effects: int) -> None:
        self.effects += effects
        match disposition:
            case "APPLIED":
                self.applied += 1
            case "LATE":
                self.late += 1
            case "DUPLICATE":
                self.duplicates += 1
            case _:
                self.rejected += 1

    def counts(self) -> tuple[int, ...]:
        """The per-input counters, to be put back by `recount` when an input is rolled back."""
        return (
            self.applied,
            self.late,
            self.duplicates,
            self.rejected,
            self.effects,
            self.buffered,
            self.stale_timers,
        )

    def recount(self, counts: tuple[int, ...]) -> None:
        (
            self.applied,
            self.late,
            self.duplicates,
            self.rejected,
            self.effects,
            self.buffered,
            self.stale_timers,
        ) = counts

    def committed(self, inputs: int, seconds: float) -> None:
        """One transaction committed (the committer thread; `publish` is the loop's)."""
        self.commits += 1
        self.inputs_committed += inputs
        self.last_commit_s = seconds
        BATCH_INPUTS.observe(inputs)
        COMMIT_SECONDS.observe(seconds)

    def publish(self, active_runs: int | None = None) -> None:
        """Push what changed since the last call to the Prometheus collectors."""
        for name in (*_MIRRORED, *_BY_DISPOSITION):
            value = getattr(self, name)
            delta = value - self._published.get(name, 0)
            if delta > 0:
                if name in _MIRRORED:
                    _MIRRORED[name].inc(delta)
                else:
                    TRANSITIONS.labels(_BY_DISPOSITION[name]).inc(delta)
                self._published[name] = value
        if active_runs is not None:
            ACTIVE_RUNS.set(active_runs)
