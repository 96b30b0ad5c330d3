"""The transition function and its table: ``transition(state, event) -> Transition`` (R1).

The table maps (status, event type) to a handler and the statuses it may enter. A pair
missing from the table is REJECTED (or LATE once the run is terminal). Handlers never raise
for domain failures: they return terminal states, PAUSED, or a non-APPLIED disposition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgspec
from msgspec.structs import replace

from agentruns.processors.catalog import refusal as catalog_refusal
from agentruns.processors.children import child_call, parent_problem
from agentruns.processors.effects import (
    AskUser,
    CallModel,
    CallTool,
    CancelTimer,
    CancelTool,
    Effect,
    NotifyParent,
    OperationSpec,
    PollTool,
    PublishResult,
    Reconcile,
    RepairNote,
    ScheduleTimer,
)
from agentruns.processors.events import (
    CancelConfirmed,
    CancelRequested,
    CancelUnconfirmed,
    Candidate,
    Event,
    ForkedFrom,
    GapTimedOut,
    GoalChanged,
    InputRefused,
    KnowledgeRefreshed,
    Message,
    ModelCallCompleted,
    ModelOutcome,
    ModelUsage,
    ReconcileCompleted,
    ReconcileOutcome,
    RedriveRequested,
    RunReopened,
    RunResolved,
    RunSubmitted,
    TimerFired,
    ToolCallAccepted,
    ToolCallFailed,
    ToolCallSucceeded,
    ToolCallTimedOut,
    ToolStatusReported,
    UserReplied,
)
from agentruns.processors.ids import (
    canonical_json,
    content_ref,
    derive_key,
    effect_key,
    operation_key,
    question_id,
    resume_token_id,
    sha256_hex,
    short_hash,
    timer_id,
)
from agentruns.processors.limits import MAX_TIME_MS
from agentruns.processors.state import (
    IN_FLIGHT,
    NON_TERMINAL,
    TERMINAL,
    TRANSIENT,
    Budgets,
    Decoder,
    ErrorClass,
    Frozen,
    Lineage,
    LoopMemory,
    Operation,
    OpStatus,
    Question,
    RunConfig,
    RunState,
    RunStatus,
    TimeAccount,
    Timer,
    TimerPurpose,
    Usage,
    ValidationRecord,
)
from agentruns.processors.validation import (
    ASK_WHEN_EXHAUSTED,
    ValidatedCall,
    ValidationContext,
    failure_reason,
    revalidate,
    schema_problem,
    task_problem,
)

RECENT_EVENT_IDS = 8
RESULT_REFS_KEPT = 24
LOOP_WINDOW = 8
DEFAULT_BACKOFF_MS = 1_000

APPROVAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["approved"],
    "properties": {"approved": {"type": "boolean"}, "comment": {"type": "string"}},
}
CLARIFICATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["answer"],
    "properties": {"answer": {"type": "string", "minLength": 1}},
}


class Disposition(StrEnum):
    APPLIED = "APPLIED"
    DUPLICATE = "DUPLICATE"
    LATE = "LATE"
    REJECTED = "REJECTED"


class Artifact(Frozen, frozen=True, kw_only=True, gc=False):
    """A content-addressed blob to persist before the new state commits (R2)."""

    ref: str
    media_type: str
    content: str


def make_artifact(content: str, media_type: str = "application/json") -> Artifact:
    return Artifact(ref=content_ref(content), media_type=media_type, content=content)


@dataclass(frozen=True, slots=True)
class Transition:
    """The result of one transition; an in-process value, never serialized as a whole."""

    state: RunState | None
    effects: tuple[Effect, ...] = ()
    artifacts: tuple[Artifact, ...] = ()
    disposition: Disposition = Disposition.APPLIED
    reason: str | None = None


def _unchanged(state: RunState | None, disposition: Disposition, reason: str) -> Transition:
    return Transition(state=state, disposition=disposition, reason=reason)


# --------------------------------------------------------------------------- accumulator


@dataclass(slots=True)
class _Out:
    """Effects, artifacts and the status path collected while one handler runs."""

    base: RunState
    event: Event
    effects: list[Effect] = field(default_factory=list)
    artifacts: list[Artifact] = field(default_factory=list)
    path: list[RunStatus] = field(default_factory=list)

    @property
    def at(self) -> int:
        return self.event.at

    @property
    def version(self) -> int:
        """The version the new state will have."""
        return self.base.version + 1

    def store(self, content: str, media_type: str = "application/json") -> str:
        art = make_artifact(content, media_type)
        if all(a.ref != art.ref for a in self.artifacts):
            self.artifacts.append(art)
        return art.ref

    def ids(self, s: RunState, step: int | None = None) -> dict[str, Any]:
        return {
            "run_id": s.run_id,
            "step": s.step if step is None else step,
            "attempt": s.attempt,
            "trace_id": s.trace_id,
        }

    def done(self, s: RunState, reason: str | None = None) -> Transition:
        base = self.base
        at = self.at
        t = base.time
        delta = at - t.last_at if at > t.last_at else 0
        was = base.status
        status = self.path[-1] if self.path else s.status
        ended_at = (t.ended_at if was in TERMINAL else at) if status in TERMINAL else None
        last_at = at if at > t.last_at else t.last_at
        # the time since the last event goes to whoever the run was waiting for (R16)
        if was is RunStatus.WAITING_USER or was is RunStatus.PAUSED:
            t = replace(t, last_at=last_at, ended_at=ended_at, user_wait_ms=t.user_wait_ms + delta)
        elif was is RunStatus.TOOL_RUNNING or was is RunStatus.WAITING_TOOL:
            t = replace(t, last_at=last_at, ended_at=ended_at, tool_wait_ms=t.tool_wait_ms + delta)
        elif was not in TERMINAL:
            t = replace(t, last_at=last_at, ended_at=ended_at, system_ms=t.system_ms + delta)
        else:
            t = replace(t, last_at=last_at, ended_at=ended_at)
        recent = base.recent_event_ids
        new = replace(
            s,
            status=status,
            version=base.version + 1,
            path=tuple(self.path),
            time=t,
            recent_event_ids=(
                (*recent, self.event.event_id)
                if len(recent) < RECENT_EVENT_IDS
                else (*recent[1 - RECENT_EVENT_IDS :], self.event.event_id)
            ),
        )
        return Transition(
            state=new,
            effects=tuple(self.effects),
            artifacts=tuple(self.artifacts),
            disposition=Disposition.APPLIED,
            reason=reason,
        )


def _goto(s: RunState, out: _Out, status: RunStatus) -> RunState:
    """Enter ``status``; recorded in the path and applied once, when the transition is done."""
    out.path.append(status)
    return s


# --------------------------------------------------------------------------- timers


def _due(at: int, delay_ms: int) -> int:
    """``at`` plus a delay, capped at the last representable time: both are bounded inputs, but
    their sum may not be, and every consumer of a timer turns it into a date."""
    return min(at + delay_ms, MAX_TIME_MS)


def _schedule(
    s: RunState, out: _Out, purpose: TimerPurpose, due_at: int, op_key: str | None = None
) -> RunState:
    tid = timer_id(s.run_id, purpose.value, s.step, s.attempt, op_key or "", out.version)
    out.effects.append(
        ScheduleTimer(
            idempotency_key=effect_key("schedule_timer", s.run_id, s.step, s.attempt, tid),
            timer_id=tid,
            due_at=due_at,
            purpose=purpose,
            **out.ids(s),
        )
    )
    timer = Timer(timer_id=tid, purpose=purpose, due_at=due_at, op_key=op_key)
    return replace(s, timers=(*s.timers, timer))


def _cancel_timers(s: RunState, out: _Out, keep: Callable[[Timer], bool]) -> RunState:
    if all(keep(t) for t in s.timers):
        return s
    kept: list[Timer] = []
    for t in s.timers:
        if keep(t):
            kept.append(t)
            continue
        out.effects.append(
            CancelTimer(
                idempotency_key=effect_key("cancel_timer", s.run_id, s.step, s.attempt, t.timer_id),
                timer_id=t.timer_id,
                **out.ids(s),
            )
        )
    return replace(s, timers=tuple(kept))


def _drop_timer(s: RunState, tid: str) -> RunState:
    return replace(s, timers=tuple(t for t in s.timers if t.timer_id != tid))


# --------------------------------------------------------------------------- terminal


def _terminate(
    s: RunState, out: _Out, status: RunStatus, reason: str, answer_ref: str | None = None
) -> RunState:
    """Enter a terminal status with cleanup effects and a published result artifact."""
    for op in s.ops:
        if op.status in IN_FLIGHT and _cancellable(s, op):
            out.effects.append(_cancel_tool(s, out, op))
    s = _cancel_timers(s, out, keep=lambda _t: False)
    result = {
        "run_id": s.run_id,
        "status": status.value,
        "resolution": s.resolution,
        "reason": reason,
        "step": s.step,
        "answer_ref": answer_ref,
        "goal": s.goal,
        "usage": s.usage.model_dump(),
        "tool_calls": s.tool_calls,
        "completed_operations": s.completed_ops,
        "operations": [
            {"key": o.key, "tool": o.tool, "status": o.status.value, "result_ref": o.result_ref}
            for o in s.ops
        ],
        "evidence": list(s.result_refs),
        "warnings": list(s.warnings),
        "time": {
            "started_at": s.time.started_at,
            "ended_at": out.at,
            "system_ms": s.time.system_ms,
            "tool_wait_ms": s.time.tool_wait_ms,
            "user_wait_ms": s.time.user_wait_ms,
        },
    }
    ref = out.store(canonical_json(result))
    out.effects.append(
        PublishResult(
            idempotency_key=effect_key(
                "publish", s.run_id, s.step, s.attempt, s.resolution, status.value
            ),
            status=status,
            resolution=s.resolution,
            result_ref=ref,
            summary=f"{status.value}: {reason}"[:300],
            tenant=s.tenant,
            **out.ids(s),
        )
    )
    parent = s.parent
    if not isinstance(parent, msgspec.UnsetType):  # a child's end answers its parent's call
        out.effects.append(
            NotifyParent(
                idempotency_key=effect_key(
                    "notify_parent", s.run_id, s.step, s.attempt, s.resolution, status.value
                ),
                run_id=parent.run_id,
                step=parent.step,
                attempt=s.attempt,
                trace_id=parent.trace_id,
                child_run_id=s.run_id,
                operation_key=parent.operation_key,
                tool=parent.tool,
                dispatch=parent.dispatch,
                status=status,
                result_ref=ref,
                answer_ref=answer_ref,
                reason=reason[:300],
                usage=s.usage,
            )
        )
    s = replace(s, outcome=reason, result_ref=ref, question=None, pending_final_ref=None)
    return _goto(s, out, status)


def _cancel_tool(s: RunState, out: _Out, op: Operation) -> CancelTool:
    return CancelTool(
        idempotency_key=effect_key(
            "cancel_tool", s.run_id, op.step, s.attempt, op.key, op.dispatch
        ),
        operation_key=op.key,
        tool=op.tool,
        dispatch=op.dispatch,
        **out.ids(s, op.step),
    )


# --------------------------------------------------------------------------- budgets, loops


def budget_problem(s: RunState, at: int) -> tuple[RunStatus, str] | None:
    """The budget that ran out at ``at`` (R8), or None."""
    b = s.config.budgets
    if b.deadline_at is not None and at >= b.deadline_at:
        return RunStatus.EXPIRED, "deadline"
    if s.step > b.max_steps:
        return RunStatus.BUDGET_EXHAUSTED, "budget:max_steps"
    if b.max_tokens is not None and s.usage.total_tokens >= b.max_tokens:
        return RunStatus.BUDGET_EXHAUSTED, "budget:max_tokens"
    if b.max_cost_micros is not None and s.usage.cost_micros >= b.max_cost_micros:
        return RunStatus.BUDGET_EXHAUSTED, "budget:max_cost"
    if b.max_tool_calls is not None and s.tool_calls > b.max_tool_calls:
        return RunStatus.BUDGET_EXHAUSTED, "budget:max_tool_calls"
    return None


def _all_same(items: tuple[str, ...], n: int) -> bool:
    return n > 0 and len(items) >= n and len(set(items[-n:])) == 1


def record_error(s: RunState, code: str) -> tuple[RunState, str | None]:
    """Remember an error code; name the loop if the same code repeats (R21)."""
    errors = (*s.loop.recent_errors, code)[-LOOP_WINDOW:]
    s = replace(s, loop=replace(s.loop, recent_errors=errors))
    if _all_same(errors, s.config.loop.max_repeat_error):
        return s, f"loop:repeated_error:{code}"
    return s, None


def record_actions(s: RunState, action_hashes: list[str]) -> tuple[RunState, str | None]:
    """Remember tool+args hashes and the step's plan hash; name a loop pattern (R21)."""
    loop, pattern = _remember_actions(s, action_hashes)
    return replace(s, loop=loop), pattern


