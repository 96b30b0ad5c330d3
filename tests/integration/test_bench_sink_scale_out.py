"""The sink bench's scale-out phase runs: several `agentruns sink` processes in one group share
the partitions and project a backlog written in one transaction, each event exactly once."""

from __future__ import annotations

import psycopg

from agentruns.bench.sink import scale_out
from agentruns.connectors.postgres.migrate import migrate
from agentruns.streams.partitioning import partition_for


def test_two_sink_processes_project_a_backlog_exactly_once(
    kafka_bootstrap: str, database_url: str
) -> None:
    migrate(database_url)
    figures = scale_out(kafka_bootstrap, database_url, sinks=2, events=400, partitions=4)
    assert figures["sinks"] == 2 and figures["events_per_second"] > 0
    tag = figures["run_ids"].removesuffix("-a-*")
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT count(*), count(DISTINCT (run_id, seq)) FROM events WHERE run_id LIKE %s",
            (f"{tag}-a-%",),
        ).fetchone()
        owners = conn.execute(
            "SELECT DISTINCT partition FROM sink_offsets WHERE consumer = %s AND topic LIKE %s",
            (f"bench-sink-{tag}-sink", "%.events"),
        ).fetchall()
        runs = conn.execute(
            "SELECT DISTINCT run_id FROM events WHERE run_id LIKE %s", (f"{tag}-a-%",)
        ).fetchall()
    assert row is not None
    total, distinct = row
    assert total == distinct == figures["events"]  # every event of the backlog, once
    # offsets of every partition that holds events kept in Postgres, next to the rows (the
    # run ids are random: a partition without a run, ~0.4% of the time, has none)
    held = {partition_for(run_id, 4) for (run_id,) in runs}
    assert {p for (p,) in owners} == held and len(held) >= 2
