"""Run events: facts that happened, past tense (R1, R4).

Every event carries ``run_id``, ``event_id`` (producer idempotency id), ``at`` (ms since
epoch, the only clock) and ``trace_id``. The per-run seq is assigned outside the core.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from agentruns.processors.limits import MAX_ITEMS, Amount, Count, DurationMs, Id, Ids, Text, TimeMs
from agentruns.processors.state import (
    CURRENT_VALIDATOR_VERSION,
    Budgets,
    Decoder,
    ErrorClass,
    ForkEdits,
    Frozen,
    LoopLimits,
    ParentLink,
    Policy,
    RunState,
    RunStatus,
    Tools,
)
from agentruns.processors.state import Message as Message
from agentruns.processors.tenants import Tenant

# Every field an event brings from outside carries its bound (agentruns.processors.limits, R30): a
# body
# with a value out of range fails to decode, so the transition function never sees it.


class EventBase(Frozen, tag_field="type", frozen=True, kw_only=True, gc=False):
    run_id: Id
    event_id: Id
    at: TimeMs
    trace_id: Id


class CatalogCheck(Frozen, frozen=True, kw_only=True, gc=False):
    """What the processor found when it held a submission against the operator's tool catalog
    (agentruns.processors.catalog): the catalog's version and its refusal, if any."""

    version: Id
    problem: Text | None = None  # `invalid_input:<what>: detail`; None: the catalog allows it


class RunSubmitted(EventBase, tag="RunSubmitted", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["RunSubmitted"]] = "RunSubmitted"
    goal: Text
    messages: Annotated[tuple[Message, ...], msgspec.Meta(max_length=MAX_ITEMS)] = ()
    tools: Tools = ()
    policy: Policy = Policy()
    model_route: Id = "default"
    budgets: Budgets = Budgets()
    loop: LoopLimits = LoopLimits()
    memory_ref: Id | None = None
    evidence_refs: Ids = ()
    validator_version: Count = CURRENT_VALIDATOR_VERSION
    # Set by the processor that applies the submission, never by a producer: the transition
    # rules the run keeps for its whole life (agentruns.processors.versions). UNSET (not
    # written) is version 1, so the submissions of version 1 runs are the bytes they were.
    rules_version: Count | msgspec.UnsetType = msgspec.UNSET
    # Set by the processor that applies the submission, never by a producer: the tool catalog
    # it checked the task against, and what it found (a producer's value is overwritten, and
    # removed when the processor has no catalog). UNSET: no catalog; the bytes are as before.
    catalog: CatalogCheck | msgspec.UnsetType = msgspec.UNSET
    # Set by the tool executor that starts this run for another run's call of a tool of kind
    # run (agentruns.processors.children), never by a task's submitter: the API and the client
    # derive no such field. UNSET: a run nobody started; the bytes are as before.
    parent: ParentLink | msgspec.UnsetType = msgspec.UNSET
    # The tenant the run belongs to (agentruns.processors.tenants), fixed here for its whole
    # life: set by the API from the caller's credential, or by the processor for a task
    # produced straight to Kafka. UNSET: the default tenant; the bytes are as before.
    tenant: Tenant | msgspec.UnsetType = msgspec.UNSET


class ModelOutcome(StrEnum):
    FINISHED = "finished"
    INCOMPLETE = "incomplete"
    TRUNCATED = "truncated"
    BLOCKED = "blocked"
    TRANSPORT_ERROR = "transport_error"
    RATE_LIMITED = "rate_limited"


class ToolCallRequest(Frozen, frozen=True, kw_only=True, gc=False):
    id: Id
    name: Id
    arguments_json: str  # model output: its size is the record's, its depth checked by the core
    expected_version: Id | None = None


class Candidate(Frozen, frozen=True, kw_only=True, gc=False):
    """A parsed, complete model generation (the candidate artifact's content)."""

    content: str = ""  # model output: bounded by the record size
    tool_calls: Annotated[tuple[ToolCallRequest, ...], msgspec.Meta(max_length=MAX_ITEMS)] = ()
    cited_refs: Ids = ()


class ModelUsage(Frozen, frozen=True, kw_only=True, gc=False):
    input_tokens: Amount = 0
    output_tokens: Amount = 0
    cost_micros: Amount = 0