def _remember_actions(s: RunState, action_hashes: list[str]) -> tuple[LoopMemory, str | None]:
    """``record_actions`` without the state copy: the new loop memory and the loop it names."""
    limits = s.config.loop
    actions = (*s.loop.recent_actions, *action_hashes)[-LOOP_WINDOW:]
    plan = action_hashes[0] if len(action_hashes) == 1 else short_hash(*sorted(action_hashes))
    plans = (*s.loop.plan_history, plan)[-4:]
    loop = replace(s.loop, recent_actions=actions, plan_history=plans)
    if _all_same(actions, limits.max_repeat_action):
        return loop, "loop:repeated_action"
    if (
        limits.detect_oscillation
        and len(plans) == 4
        and plans[0] == plans[2]
        and plans[1] == plans[3]
        and plans[0] != plans[1]
    ):
        return loop, "loop:plan_oscillation"
    return loop, None


def _mark_progress(s: RunState) -> RunState:
    return replace(s, loop=replace(s.loop, progress_in_step=True))


# --------------------------------------------------------------------------- READY and model


def _enter_ready(
    s: RunState, out: _Out, new_step: bool, messages: tuple[Message, ...] = ()
) -> RunState:
    """READY: check budgets and loops, freeze the step's context artifact, call the model."""
    if new_step:
        made_progress = s.loop.progress_in_step
        loop = replace(
            s.loop,
            progress_in_step=False,
            steps_without_progress=0 if made_progress else s.loop.steps_without_progress + 1,
        )
        s = replace(
            s,
            step=s.step + 1,
            attempt=1,
            repairs=0,
            model_failures=0,
            loop=loop,
            ops=tuple(o for o in s.ops if o.status in IN_FLIGHT),
            pending_final_ref=None,
        )
    s = _goto(s, out, RunStatus.READY)
    problem = budget_problem(s, out.at)
    if problem is not None:
        return _terminate(s, out, problem[0], problem[1])
    if s.loop.steps_without_progress >= s.config.loop.max_steps_without_progress:
        reason = f"loop:no_progress:{s.loop.steps_without_progress}_steps"
        if s.config.policy.on_no_progress == "fail":
            return _terminate(s, out, RunStatus.FAILED, reason)
        return _goto(replace(s, outcome=reason), out, RunStatus.PAUSED)
    context = _context(
        s,
        previous_context=s.context_ref if new_step else None,
        previous_candidate=s.candidate_ref if new_step else None,
        messages=messages,
        inputs=s.step_inputs,
    )
    ref = out.store(canonical_json(context))
    s = replace(s, context_ref=ref, step_inputs=(), candidate_ref=None)
    return _call_model(s, out)  # one copy per new step above, one here


def _context(
    s: RunState,
    *,
    previous_context: str | None,
    previous_candidate: str | None,
    messages: tuple[Message, ...],
    inputs: tuple[str, ...],
) -> dict[str, Any]:
    """The frozen context document of a model call (R7): what the model is asked with."""
    b = s.config.budgets
    return {
        "run_id": s.run_id,
        "step": s.step,
        "goal": s.goal,
        "previous_context": previous_context,
        "previous_candidate": previous_candidate,
        "messages": [m.model_dump() for m in messages],
        "inputs": list(inputs),
        "memory_ref": s.memory_ref,
        "evidence_refs": list(s.evidence_refs),
        "config_ref": s.config.config_ref,
        "model_route": s.config.model_route,
        "remaining": {
            "deadline_at": b.deadline_at,
            "steps": b.max_steps - s.step,
            "tokens": None if b.max_tokens is None else b.max_tokens - s.usage.total_tokens,
            "cost_micros": (
                None if b.max_cost_micros is None else b.max_cost_micros - s.usage.cost_micros
            ),
            "tool_calls": None if b.max_tool_calls is None else b.max_tool_calls - s.tool_calls,
        },
    }


def _call_model(s: RunState, out: _Out, repair: RepairNote | None = None) -> RunState:
    assert s.context_ref is not None
    out.effects.append(
        CallModel(
            idempotency_key=effect_key("call_model", s.run_id, s.step, s.attempt),
            context_ref=s.context_ref,
            model_route=s.config.model_route,
            repair=repair,
            **out.ids(s),
        )
    )
    return _goto(s, out, RunStatus.MODEL_RUNNING)


