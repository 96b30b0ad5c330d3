"""`GET /runs`: filters, counts and keyset pages over rows in the real projection tables.

The rows are written straight into `runs` with start times in a window of this test's own, so
the `since`/`until` filter isolates them from the runs of other tests in the same database."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from agentruns.processors.ids import run_id_for_key
from tests.support.api import Stack


def _insert(database_url: str, base: datetime, rows: list[dict[str, Any]]) -> None:
    with psycopg.connect(database_url) as conn:
        for i, r in enumerate(rows):
            started = base + timedelta(seconds=i)
            conn.execute(
                "INSERT INTO runs (run_id, last_seq, status, step, attempt, version, resolution,"
                " trace_id, goal, input_tokens, output_tokens, cost_micros, tool_calls,"
                " started_at, last_event_at, system_ms, tool_wait_ms, user_wait_ms, state)"
                " VALUES (%s, 1, %s, 1, 1, 1, 0, %s, %s, 0, 0, 0, 0, %s, %s, 0, 0, 0, %s)",
                (
                    r["run_id"],
                    r["status"],
                    r["trace_id"],
                    "goal",
                    started,
                    started,
                    r.get("state", "{}"),
                ),
            )


def test_the_run_list_filters_counts_and_pages_without_gaps_or_repeats(stack: Stack) -> None:
    tag = uuid.uuid4().hex[:8]
    # a past hour of its own (the stuck filter reads an idle time from now)
    first = datetime(2001, 1, 1, tzinfo=UTC)
    days = (datetime.now(UTC) - first).days - 2
    base = first + timedelta(days=random.randrange(days))
    statuses = ["SUCCEEDED"] * 7 + ["WAITING_USER"] * 3 + ["WAITING_TOOL"] * 2 + ["FAILED"]
    rows = [
        {"run_id": f"run-{tag}-{i:02d}", "status": s, "trace_id": f"trace-{tag}-{i}"}
        for i, s in enumerate(statuses)
    ]
    keyed = run_id_for_key(f"key-{tag}")
    rows.append({"run_id": keyed, "status": "READY", "trace_id": f"trace-{tag}-k"})
    # waits for a person, but its expiry timer is long due: stuck by the scanner's rule
    rows.append(
        {
            "run_id": f"run-{tag}-late",
            "status": "WAITING_USER",
            "trace_id": f"trace-{tag}-late",
            "state": '{"timers": [{"due_at": 1}]}',
        }
    )
    _insert(stack.database_url, base, rows)
    try:
        _check(stack, base, rows, tag, keyed)
    finally:  # other tests scan every run of the database
        with psycopg.connect(stack.database_url) as conn:
            conn.execute("DELETE FROM runs WHERE run_id = ANY(%s)", ([r["run_id"] for r in rows],))


def _check(stack: Stack, base: datetime, rows: list[dict[str, Any]], tag: str, keyed: str) -> None:
    window = {
        "since": int(base.timestamp() * 1000),
        "until": int((base + timedelta(hours=1)).timestamp() * 1000),
    }

    def get(**params: Any) -> dict[str, Any]:
        r = stack.http.get("/runs", params={**window, **params})
        assert r.status_code == 200, r.text
        return dict(r.json())

    everything = get(limit=200)
    ids = [r["run_id"] for r in everything["runs"]]
    assert ids == [r["run_id"] for r in reversed(rows)]  # newest first
    assert everything["next_cursor"] is None
    assert everything["counts"]["SUCCEEDED"] == 7 and everything["counts"]["WAITING_USER"] == 4
    assert sum(everything["counts"].values()) == len(rows)

    paged: list[str] = []
    cursor = None
    while True:
        page = get(limit=4, **({"cursor": cursor} if cursor else {}))
        assert len(page["runs"]) <= 4
        paged += [r["run_id"] for r in page["runs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert paged == ids

    done = get(status="SUCCEEDED,FAILED")
    assert {r["status"] for r in done["runs"]} == {"SUCCEEDED", "FAILED"}
    assert len(done["runs"]) == 8
    assert done["counts"]["WAITING_TOOL"] == 2  # counts ignore the status filter
    assert {r["status"] for r in get(waiting="user")["runs"]} == {"WAITING_USER"}
    assert len(get(waiting="tool")["runs"]) == 2
    stuck = {r["run_id"] for r in get(stuck_minutes=5)["runs"]}
    assert f"run-{tag}-late" in stuck and f"run-{tag}-08" not in stuck  # a plain question waits
    assert f"run-{tag}-10" in stuck
    assert keyed in stuck and f"run-{tag}-00" not in stuck  # terminal runs are never stuck
    assert [r["run_id"] for r in get(q=f"key-{tag}")["runs"]] == [keyed]
    assert [r["run_id"] for r in get(q=f"trace-{tag}-3")["runs"]] == [f"run-{tag}-03"]
    assert [r["run_id"] for r in get(q=f"run-{tag}-04")["runs"]] == [f"run-{tag}-04"]

    for bad in ({"status": "NOPE"}, {"waiting": "cat"}, {"limit": "x"}, {"cursor": "%%%"}):
        r = stack.http.get("/runs", params=bad)
        assert r.status_code == 400 and r.json()["error"] == "invalid_parameter", (bad, r.text)
    spec = stack.http.get("/openapi.json").json()
    assert "get" in spec["paths"]["/runs"]
