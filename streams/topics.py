"""The single source of truth for agentruns topic names and configs.

A plain data module: :func:`topic_specs` returns one :class:`TopicSpec` per topic, and
``TopicSpec.kafka_configs()`` is the exact config map to create it with (e.g. as
``NewTopic(spec.name(prefix), spec.partitions, spec.replication_factor,
config=spec.kafka_configs())``). Nothing here talks to a broker.

inbox, events, state and runs are co-partitioned (same partition count, same run_id → partition
function, :func:`agentruns.streams.partitioning.partition_for`); the other topics use the same
count so
one number sizes the deployment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "CO_PARTITIONED",
    "DEAD_LETTER",
    "DEFAULT_PARTITIONS",
    "DEFAULT_PREFIX",
    "DLQ",
    "EFFECT_KINDS",
    "EVENTS",
    "INBOX",
    "RESULTS",
    "RUNS",
    "STATE",
    "TopicNames",
    "TopicSpec",
    "effect_suffix",
    "min_insync_replicas_for",
    "topic_name",
    "topic_specs",
]

DEFAULT_PREFIX = "agentruns"


def default_prefix() -> str:
    """The topic prefix a command uses when given none: $AGENTRUNS_TOPIC_PREFIX, else
    DEFAULT_PREFIX."""
    return os.environ.get("AGENTRUNS_TOPIC_PREFIX") or DEFAULT_PREFIX


DEFAULT_PARTITIONS = 6

INBOX = "inbox"
EVENTS = "events"
STATE = "state"
RUNS = "runs"
RESULTS = "results"
DLQ = "dlq"
DEAD_LETTER = DLQ
EFFECT_KINDS: tuple[str, ...] = ("model", "tool", "timer")
#: Topics whose partitions must line up one to one (same count, same partition function).
CO_PARTITIONED: tuple[str, ...] = (INBOX, EVENTS, STATE, RUNS)

_HOUR_MS = 3_600_000
_DAY_MS = 24 * _HOUR_MS
_INFINITE = -1


def effect_suffix(kind: str) -> str:
    """``effects.<kind>``; raises ValueError for a kind not in EFFECT_KINDS."""
    if kind not in EFFECT_KINDS:
        raise ValueError(f"unknown effect kind {kind!r}; known: {EFFECT_KINDS}")
    return f"effects.{kind}"


def topic_name(suffix: str, prefix: str = DEFAULT_PREFIX) -> str:
    """``<prefix>.<suffix>``, or just the suffix when the prefix is empty."""
    return f"{prefix}.{suffix}" if prefix else suffix


def min_insync_replicas_for(replication_factor: int) -> int:
    """2 when there are at least 3 replicas (tolerates one broker down), else 1."""
    return 2 if replication_factor >= 3 else 1


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """One topic: its name suffix, sizing, the configs it is created with, what it carries."""

    suffix: str
    partitions: int
    replication_factor: int
    cleanup_policy: str  # "delete" or "compact"
    retention_ms: int  # -1: never deleted by time
    min_insync_replicas: int
    value_record: str  # short Avro record name of the values (see schemas/)
    key_format: str  # human-readable description of the record key
    purpose: str
    configs: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({}), hash=False, compare=True
    )

    def name(self, prefix: str = DEFAULT_PREFIX) -> str:
        return topic_name(self.suffix, prefix)

    def kafka_configs(self) -> dict[str, str]:
        """The full topic config map (Kafka names, string values)."""
        return {
            "cleanup.policy": self.cleanup_policy,
            "retention.ms": str(self.retention_ms),
            "min.insync.replicas": str(self.min_insync_replicas),
            **self.configs,
        }


def topic_specs(
    prefix: str = DEFAULT_PREFIX,
    partitions: int = DEFAULT_PARTITIONS,
    replication_factor: int = 1,
) -> list[TopicSpec]:
    """Every agentruns topic. ``prefix`` does not change the specs, only ``spec.name(prefix)``;
    it is accepted here so callers can validate it in one place."""
    if partitions <= 0:
        raise ValueError(f"partitions must be positive, got {partitions}")
    if replication_factor <= 0:
        raise ValueError(f"replication_factor must be positive, got {replication_factor}")
    if prefix and (prefix.startswith(".") or prefix.endswith(".")):
        raise ValueError(f"prefix must not start or end with '.': {prefix!r}")
    isr = min_insync_replicas_for(replication_factor)

    def spec(
        suffix: str,
        policy: str,
        retention_ms: int,
        record: str,
        key: str,
        purpose: str,
        configs: Mapping[str, str] | None = None,
    ) -> TopicSpec:
        return TopicSpec(
            suffix=suffix,
            partitions=partitions,
            replication_factor=replication_factor,
            cleanup_policy=policy,
            retention_ms=retention_ms,
            min_insync_replicas=isr,
            value_record=record,
            key_format=key,
            purpose=purpose,
            configs=MappingProxyType(dict(configs or {})),
        )

    events_configs = {
        # Keep the log whole: no size-based deletion either.
        "retention.bytes": "-1",
        # Leave fresh records alone for an hour so tailing readers see every write.
        "min.compaction.lag.ms": str(_HOUR_MS),
        # Tombstones (none are written today) stay visible for a day.
        "delete.retention.ms": str(_DAY_MS),
    }
    latest_per_key_configs = {
        "retention.bytes": "-1",
        "min.compaction.lag.ms": "0",
        "delete.retention.ms": str(_DAY_MS),
    }
    specs = [
        spec(
            INBOX,
            "delete",
            7 * _DAY_MS,
            "Input",
            "run_id (UTF-8)",
            "inputs from outside the processor: tasks, replies, cancels, executor results",
        ),
        spec(
            EVENTS,
            "compact",
            _INFINITE,
            "Event",
            'run_id + ":" + seq zero-padded to 20 digits (UTF-8); explicit partition',
            "the canonical run log: every accepted event, gapless per-run seq, kept forever",
            events_configs,
        ),
        spec(
            STATE,
            "compact",
            _INFINITE,
            "Snapshot",
            "run_id (UTF-8); explicit partition",
            "latest snapshot per run: state, last seq, out-of-order buffer, producer marks",
            {
                **latest_per_key_configs,
                # Roll segments hourly so superseded snapshots become compactable soon.
                "segment.ms": str(_HOUR_MS),
                "min.cleanable.dirty.ratio": "0.1",
            },
        ),
        spec(
            RUNS,
            "compact",
            _INFINITE,
            "EndedRun",
            "run_id (UTF-8); explicit partition",
            "every run evicted after its end: status, last seq, result ref; its id stays taken",
            latest_per_key_configs,
        ),
        *(
            spec(
                effect_suffix(kind),
                "delete",
                7 * _DAY_MS,
                "Effect",
                "run_id (UTF-8)",
                f"{kind} effect requests for the {kind} executors",
            )
            for kind in EFFECT_KINDS
        ),
        spec(
            RESULTS,
            "compact",
            _INFINITE,
            "Result",
            "run_id (UTF-8)",
            "terminal outcome per run (latest version kept)",
            latest_per_key_configs,
        ),
        spec(
            DLQ,
            "delete",
            30 * _DAY_MS,
            "DeadLetter",
            "the original record's key bytes (may be null)",
            "rejected records with original bytes, headers, reason and source position",
        ),
    ]
    return specs


@dataclass(frozen=True, slots=True)
class TopicNames:
    """Resolved topic names for one prefix, for code that produces or subscribes."""

    inbox: str
    events: str
    state: str
    runs: str
    results: str
    dlq: str
    effects: Mapping[str, str] = field(hash=False)

    @classmethod
    def for_prefix(cls, prefix: str = DEFAULT_PREFIX) -> TopicNames:
        return cls(
            inbox=topic_name(INBOX, prefix),
            events=topic_name(EVENTS, prefix),
            state=topic_name(STATE, prefix),
            runs=topic_name(RUNS, prefix),
            results=topic_name(RESULTS, prefix),
            dlq=topic_name(DLQ, prefix),
            effects=MappingProxyType(
                {kind: topic_name(effect_suffix(kind), prefix) for kind in EFFECT_KINDS}
            ),
        )

    def outputs(self) -> list[str]:
        """The topics a processor writes."""
        return [self.events, self.state, self.runs, self.results, self.dlq, *self.effects.values()]

    def effect(self, kind: str) -> str:
        """The effect topic for ``kind``; raises KeyError for an unknown kind."""
        return self.effects[kind]

    def all(self) -> tuple[str, ...]:
        return (
            self.inbox,
            self.events,
            self.state,
            self.runs,
            *self.effects.values(),
            self.results,
            self.dlq,
        )