def _new_attempt(s: RunState, out: _Out, repair: RepairNote | None = None) -> RunState:
    """A retry on the SAME context artifact (R7, R9); budgets are checked first (R8)."""
    s = replace(s, attempt=s.attempt + 1)
    problem = budget_problem(s, out.at)
    if problem is not None:
        return _terminate(s, out, problem[0], problem[1])
    return _call_model(s, out, repair)


def _on_model_completed(s: RunState, e: ModelCallCompleted) -> Transition:
    if (e.step, e.attempt) != (s.step, s.attempt):
        return _unchanged(s, Disposition.LATE, f"result of old attempt {e.step}.{e.attempt}")
    out = _Out(s, e)
    usage_total = Usage(
        input_tokens=s.usage.input_tokens + e.usage.input_tokens,
        output_tokens=s.usage.output_tokens + e.usage.output_tokens,
        cost_micros=s.usage.cost_micros + e.usage.cost_micros,
    )
    if e.outcome is ModelOutcome.FINISHED and e.candidate is not None:
        candidate_json = e.candidate.model_dump_json()
        ref = out.store(candidate_json)
        # applied together with the validation decision: one state copy instead of two
        applied = {"usage": usage_total, "candidate_ref": e.candidate_ref or ref}
        return out.done(_validate(s, out, e.candidate, candidate_json, applied))
    s = replace(s, usage=usage_total)
    match e.outcome:
        case ModelOutcome.BLOCKED:
            return out.done(_terminate(s, out, RunStatus.FAILED, "model:blocked"))
        case ModelOutcome.RATE_LIMITED:
            due = _due(out.at, e.retry_after_ms or DEFAULT_BACKOFF_MS)
            deadline = s.config.budgets.deadline_at
            if deadline is not None and due >= deadline:
                return out.done(_terminate(s, out, RunStatus.EXPIRED, "deadline:backoff"))
            s = _goto(s, out, RunStatus.READY)
            return out.done(_schedule(s, out, TimerPurpose.MODEL_BACKOFF, due))
        case _:
            # incomplete, truncated, transport error, or "finished" without a parsed candidate
            finished = e.outcome is ModelOutcome.FINISHED
            reason = "finished_without_candidate" if finished else e.outcome.value
            if s.model_failures + 1 >= s.config.policy.max_model_attempts:
                return out.done(
                    _terminate(s, out, RunStatus.FAILED, f"model:retries_exhausted:{reason}")
                )
            s = replace(s, model_failures=s.model_failures + 1)
            return out.done(_new_attempt(s, out))


# --------------------------------------------------------------------------- VALIDATING


def _validate(
    s: RunState, out: _Out, candidate: Candidate, candidate_json: str, applied: dict[str, Any]
) -> RunState:
    """``applied``: the model result's state update, folded into the decision's copy."""
    s = _goto(s, out, RunStatus.VALIDATING)
    cref = applied["candidate_ref"] or ""
    # the validation context reads neither usage nor candidate_ref, so ``s`` may lag here
    decision = revalidate(
        candidate, ValidationContext.from_state(s), s.config.validator_version, candidate_json
    )
    record = ValidationRecord(
        validator_version=decision.validator_version,
        candidate_ref=cref,
        ok=decision.ok,
        action=decision.action,
        error_code=decision.error_code,
        evidence_hash=decision.evidence_hash,
    )
    s = s.model_copy(update={**applied, "last_decision": record})
    match decision.action:
        case "dispatch" | "approve":
            return _dispatch(s, out, decision.calls, approve=decision.action == "approve")
        case "finalize":
            return _finalize(s, out, cref, candidate.content)
        case _:
            code = decision.error_code or "INVALID"
            s, loop = record_error(s, code)
            if loop is not None:
                return _terminate(s, out, RunStatus.FAILED, loop)
            if decision.action == "repair" and s.repairs < s.config.policy.max_repairs:
                s = replace(s, repairs=s.repairs + 1)
                note = RepairNote(candidate_ref=cref, error_code=code, detail=decision.detail)
                return _new_attempt(s, out, note)
            if decision.action == "repair" and code in ASK_WHEN_EXHAUSTED:
                return _ask(s, out, "clarification", {"problem": code, "detail": decision.detail})
            return _terminate(s, out, RunStatus.FAILED, failure_reason(code, decision.detail))


def _op_spec(s: RunState, out: _Out, op: Operation) -> OperationSpec:
    spec = s.config.tool(op.tool)
    operation = OperationSpec(
        key=op.key,
        tool=op.tool,
        arguments_json=op.args_json,
        expected_version=op.expected_version,
        policy_decision=op.policy_decision,
        dispatch=op.dispatch,
        permission=None if spec is None else spec.permission,
    )
    if spec is None or not spec.starts_run:
        return operation
    # a child run: the caller's part of its task (counted in `s` already)
    ordinal = _children(s)
    return replace(operation, child=child_call(s, out.at, ordinal, s.tool_calls))


def _children(s: RunState) -> int:
    return 0 if isinstance(s.children, msgspec.UnsetType) else s.children


def _counted_children(s: RunState, ops: Iterable[Operation]) -> RunState:
    """``s`` with the child runs that ``ops`` start counted."""
    started = sum(1 for o in ops if _starts_run(s, o))
    return replace(s, children=_children(s) + started) if started else s


def _starts_run(s: RunState, op: Operation) -> bool:
    spec = s.config.tool(op.tool)
    return spec is not None and spec.starts_run


def _send(s: RunState, out: _Out, op: Operation) -> None:
    out.effects.append(
        CallTool(
            idempotency_key=effect_key(
                "call_tool", s.run_id, op.step, s.attempt, op.key, op.dispatch
            ),
            operation=_op_spec(s, out, op),
            **out.ids(s, op.step),
        )
    )


def _dispatch(s: RunState, out: _Out, calls: Iterable[ValidatedCall], approve: bool) -> RunState:
    ops: dict[str, Operation] = {}
    for call in calls:
        key = operation_key(s.run_id, s.step, call.tool, call.arguments_json)
        ops.setdefault(
            key,
            Operation(
                key=key,
                step=s.step,
                tool=call.tool,
                call_id=call.call_id,
                args_json=call.arguments_json,
                action_hash=short_hash(call.tool, call.arguments_json),
                expected_version=call.expected_version,
                status=OpStatus.PROPOSED if approve else OpStatus.DISPATCHED,
            ),
        )
    limit = s.config.budgets.max_tool_calls
    if limit is not None and s.tool_calls + len(ops) > limit:
        return _terminate(s, out, RunStatus.BUDGET_EXHAUSTED, "budget:max_tool_calls")
    loop, pattern = _remember_actions(s, [o.action_hash for o in ops.values()])
    if pattern is not None:
        return _terminate(replace(s, loop=loop), out, RunStatus.FAILED, pattern)
    update: dict[str, Any] = {"loop": loop, "ops": (*s.ops, *ops.values())}
    if approve:
        payload = {"approve": [{"tool": o.tool, "arguments": o.args_json} for o in ops.values()]}
        return _ask(s.model_copy(update=update), out, "approval", payload)
    update["tool_calls"] = s.tool_calls + len(ops)
    s = s.model_copy(update=update)
    before = _children(s)
    for op in ops.values():
        if _starts_run(s, op):  # each child its own number among the caller's children
            before += 1
            s = replace(s, children=before)
        _send(s, out, op)
    return _goto(s, out, RunStatus.TOOL_RUNNING)


def _start_approved(s: RunState, out: _Out) -> RunState:
    ops = []
    started = sum(1 for o in s.ops if o.status is OpStatus.PROPOSED)
    s = replace(s, tool_calls=s.tool_calls + started)
    for op in s.ops:
        if op.status is OpStatus.PROPOSED:
            op = replace(op, status=OpStatus.DISPATCHED, policy_decision="approved")
            s = _counted_children(s, (op,))
            _send(s, out, op)
        ops.append(op)
    s = replace(s, ops=tuple(ops))
    return _goto(s, out, RunStatus.TOOL_RUNNING)


# --------------------------------------------------------------------------- FINALIZING


def _finalize(s: RunState, out: _Out, answer_ref: str, content: str) -> RunState:
    s = _goto(s, out, RunStatus.FINALIZING)
    open_ops = [o for o in s.ops if o.status in IN_FLIGHT or o.status is OpStatus.UNKNOWN]
    if open_ops:
        s = replace(s, pending_final_ref=answer_ref)
        return _goto(s, out, _tool_phase(s))
    missing = [t for t in s.config.policy.required_tools if t not in s.succeeded_tools]
    if missing:
        return _terminate(s, out, RunStatus.FAILED, f"finalize:unverified:{','.join(missing)}")
    return _terminate(s, out, RunStatus.SUCCEEDED, content[:200] or "answer", answer_ref)


