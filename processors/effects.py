"""Effects: declarations the executors carry out, verb-noun (R1, R25).

Every effect has a deterministic ``idempotency_key`` and run/step/attempt/trace identity.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from processors.state import Frozen, RunStatus, TimerPurpose


class EffectBase(Frozen, tag_field="type", frozen=True, kw_only=True, gc=False):
    idempotency_key: str
    run_id: str
    step: int
    attempt: int
    trace_id: str


class RepairNote(Frozen, frozen=True, kw_only=True, gc=False):
    candidate_ref: str
    error_code: str
    detail: str


class CallModel(EffectBase, tag="CallModel", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["CallModel"]] = "CallModel"
    context_ref: str
    model_route: str
    repair: RepairNote | None = None


class OperationSpec(Frozen, frozen=True, kw_only=True, gc=False):
    key: str  # passed to the backend: the same on every resend (R12, R25)
    tool: str
    arguments_json: str
    expected_version: str | None
    policy_decision: str
    dispatch: int


class CallTool(EffectBase, tag="CallTool", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["CallTool"]] = "CallTool"
    operation: OperationSpec


class Reconcile(EffectBase, tag="Reconcile", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["Reconcile"]] = "Reconcile"
    operation_key: str
    tool: str
    dispatch: int


class PollTool(EffectBase, tag="PollTool", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["PollTool"]] = "PollTool"
    operation_key: str
    tool: str
    dispatch: int
    poll: int


class CancelTool(EffectBase, tag="CancelTool", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["CancelTool"]] = "CancelTool"
    operation_key: str
    tool: str
    dispatch: int


class ScheduleTimer(EffectBase, tag="ScheduleTimer", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["ScheduleTimer"]] = "ScheduleTimer"
    timer_id: str
    due_at: int
    purpose: TimerPurpose


class CancelTimer(EffectBase, tag="CancelTimer", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["CancelTimer"]] = "CancelTimer"
    timer_id: str


class AskUser(EffectBase, tag="AskUser", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["AskUser"]] = "AskUser"
    question_id: str
    question_ref: str
    response_schema: dict[str, Any]
    expires_at: int
    token_id: str
    state_version: int


class PublishResult(EffectBase, tag="PublishResult", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["PublishResult"]] = "PublishResult"
    status: RunStatus
    resolution: int
    result_ref: str
    summary: str


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
)

EFFECT_DECODER: msgspec.json.Decoder[Effect] = msgspec.json.Decoder(Effect)
