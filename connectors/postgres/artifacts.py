"""The content-addressed artifact store in Postgres (table `artifacts`, migration 0001).

Write-once: `put_many` inserts with ON CONFLICT DO NOTHING, so re-writing the same content
(a replayed transition, a redelivered executor result) is a no-op. Writers call it BEFORE the
Kafka transaction that references the refs commits (R2). Reads are by ref.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.postgres.bulk import Conn, RetryingConnection, Table, write_rows

MAX_ARTIFACT_BYTES = 16 * 1024 * 1024
# Binary COPY (rows formatted by psycopg's C code; the unnest of Python lists it replaced spent
# ~10% of the processor's samples in psycopg's list dumper), then one INSERT ... DO NOTHING.
ARTIFACTS_TABLE = Table(
    "artifacts",
    ("ref", "media_type", "size_bytes", "content"),
    "text text integer bytea",
    "(ref)",
    "DO NOTHING",
)


class ArtifactLike(Protocol):
    @property
    def ref(self) -> str: ...
    @property
    def media_type(self) -> str: ...
    @property
    def content(self) -> str: ...


class ArtifactStoreError(AgentrunsError):
    """The artifact store could not be read or written."""


def content_ref(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class StoredArtifact:
    ref: str
    media_type: str
    content: str

    @classmethod
    def of(cls, content: str, media_type: str = "application/json") -> StoredArtifact:
        return cls(content_ref(content.encode()), media_type, content)


class PostgresArtifactStore:
    """One connection, reconnected on failure; safe to share within one thread only."""

    # Refs this store has seen committed. Artifacts are content-addressed, write-once and never
    # deleted, so a ref written once needs no second write: many runs share a configuration
    # artifact, and each run's config would otherwise be sent again with every submission.
    KNOWN_REFS = 65_536

    def __init__(self, database_url: str, *, retries: int = 30) -> None:
        self._db = RetryingConnection(database_url, ArtifactStoreError, retries=retries)
        self._known: OrderedDict[str, None] = OrderedDict()
        self._staged_on: Conn | None = None  # the connection whose session has the stage table

    def put_many(self, artifacts: Iterable[ArtifactLike]) -> int:
        rows = []
        seen: set[str] = set()
        known = self._known
        for a in artifacts:
            if a.ref in known:
                known.move_to_end(a.ref)  # recently used refs stay known
                continue
            if a.ref in seen:
                continue
            seen.add(a.ref)
            data = a.content.encode()
            if len(data) > MAX_ARTIFACT_BYTES:
                raise ArtifactStoreError(f"artifact {a.ref} is {len(data)} bytes, over the limit")
            rows.append((a.ref, a.media_type, len(data), data))
        if not rows:
            return 0

        def write(conn: Conn) -> int:
            with conn.transaction(), conn.cursor() as cur:
                if conn is not self._staged_on:  # a new session (first use, or reconnected)
                    cur.execute(ARTIFACTS_TABLE.create_stage())
                write_rows(cur, ARTIFACTS_TABLE, rows)
            self._staged_on = conn  # committed: the stage table exists in this session
            return len(rows)

        written: int = self._db.run("writing artifacts", write)
        for ref in seen:  # only after the write committed
            known[ref] = None
        while len(known) > self.KNOWN_REFS:
            known.popitem(last=False)
        return written

    def put(self, content: str, media_type: str = "application/json") -> str:
        artifact = StoredArtifact.of(content, media_type)
        self.put_many([artifact])
        return artifact.ref

    def get_many(self, refs: Sequence[str]) -> dict[str, str]:
        def read(conn: Conn) -> dict[str, str]:
            rows = conn.execute(
                "SELECT ref, content FROM artifacts WHERE ref = ANY(%s)", (list(refs),)
            ).fetchall()
            return {str(ref): bytes(content).decode() for ref, content in rows}

        return self._db.run("reading artifacts", read)

    def get(self, ref: str) -> str | None:
        return self.get_many([ref]).get(ref)

    def close(self) -> None:
        self._db.close()