# --------------------------------------------------------------------------- WAITING_USER


def _ask(s: RunState, out: _Out, kind: str, payload: dict[str, Any]) -> RunState:
    schema = APPROVAL_SCHEMA if kind == "approval" else CLARIFICATION_SCHEMA
    qid = question_id(s.run_id, s.step, s.attempt, kind, out.version)
    body = {"run_id": s.run_id, "question_id": qid, "kind": kind, "step": s.step, **payload}
    ref = out.store(canonical_json(body))
    expires = _due(out.at, s.config.policy.user_wait_ms)
    s = _schedule(s, out, TimerPurpose.USER_EXPIRY, expires)
    token = resume_token_id(s.run_id, qid, out.version)
    question = Question(
        question_id=qid,
        kind="approval" if kind == "approval" else "clarification",
        artifact_ref=ref,
        response_schema=schema,
        expires_at=expires,
        token_id=token,
        version=out.version,
        timer_id=s.timers[-1].timer_id,
    )
    out.effects.append(
        AskUser(
            idempotency_key=effect_key("ask_user", s.run_id, s.step, s.attempt, qid),
            question_id=qid,
            question_ref=ref,
            response_schema=schema,
            expires_at=expires,
            token_id=token,
            state_version=out.version,
            **out.ids(s),
        )
    )
    return _goto(replace(s, question=question), out, RunStatus.WAITING_USER)


def _on_user_replied(s: RunState, e: UserReplied) -> Transition:
    q = s.question
    if q is None:
        return _unchanged(s, Disposition.REJECTED, "no open question")
    if e.question_id != q.question_id:
        return _unchanged(s, Disposition.REJECTED, "reply to an older question")
    if e.token_id != q.token_id:
        return _unchanged(s, Disposition.REJECTED, "resume token does not match")
    if e.state_version != q.version:
        return _unchanged(s, Disposition.REJECTED, "state version changed since the question")
    if e.at >= q.expires_at:
        return _unchanged(s, Disposition.REJECTED, "reply after expiry")
    problem = schema_problem(q.response_schema, e.response)
    if problem is not None:
        return _unchanged(s, Disposition.REJECTED, f"response invalid: {problem}")
    out = _Out(s, e)
    reply_ref = out.store(canonical_json({"question_id": q.question_id, "response": e.response}))
    s = _cancel_timers(s, out, keep=lambda t: t.timer_id != q.timer_id)
    s = _mark_progress(replace(s, question=None))
    if q.kind == "approval" and e.response.get("approved") is True:
        return out.done(_start_approved(s, out))
    if q.kind == "approval":
        ops = tuple(o for o in s.ops if o.status is not OpStatus.PROPOSED)
        s = replace(s, ops=ops, step_inputs=(*s.step_inputs, "approval_denied"))
    s = replace(s, step_inputs=(*s.step_inputs, reply_ref))
    return out.done(_enter_ready(s, out, new_step=True))


# --------------------------------------------------------------------------- tools


def _tool_phase(s: RunState) -> RunStatus:
    statuses = {o.status for o in s.ops}
    if OpStatus.DISPATCHED in statuses or OpStatus.UNKNOWN in statuses:
        return RunStatus.TOOL_RUNNING
    if OpStatus.ACCEPTED in statuses or OpStatus.RUNNING in statuses:
        return RunStatus.WAITING_TOOL
    return RunStatus.TOOL_RUNNING


def _replaced(ops: tuple[Operation, ...], op: Operation) -> tuple[Operation, ...]:
    return tuple([op if o.key == op.key else o for o in ops])


def _replace_op(s: RunState, op: Operation) -> RunState:
    return replace(s, ops=_replaced(s.ops, op))


def _resend(s: RunState, out: _Out, op: Operation, retries: int | None = None) -> RunState:
    """Dispatch an operation again with the SAME key (R12); never two dispatches in flight."""
    op = replace(
        op,
        status=OpStatus.DISPATCHED,
        dispatch=op.dispatch + 1,
        retries=op.retries if retries is None else retries,
        error_class=None,
        error_code=None,
    )
    _send(s, out, op)
    return _replace_op(s, op)


def _advance(s: RunState, out: _Out) -> RunState:
    """After an operation changed: wait, finish the cancel, finalize, ask, or next step."""
    in_flight = any(o.status in IN_FLIGHT for o in s.ops)
    if s.cancel_requested:
        if in_flight:
            return _goto(s, out, _tool_phase(s))
        unknown = any(o.status is OpStatus.UNKNOWN or o.cancel_unconfirmed for o in s.ops)
        if unknown:
            return _terminate(s, out, RunStatus.CANCEL_UNKNOWN, "cancel:unconfirmed")
        return _terminate(s, out, RunStatus.CANCELLED, "cancel:confirmed")
    unknown = any(o.status is OpStatus.UNKNOWN for o in s.ops)
    backoff = any(t.purpose is TimerPurpose.TOOL_BACKOFF for t in s.timers)
    if in_flight or unknown or backoff:
        return _goto(s, out, _tool_phase(s))
    if s.pending_final_ref is not None:
        return _finalize(s, out, s.pending_final_ref, "answer")
    ambiguous = [o for o in s.ops if o.error_class is ErrorClass.OBJECT_AMBIGUOUS]
    if ambiguous:
        op = ambiguous[0]
        return _ask(s, out, "clarification", {"ambiguous": op.tool, "code": op.error_code})
    return _enter_ready(s, out, new_step=True)


def _lookup(s: RunState, e: Any, allowed: frozenset[OpStatus]) -> Operation | Transition:
    op = s.op(e.operation_key)
    if op is None:
        return _unchanged(s, Disposition.REJECTED, "unknown operation")
    if e.dispatch != op.dispatch or op.status not in allowed:
        return _unchanged(s, Disposition.LATE, f"operation is {op.status.value}/{op.dispatch}")
    return op


_POLLABLE = frozenset({OpStatus.ACCEPTED, OpStatus.RUNNING})


def _on_tool_accepted(s: RunState, e: ToolCallAccepted) -> Transition:
    op = _lookup(s, e, frozenset({OpStatus.DISPATCHED}))
    if isinstance(op, Transition):
        return op
    out = _Out(s, e)
    s = _replace_op(s, replace(op, status=OpStatus.ACCEPTED))
    due = _due(out.at, e.poll_after_ms or s.config.policy.poll_interval_ms)
    s = _schedule(s, out, TimerPurpose.TOOL_POLL, due, op.key)
    return out.done(_advance(s, out))


def _on_tool_status(s: RunState, e: ToolStatusReported) -> Transition:
    op = _lookup(s, e, _POLLABLE)
    if isinstance(op, Transition):
        return op
    if e.poll != op.polls or op.polls == 0:
        return _unchanged(s, Disposition.LATE, f"answer to poll {e.poll}, latest is {op.polls}")
    if any(t.op_key == op.key and t.purpose is TimerPurpose.TOOL_POLL for t in s.timers):
        return _unchanged(s, Disposition.LATE, "a poll is already scheduled")
    out = _Out(s, e)
    status = OpStatus.RUNNING if e.status == "running" else OpStatus.ACCEPTED
    s = _replace_op(s, replace(op, status=status))
    due = _due(out.at, s.config.policy.poll_interval_ms)
    s = _schedule(s, out, TimerPurpose.TOOL_POLL, due, op.key)
    return out.done(_advance(s, out))


def _succeed(
    s: RunState,
    out: _Out,
    op: Operation,
    result_ref: str | None,
    summary_ref: str | None = None,
    candidate_count: int | None = None,
) -> RunState:
    op = replace(op, status=OpStatus.SUCCEEDED, result_ref=result_ref, summary_ref=summary_ref)
    s = _cancel_timers(s, out, keep=lambda t: t.op_key != op.key)
    tools = s.succeeded_tools if op.tool in s.succeeded_tools else (*s.succeeded_tools, op.tool)
    update: dict[str, Any] = {
        "ops": _replaced(s.ops, op),
        "completed_ops": s.completed_ops + 1,
        "succeeded_tools": tools,
        "step_inputs": (*s.step_inputs, summary_ref or result_ref or f"succeeded:{op.tool}"),
    }
    loop: dict[str, Any] = {}
    if result_ref is not None and result_ref not in s.result_refs:
        update["result_refs"] = (*s.result_refs, result_ref)[-RESULT_REFS_KEPT:]
        loop["progress_in_step"] = True  # new evidence
    if candidate_count is not None:
        last = s.loop.last_candidate_count
        if last is not None and candidate_count < last:
            loop["progress_in_step"] = True  # candidates narrowed
        loop["last_candidate_count"] = candidate_count
    if loop:
        update["loop"] = s.loop.model_copy(update=loop)
    return s.model_copy(update=update)


