"""`agentruns versions`: the rules versions of the runs in the Postgres projection."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import psycopg
import pytest

from agentruns.connectors.projection.rules_versions import count_versions, format_report, report
from agentruns.processors.events import RunSubmitted
from agentruns.processors.state import RunStatus
from agentruns.processors.transition import transition

AT = 1_700_000_000_000


def _row(
    conn: psycopg.Connection[tuple[object, ...]], run_id: str, version: int, status: str
) -> None:
    submitted = RunSubmitted(
        run_id=run_id,
        event_id=f"{run_id}:s",
        at=AT,
        trace_id="t",
        goal="g",
        rules_version=version,
    )
    state = transition(None, submitted).state
    assert state is not None
    text = state.model_copy(update={"status": RunStatus(status)}).to_json()
    conn.execute(
        "INSERT INTO runs (run_id, last_seq, status, step, attempt, version, resolution, trace_id,"
        " goal, input_tokens, output_tokens, cost_micros, tool_calls, started_at, last_event_at,"
        " system_ms, tool_wait_ms, user_wait_ms, state) VALUES (%s, 1, %s, 1, 1, 1, 0, 't', 'g',"
        " 0, 0, 0, 0, now(), now(), 0, 0, 0, %s)",
        (run_id, status, text),
    )


@pytest.fixture
def runs_of_version_7(database_url: str) -> Iterator[list[str]]:
    """Three projected runs of rules version 7 (no other test writes that version)."""
    tag = f"run-versions-{time.monotonic_ns() % 10**9}"
    ids = [f"{tag}-{n}" for n in range(3)]
    with psycopg.connect(database_url, autocommit=True) as conn:
        _row(conn, ids[0], 7, "WAITING_USER")
        _row(conn, ids[1], 7, "MODEL_RUNNING")
        _row(conn, ids[2], 7, "SUCCEEDED")
    try:
        yield ids
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("DELETE FROM runs WHERE run_id = ANY(%s)", (ids,))


def test_versions_counts_live_and_ended_runs_per_rules_version(
    database_url: str, runs_of_version_7: list[str]
) -> None:
    found = report(count_versions(database_url))
    assert {"version": 7, "live": 2, "ended": 1} in found["versions"]
    assert found["unknown_to_this_build"] == [7]
    assert json.loads(json.dumps(found)) == found
    text = format_report(found)
    assert "            7          2           1" in text.splitlines()
    assert text.splitlines()[-1] == (
        "live runs of versions this build does not have: 7 (a processor of this build stops "
        "their partitions)"
    )
