"""The projection's SQL: one bulk upsert per table (`Table`, written with
`agentruns.connectors.postgres.bulk.write_rows`), each guarded by seq or version so a row never
moves backwards (a dead letter by its source position, so it is written once), and the sink's
own offsets (`sink_offsets`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import psycopg

from agentruns.connectors.postgres.bulk import Table
from agentruns.connectors.projection.rows import (
    DEAD_LETTER_COLUMNS,
    EVENT_COLUMNS,
    OP_COLUMNS,
    QUESTION_COLUMNS,
    RESULT_COLUMNS,
    RUN_COLUMNS,
    RUN_TIME_COLUMNS,
    SNAPSHOT_COLUMNS,
)

Conn = psycopg.Connection[tuple[Any, ...]]


def _set(columns: Iterable[str], skip: Iterable[str] = ()) -> str:
    skipped = set(skip)
    return ", ".join(f"{c} = EXCLUDED.{c}" for c in columns if c not in skipped)


EVENTS_TABLE = Table(
    "events",
    EVENT_COLUMNS,
    "text bigint text text integer integer text bigint text text text text text",
    "(run_id, seq)",
    "DO NOTHING",
    ms_columns=frozenset({"at"}),
    json_columns=frozenset({"payload"}),
)
RUNS_TABLE = Table(
    "runs",
    RUN_COLUMNS,
    "text bigint text integer integer bigint integer text text bigint bigint bigint integer"
    " bigint bigint bigint bigint bigint bigint text text text text bigint text text",
    "(run_id)",
    "DO UPDATE SET "
    + _set(RUN_COLUMNS, skip=("run_id",))
    + ", projected_at = now() WHERE runs.last_seq < EXCLUDED.last_seq",
    ms_columns=RUN_TIME_COLUMNS,
)
OPS_TABLE = Table(
    "operations",
    OP_COLUMNS,
    "text text integer text text text integer integer integer text text text text text boolean"
    " bigint",
    "(run_id, op_key)",
    "DO UPDATE SET "
    + _set(OP_COLUMNS, skip=("run_id", "op_key", "reconciliation"))
    + ", reconciliation = COALESCE(EXCLUDED.reconciliation, operations.reconciliation)"
    " WHERE operations.seq < EXCLUDED.seq",
)
QUESTIONS_TABLE = Table(
    "questions",
    QUESTION_COLUMNS,
    "text text text text timestamptz text bigint text bigint bigint bigint",
    "(run_id, question_id)",
    "DO UPDATE SET "
    + _set(QUESTION_COLUMNS, skip=("run_id", "question_id", "opened_seq"))
    + ", opened_seq = COALESCE(questions.opened_seq, EXCLUDED.opened_seq)"
    " WHERE questions.seq < EXCLUDED.seq",
)
RESULTS_TABLE = Table(
    "results",
    RESULT_COLUMNS,
    "text bigint text bigint text text text bigint",
    "(run_id, resolution)",
    "DO UPDATE SET "
    + _set(RESULT_COLUMNS, skip=("run_id", "resolution"))
    + " WHERE results.seq < EXCLUDED.seq",
    ms_columns=frozenset({"at"}),
)
SNAPSHOTS_TABLE = Table(
    "run_snapshots",
    SNAPSHOT_COLUMNS,
    "text bigint bigint text bigint",
    "(run_id)",
    "DO UPDATE SET "
    + _set(SNAPSHOT_COLUMNS, skip=("run_id",))
    + " WHERE run_snapshots.version < EXCLUDED.version",
    ms_columns=frozenset({"updated_at"}),
)
#: Keyed by the refused record's position: a dead letter written twice is one row.
DEAD_LETTERS_TABLE = Table(
    "dead_letters",
    DEAD_LETTER_COLUMNS,
    "text integer bigint text text bigint text bytea integer bytea bigint bigint integer bigint",
    "(source_topic, source_partition, source_offset)",
    "DO NOTHING",
    ms_columns=frozenset({"at", "original_timestamp"}),
)
TABLES = (
    EVENTS_TABLE,
    RUNS_TABLE,
    OPS_TABLE,
    QUESTIONS_TABLE,
    RESULTS_TABLE,
    SNAPSHOTS_TABLE,
    DEAD_LETTERS_TABLE,
)

SQL_OFFSETS = (
    "INSERT INTO sink_offsets (consumer, topic, partition, next_offset)"
    " SELECT %s, topic, partition, next_offset"
    " FROM unnest(%s::text[], %s::int[], %s::bigint[]) AS t(topic, partition, next_offset)"
    " ON CONFLICT (consumer, topic, partition) DO UPDATE"
    " SET next_offset = EXCLUDED.next_offset, updated_at = now()"
    " WHERE sink_offsets.next_offset < EXCLUDED.next_offset"
)


def read_offsets(conn: Conn, consumer: str, topics: Sequence[str]) -> dict[tuple[str, int], int]:
    rows = conn.execute(
        "SELECT topic, partition, next_offset FROM sink_offsets"
        " WHERE consumer = %s AND topic = ANY(%s)",
        (consumer, list(topics)),
    ).fetchall()
    return {(str(t), int(p)): int(o) for t, p, o in rows}