class ModelCallCompleted(EventBase, tag="ModelCallCompleted", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["ModelCallCompleted"]] = "ModelCallCompleted"
    step: Count
    attempt: Count
    outcome: ModelOutcome
    candidate_ref: Id | None = None
    candidate: Candidate | None = None
    usage: ModelUsage = ModelUsage()
    retry_after_ms: DurationMs | None = None


class OpEvent(EventBase, frozen=True, kw_only=True, gc=False):
    step: Count
    operation_key: Id
    dispatch: Count = 1


class ToolCallAccepted(OpEvent, tag="ToolCallAccepted", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["ToolCallAccepted"]] = "ToolCallAccepted"
    poll_after_ms: DurationMs | None = None


class ToolStatusReported(OpEvent, tag="ToolStatusReported", frozen=True, kw_only=True, gc=False):
    """A poll or callback said the long task is still running."""

    type: ClassVar[Literal["ToolStatusReported"]] = "ToolStatusReported"
    status: Literal["accepted", "running"] = "running"
    poll: Count  # echoes PollTool.poll: only the answer to the latest poll applies


class OutputSummary(Frozen, frozen=True, kw_only=True, gc=False):
    head: Text
    tail: Text
    error_lines: Annotated[tuple[Text, ...], msgspec.Meta(max_length=MAX_ITEMS)]
    line_count: Amount
    byte_count: Amount
    error_count: Amount


class ToolCallSucceeded(OpEvent, tag="ToolCallSucceeded", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["ToolCallSucceeded"]] = "ToolCallSucceeded"
    result_ref: Id
    result_bytes: Amount = 0
    summary: OutputSummary | None = None
    resource_version: Id | None = None
    candidate_count: Count | None = None
    # A child run's answer: what the child spent, charged to the caller's budgets (its
    # remainder is what the child's budget was carved from). UNSET for any other tool.
    child_usage: ModelUsage | msgspec.UnsetType = msgspec.UNSET


class ToolCallFailed(OpEvent, tag="ToolCallFailed", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["ToolCallFailed"]] = "ToolCallFailed"
    error_class: ErrorClass
    error_code: Id
    message: Text = ""
    retry_after_ms: DurationMs | None = None
    # A child run's failure: what the child spent, charged to the caller's budgets.
    child_usage: ModelUsage | msgspec.UnsetType = msgspec.UNSET


class ToolCallTimedOut(OpEvent, tag="ToolCallTimedOut", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["ToolCallTimedOut"]] = "ToolCallTimedOut"


class ReconcileOutcome(StrEnum):
    FOUND_SUCCEEDED = "found_succeeded"
    NOT_EXECUTED = "not_executed"
    UNDETERMINABLE = "undeterminable"


class ReconcileCompleted(OpEvent, tag="ReconcileCompleted", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["ReconcileCompleted"]] = "ReconcileCompleted"
    outcome: ReconcileOutcome
    result_ref: Id | None = None
    #: Who gave the verdict when a person did (an operator through the API); None: a look-up.
    actor: Id | None = None


class UserReplied(EventBase, tag="UserReplied", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["UserReplied"]] = "UserReplied"
    question_id: Id
    token_id: Id
    state_version: Count
    response: dict[str, Any]  # its depth is checked by the core (REJECTED past MAX_JSON_DEPTH)


class CancelRequested(EventBase, tag="CancelRequested", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["CancelRequested"]] = "CancelRequested"
    reason: Text = "requested"


class CancelConfirmed(OpEvent, tag="CancelConfirmed", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["CancelConfirmed"]] = "CancelConfirmed"


class CancelUnconfirmed(OpEvent, tag="CancelUnconfirmed", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["CancelUnconfirmed"]] = "CancelUnconfirmed"


class TimerFired(EventBase, tag="TimerFired", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["TimerFired"]] = "TimerFired"
    timer_id: Id


class GoalChanged(EventBase, tag="GoalChanged", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["GoalChanged"]] = "GoalChanged"
    step: Count
    goal: Text


class KnowledgeRefreshed(EventBase, tag="KnowledgeRefreshed", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["KnowledgeRefreshed"]] = "KnowledgeRefreshed"
    step: Count
    memory_ref: Id | None = None
    evidence_refs: Ids = ()


