"""A run's timeline rebuilt from its event log alone by folding with the CURRENT core (R28):
per event its seq, time, type, disposition, status change, effects, operations and waits, as
text (`format_timeline`) or JSON (`timeline_json`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec

from agentruns.connectors.projection.rows import project_event
from agentruns.processors.effects import (
    AskUser,
    CallModel,
    CallTool,
    CancelTimer,
    CancelTool,
    Effect,
    NotifyParent,
    PollTool,
    PublishResult,
    Reconcile,
    ScheduleTimer,
)
from agentruns.processors.state import RunState
from agentruns.processors.transition import Disposition


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def describe_effect(effect: Effect) -> str:
    match effect:
        case CallModel():
            repair = f" repair={effect.repair.error_code}" if effect.repair else ""
            return f"CallModel {effect.step}.{effect.attempt}{repair}"
        case CallTool():
            op = effect.operation
            return f"CallTool {op.tool} op={op.key} dispatch={op.dispatch}"
        case Reconcile():
            return f"Reconcile {effect.tool} op={effect.operation_key}"
        case PollTool():
            return f"PollTool {effect.tool} op={effect.operation_key} poll={effect.poll}"
        case CancelTool():
            return f"CancelTool {effect.tool} op={effect.operation_key}"
        case ScheduleTimer():
            return f"ScheduleTimer {effect.purpose} due={_iso(effect.due_at)}"
        case CancelTimer():
            return f"CancelTimer {effect.timer_id}"
        case AskUser():
            return f"AskUser {effect.question_id} expires={_iso(effect.expires_at)}"
        case PublishResult():
            return f"PublishResult {effect.status} {effect.result_ref}"
        case NotifyParent():
            return f"NotifyParent {effect.run_id} op={effect.operation_key} {effect.status}"
    return str(effect.type)  # pragma: no cover - every effect type is listed above


@dataclass
class TimelineEntry:
    seq: int
    at: str
    type: str
    step: int
    attempt: int
    disposition: str
    recorded_disposition: str
    status_before: str | None
    status_after: str
    path: list[str]
    reason: str | None
    effects: list[str]
    operations: list[str]
    waits_ms: dict[str, int]
    # what the event added to the run's model usage (a model answer's tokens and cost)
    usage: dict[str, int]
    # a fork's first record: the source, the seq it was forked at, the edits
    lineage: dict[str, Any] | None = None


def timeline(records: Sequence[dict[str, Any]]) -> tuple[list[TimelineEntry], RunState | None]:
    """Fold a run's Event records with the current core; one entry per event."""
    state: RunState | None = None
    entries: list[TimelineEntry] = []
    for record in records:
        projected = project_event(state, record)
        if projected is None:
            continue
        new = projected.state
        before = {} if state is None else {o.key: o for o in state.ops}
        ops: list[str] = []
        for row in projected.ops:
            old = before.get(row["op_key"])
            was = "new" if old is None else str(old.status)
            polls = f" polls={row['polls']}" if row["polls"] else ""
            if row["reconciliation"]:
                polls += f" reconciled={row['reconciliation']}"
            ops.append(
                f"{row['tool']} op={row['op_key']} {was}->{row['status']} "
                f"dispatch={row['dispatch']}{polls}"
            )
        for q in projected.questions:
            expires = q["expires_at"].strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
            ops.append(f"question {q['question_id']} {q['kind']} {q['status']} expires={expires}")
        old_usage = None if state is None else state.usage
        usage = {
            k: getattr(new.usage, k) - (0 if old_usage is None else getattr(old_usage, k))
            for k in ("input_tokens", "output_tokens", "cost_micros")
        }
        waits = {"system": 0, "tool": 0, "user": 0}
        if state is not None:
            waits = {
                "system": new.time.system_ms - state.time.system_ms,
                "tool": new.time.tool_wait_ms - state.time.tool_wait_ms,
                "user": new.time.user_wait_ms - state.time.user_wait_ms,
            }
        applied = projected.disposition is Disposition.APPLIED
        lineage = None
        if applied and record["type"] == "ForkedFrom":
            lineage = lineage_of(new)
        entries.append(
            TimelineEntry(
                seq=record["seq"],
                at=_iso(record["at"]),
                type=record["type"],
                step=record["step"],
                attempt=record["attempt"],
                disposition=str(projected.disposition),
                recorded_disposition=record["disposition"],
                status_before=None if state is None else str(state.status),
                status_after=str(new.status),
                path=[str(s) for s in new.path] if applied else [],
                reason=projected.reason,
                effects=[describe_effect(e) for e in projected.effects],
                operations=ops,
                waits_ms=waits,
                usage=usage,
                lineage=lineage,
            )
        )
        state = new
    return entries, state


