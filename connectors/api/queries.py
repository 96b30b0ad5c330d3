"""The SQL of the API and the console: small functions over one connection, each one statement.

They read the projection (`runs`, `events`, `operations`, `results`, `dead_letters`) and the
artifact store, and read and write the API's own tables (`api_inputs`, `api_used_tokens`,
migration 0005). Transactions stay with the callers: a function runs in whatever transaction
(or autocommit) its connection is in. The run list has its own module (`listing`).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import psycopg

from agentruns.connectors.api.pool import Conn
from agentruns.streams.clock import datetime_of

RUN_FIELDS = (
    "run_id, status, step, attempt, version, resolution, trace_id, goal, last_seq, input_tokens,"
    " output_tokens, cost_micros, tool_calls, started_at, last_event_at, ended_at, system_ms,"
    " tool_wait_ms, user_wait_ms, outcome, result_ref, state, tenant"
)


def _dicts(cur: psycopg.Cursor[tuple[Any, ...]]) -> list[dict[str, Any]]:
    names = [d.name for d in cur.description or ()]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def read_only_snapshot(conn: Conn) -> None:
    """Make the open transaction one read-only snapshot (its first statement)."""
    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")


# ---------------------------------------------------------------------- runs and their rows


def run_row(conn: Conn, run_id: str) -> dict[str, Any] | None:
    cur = conn.execute(f"SELECT {RUN_FIELDS} FROM runs WHERE run_id = %s", (run_id,))
    row = cur.fetchone()
    if row is None:
        return None
    names = [d.name for d in cur.description or ()]
    return dict(zip(names, row, strict=True))


def run_log(conn: Conn, run_id: str, limit: int) -> list[tuple[int, Any]]:
    """(seq, domain event) of the run's first `limit` records, as projected (a fork's source)."""
    rows = conn.execute(
        "SELECT seq, payload FROM events WHERE run_id = %s ORDER BY seq LIMIT %s", (run_id, limit)
    ).fetchall()
    return [(int(r[0]), r[1]) for r in rows]


def forks_of(conn: Conn, run_id: str, limit: int) -> list[dict[str, Any]]:
    """The runs forked from `run_id` (the projection's lineage), oldest first."""
    return _dicts(
        conn.execute(
            "SELECT run_id, forked_from_seq AS seq, status FROM runs"
            " WHERE forked_from_run_id = %s ORDER BY started_at, run_id LIMIT %s",
            (run_id, limit),
        )
    )


def children_of(conn: Conn, run_ids: list[str], limit: int) -> list[dict[str, Any]]:
    """The child runs of the runs `run_ids` (the projection's lineage), oldest first."""
    return _dicts(
        conn.execute(
            "SELECT run_id, parent_run_id, status, goal FROM runs"
            " WHERE parent_run_id = ANY(%s) ORDER BY started_at, run_id LIMIT %s",
            (run_ids, limit),
        )
    )


def run_tenant(conn: Conn, run_id: str) -> str | None:
    """The tenant of a projected run; None: not projected."""
    row = conn.execute("SELECT tenant FROM runs WHERE run_id = %s", (run_id,)).fetchone()
    return None if row is None else str(row[0])


def run_exists(conn: Conn, run_id: str) -> bool:
    return conn.execute("SELECT 1 FROM runs WHERE run_id = %s", (run_id,)).fetchone() is not None


def run_dead_letters(conn: Conn, run_id: str, limit: int) -> list[dict[str, Any]]:
    """The refused inputs that name `run_id`, newest first."""
    return _dicts(
        conn.execute(
            "SELECT reason, error_class, at, source_topic, source_partition, source_offset"
            " FROM dead_letters WHERE run_id = %s"
            " ORDER BY at DESC, source_topic DESC, source_partition DESC, source_offset DESC"
            " LIMIT %s",
            (run_id, limit),
        )
    )


def run_operations(conn: Conn, run_id: str) -> list[dict[str, Any]]:
    return _dicts(
        conn.execute(
            "SELECT op_key, step, tool, call_id, status, dispatch, retries, polls,"
            " policy_decision, result_ref, error_class, error_code, reconciliation,"
            " cancel_unconfirmed, seq FROM operations WHERE run_id = %s ORDER BY seq, op_key",
            (run_id,),
        )
    )


def latest_result(conn: Conn, run_id: str) -> tuple[Any, ...] | None:
    """(resolution, status, seq, summary) of the run's latest resolution, if it has a result."""
    return conn.execute(
        "SELECT resolution, status, seq, summary FROM results WHERE run_id = %s"
        " ORDER BY resolution DESC LIMIT 1",
        (run_id,),
    ).fetchone()


def events_after(conn: Conn, run_id: str, after_seq: int, limit: int) -> list[dict[str, Any]]:
    """A page of the run's events after `after_seq`, in seq order (as the API shows them)."""
    return _dicts(
        conn.execute(
            "SELECT seq, event_id, type, step, attempt, trace_id, at, disposition, reason,"
            " input_id, status, payload FROM events WHERE run_id = %s AND seq > %s"
            " ORDER BY seq LIMIT %s",
            (run_id, after_seq, limit),
        )
    )


def run_events(conn: Conn, run_id: str, limit: int) -> list[dict[str, Any]]:
    """The run's first `limit` events in seq order (as the console's run page shows them)."""
    return _dicts(
        conn.execute(
            "SELECT seq, type, step, attempt, at, disposition, reason, status, payload"
            " FROM events WHERE run_id = %s ORDER BY seq LIMIT %s",
            (run_id, limit),
        )
    )


def reply_applied(conn: Conn, run_id: str, token_id: str) -> bool:
    """Whether the run's log holds an applied reply with this resume token."""
    return (
        conn.execute(
            "SELECT seq FROM events WHERE run_id = %s AND type = 'UserReplied'"
            " AND disposition = 'APPLIED' AND payload->>'token_id' = %s LIMIT 1",
            (run_id, token_id),
        ).fetchone()
        is not None
    )


def callback_operation(conn: Conn, op_key: str) -> tuple[Any, ...] | None:
    """(run_id, step, dispatch, status, tool, trace_id) of the newest operation `op_key`."""
    return conn.execute(
        "SELECT o.run_id, o.step, o.dispatch, o.status, o.tool, r.trace_id"
        " FROM operations o JOIN runs r USING (run_id) WHERE o.op_key = %s"
        " ORDER BY o.seq DESC LIMIT 1",
        (op_key,),
    ).fetchone()


# ---------------------------------------------------------------------- the API's inputs


def insert_input(
    conn: Conn, input_id: str, run_id: str, kind: str, req_hash: str, record: bytes
) -> bool:
    """Record the input unless `input_id` is there already; True if this call inserted it."""
    return (
        conn.execute(
            "INSERT INTO api_inputs (input_id, run_id, kind, request_hash, record)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (input_id) DO NOTHING RETURNING 1",
            (input_id, run_id, kind, req_hash, record),
        ).fetchone()
        is not None
    )


def lock_input(conn: Conn, input_id: str) -> tuple[Any, bytes, Any] | None:
    """(request_hash, record, produced) of the input, its row locked until the transaction
    ends."""
    row = conn.execute(
        "SELECT request_hash, record, produced FROM api_inputs WHERE input_id = %s FOR UPDATE",
        (input_id,),
    ).fetchone()
    return None if row is None else (row[0], bytes(row[1]), row[2])


def mark_produced(conn: Conn, input_id: str) -> None:
    conn.execute("UPDATE api_inputs SET produced = true WHERE input_id = %s", (input_id,))


def input_kind(conn: Conn, input_id: str) -> str | None:
    row = conn.execute("SELECT kind FROM api_inputs WHERE input_id = %s", (input_id,)).fetchone()
    return None if row is None else str(row[0])


def submitted_input(conn: Conn, run_id: str) -> bytes | None:
    """The encoded RunSubmitted input the API recorded for `run_id`, if any."""
    row = conn.execute(
        "SELECT record FROM api_inputs WHERE run_id = %s AND kind = 'RunSubmitted' LIMIT 1",
        (run_id,),
    ).fetchone()
    return None if row is None else bytes(row[0])


def token_use(conn: Conn, token_id: str) -> tuple[Any, Any] | None:
    """(produced, request_hash) of the reply input that claimed the resume token, if any."""
    return conn.execute(
        "SELECT i.produced, i.request_hash FROM api_used_tokens t"
        " JOIN api_inputs i USING (input_id) WHERE t.token_id = %s",
        (token_id,),
    ).fetchone()


def claim_token(conn: Conn, token_id: str, run_id: str, question_id: str, input_id: str) -> None:
    """Mark the resume token used by the reply input `input_id` (at most once: a repeat
    raises the table's unique violation)."""
    conn.execute(
        "INSERT INTO api_used_tokens (token_id, run_id, question_id, input_id)"
        " VALUES (%s, %s, %s, %s)",
        (token_id, run_id, question_id, input_id),
    )


# ---------------------------------------------------------------------- artifacts


def artifact_content(conn: Conn, ref: str) -> bytes | None:
    row = conn.execute("SELECT content FROM artifacts WHERE ref = %s", (ref,)).fetchone()
    return None if row is None else bytes(row[0])


def artifact(conn: Conn, ref: str) -> tuple[str, int, bytes] | None:
    """(media_type, size_bytes, content) of the artifact, if stored."""
    row = conn.execute(
        "SELECT media_type, size_bytes, content FROM artifacts WHERE ref = %s", (ref,)
    ).fetchone()
    return None if row is None else (str(row[0]), int(row[1]), bytes(row[2]))


def store_artifact(conn: Conn, ref: str, media_type: str, content: bytes) -> None:
    """Store the artifact; one already stored under `ref` (same content) is kept."""
    conn.execute(
        "INSERT INTO artifacts (ref, media_type, size_bytes, content)"
        " VALUES (%s, %s, %s, %s) ON CONFLICT (ref) DO NOTHING",
        (ref, media_type, len(content), content),
    )


def context_chain(conn: Conn, context_ref: str, depth: int) -> list[tuple[str, Any, Any]]:
    """(ref, step, document) of the frozen contexts from `context_ref` back along
    `previous_context`, up to `depth` + 1 of them (one more tells whether older ones exist),
    newest first. Raises `psycopg.DataError` if an artifact of the chain is not JSON."""
    rows = conn.execute(
        "WITH RECURSIVE chain(ref, doc, depth) AS ("
        " SELECT ref, convert_from(content, 'UTF8')::jsonb, 1"
        " FROM artifacts WHERE ref = %s"
        " UNION ALL SELECT a.ref, convert_from(a.content, 'UTF8')::jsonb, c.depth + 1"
        " FROM chain c JOIN artifacts a ON a.ref = c.doc->>'previous_context'"
        " WHERE c.depth <= %s)"
        " SELECT ref, doc->'step', doc FROM chain ORDER BY depth",
        (context_ref, depth),
    ).fetchall()
    return [(r[0], r[1], r[2]) for r in rows]


def json_artifacts(conn: Conn, refs: list[str], max_bytes: int) -> dict[str, Any]:
    """ref -> parsed JSON of those of `refs` that are JSON documents of at most `max_bytes`
    (the others are left out)."""
    out: dict[str, Any] = {}
    rows = conn.execute(
        "SELECT ref, content FROM artifacts WHERE ref = ANY(%s) AND size_bytes <= %s",
        (refs, max_bytes),
    ).fetchall()
    for ref, content in rows:
        try:
            out[ref] = json.loads(bytes(content))
        except (ValueError, UnicodeDecodeError):
            continue
    return out


def run_questions(conn: Conn, run_id: str) -> list[dict[str, Any]]:
    """The run's questions (approvals, inputs asked of a person) in the order they opened."""
    return _dicts(
        conn.execute(
            "SELECT question_id, kind, status, opened_seq, closed_seq FROM questions"
            " WHERE run_id = %s ORDER BY seq",
            (run_id,),
        )
    )


# ---------------------------------------------------------------------- the console's charts


def finished_per_minute(conn: Conn) -> list[tuple[Any, ...]]:
    """(minute slot 0-59 of the last hour, status, runs) of the runs that ended in it."""
    return conn.execute(
        "SELECT 59 - floor(extract(epoch FROM now() - ended_at) / 60)::int AS slot,"
        " status, count(*) FROM runs WHERE ended_at > now() - interval '1 hour'"
        " GROUP BY 1, 2",
    ).fetchall()


#: Step latency per minute of the last hour, from the per-step events: a step ends at the
#: last event of its step number and took the time since the previous step of its run ended
#: (the first step: since its first event, the submission). Read through `events_at`
#: (migration 0009) over two hours, so a step that ended in the hour finds its predecessor
#: when that ended up to an hour earlier; a longer step (waiting for a person) is left out.
STEP_LATENCY_SQL = (
    "WITH steps AS ("
    " SELECT run_id, step, min(at) AS began, max(at) AS ended FROM events"
    " WHERE at > %(now)s - interval '2 hours' AND at <= %(now)s GROUP BY run_id, step),"
    " took AS ("
    " SELECT ended, ended - CASE WHEN lag(step) OVER w = step - 1 THEN lag(ended) OVER w"
    " WHEN step <= 1 THEN began END AS took"
    " FROM steps WINDOW w AS (PARTITION BY run_id ORDER BY step))"
    " SELECT 59 - floor(extract(epoch FROM %(now)s - ended) / 60)::int AS slot,"
    " percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM took) * 1000),"
    " percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM took) * 1000), count(*)"
    " FROM took WHERE took IS NOT NULL AND ended > %(now)s - interval '1 hour' GROUP BY 1"
)


def step_latency(conn: Conn, now_ms: int) -> list[tuple[int, float, float, int]]:
    """(minute slot 0-59 of the hour before `now_ms`, p50 ms, p95 ms, steps) per minute."""
    rows = conn.execute(STEP_LATENCY_SQL, {"now": datetime_of(now_ms)}).fetchall()
    return [(int(slot), float(p50), float(p95), int(n)) for slot, p50, p95, n in rows]


# ---------------------------------------------------------------------- dead letters


def dead_letter_classes(conn: Conn, limit: int) -> list[str]:
    """The distinct error classes of the dead letters, in order, at most `limit`: a walk of
    the class index, one probe per class."""
    return [
        str(c)
        for (c,) in conn.execute(
            "WITH RECURSIVE c(error_class) AS ("
            " (SELECT error_class FROM dead_letters ORDER BY error_class LIMIT 1)"
            " UNION ALL SELECT (SELECT d.error_class FROM dead_letters d"
            "  WHERE d.error_class > c.error_class ORDER BY d.error_class LIMIT 1)"
            " FROM c WHERE c.error_class IS NOT NULL)"
            " SELECT error_class FROM c WHERE error_class IS NOT NULL LIMIT %s",
            (limit,),
        ).fetchall()
    ]


def dead_letter_class_exists(conn: Conn, error_class: str) -> bool:
    return conn.execute(
        "SELECT EXISTS (SELECT 1 FROM dead_letters WHERE error_class = %s)", (error_class,)
    ).fetchone() == (True,)


def dead_letters_page(
    conn: Conn,
    *,
    error_class: str | None,
    reason_piece: str | None,
    before: tuple[datetime, str, int, int] | None,
    limit: int,
) -> list[dict[str, Any]]:
    """Up to `limit` dead letters newest first, of `error_class`, or with `reason_piece` in
    their reason, and older than the position `before` (at, topic, partition, offset); the
    original key and value as bytes."""
    where: list[str] = []
    params: list[Any] = []
    if error_class is not None:
        where.append("error_class = %s")
        params.append(error_class)
    elif reason_piece:
        where.append("strpos(reason, %s) > 0")
        params.append(reason_piece)
    if before is not None:
        where.append("(at, source_topic, source_partition, source_offset) < (%s, %s, %s, %s)")
        params.extend(before)
    rows = _dicts(
        conn.execute(
            "SELECT source_topic, source_partition, source_offset, reason, error_class, at,"
            " run_id, original_key, key_bytes, original_value, value_bytes FROM dead_letters"
            f" WHERE {' AND '.join(where) or 'true'}"
            " ORDER BY at DESC, source_topic DESC, source_partition DESC, source_offset DESC"
            " LIMIT %s",
            [*params, limit],
        )
    )
    for row in rows:
        for column in ("original_key", "original_value"):
            if row[column] is not None:
                row[column] = bytes(row[column])
    return rows
