"""When each API credential was last used, kept in Postgres (`credential_use`) so that every
API process, and every restart, sees the latest use anywhere.

A request only notes its credential's use in memory (`UseThrottle.note`, a dict under a lock);
a thread of its own (`CredentialUse`) writes the noted uses, each credential at most once per
WRITE_EVERY_MS, with GREATEST so that a process holding an older use never moves the time
back. Postgres down or slow never fails nor holds up a request: a failed write is logged at
most once per interval, its uses are tried again at the next turn, and the times in memory
stay what `GET /credentials` shows (the one request that reads the table, within
CONNECT_TIMEOUT_S and STATEMENT_TIMEOUT_MS).

The table holds credential ids and times, never a token or its hash. A process that sees a
credential removed from the file (read again) deletes its row: an id removed and later added
again names a new credential, whose last use must not be the old one's. Only a removal seen
deletes, never "every id this process does not hold": a process started with an older copy of
the file (a host not yet given the new one) must not wipe the uses of credentials added since.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import psycopg

from agentruns.connectors.postgres.dsn import scrub_dsn
from agentruns.streams.kafka_logs import RateLimiter

log = logging.getLogger("agentruns.api")

#: The least time between two writes of one credential's use by one process: a hot credential
#: (a CI job's, hundreds of requests a second) must not cost a write per request; a minute is
#: still far finer than "is this credential unused, can it go?" needs.
WRITE_EVERY_MS = 60_000
#: How often the writer wakes to write the uses that are due: a credential's first use reaches
#: the table (and the other processes' lists) within this.
FLUSH_EVERY_S = 5.0
#: Postgres is given this long to connect and each statement this long to run (a connection
#: of its own per write or read, never one of the request pool's: a turn is seconds apart).
CONNECT_TIMEOUT_S = 3
STATEMENT_TIMEOUT_MS = 5000


class UseThrottle:
    """Which noted uses are due to be written: each credential's latest use, at most once per
    ``every_ms`` of ``clock`` (pure bookkeeping; thread-safe)."""

    def __init__(self, clock: Callable[[], int], every_ms: int = WRITE_EVERY_MS) -> None:
        self._clock = clock
        self._every_ms = every_ms
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}  # id -> latest use not yet written
        self._written_at: dict[str, int] = {}  # id -> when (clock) its use was last written

    def note(self, credential_id: str, at: int) -> None:
        """A request used the credential at ``at`` (ms)."""
        with self._lock:
            held = self._pending.get(credential_id)
            if held is None or at > held:
                self._pending[credential_id] = at

    def due(self, *, every: bool = False) -> dict[str, int]:
        """The uses to write now (taken out of the pending ones): those of credentials not
        written within ``every_ms``; ``every``: all pending (the last write before a stop)."""
        now = self._clock()
        with self._lock:
            out = {
                cid: at
                for cid, at in self._pending.items()
                if every
                or cid not in self._written_at
                or now - self._written_at[cid] >= self._every_ms
            }
            for cid in out:
                del self._pending[cid]
            return out

    def written(self, uses: Iterable[str]) -> None:
        """``uses`` (from `due`) are in the table: the next write of each waits ``every_ms``."""
        now = self._clock()
        with self._lock:
            for cid in uses:
                self._written_at[cid] = now

    def failed(self, uses: dict[str, int]) -> None:
        """``uses`` (from `due`) were not written: they are due again at the next turn."""
        for cid, at in uses.items():
            self.note(cid, at)

    def keep(self, held: Iterable[str]) -> None:
        """Forget the credentials not in ``held`` (removed from the file)."""
        keep = set(held)
        with self._lock:
            self._pending = {k: v for k, v in self._pending.items() if k in keep}
            self._written_at = {k: v for k, v in self._written_at.items() if k in keep}


class CredentialUse:
    """The `credential_use` table of ``database_url``, written by a thread of its own from
    what `note` gathered; `read` for the lists."""

    def __init__(
        self,
        database_url: str,
        clock: Callable[[], int],
        *,
        every_ms: int = WRITE_EVERY_MS,
        flush_every_s: float = FLUSH_EVERY_S,
    ) -> None:
        self._url = database_url
        self.throttle = UseThrottle(clock, every_ms)
        self._flush_every_s = flush_every_s
        self._errors = RateLimiter(every_ms / 1000)
        self._lock = threading.Lock()
        self._known: set[str] | None = None  # the ids held (None: not told yet)
        self._removed: set[str] = set()  # ids removed from the file, their rows not yet deleted
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def note(self, credential_id: str, at: int) -> None:
        self.throttle.note(credential_id, at)

    def held(self, ids: Iterable[str]) -> None:
        """The credentials held now (the file read again): the rows of those held before and
        no longer are deleted at the next write. Only a removal this process saw deletes: a
        process started with an older file than another's never deletes the other's rows."""
        now = set(ids)
        self.throttle.keep(now)
        with self._lock:
            if self._known is not None:
                self._removed |= self._known - now
            self._removed -= now
            self._known = now

    def _connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        return psycopg.connect(
            self._url,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT_S,
            options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}",
        )

    def _failed(self, what: str, exc: Exception) -> None:
        dropped = self._errors.admit(what)
        if dropped is None:
            return
        first = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        log.warning(
            "credential use not %s, the times in memory stay (%s)%s",
            what,
            scrub_dsn(first, self._url),
            f"; {dropped} more since the last" if dropped else "",
        )

    def flush(self, *, every: bool = False) -> None:
        """Write the uses due (``every``: all noted), and delete the rows of credentials
        removed (one transaction); a failure is logged and all is tried again at the next
        turn."""
        uses = self.throttle.due(every=every)
        with self._lock:
            removed, self._removed = sorted(self._removed), set()
        if not uses and not removed:
            return
        try:
            with self._connect() as conn, conn.transaction():
                if removed:
                    conn.execute(
                        "DELETE FROM credential_use WHERE credential_id = ANY(%s)", (removed,)
                    )
                if uses:
                    conn.cursor().executemany(
                        "INSERT INTO credential_use (credential_id, last_used_at) VALUES (%s, %s)"
                        " ON CONFLICT (credential_id) DO UPDATE SET last_used_at ="
                        " GREATEST(credential_use.last_used_at, EXCLUDED.last_used_at)",
                        sorted(uses.items()),  # one order in every process: no deadlock
                    )
        except (psycopg.Error, OSError) as exc:
            self.throttle.failed(uses)
            with self._lock:
                self._removed |= set(removed) - (self._known or set())
            self._failed("written", exc)
            return
        self.throttle.written(uses)

    def stored(self, ids: Iterable[str]) -> dict[str, int]:
        """The stored uses of ``ids``: credential id -> last_used_at (ms). Raises
        `psycopg.Error`."""
        with self._connect() as conn:
            rows = conn.execute(
                "SELECT credential_id, last_used_at FROM credential_use"
                " WHERE credential_id = ANY(%s)",
                (sorted(ids),),
            )
            return {str(cid): int(at) for cid, at in rows}

    def read(self, ids: Iterable[str]) -> dict[str, int]:
        """`stored`; empty, with a warning in the log (at most once per interval), when
        Postgres cannot be read."""
        try:
            return self.stored(ids)
        except (psycopg.Error, OSError) as exc:
            self._failed("read", exc)
            return {}

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="credential-use")
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._flush_every_s):
            try:
                self.flush()
            except Exception:  # a bug must not end the writer: the next turn tries again
                log.exception("credential uses not written")

    def close(self) -> None:
        """Stop the writer, after one last write of every use noted."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self.flush(every=True)
