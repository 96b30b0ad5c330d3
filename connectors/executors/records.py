"""The executed-action records (table ``executed_actions``, migration 0003): what an executor
knows of every effect key it began, in Postgres.

A key is marked ``started`` before its call (``started_at``: its latest start), and
``completed`` with the exact input it is answered with, artifacts and all, before that input is
sent (R2, R25). A key that comes back (a redelivery after a crash or a rebalance) is answered
from its completed record without a second call; a ``started`` one leads its handler to
reconcile instead of calling blindly, once no other member's start of it can still be running
(its lease: two attempts never change one resource at once, R12).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentruns.connectors.executors.base import ActionRecord, ExecutorError, clean_text
from agentruns.connectors.postgres.artifacts import MAX_ARTIFACT_BYTES, StoredArtifact
from agentruns.connectors.postgres.bulk import Conn, RetryingConnection
from agentruns.processors.effects import Effect


@dataclass(frozen=True)
class Completion:
    """An effect's answer as its handler (or the guard) made it, before it is recorded."""

    effect: Effect
    input: dict[str, Any]
    detail: str
    artifacts: tuple[StoredArtifact, ...] = ()
    failed: bool = False  # a failure answer of the guard, not the handler's own
    tokens: int | None = None  # what the call used, for its route's token rate
    throttle_s: float | None = None  # the back-off the backend asked for (Retry-After)


@dataclass(frozen=True)
class Begun:
    """What `ActionRecords.begin` found and did."""

    records: dict[str, ActionRecord]  # key -> its record as it was before this start
    # key -> seconds left of the lease of a start another member made: not started here
    elsewhere: dict[str, float]


def operation_key_of(effect: Effect) -> str | None:
    op = getattr(effect, "operation", None)
    if op is not None:
        return str(op.key)
    key = getattr(effect, "operation_key", None)
    return None if key is None else str(key)