def _charged(s: RunState, usage: ModelUsage | msgspec.UnsetType) -> RunState:
    """``s`` with what a child run spent added to its usage (its budgets' counters)."""
    if isinstance(usage, msgspec.UnsetType):
        return s
    spent = Usage(
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cost_micros=usage.cost_micros,
    )
    return replace(s, usage=s.usage.plus(spent))


def _on_tool_succeeded(s: RunState, e: ToolCallSucceeded) -> Transition:
    op = _lookup(s, e, IN_FLIGHT | {OpStatus.UNKNOWN})
    if isinstance(op, Transition):
        return op
    out = _Out(s, e)
    s = _charged(s, e.child_usage)
    summary_ref = None
    if e.summary is not None and e.result_bytes > s.config.policy.large_output_bytes:
        summary = {"raw_ref": e.result_ref, "summary": e.summary.model_dump(mode="json")}
        summary_ref = out.store(canonical_json(summary))
    s = _succeed(s, out, op, e.result_ref, summary_ref, e.candidate_count)
    return out.done(_advance(s, out))


def _on_tool_failed(s: RunState, e: ToolCallFailed) -> Transition:
    op = _lookup(s, e, IN_FLIGHT)
    if isinstance(op, Transition):
        return op
    out = _Out(s, e)
    s = _charged(s, e.child_usage)
    s = _cancel_timers(s, out, keep=lambda t: t.op_key != op.key)
    failed = replace(op, status=OpStatus.FAILED, error_class=e.error_class, error_code=e.error_code)
    s = _replace_op(s, failed)
    s, loop = record_error(s, f"{e.error_class.value}:{e.error_code}")
    if loop is not None:
        return out.done(_terminate(s, out, RunStatus.FAILED, loop))
    match e.error_class:
        case ErrorClass.PERMISSION_DENIED:
            reason = f"tool:PERMISSION_DENIED:{op.tool}"
            return out.done(_terminate(s, out, RunStatus.FAILED, reason))
        case ErrorClass.RATE_LIMIT:
            due = _due(out.at, e.retry_after_ms or DEFAULT_BACKOFF_MS)
            deadline = s.config.budgets.deadline_at
            if deadline is not None and due >= deadline:
                return out.done(_terminate(s, out, RunStatus.EXPIRED, "deadline:backoff"))
            s = _schedule(s, out, TimerPurpose.TOOL_BACKOFF, due, op.key)
        case ErrorClass.TRANSIENT if op.retries < s.config.policy.max_tool_retries:
            s = _resend(s, out, failed, retries=op.retries + 1)
        case ErrorClass.STATE_CONFLICT:
            note = f"refresh:{op.tool}:{e.error_code}"
            s = replace(s, step_inputs=(*s.step_inputs, note))
        case _:
            note = f"failed:{op.tool}:{e.error_class.value}:{e.error_code}"
            s = replace(s, step_inputs=(*s.step_inputs, note))
    return out.done(_advance(s, out))


def _on_tool_timed_out(s: RunState, e: ToolCallTimedOut) -> Transition:
    op = _lookup(s, e, IN_FLIGHT)
    if isinstance(op, Transition):
        return op
    out = _Out(s, e)
    s = _cancel_timers(s, out, keep=lambda t: t.op_key != op.key)
    s = _replace_op(s, replace(op, status=OpStatus.UNKNOWN))
    out.effects.append(
        Reconcile(
            idempotency_key=effect_key(
                "reconcile", s.run_id, op.step, s.attempt, op.key, op.dispatch
            ),
            operation_key=op.key,
            tool=op.tool,
            dispatch=op.dispatch,
            **out.ids(s, op.step),
        )
    )
    return out.done(_advance(s, out))


def _on_reconciled(s: RunState, e: ReconcileCompleted) -> Transition:
    op = _lookup(s, e, frozenset({OpStatus.UNKNOWN}))
    if isinstance(op, Transition):
        return op
    if e.outcome is ReconcileOutcome.UNDETERMINABLE and s.status is RunStatus.PAUSED:
        return _unchanged(s, Disposition.LATE, "already paused for this operation")
    out = _Out(s, e)
    match e.outcome:
        case ReconcileOutcome.FOUND_SUCCEEDED:
            s = _succeed(s, out, op, e.result_ref)
        case ReconcileOutcome.NOT_EXECUTED if s.cancel_requested:
            s = _replace_op(s, replace(op, status=OpStatus.CANCELLED))
        case ReconcileOutcome.NOT_EXECUTED:
            return out.done(_goto(_resend(s, out, op), out, RunStatus.TOOL_RUNNING))
        case _:
            reason = f"reconcile:undeterminable:{op.key[:16]}"
            return out.done(_goto(replace(s, outcome=reason), out, RunStatus.PAUSED))
    s = replace(s, outcome=None)
    return out.done(_advance(s, out))


# --------------------------------------------------------------------------- cancel, timers


def _on_cancel_requested(s: RunState, e: CancelRequested) -> Transition:
    if s.cancel_requested or e.event_id in s.control_event_ids:
        return _unchanged(s, Disposition.DUPLICATE, "cancel already requested")
    out = _Out(s, e)
    s = _remember_control(s, e.event_id)
    reason = f"cancel:{e.reason}"
    s = replace(
        s, cancel_requested=True, ops=tuple(o for o in s.ops if o.status is not OpStatus.PROPOSED)
    )
    in_flight = [o for o in s.ops if o.status in IN_FLIGHT]
    uncancellable = [o for o in in_flight if not _cancellable(s, o)]
    if uncancellable or any(o.status is OpStatus.UNKNOWN for o in s.ops):
        return out.done(_terminate(s, out, RunStatus.CANCEL_UNKNOWN, reason + ":unconfirmable"))
    if not in_flight:
        return out.done(_terminate(s, out, RunStatus.CANCELLED, reason))
    for op in in_flight:
        out.effects.append(_cancel_tool(s, out, op))
    s = _cancel_timers(s, out, keep=lambda t: t.purpose is TimerPurpose.DEADLINE)
    return out.done(_goto(s, out, _tool_phase(s)))


def _cancellable(s: RunState, op: Operation) -> bool:
    spec = s.config.tool(op.tool)
    # a child run can always be told to stop: cancelling its caller cancels it
    return spec is not None and (spec.cancellable or spec.starts_run)


def _on_cancel_confirmed(s: RunState, e: CancelConfirmed) -> Transition:
    if not s.cancel_requested:
        return _unchanged(s, Disposition.REJECTED, "no cancel was requested")
    op = _lookup(s, e, IN_FLIGHT)
    if isinstance(op, Transition):
        return op
    out = _Out(s, e)
    s = _replace_op(s, replace(op, status=OpStatus.CANCELLED))
    return out.done(_advance(s, out))


def _on_cancel_unconfirmed(s: RunState, e: CancelUnconfirmed) -> Transition:
    if not s.cancel_requested:
        return _unchanged(s, Disposition.REJECTED, "no cancel was requested")
    op = _lookup(s, e, IN_FLIGHT)
    if isinstance(op, Transition):
        return op
    out = _Out(s, e)
    update = {"status": OpStatus.UNKNOWN, "cancel_unconfirmed": True}
    s = _replace_op(s, op.model_copy(update=update))
    return out.done(_advance(s, out))


def _on_timer(s: RunState, e: TimerFired) -> Transition:
    timer = s.timer(e.timer_id)
    if timer is None:
        return _unchanged(s, Disposition.LATE, "timer no longer applies")
    s0 = s
    out = _Out(s, e)
    s = _drop_timer(s, timer.timer_id)
    match timer.purpose:
        case TimerPurpose.DEADLINE:
            return out.done(_terminate(s, out, RunStatus.EXPIRED, "deadline"))
        case TimerPurpose.USER_EXPIRY:
            if s.config.policy.on_user_expiry == "cancel":
                status = RunStatus.CANCELLED
            else:
                status = RunStatus.EXPIRED
            return out.done(_terminate(s, out, status, "user_reply_expired"))
        case TimerPurpose.MODEL_BACKOFF:
            return out.done(_new_attempt(s, out))
        case TimerPurpose.TOOL_BACKOFF:
            op = s.op(timer.op_key or "")
            if op is None or op.status is not OpStatus.FAILED:
                return _unchanged(s0, Disposition.LATE, "operation no longer backing off")
            return out.done(_goto(_resend(s, out, op), out, RunStatus.TOOL_RUNNING))
        case _:
            op = s.op(timer.op_key or "")
            if op is None or op.status not in _POLLABLE:
                return _unchanged(s0, Disposition.LATE, "operation no longer pollable")
            op = replace(op, polls=op.polls + 1)
            s = _replace_op(s, op)
            out.effects.append(
                PollTool(
                    idempotency_key=effect_key(
                        "poll_tool", s.run_id, op.step, s.attempt, op.key, e.timer_id
                    ),
                    operation_key=op.key,
                    tool=op.tool,
                    dispatch=op.dispatch,
                    poll=op.polls,
                    **out.ids(s, op.step),
                )
            )
            return out.done(s)


