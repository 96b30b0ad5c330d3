"""Run events: facts that happened, past tense (R1, R4).

Every event carries ``run_id``, ``event_id`` (producer idempotency id), ``at`` (ms since
epoch, the only clock) and ``trace_id``. The per-run seq is assigned outside the core.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar, Literal

import msgspec

from processors.state import (
    CURRENT_VALIDATOR_VERSION,
    Budgets,
    ErrorClass,
    Frozen,
    LoopLimits,
    Policy,
    RunStatus,
    ToolSpec,
)


class EventBase(Frozen, tag_field="type", frozen=True, kw_only=True, gc=False):
    run_id: str
    event_id: str
    at: int
    trace_id: str


class Message(Frozen, frozen=True, kw_only=True, gc=False):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class RunSubmitted(EventBase, tag="RunSubmitted", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["RunSubmitted"]] = "RunSubmitted"
    goal: str
    messages: tuple[Message, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    policy: Policy = Policy()
    model_route: str = "default"
    budgets: Budgets = Budgets()
    loop: LoopLimits = LoopLimits()
    memory_ref: str | None = None
    evidence_refs: tuple[str, ...] = ()
    validator_version: int = CURRENT_VALIDATOR_VERSION


class ModelOutcome(StrEnum):
    FINISHED = "finished"
    INCOMPLETE = "incomplete"
    TRUNCATED = "truncated"
    BLOCKED = "blocked"
    TRANSPORT_ERROR = "transport_error"
    RATE_LIMITED = "rate_limited"


class ToolCallRequest(Frozen, frozen=True, kw_only=True, gc=False):
    id: str
    name: str
    arguments_json: str
    expected_version: str | None = None


class Candidate(Frozen, frozen=True, kw_only=True, gc=False):
    """A parsed, complete model generation (the candidate artifact's content)."""

    content: str = ""
    tool_calls: tuple[ToolCallRequest, ...] = ()
    cited_refs: tuple[str, ...] = ()


class ModelUsage(Frozen, frozen=True, kw_only=True, gc=False):
    input_tokens: int = 0
    output_tokens: int = 0
    cost_micros: int = 0


class ModelCallCompleted(EventBase, tag="ModelCallCompleted", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["ModelCallCompleted"]] = "ModelCallCompleted"
    step: int
    attempt: int
    outcome: ModelOutcome
    candidate_ref: str | None = None
    candidate: Candidate | None = None
    usage: ModelUsage = ModelUsage()
    retry_after_ms: int | None = None


class OpEvent(EventBase, frozen=True, kw_only=True, gc=False):
    step: int
    operation_key: str
    dispatch: int = 1


class ToolCallAccepted(OpEvent, tag="ToolCallAccepted", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["ToolCallAccepted"]] = "ToolCallAccepted"
    poll_after_ms: int | None = None


class ToolStatusReported(OpEvent, tag="ToolStatusReported", frozen=True, kw_only=True, gc=False):
    """A poll or callback said the long task is still running."""

    type: ClassVar[Literal["ToolStatusReported"]] = "ToolStatusReported"
    status: Literal["accepted", "running"] = "running"
    poll: int  # echoes PollTool.poll: only the answer to the latest poll applies


class OutputSummary(Frozen, frozen=True, kw_only=True, gc=False):
    head: str
    tail: str
    error_lines: tuple[str, ...]
    line_count: int
    byte_count: int
    error_count: int


class ToolCallSucceeded(OpEvent, tag="ToolCallSucceeded", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["ToolCallSucceeded"]] = "ToolCallSucceeded"
    result_ref: str
    result_bytes: int = 0
    summary: OutputSummary | None = None
    resource_version: str | None = None
    candidate_count: int | None = None


class ToolCallFailed(OpEvent, tag="ToolCallFailed", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["ToolCallFailed"]] = "ToolCallFailed"
    error_class: ErrorClass
    error_code: str
    message: str = ""
    retry_after_ms: int | None = None


class ToolCallTimedOut(OpEvent, tag="ToolCallTimedOut", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["ToolCallTimedOut"]] = "ToolCallTimedOut"


class ReconcileOutcome(StrEnum):
    FOUND_SUCCEEDED = "found_succeeded"
    NOT_EXECUTED = "not_executed"
    UNDETERMINABLE = "undeterminable"


class ReconcileCompleted(OpEvent, tag="ReconcileCompleted", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["ReconcileCompleted"]] = "ReconcileCompleted"
    outcome: ReconcileOutcome
    result_ref: str | None = None


class UserReplied(EventBase, tag="UserReplied", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["UserReplied"]] = "UserReplied"
    question_id: str
    token_id: str
    state_version: int
    response: dict[str, Any]


class CancelRequested(EventBase, tag="CancelRequested", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["CancelRequested"]] = "CancelRequested"
    reason: str = "requested"


class CancelConfirmed(OpEvent, tag="CancelConfirmed", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["CancelConfirmed"]] = "CancelConfirmed"


class CancelUnconfirmed(OpEvent, tag="CancelUnconfirmed", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["CancelUnconfirmed"]] = "CancelUnconfirmed"


class TimerFired(EventBase, tag="TimerFired", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["TimerFired"]] = "TimerFired"
    timer_id: str


class GoalChanged(EventBase, tag="GoalChanged", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["GoalChanged"]] = "GoalChanged"
    step: int
    goal: str


class KnowledgeRefreshed(EventBase, tag="KnowledgeRefreshed", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["KnowledgeRefreshed"]] = "KnowledgeRefreshed"
    step: int
    memory_ref: str | None = None
    evidence_refs: tuple[str, ...] = ()


class RunReopened(EventBase, tag="RunReopened", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["RunReopened"]] = "RunReopened"
    resolution: int  # compare-and-set: the resolution this correction applies to
    reason: str
    goal: str | None = None


class RunResolved(EventBase, tag="RunResolved", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["RunResolved"]] = "RunResolved"
    resolution: int
    status: RunStatus
    reason: str


class GapTimedOut(EventBase, tag="GapTimedOut", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["GapTimedOut"]] = "GapTimedOut"
    expected_seq: int
    diagnosis: str


class InputRefused(EventBase, tag="InputRefused", frozen=True, kw_only=True, gc=False):
    """The processor could not take an input of this run (its body or what it would write is
    over a limit, it cannot be decoded): the run fails with the reason (R30). Written by the
    processor, never by a producer; ``event_id`` and ``at`` derive from the refused input."""

    type: ClassVar[Literal["InputRefused"]] = "InputRefused"
    reason: str  # invalid_input:<what>[: detail]
    input_id: str | None = None


Event = (
    RunSubmitted
    | ModelCallCompleted
    | ToolCallAccepted
    | ToolStatusReported
    | ToolCallSucceeded
    | ToolCallFailed
    | ToolCallTimedOut
    | ReconcileCompleted
    | UserReplied
    | CancelRequested
    | CancelConfirmed
    | CancelUnconfirmed
    | TimerFired
    | GoalChanged
    | KnowledgeRefreshed
    | RunReopened
    | RunResolved
    | GapTimedOut
    | InputRefused
)

EVENT_TYPES: tuple[str, ...] = (
    "RunSubmitted",
    "ModelCallCompleted",
    "ToolCallAccepted",
    "ToolStatusReported",
    "ToolCallSucceeded",
    "ToolCallFailed",
    "ToolCallTimedOut",
    "ReconcileCompleted",
    "UserReplied",
    "CancelRequested",
    "CancelConfirmed",
    "CancelUnconfirmed",
    "TimerFired",
    "GoalChanged",
    "KnowledgeRefreshed",
    "RunReopened",
    "RunResolved",
    "GapTimedOut",
    "InputRefused",
)

EVENT_DECODER: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)


def parse_event(data: str | bytes) -> Event:
    """Decode one event from JSON (raises msgspec.ValidationError on bad input)."""
    return EVENT_DECODER.decode(data)
