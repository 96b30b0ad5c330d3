"""One lazily (re)opened autocommit Postgres connection that retries through outages.

Shared by the adapters that own a connection in one thread (the artifact store, the executed-
action records): a call that fails with an OperationalError (server restarting, connection
dropped) closes the connection and is retried with exponential back-off; after `retries`
attempts the caller's own error type is raised, marked retryable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

from streams.errors import AgentrunsError

T = TypeVar("T")
Conn = psycopg.Connection[tuple[Any, ...]]


class RetryingConnection:
    def __init__(
        self, database_url: str, error: type[AgentrunsError], *, retries: int = 30
    ) -> None:
        self._url = database_url
        self._error = error
        self._retries = retries
        self._conn: Conn | None = None

    def _connection(self) -> Conn:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self._url, autocommit=True)
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
