"""Postgres schema migrations: versioned SQL files applied once each, in order.

`connectors/postgres/migrations/NNNN_name.sql` files run in one transaction each and are recorded in
`schema_migrations`; an advisory lock makes concurrent `migrate` calls (several processes
starting at once) safe. Applying twice is a no-op.
"""

from __future__ import annotations

from importlib import resources

import psycopg

from agentruns.connectors.errors import ServiceUnreachableError
from agentruns.connectors.postgres.dsn import redact_dsn, scrub_dsn

_LOCK_ID = 0x6167656E7472  # "agentr": one advisory lock for migrations


def migration_files() -> list[tuple[str, str]]:
    """(version, sql) for every shipped migration, sorted by version."""
    folder = resources.files("agentruns.connectors.postgres") / "migrations"
    files = sorted((f.name, f.read_text()) for f in folder.iterdir() if f.name.endswith(".sql"))
    return [(name.removesuffix(".sql"), sql) for name, sql in files]


def migrate(database_url: str) -> list[str]:
    """Apply the migrations not yet applied; return the versions applied now."""
    try:
        conn = psycopg.connect(database_url, autocommit=True)
    except psycopg.Error as exc:  # unreachable, or a DSN psycopg cannot read
        first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        reason = scrub_dsn(first, database_url)
        raise ServiceUnreachableError(
            f"cannot connect to Postgres at {redact_dsn(database_url)} ({reason})",
            hint="is it running?",
        ) from None
    applied: list[str] = []
    with conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (_LOCK_ID,))
        try:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}
            for version, sql in migration_files():
                if version in done:
                    continue
                with conn.transaction():
                    conn.execute(sql.encode())
                    conn.execute("INSERT INTO schema_migrations (version) VALUES (%s)", (version,))
                applied.append(version)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_ID,))
    return applied
