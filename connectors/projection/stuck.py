"""Which projected runs are without progress, as SQL on the `runs` table: the scanner
(`agentruns scan`) and the run list (`GET /runs?stuck_minutes=`) ask the same question."""

from __future__ import annotations

from typing import Any

from agentruns.processors.state import TERMINAL

#: The terminal statuses as an SQL list, written out so that the planner can match it with the
#: partial index of live runs (migration 0007 spells the same list).
TERMINAL_SQL = "(" + ", ".join(f"'{s}'" for s in sorted(t.value for t in TERMINAL)) + ")"


def stuck_condition(now_ms: int, stale_after_s: float) -> tuple[str, list[Any]]:
    """The SQL condition on `runs` (with its parameters) of a run without progress: not
    terminal, no event for `stale_after_s`, and not merely waiting for a person (a run in
    WAITING_USER counts only when one of its timers is due and has not fired)."""
    sql = (
        f"status NOT IN {TERMINAL_SQL} AND last_event_at < to_timestamp(%s / 1000.0)"
        " AND (status <> 'WAITING_USER' OR EXISTS (SELECT 1 FROM"
        " jsonb_array_elements(coalesce(state::jsonb -> 'timers', '[]'::jsonb)) t"
        " WHERE (t ->> 'due_at')::bigint <= %s))"
    )
    return sql, [now_ms - stale_after_s * 1000, now_ms]