class RunReopened(EventBase, tag="RunReopened", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["RunReopened"]] = "RunReopened"
    resolution: Count  # compare-and-set: the resolution this correction applies to
    reason: Text
    goal: Text | None = None
    #: Who reopened it (an operator through the API), kept in the log; None in older records.
    actor: Id | None = None


class RunResolved(EventBase, tag="RunResolved", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["RunResolved"]] = "RunResolved"
    resolution: Count
    status: RunStatus
    reason: Text
    #: Who resolved it (an operator through the API), kept in the log; None in older records.
    actor: Id | None = None


class RedriveRequested(EventBase, tag="RedriveRequested", frozen=True, kw_only=True, gc=False):
    """An operator asked to drive a run again that nothing else will move: no timer is pending
    and the answer it waits for is not coming. A model call is made again as a new attempt; a
    tool call in flight is looked up by its key (Reconcile), never sent blindly again."""

    type: ClassVar[Literal["RedriveRequested"]] = "RedriveRequested"
    version: Count  # compare-and-set: the state version the operator saw stuck
    reason: Text = "requested"
    actor: Id | None = None


class GapTimedOut(EventBase, tag="GapTimedOut", frozen=True, kw_only=True, gc=False):
    type: ClassVar[Literal["GapTimedOut"]] = "GapTimedOut"
    expected_seq: Count
    diagnosis: Text


class InputRefused(EventBase, tag="InputRefused", frozen=True, kw_only=True, gc=False):
    """The processor could not take an input of this run (its body or what it would write is
    over a limit, it cannot be decoded): the run fails with the reason (R30). Written by the
    processor, never by a producer; ``event_id`` and ``at`` derive from the refused input, within
    their bounds (an id longer than MAX_ID_CHARS is replaced by a digest)."""

    type: ClassVar[Literal["InputRefused"]] = "InputRefused"
    reason: Text  # invalid_input:<what>[: detail]
    input_id: Id | None = None


class CarriedArtifact(Frozen, frozen=True, kw_only=True, gc=False):
    """An artifact a record carries for the processor to store with it (content-addressed:
    the core checks ``ref`` is the content's)."""

    ref: Id
    media_type: Id = "application/json"
    content: str  # bounded by the record size


class ForkedFrom(EventBase, tag="ForkedFrom", frozen=True, kw_only=True, gc=False):
    """The first record of a fork: a new run that starts from another run's state at one seq
    (agentruns.processors.lineage). Written by whoever forks (`agentruns fork`/`resume`, the
    API) with ``event_id`` = the new run's submission id, so forking twice with one
    idempotency key gives one fork. ``state`` is the source's state after its record ``source_seq``,
    as folded from its log: the record alone explains the fork's start, the source is never
    read again. Effects the source completed are part of that state; what it was waiting on
    is asked for again under the fork's own keys."""

    type: ClassVar[Literal["ForkedFrom"]] = "ForkedFrom"
    source_run_id: Id
    source_seq: Count
    state: RunState  # bounded by the record size, like a snapshot
    edits: ForkEdits = ForkEdits()
    #: The artifacts `state` names that the source's log did not store (those of the records
    #: folded again after a replaced input), stored by the processor with the record.
    artifacts: Annotated[tuple[CarriedArtifact, ...], msgspec.Meta(max_length=MAX_ITEMS)] = ()
    #: Who forked it (an operator through the API or the CLI), kept in the log.
    actor: Id | None = None


Event = (
    RunSubmitted
    | ForkedFrom
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
    | RedriveRequested
    | GapTimedOut
    | InputRefused
)

EVENT_TYPES: tuple[str, ...] = (
    "RunSubmitted",
    "ForkedFrom",
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
    "RedriveRequested",
    "GapTimedOut",
    "InputRefused",
)

EVENT_DECODER: Decoder[Event] = Decoder(msgspec.json.Decoder(Event))


def parse_event(data: str | bytes) -> Event:
    """Decode one event from JSON (raises msgspec.DecodeError or its subclass
    msgspec.ValidationError on bad input, nothing else)."""
    return EVENT_DECODER.decode(data)
