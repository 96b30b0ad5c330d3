"""The run list behind `GET /runs` and the console's runs page: filters, keyset pages, counts.

Runs are listed newest first by (started_at, run_id), a key that never changes for a run, so a
cursor neither skips nor repeats a row while the runs it pages over progress. Every filter is
an indexed condition (migration 0007): status through (status, started_at, run_id), search by
run id, idempotency key (the run id derived from it) or trace id through equalities.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from agentruns.connectors.api.credentials import Credential
from agentruns.connectors.api.errors import ApiError
from agentruns.connectors.api.pool import Conn
from agentruns.connectors.projection.stuck import stuck_condition
from agentruns.processors.ids import run_id_for_key
from agentruns.processors.state import RunStatus
from agentruns.processors.tenants import DEFAULT_TENANT, tenant_key, valid_tenant
from agentruns.streams.clock import datetime_of, ms_of

#: Statuses in which a run waits for a person or for a tool (the core's TimeAccount split).
WAITING: dict[str, tuple[str, ...]] = {
    "user": (RunStatus.WAITING_USER.value, RunStatus.PAUSED.value),
    "tool": (RunStatus.TOOL_RUNNING.value, RunStatus.WAITING_TOOL.value),
}
MAX_LIMIT = 200
GOAL_CHARS = 200


@dataclass(frozen=True)
class RunFilter:
    """What the list is narrowed to; every field optional."""

    statuses: tuple[str, ...] = ()
    waiting: str | None = None  # "user" or "tool"
    stuck_minutes: float | None = None  # no progress for this long (the `agentruns scan` rule)
    since_ms: int | None = None  # started at or after
    until_ms: int | None = None  # started before
    search: str | None = None  # run id, idempotency key or trace id
    limit: int = 50
    cursor: str | None = None
    #: Only this tenant's runs; None: every tenant's (an admin's list, unless it names one).
    tenant: str | None = None
    #: The tenant an idempotency key searched for is taken within (`tenant_key`).
    key_tenant: str = DEFAULT_TENANT

    @classmethod
    def of_query(cls, query: dict[str, str], caller: Credential | None = None) -> RunFilter:
        """The filter of a query string, narrowed to ``caller``'s tenant unless it is an
        admin (who may name one: ``tenant``); a malformed value is a 400 `ApiError`."""

        def number(name: str, lo: float, hi: float) -> float | None:
            raw = query.get(name, "").strip()
            if not raw:
                return None
            try:
                value = float(raw)
            except ValueError:
                raise ApiError(400, "invalid_parameter", f"{name} must be a number") from None
            if not lo <= value <= hi:
                raise ApiError(400, "invalid_parameter", f"{name} must be from {lo} to {hi}")
            return value

        known = {s.value for s in RunStatus}
        statuses = tuple(s for s in query.get("status", "").split(",") if s)
        unknown = [s for s in statuses if s not in known]
        if unknown:
            raise ApiError(400, "invalid_parameter", f"unknown status {unknown[0][:40]}")
        waiting = query.get("waiting") or None
        if waiting is not None and waiting not in WAITING:
            raise ApiError(400, "invalid_parameter", "waiting must be user or tool")
        since, until = number("since", 0, 2**53), number("until", 0, 2**53)
        limit = number("limit", 1, MAX_LIMIT)
        search = (query.get("q") or "").strip()[:400] or None
        tenant = None if caller is None else caller.tenant_scope
        named = query.get("tenant") or None
        if named is not None and not valid_tenant(named):
            raise ApiError(400, "invalid_parameter", "tenant is not a tenant name")
        if tenant is None:
            tenant = named
        elif named is not None and named != tenant:
            tenant = "-"  # another tenant's: no runs (no tenant name starts with -)
        return cls(
            tenant=tenant,
            key_tenant=DEFAULT_TENANT if caller is None else caller.tenant,
            statuses=statuses,
            waiting=waiting,
            stuck_minutes=number("stuck_minutes", 0, 10**6),
            since_ms=None if since is None else int(since),
            until_ms=None if until is None else int(until),
            search=search,
            limit=50 if limit is None else int(limit),
            cursor=query.get("cursor") or None,
        )


def _encode_cursor(started_at: datetime, run_id: str) -> str:
    text = f"{started_at.isoformat()}|{run_id}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, run_id = text.split("|", 1)
        return datetime.fromisoformat(at), run_id
    except ValueError:
        raise ApiError(400, "invalid_parameter", "cursor is not one this API returned") from None


def _conditions(f: RunFilter, now_ms: int) -> tuple[list[str], list[Any]]:
    """The WHERE conditions of every filter but status (the counts are taken over these)."""
    where: list[str] = []
    params: list[Any] = []
    if f.waiting is not None:
        where.append("status = ANY(%s)")
        params.append(list(WAITING[f.waiting]))
    if f.stuck_minutes is not None:
        sql, more = stuck_condition(now_ms, f.stuck_minutes * 60)
        where.append(sql)
        params.extend(more)
    if f.since_ms is not None:
        where.append("started_at >= %s")
        params.append(datetime_of(f.since_ms))
    if f.until_ms is not None:
        where.append("started_at < %s")
        params.append(datetime_of(f.until_ms))
    if f.search is not None:
        where.append("(run_id = %s OR run_id = %s OR trace_id = %s)")
        params.extend([f.search, run_id_for_key(tenant_key(f.search, f.key_tenant)), f.search])
    if f.tenant is not None:
        where.append("tenant = %s")
        params.append(f.tenant)
    return where, params


def list_runs(conn: Conn, f: RunFilter, now_ms: int) -> dict[str, Any]:
    """One page of runs (newest first), the cursor of the next page and counts per status."""
    where, params = _conditions(f, now_ms)
    counted = " AND ".join(where) or "true"
    counts: dict[str, int] = dict(
        conn.execute(
            f"SELECT status, count(*) FROM runs WHERE {counted} GROUP BY status",
            params,
        ).fetchall()
    )
    page_where, page_params = list(where), list(params)
    if f.statuses:
        page_where.append("status = ANY(%s)")
        page_params.append(list(f.statuses))
    if f.cursor is not None:
        started_at, run_id = _decode_cursor(f.cursor)
        page_where.append("(started_at, run_id) < (%s, %s)")
        page_params.extend([started_at, run_id])
    cur = conn.execute(
        "SELECT r.run_id, r.status, left(r.goal, %s) AS goal, r.step, r.attempt, r.trace_id,"
        " r.started_at, r.last_event_at, r.ended_at, r.system_ms, r.tool_wait_ms,"
        " r.user_wait_ms, r.last_seq, r.tenant,"
        " (SELECT e.type FROM events e WHERE e.run_id = r.run_id AND e.seq = r.last_seq)"
        " AS last_event"
        f" FROM runs r WHERE {' AND '.join(page_where) or 'true'}"
        " ORDER BY r.started_at DESC, r.run_id DESC LIMIT %s",
        [GOAL_CHARS, *page_params, f.limit + 1],
    )
    names = [d.name for d in cur.description or ()]
    rows = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
    more = len(rows) > f.limit
    rows = rows[: f.limit]
    next_cursor = (
        _encode_cursor(rows[-1]["started_at"], rows[-1]["run_id"]) if more and rows else None
    )
    runs = [
        {
            "run_id": r["run_id"],
            "status": r["status"],
            "goal": r["goal"],
            "step": r["step"],
            "attempt": r["attempt"],
            "trace_id": r["trace_id"],
            "started_at": ms_of(r["started_at"]),
            "last_event_at": ms_of(r["last_event_at"]),
            "ended_at": ms_of(r["ended_at"]),
            "last_seq": r["last_seq"],
            "last_event": r["last_event"],
            "tenant": r["tenant"],
            "waits": {
                "system_ms": r["system_ms"],
                "tool_wait_ms": r["tool_wait_ms"],
                "user_wait_ms": r["user_wait_ms"],
            },
        }
        for r in rows
    ]
    return {
        "runs": runs,
        "next_cursor": next_cursor,
        "counts": {s.value: int(counts.get(s.value, 0)) for s in RunStatus},
    }
