"""A small blocking pool of autocommit Postgres connections for the API's threadpool; an
unreachable or exhausted database is answered as a 503 `ApiError`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

import psycopg

from agentruns.connectors.api.errors import ApiError
from agentruns.connectors.postgres.dsn import scrub_dsn

Conn = psycopg.Connection[tuple[Any, ...]]


class ConnectionPool:
    """A small blocking pool of autocommit Postgres connections (psycopg_pool is not a
    dependency); a broken connection is dropped instead of returned."""

    def __init__(self, url: str, size: int) -> None:
        self._url = url
        self._idle: queue.LifoQueue[Conn] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(size)
        self._closed = False

    @contextlib.contextmanager
    def connection(self) -> Iterator[Conn]:
        if not self._slots.acquire(timeout=30):
            raise ApiError(503, "database_busy", "no database connection free within 30 s")
        conn: Conn | None = None
        try:
            with contextlib.suppress(queue.Empty):
                conn = self._idle.get_nowait()
            if conn is None or conn.closed:
                try:
                    conn = psycopg.connect(self._url, autocommit=True, connect_timeout=10)
                except psycopg.Error as exc:  # unreachable, or a DSN psycopg cannot read
                    detail = scrub_dsn(str(exc).strip(), self._url)
                    raise ApiError(503, "database_unavailable", f"Postgres: {detail}") from None
            healthy = False
            try:
                yield conn
                healthy = True
            except psycopg.OperationalError as exc:
                detail = scrub_dsn(str(exc).strip(), self._url)
                raise ApiError(503, "database_unavailable", f"Postgres: {detail}") from exc
            except BaseException:
                # A refusal raised inside the block leaves the connection usable unless a
                # transaction is still open on it.
                status = conn.info.transaction_status
                healthy = status == psycopg.pq.TransactionStatus.IDLE
                raise
            finally:
                if healthy and not self._closed and not conn.closed:
                    self._idle.put(conn)
                else:
                    conn.close()
        finally:
            self._slots.release()

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return
