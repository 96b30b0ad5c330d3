"""Postgres helpers shared by the adapters.

`RetryingConnection`: one lazily (re)opened autocommit connection that retries through outages,
for the adapters that own a connection in one thread (the artifact store, the executed-action
records): a call that fails with an OperationalError (server restarting, connection dropped)
closes the connection and is retried with exponential back-off; after `retries` attempts the
caller's own error type is raised, marked retryable.

`Table` and `write_rows`: bulk writes by binary COPY into a staging temp table, then one upsert.

`prefer_lz4`: the writers' sessions compress large values (runs.state, artifacts) with lz4.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from agentruns.processors.limits import MAX_TIME_MS
from agentruns.streams.errors import AgentrunsError

T = TypeVar("T")
Conn = psycopg.Connection[tuple[Any, ...]]


class RetryingConnection:
    """``settings``: session parameters set on every (re)connection, for a connection whose
    statements all need the same planner choice."""

    def __init__(
        self,
        database_url: str,
        error: type[AgentrunsError],
        *,
        retries: int = 30,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        self._url = database_url
        self._error = error
        self._retries = retries
        self._settings = dict(settings or {})
        self._conn: Conn | None = None

    def _connection(self) -> Conn:
        if self._conn is None or self._conn.closed:
            conn = psycopg.connect(self._url, autocommit=True)
            for name, value in self._settings.items():
                conn.execute(sql.SQL("SET {} = {}").format(sql.Identifier(name), value))
            prefer_lz4(conn)
            self._conn = conn
        return self._conn

    def run(self, what: str, fn: Callable[[Conn], T]) -> T:
        delay = 0.1
        for attempt in range(self._retries):
            try:
                return fn(self._connection())
            except psycopg.OperationalError as exc:
                self.close()
                if attempt == self._retries - 1:
                    raise self._error(f"{what} failed: {exc}", retryable=True) from exc
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None


def prefer_lz4(conn: Conn) -> bool:
    """Make lz4 this session's TOAST compression; False where the server lacks it (built
    without lz4, or older than Postgres 14), which keeps the default, pglz.

    Why: values over ~2 KB are compressed when stored, and pglz is slow: staging the sink's
    runs rows (a ~4 KB RunState each) cost Postgres 33-39 us of CPU per projected event with
    pglz and 16-20 with lz4. A value keeps the compression it was stored with, also when an
    INSERT ... SELECT moves it from a stage table, so the session setting decides it."""
    try:
        conn.execute("SET default_toast_compression = 'lz4'")
    except (psycopg.errors.InvalidParameterValue, psycopg.errors.UndefinedObject):
        # not built with lz4 / no such setting (< 14); a lost connection is the caller's
        # to retry, so only these two are swallowed
        if not conn.autocommit:
            conn.rollback()
        return False
    if not conn.autocommit:
        conn.commit()  # a SET made in a transaction lasts only if that transaction commits
    return True


#: The times a projection stores, in epoch milliseconds: what Python's datetime represents
#: (0001-01-01 to 9999-12-31, UTC). A time outside is stored as the nearest bound, the same in
#: Postgres as in Python (`clamp_ms`), so a hostile time neither breaks a batch nor differs.
MIN_STORED_MS = -62_135_596_800_000
MAX_STORED_MS = MAX_TIME_MS


def clamp_ms(ms: int) -> int:
    return min(max(ms, MIN_STORED_MS), MAX_STORED_MS)


# Staged as epoch milliseconds (what event data carries), turned into timestamptz by Postgres:
# exact (the product stays below 2**53 microseconds) and no datetime per value in Python.
# Clamped as `clamp_ms` does (GREATEST/LEAST skip NULL, hence the CASE).
_MS = (
    "CASE WHEN {c} IS NULL THEN NULL ELSE timestamptz 'epoch'"
    f" + LEAST(GREATEST({{c}}, {MIN_STORED_MS}), {MAX_STORED_MS}) * interval '1 millisecond' END"
)


@dataclass(frozen=True)
class Table:
    """A table written in bulk: binary COPY into a session temp table, then one
    INSERT ... SELECT ... ON CONFLICT into the real table (COPY is psycopg's fast path, binary
    saves formatting and parsing every number; the guards live in the ON CONFLICT clause).
    The sink's projection tables and the artifact store write this way.

    `types` are the staged Postgres types in `columns` order, space-separated; a `bigint`
    staged for a timestamptz column holds epoch milliseconds, a `text` staged for jsonb holds
    the JSON text."""

    name: str
    columns: tuple[str, ...]
    types: str
    conflict: str
    update: str
    ms_columns: frozenset[str] = frozenset()
    json_columns: frozenset[str] = frozenset()

    @property
    def stage(self) -> str:
        return f"_stage_{self.name}"

    @property
    def stage_types(self) -> list[str]:
        return self.types.split()

    def create_stage(self) -> str:
        cols = ", ".join(f"{c} {t}" for c, t in zip(self.columns, self.stage_types, strict=True))
        return f"CREATE TEMP TABLE IF NOT EXISTS {self.stage} ({cols}) ON COMMIT DELETE ROWS"

    def copy(self) -> str:
        return f"COPY {self.stage} ({', '.join(self.columns)}) FROM STDIN (FORMAT BINARY)"

    def _select(self, column: str) -> str:
        if column in self.ms_columns:
            return _MS.format(c=column)
        if column in self.json_columns:
            return f"{column}::jsonb"
        return column

    def upsert(self) -> str:
        names = ", ".join(self.columns)
        values = ", ".join(self._select(c) for c in self.columns)
        return (
            f"INSERT INTO {self.name} ({names}) SELECT {values} FROM {self.stage}"
            f" ON CONFLICT {self.conflict} {self.update}"
        )


def write_rows(
    cur: psycopg.Cursor[Any], table: Table, rows: Iterable[Sequence[Any]], *, clear: bool = False
) -> None:
    """Stage `rows` (value tuples in `table.columns` order) with a binary COPY, then upsert them
    (the stage empties itself at commit; with `clear` at once, for a transaction that writes
    the table more than once)."""
    with cur.copy(table.copy()) as copy:
        copy.set_types(table.stage_types)
        write = copy.write_row
        for row in rows:
            write(row)
    cur.execute(table.upsert())
    if clear:
        cur.execute(f"DELETE FROM {table.stage}")