# --------------------------------------------------------------------------- goals, knowledge


def _on_goal_changed(s: RunState, e: GoalChanged) -> Transition:
    if e.step != s.step:
        return _unchanged(s, Disposition.LATE, f"goal change for step {e.step}")
    if any(o.status in IN_FLIGHT or o.status is OpStatus.UNKNOWN for o in s.ops):
        return _unchanged(s, Disposition.REJECTED, "operations in flight: resend after them")
    out = _Out(s, e)
    goal_hash = sha256_hex(e.goal)[:16]
    if s.config.policy.on_goal_change == "new_run":
        reason = f"superseded:new_goal:{goal_hash}"
        return out.done(_terminate(s, out, RunStatus.CANCELLED, reason))
    s = _cancel_timers(s, out, keep=lambda t: t.purpose is TimerPurpose.DEADLINE)
    s = replace(
        s,
        goal=e.goal,
        question=None,
        ops=tuple(o for o in s.ops if o.status is not OpStatus.PROPOSED),
        step_inputs=(*s.step_inputs, f"goal_changed:{goal_hash}"),
        warnings=(*s.warnings, f"goal changed at step {s.step}")[-8:],
    )
    return out.done(_enter_ready(_mark_progress(s), out, new_step=True))


def _on_knowledge(s: RunState, e: KnowledgeRefreshed) -> Transition:
    if e.step != s.step:
        return _unchanged(s, Disposition.LATE, f"refresh for step {e.step}")
    out = _Out(s, e)
    s = _cancel_timers(s, out, keep=lambda t: t.purpose is TimerPurpose.DEADLINE)
    if set(e.evidence_refs) - set(s.evidence_refs) or e.memory_ref != s.memory_ref:
        s = _mark_progress(s)
    s = replace(
        s,
        memory_ref=e.memory_ref,
        evidence_refs=e.evidence_refs,
        step_inputs=(*s.step_inputs, "knowledge_refreshed"),
    )
    return out.done(_enter_ready(s, out, new_step=True))


# --------------------------------------------------------------------------- corrections, gaps


def _on_reopened(s: RunState, e: RunReopened) -> Transition:
    if e.resolution != s.resolution:
        return _unchanged(s, Disposition.REJECTED, "stale resolution (compare-and-set)")
    if s.status is RunStatus.PAUSED and any(o.status is OpStatus.UNKNOWN for o in s.ops):
        return _unchanged(s, Disposition.REJECTED, "reconcile the unknown operation first")
    out = _Out(s, e)
    abandoned = [o for o in s.ops if o.status is OpStatus.UNKNOWN or o.status in IN_FLIGHT]
    warnings = s.warnings
    if abandoned:
        warnings = (
            *warnings,
            f"reopened with {len(abandoned)} unknown operation(s): {abandoned[0].key[:16]}",
        )[-8:]
    s = replace(
        s,
        resolution=s.resolution + 1,
        goal=e.goal or s.goal,
        outcome=None,
        result_ref=None,
        cancel_requested=False,
        ops=(),
        warnings=warnings,
        step_inputs=(*s.step_inputs, f"reopened:{sha256_hex(e.reason)[:16]}"),
        loop=LoopMemory(),
    )
    deadline = s.config.budgets.deadline_at
    if deadline is not None and all(t.purpose is not TimerPurpose.DEADLINE for t in s.timers):
        s = _schedule(s, out, TimerPurpose.DEADLINE, deadline)
    return out.done(_enter_ready(s, out, new_step=True))


def _on_resolved(s: RunState, e: RunResolved) -> Transition:
    if e.resolution != s.resolution:
        return _unchanged(s, Disposition.REJECTED, "stale resolution (compare-and-set)")
    if e.status not in TERMINAL:
        return _unchanged(s, Disposition.REJECTED, "a resolution must name a terminal status")
    out = _Out(s, e)
    s = replace(s, resolution=s.resolution + 1)
    return out.done(_terminate(s, out, e.status, f"resolved:{e.reason}"))


def _on_redrive(s: RunState, e: RedriveRequested) -> Transition:
    """Drive a run that nothing else will: only when the operator saw the state it is in now
    (the version), and no timer but the deadline is pending (a pending timer will drive it, and
    a due one that did not fire is the timer service's to re-drive, `agentruns scan`)."""
    if e.version != s.version:
        return _unchanged(s, Disposition.REJECTED, "stale version (compare-and-set)")
    driving = [t for t in s.timers if t.purpose is not TimerPurpose.DEADLINE]
    if driving:
        return _unchanged(s, Disposition.REJECTED, f"a {driving[0].purpose.value} timer is pending")
    out = _Out(s, e)
    if s.status in (RunStatus.READY, RunStatus.MODEL_RUNNING):
        # the old attempt's answer, if it ever comes, is LATE: one model call counts
        return out.done(_new_attempt(s, out))
    for op in s.ops:
        if op.status not in IN_FLIGHT and op.status is not OpStatus.UNKNOWN:
            continue
        op = replace(op, status=OpStatus.UNKNOWN)
        s = _replace_op(s, op)
        out.effects.append(
            Reconcile(
                # a new key: a look-up whose answer never came is asked again, not answered
                # from the executor's record of the first one
                idempotency_key=effect_key(
                    "reconcile", s.run_id, op.step, s.attempt, op.key, op.dispatch, e.event_id
                ),
                operation_key=op.key,
                tool=op.tool,
                dispatch=op.dispatch,
                **out.ids(s, op.step),
            )
        )
    return out.done(_advance(s, out))


def _remember_control(s: RunState, event_id: str) -> RunState:
    """Run-level events are not bound to a step/op/timer: remember their ids (bounded)."""
    return replace(s, control_event_ids=(*s.control_event_ids, event_id)[-8:])


def _on_gap(s: RunState, e: GapTimedOut) -> Transition:
    if e.event_id in s.control_event_ids:
        return _unchanged(s, Disposition.DUPLICATE, "gap already diagnosed")
    out = _Out(s, e)
    s = _remember_control(s, e.event_id)
    reason = f"seq_gap:{e.expected_seq}:{e.diagnosis}"[:300]
    return out.done(_terminate(s, out, RunStatus.FAILED, reason))


def _on_input_refused(s: RunState, e: InputRefused) -> Transition:
    if e.event_id in s.control_event_ids:
        return _unchanged(s, Disposition.DUPLICATE, "input already refused")
    out = _Out(s, e)
    s = _remember_control(s, e.event_id)
    return out.done(_terminate(s, out, RunStatus.FAILED, e.reason[:300]))


# --------------------------------------------------------------------------- submission


def _on_submitted(e: RunSubmitted) -> Transition:
    # the task's own consistency first, then what the processor's catalog check found
    lineage = parent_problem(e)
    problem = task_problem(e) or catalog_refusal(e) or lineage
    # a refused task's tools are not kept: its state holds nothing it could not serialize
    tools = e.tools if problem is None else ()
    config = RunConfig(
        tools=tools,
        config_ref="",
        policy=e.policy,
        budgets=e.budgets,
        loop=e.loop,
        model_route=e.model_route,
        validator_version=e.validator_version,
    )
    frozen = frozen_config(config)
    config = replace(config, config_ref=content_ref(frozen))
    s = RunState(
        run_id=e.run_id,
        trace_id=e.trace_id,
        submitted_event_id=e.event_id,
        status=RunStatus.READY,
        version=0,
        rules_version=e.rules_version,
        catalog_version=msgspec.UNSET
        if isinstance(e.catalog, msgspec.UnsetType)
        else e.catalog.version,
        goal=e.goal,
        config=config,
        memory_ref=e.memory_ref,
        evidence_refs=e.evidence_refs,
        time=TimeAccount(started_at=e.at, last_at=e.at),
        # a link that cannot be (a cycle) answers nobody; any other refused child answers
        # the call that started it with its failure
        parent=msgspec.UNSET if lineage is not None else e.parent,
        tenant=e.tenant,
    )
    out = _Out(s, e)
    out.store(frozen)
    if problem is not None:  # the run exists, so the producer receives its result
        return out.done(_terminate(s, out, RunStatus.FAILED, problem))
    if e.budgets.deadline_at is not None:
        s = _schedule(s, out, TimerPurpose.DEADLINE, e.budgets.deadline_at)
    return out.done(_enter_ready(s, out, new_step=False, messages=e.messages))


