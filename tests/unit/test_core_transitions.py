"""Table-driven tests: one per transition and per rejection of the core state machine."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentruns.processors.effects import (
    AskUser,
    CallModel,
    CallTool,
    CancelTimer,
    CancelTool,
    PollTool,
    PublishResult,
    Reconcile,
    ScheduleTimer,
)
from agentruns.processors.events import (
    CancelConfirmed,
    CancelRequested,
    CancelUnconfirmed,
    Candidate,
    GapTimedOut,
    GoalChanged,
    InputRefused,
    KnowledgeRefreshed,
    ModelCallCompleted,
    ModelOutcome,
    ModelUsage,
    OutputSummary,
    ReconcileCompleted,
    ReconcileOutcome,
    RedriveRequested,
    RunReopened,
    RunResolved,
    TimerFired,
    ToolCallAccepted,
    ToolCallFailed,
    ToolCallTimedOut,
    ToolStatusReported,
    UserReplied,
    parse_event,
)
from agentruns.processors.ids import content_ref
from agentruns.processors.state import (
    Budgets,
    ErrorClass,
    LoopLimits,
    OpStatus,
    Policy,
    RunStatus,
    TimerPurpose,
)
from agentruns.processors.transition import TABLE, Disposition, transition
from tests.unit._core_support import Driver, effects_of, only, search

S = RunStatus


def started(**kw: Any) -> Driver:
    d = Driver()
    d.submit(**kw)
    return d


def at_tool(*calls: tuple[str, dict[str, Any]], **kw: Any) -> Driver:
    d = started(**kw)
    d.calls(*(calls or (search(),)))
    assert d.s.status is S.TOOL_RUNNING
    return d


# --- submission, READY


def test_submit_freezes_context_and_calls_model() -> None:
    d = Driver()
    t = d.submit()
    assert t.disposition is Disposition.APPLIED
    assert d.s.status is S.MODEL_RUNNING
    assert d.s.path == (S.READY, S.MODEL_RUNNING)
    call = only(t, CallModel)
    assert (call.step, call.attempt, call.context_ref) == (1, 1, d.s.context_ref)
    context = {a.ref: a for a in t.artifacts}[call.context_ref]
    body = json.loads(context.content)
    assert body["step"] == 1 and body["messages"] == [] and body["config_ref"].startswith("sha256:")
    assert content_ref(context.content) == call.context_ref
    assert only(t, ScheduleTimer).purpose is TimerPurpose.DEADLINE
    assert d.s.version == 1


@pytest.mark.parametrize(
    ("event_type", "reason"),
    [("ModelCallCompleted", "unknown run"), ("CancelRequested", "unknown run")],
)
def test_first_event_must_be_submission(event_type: str, reason: str) -> None:
    d = Driver()
    event = (
        d.make(CancelRequested)
        if event_type == "CancelRequested"
        else d.make(
            ModelCallCompleted,
            step=1,
            attempt=1,
            outcome=ModelOutcome.FINISHED,
        )
    )
    t = transition(None, event)
    assert t.disposition is Disposition.REJECTED and t.state is None
    assert reason in (t.reason or "")


def test_resubmission_is_duplicate_and_other_run_rejected() -> None:
    d = started()
    first = d.log[0]
    assert transition(d.s, first).disposition is Disposition.DUPLICATE
    other = first.model_copy(update={"event_id": "other"})
    assert transition(d.s, other).disposition is Disposition.REJECTED
    foreign = d.make(CancelRequested, run_id="someone-else")
    assert transition(d.s, foreign).disposition is Disposition.REJECTED


@pytest.mark.parametrize(
    ("budgets", "usage", "status", "reason"),
    [
        (Budgets(max_tokens=150), ModelUsage(input_tokens=200), S.BUDGET_EXHAUSTED, "max_tokens"),
        (Budgets(max_cost_micros=5), ModelUsage(cost_micros=9), S.BUDGET_EXHAUSTED, "max_cost"),
        (Budgets(max_steps=1), ModelUsage(), S.BUDGET_EXHAUSTED, "max_steps"),
    ],
)
def test_budgets_checked_at_ready(
    budgets: Budgets, usage: ModelUsage, status: RunStatus, reason: str
) -> None:
    d = started(budgets=budgets)
    if reason == "max_tokens":
        # tokens run out: the retry after a truncated stream is not "one more try"
        t = d.model(ModelOutcome.TRUNCATED, usage=usage)
    else:
        d.calls(search(), usage=usage)
        t = d.succeed()
    assert d.s.status is status and reason in (d.s.outcome or "")
    assert only(t, PublishResult).status is status
    assert not effects_of(t, CallModel)


def test_deadline_at_ready_expires() -> None:
    d = started(budgets=Budgets(deadline_at=Driver().now + 250))
    d.calls(search())
    d.now += 1_000
    t = d.succeed()
    assert d.s.status is S.EXPIRED and d.s.outcome == "deadline"
    assert only(t, PublishResult).status is S.EXPIRED


def test_max_tool_calls_budget() -> None:
    d = started(budgets=Budgets(max_tool_calls=1))
    t = d.calls(search("a"), search("b"))
    assert d.s.status is S.BUDGET_EXHAUSTED and d.s.outcome == "budget:max_tool_calls"
    assert not effects_of(t, CallTool)


# --- MODEL_RUNNING


@pytest.mark.parametrize(
    "outcome", [ModelOutcome.INCOMPLETE, ModelOutcome.TRUNCATED, ModelOutcome.TRANSPORT_ERROR]
)
def test_untrusted_stream_retries_on_same_context(outcome: ModelOutcome) -> None:
    d = started()
    ctx = d.s.context_ref
    t = d.model(outcome)
    call = only(t, CallModel)
    assert (call.attempt, call.context_ref, d.s.status) == (2, ctx, S.MODEL_RUNNING)
    assert call.idempotency_key != d.log and d.s.path == (S.MODEL_RUNNING,)


def test_model_retries_are_bounded() -> None:
    d = started(policy=Policy(max_model_attempts=2))
    d.model(ModelOutcome.INCOMPLETE)
    t = d.model(ModelOutcome.INCOMPLETE)
    assert d.s.status is S.FAILED and "retries_exhausted" in (d.s.outcome or "")
    assert only(t, PublishResult).status is S.FAILED


def test_finished_without_candidate_is_not_trusted() -> None:
    d = started()
    t = d.model(ModelOutcome.FINISHED, candidate=None)
    assert only(t, CallModel).attempt == 2 and not effects_of(t, CallTool)


def test_blocked_fails() -> None:
    d = started()
    d.model(ModelOutcome.BLOCKED)
    assert d.s.status is S.FAILED and d.s.outcome == "model:blocked"


def test_rate_limited_backs_off_through_timer() -> None:
    d = started()
    t = d.model(ModelOutcome.RATE_LIMITED, retry_after_ms=5_000)
    timer = only(t, ScheduleTimer)
    assert timer.purpose is TimerPurpose.MODEL_BACKOFF and timer.due_at == d.now + 5_000
    assert d.s.status is S.READY and not effects_of(t, CallModel)
    t = d.apply(TimerFired, timer_id=timer.timer_id)
    assert only(t, CallModel).attempt == 2 and d.s.status is S.MODEL_RUNNING


def test_rate_limit_beyond_deadline_expires() -> None:
    d = started(budgets=Budgets(deadline_at=Driver().now + 1_000))
    d.model(ModelOutcome.RATE_LIMITED, retry_after_ms=60_000)
    assert d.s.status is S.EXPIRED and d.s.outcome == "deadline:backoff"


def test_result_of_old_attempt_is_late() -> None:
    d = started()
    d.model(ModelOutcome.INCOMPLETE)
    before = d.s
    t = d.final(content="late")  # uses current attempt → fine; now send an old one
    assert t.disposition is Disposition.APPLIED
    d2 = started()
    d2.model(ModelOutcome.INCOMPLETE)
    before = d2.s
    t2 = d2.model(candidate=Candidate(content="old"), attempt=1)
    assert t2.disposition is Disposition.LATE and t2.state is before and not t2.effects


# --- VALIDATING


def test_valid_tool_call_dispatches_operation() -> None:
    d = started()
    t = d.calls(search("q"))
    assert d.s.path == (S.VALIDATING, S.TOOL_RUNNING)
    call = only(t, CallTool)
    op = d.s.ops[0]
    assert call.operation.key == op.key and call.operation.arguments_json == '{"query":"q"}'
    # the permission the run declared rides with the call: the executor checks it again
    assert call.operation.permission == "read"
    assert op.status is OpStatus.DISPATCHED and op.policy_decision == "allow"
    assert d.s.last_decision is not None and d.s.last_decision.validator_version == 2
    assert d.s.tool_calls == 1


def test_same_call_twice_in_one_candidate_is_one_operation() -> None:
    d = started()
    t = d.calls(search("q"), ("search", {"query": "q"}))
    assert len(effects_of(t, CallTool)) == 1 and len(d.s.ops) == 1


@pytest.mark.parametrize(
    ("call", "code"),
    [
        (("nope", {}), "UNKNOWN_TOOL"),
        (("search", {"limit": 3}), "SCHEMA_VIOLATION"),
        (("search", {"query": "sha256:" + "0" * 64}), "UNRESOLVED_REFERENCE"),
    ],
)
def test_invalid_candidate_gets_bounded_repair(call: tuple[str, dict[str, Any]], code: str) -> None:
    d = started(policy=Policy(max_repairs=1))
    t = d.calls(call)
    repair = only(t, CallModel).repair
    assert repair is not None and repair.error_code == code
    assert d.s.path == (S.VALIDATING, S.MODEL_RUNNING) and not effects_of(t, CallTool)
    t = d.calls(call)
    if code == "UNRESOLVED_REFERENCE":
        assert d.s.status is S.WAITING_USER and only(t, AskUser)
    else:
        assert d.s.status is S.FAILED and d.s.outcome == f"validation:{code}"


def test_invalid_arguments_json_repairs() -> None:
    from agentruns.processors.events import ToolCallRequest

    d = started()
    bad = Candidate(tool_calls=(ToolCallRequest(id="a", name="search", arguments_json="[1"),))
    t = d.model(candidate=bad)
    assert only(t, CallModel).repair.error_code == "INVALID_ARGUMENTS_JSON"


def test_permission_denied_is_never_retried() -> None:
    d = started(policy=Policy(allowed_permissions=("read",)))
    t = d.calls(("update_record", {"record_id": "r", "fields": {}}))
    assert d.s.status is S.FAILED and d.s.outcome == "validation:PERMISSION_DENIED"
    assert not effects_of(t, CallModel) and not effects_of(t, CallTool)


def test_final_answer_goes_through_finalizing_to_success() -> None:
    d = started()
    t = d.final("the answer")
    assert d.s.path == (S.VALIDATING, S.FINALIZING, S.SUCCEEDED)
    publish = only(t, PublishResult)
    assert publish.status is S.SUCCEEDED and publish.result_ref == d.s.result_ref
    assert publish.result_ref in {a.ref for a in t.artifacts}
    assert d.s.time.ended_at == d.now


def test_final_answer_needs_required_tools_then_evidence() -> None:
    policy = Policy(required_tools=("search",), require_evidence=True, max_repairs=3)
    d = started(policy=policy)
    t = d.final()
    assert only(t, CallModel).repair.error_code == "COMPLETION_UNMET"
    d.calls(search())
    d.succeed(result="evidence-1")
    t = d.final()
    assert only(t, CallModel).repair.error_code == "MISSING_EVIDENCE"
    t = d.final(cited=(content_ref("evidence-1"),))
    assert d.s.status is S.SUCCEEDED


def test_broken_final_text_is_new_summarization_attempt_no_tool_redone() -> None:
    d = started()
    d.calls(search())
    d.succeed()
    t = d.final(content="   ")
    assert only(t, CallModel).repair is not None and not effects_of(t, CallTool)
    assert d.s.step == 2 and d.s.attempt == 2


def test_approval_required_asks_user_and_dispatches_once_on_approval() -> None:
    d = started()
    t = d.calls(("delete_record", {"record_id": "r1"}))
    ask = only(t, AskUser)
    assert d.s.status is S.WAITING_USER and d.s.ops[0].status is OpStatus.PROPOSED
    assert ask.state_version == d.s.version and not effects_of(t, CallTool)
    reply = d.make(
        UserReplied,
        question_id=ask.question_id,
        token_id=ask.token_id,
        state_version=ask.state_version,
        response={"approved": True},
    )
    t = d.send(reply)
    call = only(t, CallTool)
    assert call.operation.policy_decision == "approved" and d.s.status is S.TOOL_RUNNING
    assert transition(d.s, reply).disposition is Disposition.DUPLICATE
    again = reply.model_copy(update={"event_id": "fresh"})
    assert transition(d.s, again).disposition is Disposition.REJECTED


def test_approval_denied_replans() -> None:
    d = started()
    ask = only(d.calls(("delete_record", {"record_id": "r1"})), AskUser)
    t = d.apply(
        UserReplied,
        question_id=ask.question_id,
        token_id=ask.token_id,
        state_version=ask.state_version,
        response={"approved": False},
    )
    assert d.s.step == 2 and only(t, CallModel) and not d.s.ops


# --- WAITING_USER rejections


def _asked() -> tuple[Driver, AskUser]:
    d = started()
    return d, only(d.calls(("delete_record", {"record_id": "r1"})), AskUser)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"question_id": "q-old"}, "older question"),
        ({"token_id": "tok-forged"}, "token"),
        ({"state_version": 1}, "version"),
        ({"response": {"approved": "yes"}}, "invalid"),
        ({"at": 10**15}, "expiry"),
    ],
)
def test_bad_replies_rejected_state_unchanged(change: dict[str, Any], reason: str) -> None:
    d, ask = _asked()
    fields = {
        "question_id": ask.question_id,
        "token_id": ask.token_id,
        "state_version": ask.state_version,
        "response": {"approved": True},
    }
    fields.update(change)
    before = d.s
    t = d.apply(UserReplied, **fields)
    assert t.disposition is Disposition.REJECTED and reason in (t.reason or "")
    assert t.state is before and not t.effects


def test_reply_when_no_question_rejected() -> None:
    d = started()
    t = d.apply(UserReplied, question_id="q", token_id="t", state_version=1, response={})
    assert t.disposition is Disposition.REJECTED


@pytest.mark.parametrize(("policy", "status"), [("expire", S.EXPIRED), ("cancel", S.CANCELLED)])
def test_user_wait_expiry_by_policy(policy: str, status: RunStatus) -> None:
    d = started(
        policy=Policy(
            allowed_permissions=("read", "write", "admin"),
            approval_required=("admin",),
            on_user_expiry=policy,
        )
    )
    d.calls(("delete_record", {"record_id": "r1"}))
    q = d.s.question
    assert q is not None
    d.now = q.expires_at
    t = d.apply(TimerFired, timer_id=q.timer_id)
    assert d.s.status is status and d.s.outcome == "user_reply_expired" and d.s.question is None
    assert only(t, PublishResult).status is status
    assert d.s.time.user_wait_ms >= 600_000


# --- tools


def test_success_moves_to_next_step_with_result_in_context() -> None:
    d = at_tool()
    t = d.succeed(result="r1")
    assert d.s.step == 2 and d.s.attempt == 1 and d.s.status is S.MODEL_RUNNING
    assert d.s.path == (S.READY, S.MODEL_RUNNING)
    ctx = {a.ref: a.content for a in t.artifacts}[only(t, CallModel).context_ref]
    assert content_ref("r1") in json.loads(ctx)["inputs"]
    assert d.s.completed_ops == 1 and "search" in d.s.succeeded_tools


def test_two_operations_wait_for_both() -> None:
    d = at_tool(search("a"), search("b"))
    t = d.succeed(0)
    assert d.s.status is S.TOOL_RUNNING and not effects_of(t, CallModel)
    d.succeed(1)
    assert d.s.step == 2


def test_large_output_gets_summary_artifact() -> None:
    d = at_tool()
    summary = OutputSummary(
        head="h", tail="t", error_lines=("ERROR x",), line_count=5, byte_count=99_999, error_count=1
    )
    t = d.succeed(result="big", result_bytes=99_999, summary=summary)
    blobs = {a.ref: json.loads(a.content) for a in t.artifacts}
    summaries = [b for b in blobs.values() if "raw_ref" in b]
    assert summaries and summaries[0]["raw_ref"] == content_ref("big")


def test_async_tool_waits_and_polls() -> None:
    d = at_tool(("build_report", {"title": "t"}))
    t = d.op_event(ToolCallAccepted, poll_after_ms=1_000)
    assert d.s.status is S.WAITING_TOOL and d.s.ops[0].status is OpStatus.ACCEPTED
    timer = only(t, ScheduleTimer)
    assert d.op_event(ToolStatusReported, poll=0).disposition is Disposition.LATE
    t = d.apply(TimerFired, timer_id=timer.timer_id)
    poll = only(t, PollTool)
    assert poll.operation_key == d.s.ops[0].key and poll.poll == 1
    t = d.op_event(ToolStatusReported, poll=1)
    assert d.s.ops[0].status is OpStatus.RUNNING and only(t, ScheduleTimer)
    dup = d.op_event(ToolStatusReported, poll=1)
    assert dup.disposition is Disposition.LATE
    nxt = only(t, ScheduleTimer)
    d.apply(TimerFired, timer_id=nxt.timer_id)
    assert d.op_event(ToolStatusReported, poll=1).disposition is Disposition.LATE
    assert d.op_event(ToolStatusReported, poll=2).disposition is Disposition.APPLIED
    t = d.succeed()
    assert d.s.step == 2 and only(t, CancelTimer)
    assert d.s.time.tool_wait_ms > 0


def test_timeout_makes_operation_unknown_and_reconciles() -> None:
    d = at_tool()
    key = d.s.ops[0].key
    t = d.op_event(ToolCallTimedOut)
    assert d.s.ops[0].status is OpStatus.UNKNOWN and only(t, Reconcile).operation_key == key
    assert not effects_of(t, CallTool) and len(d.s.ops) == 1
    t = d.op_event(ReconcileCompleted, outcome=ReconcileOutcome.NOT_EXECUTED)
    call = only(t, CallTool)
    assert call.operation.key == key and call.operation.dispatch == 2
    assert d.s.ops[0].status is OpStatus.DISPATCHED
    stale = d.apply(
        ToolCallTimedOut, step=1, operation_key=key, dispatch=1
    )  # the old dispatch's timeout again
    assert stale.disposition is Disposition.LATE


def test_reconcile_found_succeeded_continues() -> None:
    d = at_tool()
    d.op_event(ToolCallTimedOut)
    d.op_event(
        ReconcileCompleted, outcome=ReconcileOutcome.FOUND_SUCCEEDED, result_ref=content_ref("x")
    )
    assert d.s.step == 2 and d.s.status is S.MODEL_RUNNING


def test_reconcile_undeterminable_pauses_then_operator_resolves() -> None:
    d = at_tool()
    d.op_event(ToolCallTimedOut)
    d.op_event(ReconcileCompleted, outcome=ReconcileOutcome.UNDETERMINABLE)
    assert d.s.status is S.PAUSED and "undeterminable" in (d.s.outcome or "")
    again = d.op_event(ReconcileCompleted, outcome=ReconcileOutcome.UNDETERMINABLE)
    assert again.disposition is Disposition.LATE
    rejected = d.apply(RunReopened, resolution=0, reason="try")
    assert rejected.disposition is Disposition.REJECTED
    d.op_event(ReconcileCompleted, outcome=ReconcileOutcome.FOUND_SUCCEEDED)
    assert d.s.status is S.MODEL_RUNNING and d.s.step == 2 and d.s.outcome is None


@pytest.mark.parametrize(
    ("error_class", "expect"),
    [
        (ErrorClass.PERMISSION_DENIED, "failed"),
        (ErrorClass.OBJECT_AMBIGUOUS, "ask"),
        (ErrorClass.RATE_LIMIT, "backoff"),
        (ErrorClass.STATE_CONFLICT, "replan"),
        (ErrorClass.TRANSIENT, "resend"),
        (ErrorClass.UNKNOWN, "replan"),
    ],
)
def test_error_classes(error_class: ErrorClass, expect: str) -> None:
    d = at_tool()
    key = d.s.ops[0].key
    t = d.op_event(ToolCallFailed, error_class=error_class, error_code="E1", retry_after_ms=500)
    match expect:
        case "failed":
            assert d.s.status is S.FAILED and "PERMISSION_DENIED" in (d.s.outcome or "")
            assert not effects_of(t, CallTool) and not effects_of(t, CallModel)
        case "ask":
            assert d.s.status is S.WAITING_USER and only(t, AskUser)
        case "backoff":
            timer = only(t, ScheduleTimer)
            assert timer.purpose is TimerPurpose.TOOL_BACKOFF and d.s.status is S.TOOL_RUNNING
            t = d.apply(TimerFired, timer_id=timer.timer_id)
            call = only(t, CallTool)
            assert call.operation.key == key and call.operation.dispatch == 2
        case "resend":
            call = only(t, CallTool)
            assert call.operation.key == key and d.s.ops[0].retries == 1
        case _:
            assert d.s.step == 2 and only(t, CallModel)
            ctx = {a.ref: a.content for a in t.artifacts}[only(t, CallModel).context_ref]
            assert "E1" in ctx


def test_tool_rate_limit_beyond_deadline_expires() -> None:
    d = at_tool(budgets=Budgets(deadline_at=Driver().now + 1_000))
    d.op_event(
        ToolCallFailed, error_class=ErrorClass.RATE_LIMIT, error_code="E", retry_after_ms=10**6
    )
    assert d.s.status is S.EXPIRED


def test_transient_retries_are_bounded() -> None:
    d = at_tool(policy=Policy(max_tool_retries=1), loop=LoopLimits(max_repeat_error=5))
    d.op_event(ToolCallFailed, error_class=ErrorClass.TRANSIENT, error_code="E")
    t = d.op_event(ToolCallFailed, error_class=ErrorClass.TRANSIENT, error_code="E")
    assert not effects_of(t, CallTool) and d.s.step == 2


@pytest.mark.parametrize(
    ("event", "fields", "disposition"),
    [
        (ToolCallAccepted, {"operation_key": "nope"}, Disposition.REJECTED),
        (ToolCallFailed, {"dispatch": 7, "error_class": "TRANSIENT", "error_code": "E"}, "LATE"),
        (ReconcileCompleted, {"outcome": "not_executed"}, Disposition.LATE),
        (CancelConfirmed, {}, Disposition.REJECTED),
        (CancelUnconfirmed, {}, Disposition.REJECTED),
    ],
)
def test_operation_event_rejections(event: type, fields: dict[str, Any], disposition: str) -> None:
    d = at_tool()
    before = d.s
    t = d.op_event(event, **fields)
    assert t.disposition == disposition and t.state is before and not t.effects


@pytest.mark.parametrize(
    ("status_event", "status"),
    [
        ("ToolCallAccepted", S.MODEL_RUNNING),
        ("UserReplied", S.TOOL_RUNNING),
        ("KnowledgeRefreshed", S.TOOL_RUNNING),
    ],
)
def test_events_not_in_table_rejected(status_event: str, status: RunStatus) -> None:
    assert (status, status_event) not in TABLE
    d = at_tool() if status is S.TOOL_RUNNING else started()
    cls = {
        "ToolCallAccepted": ToolCallAccepted,
        "UserReplied": UserReplied,
        "KnowledgeRefreshed": KnowledgeRefreshed,
    }[status_event]
    fields: dict[str, Any] = {
        "ToolCallAccepted": {"step": 1, "operation_key": "k"},
        "UserReplied": {"question_id": "q", "token_id": "t", "state_version": 1, "response": {}},
        "KnowledgeRefreshed": {"step": 1},
    }[status_event]
    t = d.apply(cls, **fields)
    assert t.disposition is Disposition.REJECTED and "not accepted" in (t.reason or "")


# --- cancel


def test_cancel_while_model_running() -> None:
    d = started()
    t = d.apply(CancelRequested)
    assert d.s.status is S.CANCELLED and only(t, PublishResult).status is S.CANCELLED
    assert only(t, CancelTimer)
    late = d.model(candidate=Candidate(content="x"), attempt=1, step=1)
    assert late.disposition is Disposition.LATE


def test_cancel_while_cancellable_tool_runs_confirmed() -> None:
    d = at_tool(("build_report", {"title": "t"}))
    d.op_event(ToolCallAccepted)
    t = d.apply(CancelRequested)
    assert only(t, CancelTool).operation_key == d.s.ops[0].key and d.s.cancel_requested
    assert d.apply(CancelRequested).disposition is Disposition.DUPLICATE
    d.op_event(CancelConfirmed)
    assert d.s.status is S.CANCELLED


def test_cancel_unconfirmed_is_cancel_unknown() -> None:
    d = at_tool(("build_report", {"title": "t"}))
    d.apply(CancelRequested)
    d.op_event(CancelUnconfirmed)
    assert d.s.status is S.CANCEL_UNKNOWN


def test_cancel_then_tool_completes_anyway_is_cancelled() -> None:
    d = at_tool(("build_report", {"title": "t"}))
    d.apply(CancelRequested)
    d.succeed()
    assert d.s.status is S.CANCELLED and d.s.ops[0].status is OpStatus.SUCCEEDED


def test_cancel_of_uncancellable_tool_is_cancel_unknown() -> None:
    d = at_tool()
    t = d.apply(CancelRequested)
    assert d.s.status is S.CANCEL_UNKNOWN and not effects_of(t, CancelTool)


def test_cancel_with_unknown_operation_reconciled_not_executed() -> None:
    d = at_tool(("build_report", {"title": "t"}), ("search", {"query": "q"}))
    d.op_event(ToolCallTimedOut, op_index=1)
    d.apply(CancelRequested)
    assert d.s.status is S.CANCEL_UNKNOWN


def test_cancel_waits_for_not_executed_reconcile() -> None:
    d = at_tool(("build_report", {"title": "t"}))
    d.op_event(ToolCallAccepted)
    d.apply(CancelRequested)
    d.op_event(CancelConfirmed)
    assert d.s.status is S.CANCELLED


# --- timers, goals, knowledge


def test_deadline_timer_expires_any_state() -> None:
    d = at_tool(("build_report", {"title": "t"}))
    deadline = next(t for t in d.s.timers if t.purpose is TimerPurpose.DEADLINE)
    d.now = deadline.due_at
    t = d.apply(TimerFired, timer_id=deadline.timer_id)
    assert d.s.status is S.EXPIRED and only(t, CancelTool)
    assert d.apply(TimerFired, timer_id=deadline.timer_id).disposition is Disposition.LATE


def test_unknown_timer_is_late() -> None:
    d = started()
    assert d.apply(TimerFired, timer_id="tmr-x").disposition is Disposition.LATE


@pytest.mark.parametrize(
    ("policy", "status"), [("continue", S.MODEL_RUNNING), ("new_run", S.CANCELLED)]
)
def test_goal_change_by_policy(policy: str, status: RunStatus) -> None:
    d = started(policy=Policy(on_goal_change=policy))
    t = d.apply(GoalChanged, step=1, goal="new goal")
    assert d.s.status is status
    if status is S.MODEL_RUNNING:
        assert d.s.goal == "new goal" and d.s.step == 2 and only(t, CallModel)
        assert d.s.warnings
    else:
        assert "superseded" in (d.s.outcome or "")
    assert d.apply(GoalChanged, step=1, goal="x").disposition in (
        Disposition.LATE,
        Disposition.REJECTED,
    )


def test_goal_change_rejected_while_tool_runs() -> None:
    d = started()
    d.calls(search())
    d.state = d.s.model_copy(update={"status": S.READY})  # force a table row with an op in flight
    t = d.apply(GoalChanged, step=1, goal="x")
    assert t.disposition is Disposition.REJECTED


def test_knowledge_refresh_is_a_new_step() -> None:
    d = started()
    t = d.apply(KnowledgeRefreshed, step=1, evidence_refs=(content_ref("kb"),))
    assert d.s.step == 2 and only(t, CallModel).context_ref != d.log[0]
    assert d.s.evidence_refs == (content_ref("kb"),)
    assert d.apply(KnowledgeRefreshed, step=1).disposition is Disposition.LATE


def test_gap_timeout_fails_with_diagnosis() -> None:
    d = started()
    d.apply(GapTimedOut, expected_seq=7, diagnosis="seq 7 never arrived")
    assert d.s.status is S.FAILED and d.s.outcome == "seq_gap:7:seq 7 never arrived"


def test_a_refused_input_fails_the_run_once_with_its_reason() -> None:
    d = started()
    refused = d.make(InputRefused, reason="invalid_input:record_too_large: 2 MB", input_id="i-1")
    t = transition(d.s, refused)
    assert t.state is not None and t.state.status is S.FAILED
    assert t.state.outcome == "invalid_input:record_too_large: 2 MB"
    assert any(isinstance(e, PublishResult) for e in t.effects)
    again = transition(t.state, refused)
    assert again.disposition is Disposition.DUPLICATE and not again.effects


# --- terminal, corrections


def test_terminal_state_is_written_once_and_late_events_ignored() -> None:
    d = started()
    d.final()
    done = d.s
    for event in (
        d.make(CancelRequested),
        d.make(TimerFired, timer_id="x"),
        d.make(GapTimedOut, expected_seq=1, diagnosis="x"),
    ):
        t = transition(done, event)
        assert t.disposition is Disposition.LATE and t.state is done and not t.effects


def test_reopen_and_resolve_are_compare_and_set() -> None:
    d = started()
    d.final()
    assert d.apply(RunResolved, resolution=5, status=S.FAILED, reason="x").disposition is (
        Disposition.REJECTED
    )
    assert d.apply(RunResolved, resolution=0, status=S.READY, reason="x").disposition is (
        Disposition.REJECTED
    )
    t = d.apply(RunResolved, resolution=0, status=S.FAILED, reason="audit found a problem")
    assert d.s.status is S.FAILED and d.s.resolution == 1
    assert only(t, PublishResult).resolution == 1
    t = d.apply(RunReopened, resolution=1, reason="retry", goal="again")
    assert d.s.status is S.MODEL_RUNNING and d.s.resolution == 2 and d.s.goal == "again"
    assert only(t, CallModel)
    assert d.apply(RunReopened, resolution=1, reason="x").disposition is Disposition.REJECTED


def test_operator_actions_carry_their_actor_into_the_log() -> None:
    d = at_tool()
    d.op_event(ToolCallTimedOut)
    d.op_event(ReconcileCompleted, outcome=ReconcileOutcome.UNDETERMINABLE)
    verdict = d.make(
        ReconcileCompleted,
        step=d.s.ops[0].step,
        operation_key=d.s.ops[0].key,
        dispatch=d.s.ops[0].dispatch,
        outcome=ReconcileOutcome.NOT_EXECUTED,
        actor="operator:alice",
    )
    assert d.send(verdict).disposition is Disposition.APPLIED
    assert d.s.status is S.TOOL_RUNNING and d.s.ops[0].dispatch == 2
    decoded = type(verdict).model_validate_json(verdict.model_dump_json())
    assert decoded.actor == "operator:alice"
    # records written before the field existed decode with no actor
    old = json.loads(
        RunResolved(**_ids(), resolution=0, status=S.FAILED, reason="x").model_dump_json()
    )
    del old["actor"]
    assert isinstance(resolved := parse_event(json.dumps(old)), RunResolved)
    assert resolved.actor is None


def _ids() -> dict[str, Any]:
    return {"run_id": "r", "event_id": "e", "at": 1, "trace_id": "t"}


def test_redrive_of_a_model_call_that_never_answered_is_a_new_attempt() -> None:
    d = started()
    assert d.s.status is S.MODEL_RUNNING and d.s.attempt == 1
    seen = d.s.version
    t = d.apply(RedriveRequested, version=seen, reason="model executor lost it", actor="op:a")
    assert t.disposition is Disposition.APPLIED
    assert d.s.status is S.MODEL_RUNNING and d.s.attempt == 2
    call = only(t, CallModel)
    assert call.attempt == 2 and call.context_ref == d.s.context_ref
    # the first attempt's answer, should it come after all, no longer applies
    late = d.model(step=1, attempt=1)
    assert late.disposition is Disposition.LATE


def test_redrive_is_compare_and_set_on_the_version() -> None:
    d = started()
    stale = d.apply(RedriveRequested, version=d.s.version + 1)
    assert stale.disposition is Disposition.REJECTED and "stale" in (stale.reason or "")
    seen = d.s.version
    d.apply(RedriveRequested, version=seen)
    again = d.apply(RedriveRequested, version=seen)  # a second operator saw the same state
    assert again.disposition is Disposition.REJECTED and d.s.attempt == 2


def test_redrive_of_a_tool_call_looks_it_up_never_resends_it() -> None:
    d = at_tool()
    op = d.s.ops[0]
    t = d.apply(RedriveRequested, version=d.s.version)
    assert t.disposition is Disposition.APPLIED and not effects_of(t, CallTool)
    look = only(t, Reconcile)
    assert look.operation_key == op.key and look.dispatch == op.dispatch
    assert d.s.status is S.TOOL_RUNNING and d.s.ops[0].status is OpStatus.UNKNOWN
    # a look-up that never answered is asked again under a new key
    t2 = d.apply(RedriveRequested, version=d.s.version)
    assert only(t2, Reconcile).idempotency_key != look.idempotency_key
    # the call's own answer, late, still counts
    d.succeed()
    assert d.last is not None and d.last.disposition is Disposition.APPLIED
    assert d.s.step == 2 and d.s.status is S.MODEL_RUNNING


def test_redrive_is_refused_while_a_timer_drives_the_run_or_where_nothing_is_stuck() -> None:
    d = started()
    d.model(ModelOutcome.RATE_LIMITED, retry_after_ms=5_000)
    assert any(t.purpose is TimerPurpose.MODEL_BACKOFF for t in d.s.timers)
    t = d.apply(RedriveRequested, version=d.s.version)
    assert t.disposition is Disposition.REJECTED and "MODEL_BACKOFF" in (t.reason or "")
    ask = started()
    ask.calls(("delete_record", {"record_id": "r1"}))
    assert ask.s.status is S.WAITING_USER  # a person's answer is awaited, nothing is stuck
    t = ask.apply(RedriveRequested, version=ask.s.version)
    assert t.disposition is Disposition.REJECTED
    done = started()
    done.final()
    t = done.apply(RedriveRequested, version=done.s.version)
    assert t.disposition is Disposition.LATE and done.s.status is S.SUCCEEDED


def test_reopen_reschedules_deadline() -> None:
    d = started()
    d.apply(CancelRequested)
    t = d.apply(RunReopened, resolution=0, reason="r")
    assert any(x.purpose is TimerPurpose.DEADLINE for x in effects_of(t, ScheduleTimer))


# --- loops, progress


def test_repeated_action_loop() -> None:
    d = started(loop=LoopLimits(max_repeat_action=3, max_steps_without_progress=99))
    for _ in range(2):
        d.calls(search("same"))
        d.succeed()
    d.calls(search("same"))
    assert d.s.status is S.FAILED and d.s.outcome == "loop:repeated_action"


def test_plan_oscillation_loop() -> None:
    d = started(loop=LoopLimits(max_steps_without_progress=99), budgets=Budgets(max_steps=20))
    for q in ("a", "b", "a"):
        d.calls(search(q))
        d.succeed()
    d.calls(search("b"))
    assert d.s.status is S.FAILED and d.s.outcome == "loop:plan_oscillation"


def test_repeated_error_loop() -> None:
    d = started(loop=LoopLimits(max_repeat_error=2))
    d.calls(search("a"))
    d.op_event(ToolCallFailed, error_class=ErrorClass.STATE_CONFLICT, error_code="E9")
    d.calls(search("b"))
    d.op_event(ToolCallFailed, error_class=ErrorClass.STATE_CONFLICT, error_code="E9")
    assert d.s.status is S.FAILED and d.s.outcome == "loop:repeated_error:STATE_CONFLICT:E9"


@pytest.mark.parametrize(("action", "status"), [("pause", S.PAUSED), ("fail", S.FAILED)])
def test_no_progress(action: str, status: RunStatus) -> None:
    d = started(
        policy=Policy(on_no_progress=action),
        loop=LoopLimits(max_steps_without_progress=2),
    )
    for q in ("a", "b", "c"):  # the first result is new evidence; the next two are not
        d.calls(search(q))
        d.succeed(result="same output")
    assert d.s.status is status and "no_progress" in (d.s.outcome or "")
    if status is S.PAUSED:
        d.apply(RunReopened, resolution=0, reason="operator says go on")
        assert d.s.status is S.MODEL_RUNNING


def test_narrowed_candidates_count_as_progress() -> None:
    d = started(loop=LoopLimits(max_steps_without_progress=1))
    d.calls(search("a"))
    d.succeed(result="same", candidate_count=10)
    d.calls(search("b"))
    d.succeed(result="same", candidate_count=4)
    assert d.s.status is S.MODEL_RUNNING


def test_event_cap_fails_run() -> None:
    d = started(loop=LoopLimits(max_events=3))
    d.model(ModelOutcome.INCOMPLETE)
    d.model(ModelOutcome.INCOMPLETE)
    t = d.model(ModelOutcome.INCOMPLETE)
    assert d.s.status is S.FAILED and d.s.outcome == "loop:event_cap:3"
    assert only(t, PublishResult)


# --- finalize with tools open


def test_final_answer_with_tool_still_running_waits() -> None:
    d = at_tool(("build_report", {"title": "t"}))
    d.op_event(ToolCallAccepted)
    # a final answer arriving while the async tool runs (state forced into MODEL_RUNNING)
    d.state = d.s.model_copy(update={"status": S.MODEL_RUNNING})
    t = d.final()
    assert d.s.status is S.WAITING_TOOL and d.s.pending_final_ref is not None
    assert not effects_of(t, PublishResult)
    d.state = d.s.model_copy(update={"status": S.WAITING_TOOL})
    d.succeed()
    assert d.s.status is S.SUCCEEDED


def test_time_accounting_splits_buckets() -> None:
    d = at_tool()
    d.now += 10_000
    d.succeed()
    assert d.s.time.tool_wait_ms >= 10_000 and d.s.time.system_ms >= 100
    assert d.s.time.user_wait_ms == 0


def test_cancel_with_two_operations_one_unknown_reconciled_not_executed() -> None:
    d = started()
    d.calls(("build_report", {"title": "a"}), ("delete_record", {"record_id": "x"}))
    assert d.s.status is S.WAITING_USER  # delete needs approval: approve it first
    q = d.s.question
    assert q is not None
    d.apply(
        UserReplied,
        question_id=q.question_id,
        token_id=q.token_id,
        state_version=q.version,
        response={"approved": True},
    )
    assert [o.status for o in d.s.ops] == [OpStatus.DISPATCHED, OpStatus.DISPATCHED]
    d.apply(CancelRequested)
    d.op_event(ToolCallTimedOut, op_index=1)
    assert d.s.ops[1].status is OpStatus.UNKNOWN and not d.s.terminal
    d.op_event(ReconcileCompleted, op_index=1, outcome=ReconcileOutcome.NOT_EXECUTED)
    assert d.s.ops[1].status is OpStatus.CANCELLED and not d.s.terminal
    d.op_event(CancelConfirmed, op_index=0)
    assert d.s.status is S.CANCELLED


def test_reopen_after_cancel_unknown_warns_and_old_control_events_stay_handled() -> None:
    d = at_tool()
    cancel = d.make(CancelRequested)
    d.send(cancel)
    assert d.s.status is S.CANCEL_UNKNOWN
    d.apply(RunReopened, resolution=0, reason="operator checked the backend")
    assert d.s.status is S.MODEL_RUNNING and "unknown operation" in d.s.warnings[-1]
    assert transition(d.s, cancel).disposition is Disposition.DUPLICATE
    gap = d.make(GapTimedOut, expected_seq=3, diagnosis="hole")
    d.send(gap)
    d.apply(RunReopened, resolution=1, reason="again")
    assert d.s.status is S.MODEL_RUNNING
    for _ in range(9):  # push the gap out of the recent-event window
        d.model(ModelOutcome.RATE_LIMITED, retry_after_ms=1)
        d.apply(TimerFired, timer_id=d.s.timers[-1].timer_id)
    assert transition(d.s, gap).disposition is Disposition.DUPLICATE
    assert transition(d.s, cancel).disposition is Disposition.DUPLICATE
