"""The processor's store of ended runs: every run evicted after its end, on local disk.

A run that ended leaves the processor's memory and the state topic after the terminal
retention (`streams.eviction`), but its id stays taken for good: an input for it is answered
LATE at its next seq, whatever its `at`, after any number of restarts. What is kept of it
(`Ended`: status, last seq, when it ended, its result's ref) is written to the compacted `runs`
topic in the transaction that evicts it, and to this store once that transaction committed. The
topic is the truth; the store is its local copy, as a Kafka Streams state store is of its
changelog: it records, per partition, the offset of the topic it holds everything before
(`checkpoint`), so a restore reads only the topic's tail, and a store that is missing, of
another cluster or behind the topic's start is rebuilt from the topic.

SQLite (the standard library's), one table keyed by (partition, run_id), in WAL mode: a point
lookup per unknown run id on the per-input path, bounded memory (its page cache) whatever the
number of ended runs, and a file several processes on one host may share (updates only move a
run's last seq forward, so a late writer never undoes a newer one). `synchronous=NORMAL`: a
crash of the process loses nothing; one of the host may lose the last updates, which the
checkpoint, committed with them, makes the restore read again.

Only the thread that opened it uses a store (the processor's loop thread).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path

from agentruns.streams.sequencing import Ended

__all__ = ["RunStore", "StoredRun"]

log = logging.getLogger("agentruns.processor")

#: (partition, run_id, what is kept of it)
StoredRun = tuple[int, str, Ended]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ended_runs (
    partition INTEGER NOT NULL,
    run_id TEXT NOT NULL,
    status TEXT NOT NULL,
    last_seq INTEGER NOT NULL,
    ended_at INTEGER NOT NULL,
    result_ref TEXT,
    PRIMARY KEY (partition, run_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS checkpoints (
    partition INTEGER PRIMARY KEY,
    next_offset INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""

_UPSERT = """
INSERT INTO ended_runs (partition, run_id, status, last_seq, ended_at, result_ref)
VALUES (?, ?, ?, ?, ?, ?)
ON CONFLICT (partition, run_id) DO UPDATE SET
    status = excluded.status,
    last_seq = excluded.last_seq,
    ended_at = excluded.ended_at,
    result_ref = excluded.result_ref
WHERE excluded.last_seq >= ended_runs.last_seq
"""

_CHECKPOINT = """
INSERT INTO checkpoints (partition, next_offset) VALUES (?, ?)
ON CONFLICT (partition) DO UPDATE SET next_offset = max(next_offset, excluded.next_offset)
"""


class RunStore:
    """Ended runs by (partition, run_id), and the `runs` topic offset each partition holds up
    to. ``path`` None: in memory, rebuilt from the topic at every restore."""

    def __init__(self, path: Path | None, topic_id: str = "") -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(
            ":memory:" if path is None else str(path), timeout=30.0, isolation_level=None
        )
        if path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._adopt(topic_id)

    @classmethod
    def opened(cls, path: Path | None, topic_id: str = "") -> RunStore:
        """The store at `path`; a file SQLite cannot read is moved aside and a new one made
        (the topic holds everything it had)."""
        try:
            return cls(path, topic_id)
        except sqlite3.DatabaseError as exc:
            if path is None:
                raise
            aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
            log.warning("run store %s cannot be read (%s): moved to %s", path, exc, aside)
            path.rename(aside)
            for suffix in ("-wal", "-shm"):
                path.with_name(path.name + suffix).unlink(missing_ok=True)
            return cls(path, topic_id)

    def _adopt(self, topic_id: str) -> None:
        """A store kept for another `runs` topic (recreated, or of another cluster with the same
        names) holds nothing of this one: emptied."""
        if not topic_id:
            return
        with self._transaction():
            row = self._db.execute("SELECT value FROM meta WHERE name = 'topic_id'").fetchone()
            if row is not None and row[0] == topic_id:
                return
            self._db.execute("DELETE FROM ended_runs")
            self._db.execute("DELETE FROM checkpoints")
            self._db.execute(
                "INSERT OR REPLACE INTO meta (name, value) VALUES ('topic_id', ?)", (topic_id,)
            )

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)

    def get(self, partition: int, run_id: str) -> Ended | None:
        row = self._db.execute(
            "SELECT status, last_seq, ended_at, result_ref FROM ended_runs"
            " WHERE partition = ? AND run_id = ?",
            (partition, run_id),
        ).fetchone()
        if row is None:
            return None
        status, last_seq, ended_at, result_ref = row
        return Ended(status, last_seq, ended_at, result_ref)

    def put(self, runs: Iterable[StoredRun], checkpoints: dict[int, int]) -> None:
        """Store `runs` and move each partition's checkpoint to at least the offset given, in
        one SQLite transaction."""
        with self._transaction():
            self._db.executemany(
                _UPSERT,
                (
                    (p, run_id, e.status, e.last_seq, e.ended_at, e.result_ref)
                    for p, run_id, e in runs
                ),
            )
            self._db.executemany(_CHECKPOINT, checkpoints.items())

    def checkpoint(self, partition: int) -> int:
        """The `runs` topic offset of `partition` the store holds everything before (0: none)."""
        row = self._db.execute(
            "SELECT next_offset FROM checkpoints WHERE partition = ?", (partition,)
        ).fetchone()
        return 0 if row is None else int(row[0])

    def reset(self, partition: int) -> None:
        """Forget `partition`: it is read again from the topic's start."""
        with self._transaction():
            self._db.execute("DELETE FROM ended_runs WHERE partition = ?", (partition,))
            self._db.execute("DELETE FROM checkpoints WHERE partition = ?", (partition,))

    def count(self, partition: int | None = None) -> int:
        if partition is None:
            row = self._db.execute("SELECT count(*) FROM ended_runs").fetchone()
        else:
            row = self._db.execute(
                "SELECT count(*) FROM ended_runs WHERE partition = ?", (partition,)
            ).fetchone()
        return int(row[0])

    def close(self) -> None:
        self._db.close()


class _Transaction:
    """BEGIN IMMEDIATE .. COMMIT (ROLLBACK on an error): a writer takes the lock up front, so
    two processes sharing the file never deadlock upgrading a read lock."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        self._db.execute("COMMIT" if exc is None else "ROLLBACK")
