"""Processor metrics: plain counters for tests and logs, mirrored to Prometheus.

`agentruns processor --metrics-port N` serves them (prometheus-client's own HTTP server).
Module-level collectors because Prometheus' registry is per process; several processors in one
process (monolith mode, tests) add into the same series.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

TRANSITIONS = Counter(
    "agentruns_transitions_total", "Inputs applied by the core, by disposition", ["disposition"]
)
EFFECTS = Counter("agentruns_effects_total", "Effects produced")
DUPLICATES = Counter("agentruns_duplicate_inputs_total", "Exact duplicate inputs dropped")
BUFFERED = Counter("agentruns_buffered_inputs_total", "Inputs held for a seq gap")
DEAD_LETTERS = Counter("agentruns_dead_letters_total", "Inputs sent to the DLQ")
ABORTS = Counter("agentruns_transaction_aborts_total", "Transactions aborted and rewound")
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
ACTIVE_RUNS = Gauge("agentruns_active_runs", "Runs held in memory by this process")


@dataclass
class ProcessorStats:
    applied: int = 0
    late: int = 0
    duplicates: int = 0
    rejected: int = 0
    effects: int = 0
    buffered: int = 0
    dead_letters: int = 0
    stale_timers: int = 0
    aborts: int = 0
    commits: int = 0
    inputs_committed: int = 0
    last_commit_s: float = 0.0

    def count(self, disposition: str, effects: int) -> None:
        TRANSITIONS.labels(str(disposition)).inc()
        EFFECTS.inc(effects)
        self.effects += effects
        match str(disposition):
            case "APPLIED":
                self.applied += 1
            case "LATE":
                self.late += 1
            case "DUPLICATE":
                self.duplicates += 1
            case _:
                self.rejected += 1

    def committed(self, inputs: int, seconds: float) -> None:
        self.commits += 1
        self.inputs_committed += inputs
        self.last_commit_s = seconds
        BATCH_INPUTS.observe(inputs)
        COMMIT_SECONDS.observe(seconds)
