"""`agentruns.connectors.postgres.bulk.prefer_lz4` against the real Postgres: the session setting
sticks in both
connection modes the adapters use."""

from __future__ import annotations

import psycopg
import pytest

from agentruns.connectors.postgres.bulk import prefer_lz4


@pytest.mark.parametrize("autocommit", [True, False])
def test_prefer_lz4_makes_lz4_the_sessions_toast_compression(
    database_url: str, autocommit: bool
) -> None:
    with psycopg.connect(database_url, autocommit=autocommit) as conn:
        assert prefer_lz4(conn)  # the Postgres we ship with (apt, 15) is built with lz4
        # committed, not left in an open transaction: a later rollback keeps it
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        conn.rollback()
        row = conn.execute("SHOW default_toast_compression").fetchone()
        assert row == ("lz4",)
        conn.rollback()
        conn.execute("CREATE TEMP TABLE big (v text)")
        conn.execute("INSERT INTO big SELECT repeat('agentruns ', 1000)")
        row = conn.execute("SELECT pg_column_compression(v) FROM big").fetchone()
        assert row == ("lz4",)