# --------------------------------------------------------------------------- forks


def frozen_config(config: RunConfig) -> str:
    """The frozen run configuration artifact of `config` (its ref is ``config.config_ref``)."""
    return canonical_json(
        {
            "tools": [t.model_dump(mode="json") for t in config.tools],
            "policy": config.policy.model_dump(mode="json"),
            "budgets": config.budgets.model_dump(mode="json"),
            "loop": config.loop.model_dump(mode="json"),
            "model_route": config.model_route,
            "validator_version": config.validator_version,
        }
    )


def _lowered(old: int | None, new: int | None) -> bool:
    """A limit lowered (None is no limit: above every number)."""
    return new is not None and (old is None or new < old)


def budgets_refusal(old: Budgets, new: Budgets, at: int) -> str | None:
    """Why a fork may not take `new` in place of its source's budgets `old` (None: it may): a
    fork raises budgets, never lowers them, and a new deadline lies after the fork's time."""
    for name in ("max_steps", "max_tokens", "max_cost_micros", "max_tool_calls", "deadline_at"):
        before, after = getattr(old, name), getattr(new, name)
        if _lowered(before, after):
            return f"a fork raises budgets, never lowers them: {name} {after} < {before}"
    if new.deadline_at is not None and new.deadline_at != old.deadline_at and new.deadline_at <= at:
        return f"the new deadline {new.deadline_at} is not after the fork's time {at}"
    return None


def fork_timer_id(run_id: str, source_timer_id: str) -> str:
    """The fork's id of a timer the source had pending (the source's stays the source's)."""
    return "tmr-" + derive_key("timer", run_id, "fork", source_timer_id)[:32]


def _rekeyed_text(text: str, keys: dict[str, str]) -> str:
    for old, new in keys.items():
        text = text.replace(old[:16], new[:16])
    return text


def _on_forked(e: ForkedFrom) -> Transition:
    """Start a fork: the source's state at the fork point under the fork's identity, then the
    effects the source was waiting on asked for again under the fork's keys (its operations,
    timers and question are re-keyed from the fork's run id: nothing of the fork can be
    answered by, or answer, the source). Completed effects are not asked for: their results
    are in the state. Version, time and counters are the source's: folding the source's later
    inputs (re-addressed to the fork) gives the source's later states, up to those keys."""
    src = e.state
    if e.run_id == src.run_id:
        return _unchanged(None, Disposition.REJECTED, "a fork needs a run id of its own")
    if e.source_run_id != src.run_id:
        return _unchanged(None, Disposition.REJECTED, "the state is not the source's")
    if src.status in TRANSIENT:
        return _unchanged(None, Disposition.REJECTED, f"no fork from {src.status.value}")
    if src.cancel_requested and not src.terminal:
        return _unchanged(None, Disposition.REJECTED, "the source is being cancelled there")
    if e.edits.messages and src.status is not RunStatus.MODEL_RUNNING:
        reason = f"messages are added where the model is asked, not in {src.status.value}"
        return _unchanged(None, Disposition.REJECTED, reason)
    if any(content_ref(a.content) != a.ref for a in e.artifacts):
        return _unchanged(None, Disposition.REJECTED, "an artifact's ref is not its content's")
    budgets = e.edits.budgets
    if budgets is not None:
        refused = budgets_refusal(src.config.budgets, budgets, e.at)
        if refused is not None:
            return _unchanged(None, Disposition.REJECTED, refused)
    new_deadline = budgets is not None and budgets.deadline_at != src.config.budgets.deadline_at
    run_id = e.run_id
    keys = {o.key: operation_key(run_id, o.step, o.tool, o.args_json) for o in src.ops}
    # an accepted asynchronous operation is the backend's under the source's key: the fork's
    # key is unknown there, so the fork dispatches it again (and drops its poll timer)
    redispatched = {o.key for o in src.ops if o.status in _POLLABLE}
    ops = tuple(
        replace(
            o,
            key=keys[o.key],
            status=OpStatus.DISPATCHED if o.key in redispatched else o.status,
            polls=0 if o.key in redispatched else o.polls,
        )
        for o in src.ops
    )
    timers = tuple(
        replace(
            t,
            timer_id=fork_timer_id(run_id, t.timer_id),
            op_key=None if t.op_key is None else keys.get(t.op_key, t.op_key),
        )
        for t in src.timers
        if not (t.purpose is TimerPurpose.TOOL_POLL and t.op_key in redispatched)
        # a raised deadline replaces the source's deadline timer (scheduled below)
        and not (new_deadline and t.purpose is TimerPurpose.DEADLINE)
    )
    question = src.question
    if question is not None:
        qid = question_id(run_id, src.step, src.attempt, question.kind, question.version)
        question = replace(
            question,
            question_id=qid,
            token_id=resume_token_id(run_id, qid, question.version),
            timer_id=fork_timer_id(run_id, question.timer_id),
        )
    s = replace(
        src,
        run_id=run_id,
        trace_id=e.trace_id,
        # the core's texts quote an operation by its key's head: the fork's, in the fork
        outcome=None if src.outcome is None else _rekeyed_text(src.outcome, keys),
        warnings=tuple(_rekeyed_text(w, keys) for w in src.warnings),
        submitted_event_id=e.event_id,
        forked_from=Lineage(source_run_id=src.run_id, source_seq=e.source_seq, edits=e.edits),
        # a fork answers no caller: the source's end does, if it was started as a child
        parent=msgspec.UNSET,
        # the source's submission is the fork's own in the fork
        recent_event_ids=tuple(
            e.event_id if i == src.submitted_event_id else i for i in src.recent_event_ids
        ),
        ops=ops,
        timers=timers,
        question=question,
    )
    out = _Out(s, e)
    for a in e.artifacts:
        if all(x.ref != a.ref for x in out.artifacts):
            out.artifacts.append(Artifact(ref=a.ref, media_type=a.media_type, content=a.content))
    config = s.config
    if e.edits.model_route is not None and e.edits.model_route != config.model_route:
        config = replace(config, model_route=e.edits.model_route)
    if budgets is not None and budgets != config.budgets:
        config = replace(config, budgets=budgets)
    if config is not s.config:
        frozen = frozen_config(config)
        s = replace(s, config=replace(config, config_ref=content_ref(frozen)))
        out.store(frozen)
    for t in s.timers:
        out.effects.append(
            ScheduleTimer(
                idempotency_key=effect_key("schedule_timer", run_id, s.step, s.attempt, t.timer_id),
                timer_id=t.timer_id,
                due_at=t.due_at,
                purpose=t.purpose,
                **out.ids(s),
            )
        )
    if new_deadline and budgets is not None and budgets.deadline_at is not None and not s.terminal:
        s = _schedule(s, out, TimerPurpose.DEADLINE, budgets.deadline_at)
    if s.terminal:
        return Transition(state=s, effects=tuple(out.effects), artifacts=tuple(out.artifacts))
    # operations in flight (a step's, or an earlier step's still running) go out again; one
    # whose outcome the source did not know is looked up under its new key
    for op in s.ops:
        if op.status is OpStatus.DISPATCHED:
            _send(s, out, op)
        elif op.status is OpStatus.UNKNOWN:
            out.effects.append(
                Reconcile(
                    idempotency_key=effect_key(
                        "reconcile", run_id, op.step, s.attempt, op.key, op.dispatch
                    ),
                    operation_key=op.key,
                    tool=op.tool,
                    dispatch=op.dispatch,
                    **out.ids(s, op.step),
                )
            )
    if redispatched and s.status in (RunStatus.TOOL_RUNNING, RunStatus.WAITING_TOOL):
        s = replace(s, status=_tool_phase(s))
    raised = budgets is not None and budgets != src.config.budgets
    if e.edits.messages or (raised and s.status is RunStatus.MODEL_RUNNING):
        # the same step asked again with the messages, or with what remains of raised budgets
        # (the model executor reads the deadline there): a context after the source's
        context = _context(
            s,
            previous_context=s.context_ref,
            previous_candidate=None,
            messages=e.edits.messages,
            inputs=(),
        )
        s = replace(s, context_ref=out.store(canonical_json(context)))
    if s.status is RunStatus.MODEL_RUNNING:
        _call_model(s, out)
    elif s.status is RunStatus.WAITING_USER and question is not None:
        out.effects.append(
            AskUser(
                idempotency_key=effect_key(
                    "ask_user", run_id, s.step, s.attempt, question.question_id
                ),
                question_id=question.question_id,
                question_ref=question.artifact_ref,
                response_schema=question.response_schema,
                expires_at=question.expires_at,
                token_id=question.token_id,
                state_version=question.version,
                **out.ids(s),
            )
        )
    return Transition(state=s, effects=tuple(out.effects), artifacts=tuple(out.artifacts))


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True, slots=True)
class Row:
    """A table cell: the handler and the statuses it may enter first (``path[0]``)."""

    handler: Callable[[RunState, Any], Transition]
    targets: frozenset[RunStatus]
    capped: bool  # the event cap may fail the run instead (every non-terminal row)

    @property
    def reachable(self) -> frozenset[RunStatus]:
        return self.targets | {RunStatus.FAILED} if self.capped else self.targets