class ActionRecords:
    """The executed-action records in Postgres. One connection; the loop thread only.

    Every statement here finds rows by primary key, so the session plans no sequential scan
    (``enable_seqscan = off``): psycopg prepares a statement on its fifth run, and Postgres
    then keeps the generic plan it chose while the table was small, a sequential scan that
    grows with the table until autovacuum analyzes it (8.8 ms a statement at 9,000 rows on a
    fresh database, where the index takes 0.3 ms)."""

    _COLUMNS = "idempotency_key, effect_type, status, starts, input_json, detail"

    def __init__(self, database_url: str, executor: str, *, retries: int = 30) -> None:
        self._executor = executor
        self._db = RetryingConnection(
            database_url, ExecutorError, retries=retries, settings={"enable_seqscan": "off"}
        )

    def fetch(self, keys: Sequence[str]) -> dict[str, ActionRecord]:
        if not keys:
            return {}

        def read(conn: Conn) -> dict[str, ActionRecord]:
            rows = conn.execute(
                f"SELECT {self._COLUMNS} FROM executed_actions WHERE idempotency_key = ANY(%s)",
                (list(keys),),
            ).fetchall()
            return {r[0]: ActionRecord(*r) for r in rows}

        result: dict[str, ActionRecord] = self._db.run("reading executed actions", read)
        return result

    def begin(self, effects: Sequence[Effect], leases: Sequence[float]) -> Begun:
        """One statement: return the records as they were, and mark every key that is not
        completed ``started`` (new rows, or ``starts + 1`` for a started one: a restart), its
        ``started_at`` now, unless another member started it less than its lease ago.

        ``leases[i]``: how long a start of ``effects[i]`` may still be calling its backend (the
        executor's guard, attempts and back-off included); 0 when a second call beside it
        changes nothing outside. A start younger than that by another member may still be
        running there (a partition handed over with its call in flight): the key is not
        started here, and ``Begun.elsewhere`` says how long its lease has left. A start of
        this member's own name is over (this member restarted, or it holds the key still and
        never begins it twice). The lease is looked at only where the key exists (the
        conflict's own condition): a new key, the common case, costs no more than before.
        The outer SELECT reads the snapshot from before the INSERT of its own statement, so it
        returns the previous records, exactly what the handlers must see; time is the
        database's, one clock for every member."""
        if not effects:
            return Begun({}, {})
        columns = (
            [e.idempotency_key for e in effects],
            [e.type for e in effects],
            [clean_text(e.run_id, None) for e in effects],  # informational: a run id from outside
            [e.step for e in effects],
            [e.attempt for e in effects],
            [operation_key_of(e) for e in effects],
            [float(lease) for lease in leases],
        )
        if len(columns[-1]) != len(effects):
            raise ValueError(f"{len(effects)} effects and {len(columns[-1])} leases")

        def write(conn: Conn) -> list[tuple[Any, ...]]:
            rows: list[tuple[Any, ...]] = conn.execute(
                "WITH v AS MATERIALIZED (SELECT * FROM unnest("
                " %b::text[], %b::text[], %b::text[], %b::int[], %b::int[], %b::text[],"
                " %b::float8[]) AS v(k, t, r, s, a, o, lease)),"
                " started AS ("
                " INSERT INTO executed_actions (idempotency_key, effect_type, run_id, step,"
                " attempt, operation_key, status, executor)"
                " SELECT k, t, r, s, a, o, 'started', %s FROM v"
                " ON CONFLICT (idempotency_key) DO UPDATE"
                " SET starts = executed_actions.starts + 1, executor = EXCLUDED.executor,"
                " started_at = now()"
                " WHERE executed_actions.status = 'started'"
                " AND (executed_actions.executor = EXCLUDED.executor OR (SELECT v.lease <= 0"
                " OR executed_actions.started_at <= now() - v.lease * interval '1 second'"
                " FROM v WHERE v.k = EXCLUDED.idempotency_key))"
                " RETURNING idempotency_key)"
                f" SELECT {self._COLUMNS}, extract(epoch FROM now() - started_at)::float8,"
                " idempotency_key IN (SELECT idempotency_key FROM started)"
                " FROM executed_actions WHERE idempotency_key = ANY(%b::text[])",
                (*columns, self._executor, columns[0]),
            ).fetchall()
            return rows

        rows = self._db.run("starting actions", write)
        lease_of = dict(zip(columns[0], columns[-1], strict=True))
        records: dict[str, ActionRecord] = {}
        elsewhere: dict[str, float] = {}
        for row in rows:
            record = ActionRecord(*row[:6])
            records[record.key] = record
            age_s, taken = float(row[6]), bool(row[7])
            if not taken and not record.completed:
                elsewhere[record.key] = max(0.0, lease_of[record.key] - age_s)
        return Begun(records, elsewhere)

    def complete(
        self, completions: Sequence[Completion], artifacts: Sequence[StoredArtifact] = ()
    ) -> dict[str, dict[str, Any]]:
        """Write the artifacts and record the inputs, in ONE statement (atomic, one round trip).

        Returns key -> the input to send: ours, or the first writer's when another executor
        completed the key first (a row already completed is never overwritten)."""
        if not completions:
            return {}
        unique: dict[str, StoredArtifact] = {}
        for artifact in artifacts:
            unique.setdefault(artifact.ref, artifact)
        blobs = [a.content.encode() for a in unique.values()]
        for ref, blob in zip(unique, blobs, strict=True):
            if len(blob) > MAX_ARTIFACT_BYTES:
                raise ExecutorError(f"artifact {ref} is {len(blob)} bytes, over the limit")
        params = (
            list(unique),
            [a.media_type for a in unique.values()],
            [len(b) for b in blobs],
            blobs,
            [c.effect.idempotency_key for c in completions],
            [c.input["kind"] for c in completions],
            [c.input["input_id"] for c in completions],
            [json.dumps(c.input, sort_keys=True, separators=(",", ":")) for c in completions],
            [c.detail for c in completions],
        )

        def write(conn: Conn) -> set[str]:
            rows = conn.execute(
                "WITH stored AS ("
                " INSERT INTO artifacts (ref, media_type, size_bytes, content)"
                " SELECT * FROM unnest(%b::text[], %b::text[], %b::int[], %b::bytea[])"
                " ON CONFLICT (ref) DO NOTHING)"
                " UPDATE executed_actions AS a SET status = 'completed', result_kind = v.kind,"
                " input_id = v.input_id, input_json = v.input_json, detail = v.detail,"
                " completed_at = now()"
                " FROM unnest(%b::text[], %b::text[], %b::text[], %b::text[], %b::text[])"
                " AS v(key, kind, input_id, input_json, detail)"
                " WHERE a.idempotency_key = v.key AND a.status = 'started'"
                " RETURNING a.idempotency_key",
                params,
            ).fetchall()
            return {str(r[0]) for r in rows}

        updated: set[str] = self._db.run("completing actions", write)
        chosen = {c.effect.idempotency_key: c.input for c in completions}
        raced = [k for k in chosen if k not in updated]
        if raced:
            for key, record in self.fetch(raced).items():
                if record.completed:
                    chosen[key] = record.input()
        return chosen

    def close(self) -> None:
        self._db.close()


__all__ = ["ActionRecords", "Begun", "Completion", "operation_key_of"]
