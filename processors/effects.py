"""Effects: declarations the executors carry out, verb-noun (R1, R25).

Every effect has a deterministic ``idempotency_key`` and run/step/attempt/trace identity.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from agentruns.processors.limits import Count, Id, Ids, TimeMs
from agentruns.processors.state import (
    Budgets,
    Decoder,
    Frozen,
    Policy,
    RunStatus,
    TimerPurpose,
    Tools,
    Usage,
)
from agentruns.processors.tenants import Tenant

# Values an effect copies from the run's input keep their bounds (ids, times the core caps at
# MAX_TIME_MS); counters the core increments (step, attempt, dispatch, poll) stay unbounded.


class EffectBase(Frozen, tag_field="type", frozen=True, kw_only=True, gc=False):
    idempotency_key: str
    run_id: Id
    step: int
    attempt: int
    trace_id: Id


class RepairNote(Frozen, frozen=True, kw_only=True, gc=False):
    candidate_ref: str
    error_code: str
    detail: str


class CallModel(EffectBase, tag="CallModel", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["CallModel"]] = "CallModel"
    context_ref: str
    model_route: Id
    repair: RepairNote | None = None


class ChildCall(Frozen, frozen=True, kw_only=True, gc=False):
    """What a call of a tool of kind run carries of its caller for the child it starts
    (agentruns.processors.children): the caller's rights, what it has left, where it stands."""

    at: TimeMs  # when the call was made: the child's submission time, the same on every resend
    trace_id: Id  # the caller's
    depth: Count  # the child's depth: the caller's plus one
    ancestors: Ids  # the child's ancestors, the oldest first, the caller last
    ordinal: Count  # the caller's child runs, this one included
    remaining: Budgets  # what the caller has left of its budgets
    tools: Tools  # the caller's tools: the child's are among them
    policy: Policy  # the caller's: the child keeps its approvals
    model_route: Id  # the caller's, unless the catalog entry names another
    # the caller's tenant, which is the child's; UNSET (not written): the default tenant
    tenant: Tenant | msgspec.UnsetType = msgspec.UNSET


class OperationSpec(Frozen, frozen=True, kw_only=True, gc=False):
    key: str  # passed to the backend: the same on every resend (R12, R25)
    tool: Id
    arguments_json: str
    expected_version: str | None
    policy_decision: str
    dispatch: int
    # The permission the run declared for the tool (its approval followed from it): the tool
    # executor refuses the call when its catalog now ranks the tool stricter. None: an effect
    # written before it was carried (not checked).
    permission: Id | None = None
    # A call of a tool of kind run: the caller's part of the child's task. UNSET (not
    # written) for any other call.
    child: ChildCall | msgspec.UnsetType = msgspec.UNSET


class CallTool(EffectBase, tag="CallTool", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["CallTool"]] = "CallTool"
    operation: OperationSpec


class Reconcile(EffectBase, tag="Reconcile", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["Reconcile"]] = "Reconcile"
    operation_key: str
    tool: Id
    dispatch: int


class PollTool(EffectBase, tag="PollTool", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["PollTool"]] = "PollTool"
    operation_key: str
    tool: Id
    dispatch: int
    poll: int


class CancelTool(EffectBase, tag="CancelTool", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["CancelTool"]] = "CancelTool"
    operation_key: str
    tool: Id
    dispatch: int


class ScheduleTimer(EffectBase, tag="ScheduleTimer", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["ScheduleTimer"]] = "ScheduleTimer"
    timer_id: str
    due_at: TimeMs
    purpose: TimerPurpose


class CancelTimer(EffectBase, tag="CancelTimer", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["CancelTimer"]] = "CancelTimer"
    timer_id: str


class AskUser(EffectBase, tag="AskUser", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["AskUser"]] = "AskUser"
    question_id: str
    question_ref: str
    response_schema: dict[str, Any]
    expires_at: TimeMs
    token_id: str
    state_version: int


class PublishResult(EffectBase, tag="PublishResult", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["PublishResult"]] = "PublishResult"
    status: RunStatus
    resolution: int
    result_ref: str
    summary: str
    # The run's tenant (agentruns.processors.tenants): on the result record, so a consumer of
    # the results topic can route it; UNSET (not written) for the default tenant.
    tenant: str | msgspec.UnsetType = msgspec.UNSET


class NotifyParent(EffectBase, tag="NotifyParent", frozen=True, kw_only=True, gc=False):
    """A child run ended: its end answers the call of its parent that started it. Addressed to
    the parent (``run_id``, ``trace_id``, ``step`` are the parent's call's), carried by the tool
    executor, which answers the parent's operation with the child's result or failure."""

    type: ClassVar[Literal["NotifyParent"]] = "NotifyParent"
    child_run_id: Id
    operation_key: Id
    tool: Id
    dispatch: int
    status: RunStatus
    result_ref: str  # the child's result document
    answer_ref: str | None  # the child's final answer (a candidate), when it succeeded
    reason: str
    usage: Usage = Usage()  # what the child spent, charged to the caller


Effect = (
    CallModel
    | CallTool
    | Reconcile
    | PollTool
    | CancelTool
    | ScheduleTimer
    | CancelTimer
    | AskUser
    | PublishResult
    | NotifyParent
)

EFFECT_DECODER: Decoder[Effect] = Decoder(msgspec.json.Decoder(Effect))
