"""Run logs for the sink and audit tests: scripted runs folded through the real core and
written as Event/Snapshot/Result records in Kafka transactions, as the processor writes them."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg

from agentruns.connectors.dev.servers.log_writer import LogWriter
from agentruns.connectors.dev.servers.workload import interleave, simulate
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.connectors.projection.sink import Sink, SinkConfig
from agentruns.processors.events import Event
from agentruns.streams.admin import ensure_topics
from tests.support.pipeline import running_on_thread

PARTITIONS = 3


def scripted_runs(tag: str, count: int, seed: int = 5) -> list[list[Event]]:
    """`count` short runs; every third one with chaos (duplicates, cancels, stale results...)."""
    rng = random.Random(seed)
    return [
        simulate(
            rng,
            f"{tag}-{i:04d}",
            steps=rng.randint(1, 4),
            chaos=0.15 if i % 3 == 0 else 0.0,
            faults=0.2,
        )
        for i in range(count)
    ]


def new_log(bootstrap: str, store: PostgresArtifactStore | None, prefix: str) -> LogWriter:
    """A writer on fresh topics; with `store`, artifacts are written before each commit (R2)."""
    ensure_topics(bootstrap, prefix=prefix, partitions=PARTITIONS)
    return LogWriter(
        bootstrap,
        prefix,
        PARTITIONS,
        write_artifacts=None if store is None else store.put_many,
    )


def write_runs(
    writer: LogWriter, runs: Sequence[Sequence[Event]], *, per_transaction: int = 150, seed: int = 1
) -> list[tuple[str, int]]:
    """Interleave the runs and write them; returns every (run_id, seq) written."""
    events = interleave(runs, random.Random(seed))
    keys: list[tuple[str, int]] = []
    for start in range(0, len(events), per_transaction):
        records = writer.plan(events[start : start + per_transaction])
        keys.extend(writer.planned)
        writer.send(records)
    return keys


def projected_events(database_url: str, tag: str) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM events WHERE run_id LIKE %s", (f"{tag}-%",)
        ).fetchone()
    assert row is not None
    return int(row[0])


@contextmanager
def running_sink(bootstrap: str, database_url: str, prefix: str, **options: Any) -> Iterator[Sink]:
    sink = Sink(
        SinkConfig(
            bootstrap=bootstrap,
            database_url=database_url,
            prefix=prefix,
            **{"group_id": f"{prefix}-sink", "assign": "all", **options},
        )
    )
    with running_on_thread(sink.run, "sink"):
        yield sink