S = RunStatus


def _set(*statuses: RunStatus) -> frozenset[RunStatus]:
    return frozenset(statuses)


# Statuses a handler may pass through inside one transition, and where each may lead.
PASS_THROUGH: dict[RunStatus, frozenset[RunStatus]] = {
    S.READY: _set(S.MODEL_RUNNING, S.PAUSED, S.FAILED, S.EXPIRED, S.BUDGET_EXHAUSTED),
    S.VALIDATING: _set(
        S.TOOL_RUNNING,
        S.WAITING_USER,
        S.FINALIZING,
        S.MODEL_RUNNING,
        S.FAILED,
        S.BUDGET_EXHAUSTED,
        S.EXPIRED,
    ),
    S.FINALIZING: _set(S.SUCCEEDED, S.FAILED, S.TOOL_RUNNING, S.WAITING_TOOL),
}
# Statuses a committed state can rest in (VALIDATING and FINALIZING never rest).
RESTING: tuple[RunStatus, ...] = tuple(s for s in NON_TERMINAL if s not in TRANSIENT)

_WAIT_TOOLS = _set(S.TOOL_RUNNING, S.WAITING_TOOL)
_CANCEL_ENDS = _set(S.CANCELLED, S.CANCEL_UNKNOWN)
# Where _advance may go once an operation changed.
_ADVANCE = _WAIT_TOOLS | _CANCEL_ENDS | _set(S.READY, S.WAITING_USER, S.FINALIZING)


def _build_table() -> dict[tuple[RunStatus, str], Row]:
    table: dict[tuple[RunStatus, str], Row] = {}

    def add(
        statuses: Iterable[RunStatus],
        event: str,
        handler: Callable[[RunState, Any], Transition],
        targets: frozenset[RunStatus],
    ) -> None:
        for status in statuses:
            table[(status, event)] = Row(handler, targets, capped=status not in TERMINAL)

    tools = (S.TOOL_RUNNING, S.WAITING_TOOL)
    add(
        (S.MODEL_RUNNING,),
        "ModelCallCompleted",
        _on_model_completed,
        _set(S.VALIDATING, S.MODEL_RUNNING, S.READY, S.FAILED, S.EXPIRED, S.BUDGET_EXHAUSTED),
    )
    add(tools, "ToolCallAccepted", _on_tool_accepted, _WAIT_TOOLS)
    add(tools, "ToolStatusReported", _on_tool_status, _WAIT_TOOLS)
    add(tools, "ToolCallSucceeded", _on_tool_succeeded, _ADVANCE)
    add(tools, "ToolCallFailed", _on_tool_failed, _ADVANCE | _set(S.FAILED, S.EXPIRED))
    add(tools, "ToolCallTimedOut", _on_tool_timed_out, _WAIT_TOOLS | _CANCEL_ENDS)
    add((*tools, S.PAUSED), "ReconcileCompleted", _on_reconciled, _ADVANCE | _set(S.PAUSED))
    add(tools, "CancelConfirmed", _on_cancel_confirmed, _WAIT_TOOLS | _CANCEL_ENDS)
    add(tools, "CancelUnconfirmed", _on_cancel_unconfirmed, _WAIT_TOOLS | _CANCEL_ENDS)
    add((S.WAITING_USER,), "UserReplied", _on_user_replied, _set(S.TOOL_RUNNING, S.READY))
    for status in RESTING:
        cancel = _CANCEL_ENDS | (_WAIT_TOOLS if status in tools else _set())
        add((status,), "CancelRequested", _on_cancel_requested, cancel)
        timer = {
            S.READY: _set(S.MODEL_RUNNING, S.EXPIRED, S.BUDGET_EXHAUSTED),
            S.TOOL_RUNNING: _set(S.EXPIRED),
            S.WAITING_TOOL: _set(S.EXPIRED, S.TOOL_RUNNING),
            S.WAITING_USER: _set(S.EXPIRED, S.CANCELLED),
        }.get(status, _set(S.EXPIRED))
        add((status,), "TimerFired", _on_timer, timer)
    add(RESTING, "GapTimedOut", _on_gap, _set(S.FAILED))
    add(RESTING, "InputRefused", _on_input_refused, _set(S.FAILED))
    add(
        (S.MODEL_RUNNING, S.READY, S.WAITING_USER, S.PAUSED),
        "GoalChanged",
        _on_goal_changed,
        _set(S.READY, S.CANCELLED),
    )
    add((S.MODEL_RUNNING, S.READY), "KnowledgeRefreshed", _on_knowledge, _set(S.READY))
    add((*TERMINAL, S.PAUSED), "RunReopened", _on_reopened, _set(S.READY))
    add((*TERMINAL, S.PAUSED), "RunResolved", _on_resolved, frozenset(TERMINAL))
    add(
        (S.READY, S.MODEL_RUNNING),
        "RedriveRequested",
        _on_redrive,
        _set(S.MODEL_RUNNING, S.EXPIRED, S.BUDGET_EXHAUSTED),
    )
    add(tools, "RedriveRequested", _on_redrive, _ADVANCE)
    return table


TABLE: dict[tuple[RunStatus, str], Row] = _build_table()


def transition(state: RunState | None, event: Event) -> Transition:
    """Apply one event to a run's state. Pure; never raises for domain failures."""
    if state is None:
        match event:
            case RunSubmitted():
                return _on_submitted(event)
            case ForkedFrom():
                return _on_forked(event)
            case _:
                return _unchanged(None, Disposition.REJECTED, "unknown run: submit it first")
    if event.run_id != state.run_id:
        return _unchanged(state, Disposition.REJECTED, "event is for another run")
    if event.event_id in state.recent_event_ids or event.event_id == state.submitted_event_id:
        return _unchanged(state, Disposition.DUPLICATE, "event already applied")
    row = TABLE.get((state.status, event.type))
    if row is None:
        if state.terminal:
            return _unchanged(state, Disposition.LATE, f"run is {state.status.value}")
        return _unchanged(
            state, Disposition.REJECTED, f"{event.type} not accepted in {state.status.value}"
        )
    if not state.terminal and state.version >= state.config.loop.max_events:
        out = _Out(state, event)
        reason = f"loop:event_cap:{state.config.loop.max_events}"
        return out.done(_terminate(state, out, RunStatus.FAILED, reason))
    return row.handler(state, event)


def fold(events: Iterable[Event], state: RunState | None = None) -> RunState | None:
    """Replay events (R3, R28): the state after applying them in order."""
    for event in events:
        state = transition(state, event).state
    return state


class _CallFunction(msgspec.Struct, frozen=True):
    name: str
    arguments: str = ""


class _MessageCall(msgspec.Struct, frozen=True):
    id: str
    function: _CallFunction


class _Message(msgspec.Struct, frozen=True):
    content: str | None = None
    tool_calls: tuple[_MessageCall, ...] | None = None


class _ExecutorCandidate(msgspec.Struct, frozen=True):
    """The model executor's candidate artifact: an assistant message in OpenAI form, beside
    fields (finish reason, usage, ...) the core does not read."""

    message: _Message


_EXECUTOR_CANDIDATE = Decoder(msgspec.json.Decoder(_ExecutorCandidate))


def load_candidate(content: str) -> Candidate:
    """Parse a stored candidate artifact (for audit re-validation, R28): the core's own form
    (``Candidate.model_dump_json()``) or the model executor's (an assistant ``message``). Both
    are validated as strictly as a decoded ``Candidate``; raises only msgspec.DecodeError (or
    its subclass msgspec.ValidationError), whatever the content."""
    try:
        return Candidate.model_validate_json(content)
    except msgspec.ValidationError as core_form:
        try:
            message = _EXECUTOR_CANDIDATE.decode(content).message
        except msgspec.ValidationError:
            raise core_form from None
    calls = message.tool_calls or ()
    return Candidate.model_validate(
        {
            "content": message.content or "",
            "tool_calls": [
                {"id": c.id, "name": c.function.name, "arguments_json": c.function.arguments}
                for c in calls
            ],
        }
    )
