"""The executed-action records: a start another member may still be running is not taken over
before its lease ends, and the statements keep to the primary key as the table grows.

On a fresh database whose table autovacuum has not analyzed yet, a prepared statement keeps the
generic plan Postgres chose while the table was small: a sequential scan, whatever the table
holds later. The records' session plans no sequential scan, so a batch reads its rows through
the index at any size. Real Postgres: a database of its own, autovacuum off for the table, so no
analyze comes between."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from agentruns.connectors.executors.records import ActionRecords, Completion
from agentruns.connectors.postgres.migrate import migrate
from agentruns.processors.effects import CallModel

BATCH = 18


def _call(n: int | str) -> CallModel:
    return CallModel(
        idempotency_key=f"run-{n}:model:1:1",
        run_id=f"run-{n}",
        step=1,
        attempt=1,
        trace_id="t",
        context_ref="sha256:" + "0" * 64,
        model_route="default",
    )


@pytest.fixture
def fresh_database(database_url: str) -> Iterator[str]:
    name = f"records_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = psycopg.conninfo.make_conninfo(database_url, dbname=name)
    try:
        migrate(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("ALTER TABLE executed_actions SET (autovacuum_enabled = false)")
        yield url
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _batch(records: ActionRecords, n: int) -> None:
    effects = [_call(f"{n}-{i}") for i in range(BATCH)]
    begun = records.begin(effects, [30.0] * len(effects))
    assert begun.elsewhere == {} and all(not r.completed for r in begun.records.values())
    completions = [
        Completion(e, {"kind": "ModelCallCompleted", "input_id": f"in-{e.run_id}"}, "ok")
        for e in effects
    ]
    answers = records.complete(completions)
    assert len(answers) == BATCH
    assert records.fetch([effects[0].idempotency_key])[effects[0].idempotency_key].completed


def _scans(url: str, table: str, owner: ActionRecords) -> tuple[int, int]:
    """Scans of ``table`` so far, the owner's own connection's included: its counters are
    flushed as it goes idle after asking to (Postgres 15+), not every second."""
    owner._db.run("flushing statistics", lambda c: c.execute("SELECT pg_stat_force_next_flush()"))
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT seq_scan, idx_scan FROM pg_stat_user_tables WHERE relname = %s", (table,)
        ).fetchone()
    assert row is not None
    return int(row[0] or 0), int(row[1] or 0)


def test_the_records_read_by_the_index_however_the_table_grew_since_planning(
    fresh_database: str,
) -> None:
    records = ActionRecords(fresh_database, "test")
    try:
        for n in range(20):  # past psycopg's prepare threshold (5) and five custom plans
            _batch(records, n)
        with psycopg.connect(fresh_database, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO executed_actions (idempotency_key, effect_type, run_id, step,"
                " attempt, status, executor, input_json, completed_at)"
                " SELECT 'old-' || g, 'CallModel', 'old', 1, 1, 'completed', 'x', '{}', now()"
                " FROM generate_series(1, 20000) AS g"
            )
        seq_before, idx_before = _scans(fresh_database, "executed_actions", records)
        for n in range(20, 40):
            _batch(records, n)
        seq_after, idx_after = _scans(fresh_database, "executed_actions", records)
    finally:
        records.close()
    assert seq_after == seq_before  # not one sequential scan of the grown table
    assert idx_after - idx_before >= 20 * 3  # begin, complete and fetch of every batch


def test_a_start_by_another_member_is_not_taken_over_before_its_lease_ends(
    fresh_database: str,
) -> None:
    """Member a starts a key; member b may not start it beside a's call while a's lease runs
    (a partition handed over with its call in flight), may once the lease has ended, and may at
    once when a second call changes nothing outside (lease 0). A restart of a (its own name)
    takes its keys over at once: its earlier process is gone."""
    a, b = ActionRecords(fresh_database, "member-a"), ActionRecords(fresh_database, "member-b")
    held, free, short, own = (_call(f"lease-{i}") for i in range(4))
    try:
        first = a.begin([held, free, short, own], [60.0, 60.0, 0.5, 60.0])
        assert first.records == {} and first.elsewhere == {}  # new keys, all started by a

        second = b.begin([held, free], [60.0, 0.0])
        assert set(second.elsewhere) == {held.idempotency_key}
        assert 55.0 < second.elsewhere[held.idempotency_key] <= 60.0
        assert second.records[held.idempotency_key].starts == 1  # not started by b
        assert second.records[free.idempotency_key].starts == 1  # the record as it was
        assert b.fetch([free.idempotency_key])[free.idempotency_key].starts == 2  # taken

        time.sleep(0.6)  # past the short lease
        third = b.begin([short], [0.5])
        assert third.elsewhere == {} and third.records[short.idempotency_key].starts == 1

        again = a.begin([own], [60.0])  # a restarted: its own start is over
        assert again.elsewhere == {} and again.records[own.idempotency_key].starts == 1

        # b's start of `short` is b's now: a may not take it back within the lease
        back = a.begin([short], [60.0])
        assert set(back.elsewhere) == {short.idempotency_key}

        # an answer recorded by the start's owner ends the wait: b replays it
        a.complete([Completion(held, {"kind": "ModelCallCompleted", "input_id": "i"}, "ok")])
        last = b.begin([held], [60.0])
        assert last.elsewhere == {} and last.records[held.idempotency_key].completed
    finally:
        a.close()
        b.close()


def test_a_lease_for_every_effect_or_none() -> None:
    records = ActionRecords("postgresql://unused.invalid/x", "m")
    try:
        with pytest.raises(ValueError, match="2 effects and 1 leases"):
            records.begin([_call(1), _call(2)], [1.0])
    finally:
        records.close()