def lineage_of(state: RunState) -> dict[str, Any] | None:
    """The run's source, fork point and edits, when it is a fork."""
    lineage = state.forked_from
    if isinstance(lineage, msgspec.UnsetType):
        return None
    return lineage.model_dump()


def _lineage_line(lineage: dict[str, Any]) -> str:
    given = lineage["edits"]
    shown = [f"model_route={given['model_route']}"] if given.get("model_route") else []
    if given.get("replaced_inputs"):
        seqs = ",".join(str(r["seq"]) for r in given["replaced_inputs"])
        shown.append(f"replaced records {seqs}")
    edits = ", ".join(shown)
    return (
        f"forked from {lineage['source_run_id']} at seq {lineage['source_seq']}"
        f" (edits: {edits or 'none'})"
    )


def format_timeline(run_id: str, entries: Sequence[TimelineEntry], state: RunState | None) -> str:
    lines = [f"run {run_id}: {len(entries)} events"]
    for e in entries:
        change = (
            f"{e.status_before or '-'} -> {e.status_after}"
            if e.status_before != e.status_after
            else f"{e.status_after}"
        )
        disposition = e.disposition
        if e.recorded_disposition != e.disposition:
            disposition += f" (recorded {e.recorded_disposition})"
        lines.append(
            f"{e.seq:>4}  {e.at}  {e.type:<20} {e.step}.{e.attempt}  {disposition:<9} {change}"
        )
        if e.lineage is not None:
            lines.append(f"      {_lineage_line(e.lineage)}")
        if e.path and len(e.path) > 1:
            lines.append(f"      path: {' -> '.join(e.path)}")
        if e.reason:
            lines.append(f"      reason: {e.reason}")
        for effect in e.effects:
            lines.append(f"      effect: {effect}")
        for op in e.operations:
            kind = "" if op.startswith("question ") else "operation: "
            lines.append(f"      {kind}{op}")
        if any(e.usage.values()):
            lines.append(
                f"      usage: +{e.usage['input_tokens']} in / +{e.usage['output_tokens']} out"
                f" tokens, +{e.usage['cost_micros']} micros"
            )
        waited = ", ".join(f"{k} +{v}ms" for k, v in e.waits_ms.items() if v)
        if waited:
            lines.append(f"      time: {waited}")
    if state is not None:
        t = state.time
        lineage = lineage_of(state)
        if lineage is not None:
            lines.append(_lineage_line(lineage))
        parent = state.parent
        if not isinstance(parent, msgspec.UnsetType):
            lines.append(
                f"started by {parent.run_id} (its call of {parent.tool} at step {parent.step},"
                f" op={parent.operation_key}, depth {parent.depth})"
            )
        lines.append(
            f"final: {state.status} step {state.step} version {state.version} "
            f"resolution {state.resolution} outcome {state.outcome or '-'}"
        )
        lines.append(
            f"time: system {t.system_ms}ms, tool wait {t.tool_wait_ms}ms, "
            f"user wait {t.user_wait_ms}ms; usage: {state.usage.input_tokens} in / "
            f"{state.usage.output_tokens} out tokens, {state.usage.cost_micros} micros"
        )
        if state.result_ref:
            lines.append(f"result: {state.result_ref}")
    return "\n".join(lines)


def timeline_json(run_id: str, entries: Sequence[TimelineEntry], state: RunState | None) -> str:
    final = None
    if state is not None:
        final = {
            "status": str(state.status),
            "step": state.step,
            "version": state.version,
            "resolution": state.resolution,
            "outcome": state.outcome,
            "result_ref": state.result_ref,
            "time": state.time.model_dump(),
            "usage": state.usage.model_dump(),
            "forked_from": lineage_of(state),
        }
    return json.dumps(
        {"run_id": run_id, "events": [asdict(e) for e in entries], "final": final},
        sort_keys=True,
    )
