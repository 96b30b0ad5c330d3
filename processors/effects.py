"""Effects: declarations the executors carry out, verb-noun (R1, R25).

Every effect has a deterministic ``idempotency_key`` and run/step/attempt/trace identity.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter

from processors.state import Frozen, RunStatus, TimerPurpose


class EffectBase(Frozen):
    idempotency_key: str
    run_id: str
    step: int
    attempt: int
    trace_id: str


class RepairNote(Frozen):
    candidate_ref: str
    error_code: str
    detail: str


class CallModel(EffectBase):
    type: Literal["CallModel"] = "CallModel"
    context_ref: str
    model_route: str
    repair: RepairNote | None = None


class OperationSpec(Frozen):
    key: str  # passed to the backend: the same on every resend (R12, R25)
    tool: str
    arguments_json: str
    expected_version: str | None
    policy_decision: str
    dispatch: int


class CallTool(EffectBase):
    type: Literal["CallTool"] = "CallTool"
    operation: OperationSpec


class Reconcile(EffectBase):
    type: Literal["Reconcile"] = "Reconcile"
    operation_key: str
    tool: str
    dispatch: int


class PollTool(EffectBase):
    type: Literal["PollTool"] = "PollTool"
    operation_key: str
    tool: str
    dispatch: int
    poll: int


class CancelTool(EffectBase):
    type: Literal["CancelTool"] = "CancelTool"
    operation_key: str
    tool: str
    dispatch: int


class ScheduleTimer(EffectBase):
    type: Literal["ScheduleTimer"] = "ScheduleTimer"
    timer_id: str
    due_at: int
    purpose: TimerPurpose


class CancelTimer(EffectBase):
    type: Literal["CancelTimer"] = "CancelTimer"
    timer_id: str


class AskUser(EffectBase):
    type: Literal["AskUser"] = "AskUser"
    question_id: str
    question_ref: str
    response_schema: dict[str, Any]
    expires_at: int
    token_id: str
    state_version: int


class PublishResult(EffectBase):
    type: Literal["PublishResult"] = "PublishResult"
    status: RunStatus
    resolution: int
    result_ref: str
    summary: str


Effect = Annotated[
    CallModel
    | CallTool
    | Reconcile
    | PollTool
    | CancelTool
    | ScheduleTimer
    | CancelTimer
    | AskUser
    | PublishResult,
    Field(discriminator="type"),
]

EFFECT_ADAPTER: TypeAdapter[Effect] = TypeAdapter(Effect)
