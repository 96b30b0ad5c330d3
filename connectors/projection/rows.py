"""The pure projection: what an Event record adds to the Postgres tables, as rows.

`project_event` folds one record with the current core and returns the rows it changes (the
run, its event, the operations and questions that moved); the column lists and the row
builders say what each table holds (`dead_letter_values`: the row of a DeadLetter record).
No I/O: the sink writes these rows, the audit compares them with what Postgres holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

from agentruns.connectors.postgres.bulk import clamp_ms
from agentruns.processors import versions
from agentruns.processors.effects import Effect
from agentruns.processors.events import (
    CancelConfirmed,
    CancelRequested,
    Event,
    ReconcileCompleted,
    ReconcileOutcome,
    TimerFired,
    ToolCallFailed,
    ToolCallSucceeded,
    UserReplied,
)
from agentruns.processors.limits import MAX_ID_CHARS
from agentruns.processors.state import SETTLED, Operation, OpStatus, Question, RunState
from agentruns.processors.tenants import tenant_of
from agentruns.processors.transition import Disposition
from agentruns.streams.dlq import MAX_REASON_CHARS, text
from agentruns.streams.records import parse_event_body

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def ms_time(ms: int) -> datetime:
    """Event-data milliseconds as an exact timestamptz value; outside what datetime holds, the
    nearest bound (as Postgres stores it, see agentruns.connectors.postgres.bulk.clamp_ms)."""
    return EPOCH + timedelta(milliseconds=clamp_ms(ms))


OP_COLUMNS = (
    "run_id",
    "op_key",
    "step",
    "tool",
    "call_id",
    "status",
    "dispatch",
    "retries",
    "polls",
    "policy_decision",
    "result_ref",
    "error_class",
    "error_code",
    "reconciliation",
    "cancel_unconfirmed",
    "seq",
)
QUESTION_COLUMNS = (
    "run_id",
    "question_id",
    "kind",
    "artifact_ref",
    "expires_at",
    "token_id",
    "state_version",
    "status",
    "opened_seq",
    "closed_seq",
    "seq",
)
RUN_COLUMNS = (
    "run_id",
    "last_seq",
    "status",
    "step",
    "attempt",
    "version",
    "resolution",
    "trace_id",
    "goal",
    "input_tokens",
    "output_tokens",
    "cost_micros",
    "tool_calls",
    "started_at",
    "last_event_at",
    "ended_at",
    "system_ms",
    "tool_wait_ms",
    "user_wait_ms",
    "outcome",
    "result_ref",
    "state",
    "forked_from_run_id",
    "forked_from_seq",
    "parent_run_id",
    "tenant",
)
EVENT_COLUMNS = (
    "run_id",
    "seq",
    "event_id",
    "type",
    "step",
    "attempt",
    "trace_id",
    "at",
    "disposition",
    "reason",
    "input_id",
    "status",
    "payload",
)


def op_row(run_id: str, op: Operation, seq: int, reconciliation: str | None) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "op_key": op.key,
        "step": op.step,
        "tool": op.tool,
        "call_id": op.call_id,
        "status": str(op.status),
        "dispatch": op.dispatch,
        "retries": op.retries,
        "polls": op.polls,
        "policy_decision": op.policy_decision,
        "result_ref": op.result_ref,
        "error_class": None if op.error_class is None else str(op.error_class),
        "error_code": op.error_code,
        "reconciliation": reconciliation,
        "cancel_unconfirmed": op.cancel_unconfirmed,
        "seq": seq,
    }


def question_row(
    run_id: str, q: Question, status: str, seq: int, *, opened: bool
) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "question_id": q.question_id,
        "kind": q.kind,
        "artifact_ref": q.artifact_ref,
        "expires_at": ms_time(q.expires_at),
        "token_id": q.token_id,
        "state_version": q.version,
        "status": status,
        "opened_seq": seq if opened else None,
        "closed_seq": None if opened else seq,
        "seq": seq,
    }


RUN_TIME_COLUMNS = frozenset({"started_at", "last_event_at", "ended_at"})


def run_values(state: RunState, last_seq: int) -> tuple[Any, ...]:
    """The runs row in RUN_COLUMNS order as the sink stages it: times as epoch milliseconds,
    the state as its canonical JSON text."""
    t = state.time
    usage = state.usage
    return (
        state.run_id,
        last_seq,
        str(state.status),
        state.step,
        state.attempt,
        state.version,
        state.resolution,
        state.trace_id,
        state.goal,
        usage.input_tokens,
        usage.output_tokens,
        usage.cost_micros,
        state.tool_calls,
        t.started_at,
        t.last_at,
        t.ended_at,
        t.system_ms,
        t.tool_wait_ms,
        t.user_wait_ms,
        state.outcome,
        state.result_ref,
        state.model_dump_json(),
        *_lineage(state),
        None if isinstance(state.parent, msgspec.UnsetType) else state.parent.run_id,
        tenant_of(state.tenant),
    )


def _lineage(state: RunState) -> tuple[str | None, int | None]:
    lineage = state.forked_from
    if isinstance(lineage, msgspec.UnsetType):
        return None, None
    return lineage.source_run_id, lineage.source_seq


def run_row(state: RunState, last_seq: int) -> dict[str, Any]:
    """The runs row as Postgres returns it (times as datetimes); audit compares with it."""
    row = dict(zip(RUN_COLUMNS, run_values(state, last_seq), strict=True))
    for c in RUN_TIME_COLUMNS:
        if row[c] is not None:
            row[c] = ms_time(row[c])
    return row


def event_values(record: dict[str, Any], status: str) -> tuple[Any, ...]:
    """The events row in EVENT_COLUMNS order as the sink stages it: `at` in epoch milliseconds,
    the payload the record's body as-is (the core's canonical JSON; Postgres parses it once)."""
    return (
        record["run_id"],
        record["seq"],
        record["event_id"],
        record["type"],
        record["step"],
        record["attempt"],
        record["trace_id"],
        record["at"],
        record["disposition"],
        record["reason"],
        record["input_id"],
        status,
        record["body"],
    )


def event_row(record: dict[str, Any], status: str) -> dict[str, Any]:
    """The events row as Postgres returns it (`at` as a datetime); audit compares with it."""
    row = dict(zip(EVENT_COLUMNS, event_values(record, status), strict=True))
    row["at"] = ms_time(row["at"])
    return row


def _settled_by(event: Event, old: Operation) -> Operation | None:
    """The last version of an op the transition settled and pruned in the same step (the core
    drops settled ops when a new step starts, so that version is in no state)."""
    if getattr(event, "operation_key", None) != old.key:
        return None
    match event:
        case ToolCallSucceeded():
            return old.model_copy(
                update={"status": OpStatus.SUCCEEDED, "result_ref": event.result_ref}
            )
        case ReconcileCompleted() if event.outcome is ReconcileOutcome.FOUND_SUCCEEDED:
            return old.model_copy(
                update={"status": OpStatus.SUCCEEDED, "result_ref": event.result_ref}
            )
        case ToolCallFailed():
            return old.model_copy(
                update={
                    "status": OpStatus.FAILED,
                    "error_class": event.error_class,
                    "error_code": event.error_code,
                }
            )
        case CancelConfirmed():
            return old.model_copy(update={"status": OpStatus.CANCELLED})
        case _:
            return None


def _question_end(event: Event, q: Question, applied: bool) -> str:
    if applied and isinstance(event, UserReplied) and event.question_id == q.question_id:
        return "answered"
    if isinstance(event, TimerFired) and event.timer_id == q.timer_id:
        return "expired"
    if isinstance(event, CancelRequested):
        return "cancelled"
    return "closed"


@dataclass
class Projected:
    """What one event adds to the projection."""

    state: RunState
    record: dict[str, Any]  # the Event record folded
    ops: list[dict[str, Any]]
    questions: list[dict[str, Any]]
    disposition: Disposition
    effects: tuple[Effect, ...] = ()
    reason: str | None = None

    @property
    def status(self) -> str:
        """The run status after the event (the events row's `status`)."""
        return str(self.state.status)

    @property
    def event(self) -> dict[str, Any]:
        """The events row (as Postgres returns it)."""
        return event_row(self.record, self.status)


def project_event(state: RunState | None, record: dict[str, Any]) -> Projected | None:
    """Fold one Event record into `state` under the run's rules version and say which rows
    change. Pure (used by audit too). Raises `versions.UnknownRulesVersionError` for a run of
    a rules version this build does not have.

    The sink's hot path: operations and questions are compared by identity (the core keeps an
    unchanged tuple/record as the same object), so an event that touches neither costs one parse
    and one transition.
    """
    event = parse_event_body(record["body"])
    # the run's own rules, for its whole life (UnknownRulesVersionError: a newer build's run)
    result = versions.apply(state, event)
    new = result.state
    if new is None:
        return None
    ops: list[dict[str, Any]] = []
    questions: list[dict[str, Any]] = []
    old_ops: tuple[Operation, ...] = () if state is None else state.ops
    old_q = None if state is None else state.question
    applied = result.disposition is Disposition.APPLIED
    if new.ops is not old_ops:
        run_id, seq = record["run_id"], record["seq"]
        recon = event.outcome.value if applied and isinstance(event, ReconcileCompleted) else None
        recon_key = getattr(event, "operation_key", None)
        before = {o.key: o for o in old_ops}
        for op in new.ops:
            if before.pop(op.key, None) is not op:
                ops.append(op_row(run_id, op, seq, recon if op.key == recon_key else None))
        for gone in before.values():  # pruned in this transition
            if gone.status in SETTLED:
                continue  # its final version was projected when it settled
            final = _settled_by(event, gone)
            if final is None:
                final = gone.model_copy(update={"status": OpStatus.CANCELLED})
            ops.append(op_row(run_id, final, seq, recon if gone.key == recon_key else None))
    if new.question is not old_q:
        run_id, seq = record["run_id"], record["seq"]
        if old_q is not None and (
            new.question is None or new.question.question_id != old_q.question_id
        ):
            status = _question_end(event, old_q, applied)
            questions.append(question_row(run_id, old_q, status, seq, opened=False))
        if new.question is not None and (
            old_q is None or old_q.question_id != new.question.question_id
        ):
            questions.append(question_row(run_id, new.question, "open", seq, opened=True))
    return Projected(new, record, ops, questions, result.disposition, result.effects, result.reason)


def merge_op(rows: dict[tuple[str, str], dict[str, Any]], row: dict[str, Any]) -> None:
    """Later version of an op wins; a reconciliation outcome sticks until a newer one."""
    key = (row["run_id"], row["op_key"])
    previous = rows.get(key)
    if previous is not None and row["reconciliation"] is None:
        row = {**row, "reconciliation": previous["reconciliation"]}
    rows[key] = row


def merge_question(rows: dict[tuple[str, str], dict[str, Any]], row: dict[str, Any]) -> None:
    key = (row["run_id"], row["question_id"])
    previous = rows.get(key)
    if previous is not None and row["opened_seq"] is None:
        row = {**row, "opened_seq": previous["opened_seq"]}
    rows[key] = row


RESULT_COLUMNS = (
    "run_id",
    "resolution",
    "status",
    "seq",
    "result_ref",
    "summary",
    "trace_id",
    "at",
)
SNAPSHOT_COLUMNS = ("run_id", "last_seq", "version", "status", "updated_at")


def result_values(r: dict[str, Any]) -> tuple[Any, ...]:
    """A Result record as the results row, in RESULT_COLUMNS order."""
    return (r["run_id"], r["version"], r["status"], r["seq"], r["result_ref"], r["summary"],
            r["trace_id"], r["at"])  # fmt: skip


def snapshot_values(s: dict[str, Any]) -> tuple[Any, ...]:
    return (s["run_id"], s["last_seq"], s["version"], s["status"], s["updated_at"])


DEAD_LETTER_COLUMNS = (
    "source_topic",
    "source_partition",
    "source_offset",
    "reason",
    "error_class",
    "at",
    "run_id",
    "original_key",
    "key_bytes",
    "original_value",
    "value_bytes",
    "original_timestamp",
    "dlq_partition",
    "dlq_offset",
)
#: The bytes of an original key or value a dead_letters row keeps (the size of the whole
#: beside them): what the console previews, never the whole of a hostile record.
STORED_BYTES = 4096
#: Characters kept of a dead letter's texts: a foreign writer's may be of any length.
REASON_CHARS = MAX_REASON_CHARS
CLASS_CHARS = 100
TOPIC_CHARS = 249  # Kafka's longest topic name
UNDECODABLE = "undecodable dead letter"


def _stored_text(value: str | None, limit: int) -> str | None:
    """A text as Postgres stores it: UTF-8 (lone surrogates replaced), no NUL, cut."""
    if value is None:
        return None
    return text(value).replace("\x00", "\ufffd")[:limit]


def _whole_size(stored: bytes | None, notes: Sequence[tuple[str, bytes | None]]) -> int:
    """The size of an original value: the `original_length` header `dlq.fit` adds when it cut
    the value to fit the topic, else the bytes the dead letter holds."""
    for key, raw in notes:
        if key == "original_length" and raw is not None and raw.isdigit() and len(raw) < 19:
            return max(int(raw), len(stored or b""))
    return len(stored or b"")


def dead_letter_values(
    record: dict[str, Any],
    dlq_partition: int,
    dlq_offset: int,
    notes: Sequence[tuple[str, bytes | None]] = (),
) -> tuple[Any, ...]:
    """The dead_letters row of a DeadLetter record in DEAD_LETTER_COLUMNS order (times in epoch
    milliseconds), from its position on the DLQ topic and that record's headers (`notes`)."""
    key: bytes | None = record.get("original_key")
    value: bytes | None = record.get("original_value")
    return (
        _stored_text(record["source_topic"], TOPIC_CHARS),
        record["source_partition"],
        record["source_offset"],
        _stored_text(record["reason"], REASON_CHARS),
        _stored_text(record["error_class"], CLASS_CHARS),
        record["at"],
        _stored_text(record.get("run_id"), MAX_ID_CHARS),
        None if key is None else key[:STORED_BYTES],
        len(key or b""),
        None if value is None else value[:STORED_BYTES],
        _whole_size(value, notes),
        record.get("original_timestamp"),
        dlq_partition,
        dlq_offset,
    )


def undecodable_dead_letter_values(
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    at: int,
    reason: str,
    error_class: str,
) -> tuple[Any, ...]:
    """The row of a record on the DLQ topic that is not a DeadLetter: keyed by its own
    position, its bytes kept as an original's (it is not sent to the DLQ again)."""
    return dead_letter_values(
        {
            "source_topic": topic,
            "source_partition": partition,
            "source_offset": offset,
            "reason": f"{UNDECODABLE}: {reason}",
            "error_class": error_class,
            "at": at,
            "original_key": key,
            "original_value": value,
        },
        partition,
        offset,
    )
