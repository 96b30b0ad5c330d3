"""The run state: immutable, small, deterministic to serialize (R1, R3, R6).

Artifacts are held by reference (``sha256:`` refs); histories are bounded windows.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Generic, Literal, Self, TypeVar

import msgspec
import msgspec.inspect

from agentruns.processors.limits import (
    LARGE_OUTPUT_BYTES,
    MAX_ITEMS,
    Amount,
    Count,
    DurationMs,
    Id,
    Ids,
    Text,
    TimeMs,
)

CURRENT_VALIDATOR_VERSION = 2
_T = TypeVar("_T")

_replace = msgspec.structs.replace
_ENCODER = msgspec.json.Encoder()


class Frozen(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, gc=False):
    """Base of every core record: immutable, unknown fields rejected when decoded.

    msgspec structs, not pydantic models: the core copies and builds several records per
    transition and serializes a snapshot per run per batch, where msgspec is 10-20x faster.
    Construction does not validate (mypy checks the core's own calls); decoding from JSON or
    from builtins (:meth:`model_validate_json`, :meth:`model_validate`) validates strictly.
    The ``model_*`` names keep the pydantic-style API the adapters use.
    """

    def model_copy(self, *, update: Mapping[str, Any] | None = None) -> Self:
        """A copy with ``update`` applied (no validation: callers pass typed values)."""
        return _replace(self, **update) if update else self

    def model_dump_json(self) -> str:
        """Deterministic JSON: fields in declaration order (a union tag first)."""
        return _ENCODER.encode(self).decode()

    def model_dump(self, mode: Literal["python", "json"] = "python") -> dict[str, Any]:
        """Plain dicts, lists/tuples and strings (enums by value), as JSON would carry them."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    @classmethod
    def model_validate_json(cls, data: str | bytes) -> Self:
        """Decode and validate (raises :class:`msgspec.DecodeError` or its subclass
        :class:`msgspec.ValidationError`, nothing else)."""
        try:
            return msgspec.json.decode(data, type=cls)
        except RecursionError:
            raise msgspec.DecodeError(_TOO_DEEP) from None

    @classmethod
    def model_validate(cls, data: Any) -> Self:
        """Validate builtins (a parsed JSON document) into this type."""
        try:
            return msgspec.convert(data, type=cls)
        except RecursionError:
            raise msgspec.ValidationError(_TOO_DEEP) from None


# msgspec decodes nested containers recursively and raises RecursionError past the
# interpreter's limit; the decoders turn it into the DecodeError every caller handles.
_TOO_DEEP = "JSON is nested too deeply"


class Decoder(Generic[_T]):
    """A msgspec JSON decoder that raises only :class:`msgspec.DecodeError` (or its subclass
    :class:`msgspec.ValidationError`) on bad input, whatever its nesting.

    Tolerant of fields it does not know, at any depth: a record written by a newer version of
    agentruns (one more field in an event, an effect or a snapshot) decodes to the fields this
    version knows, with their bounds and types checked as always. The classes stay strict (the
    JSON Schemas and the API's task door refuse unknown fields); only a body that the strict
    decode refuses for an unknown field takes the slower path: parsed to builtins, every
    unknown field removed, converted strictly (docs/codec.md, "Unknown fields")."""

    __slots__ = ("_decoder", "_shape")

    def __init__(self, decoder: msgspec.json.Decoder[_T]) -> None:
        self._decoder = decoder
        self._shape: _Shape | None = None

    def decode(self, data: str | bytes) -> _T:
        return self.decode_keeping(data)[0]

    def decode_keeping(self, data: str | bytes) -> tuple[_T, dict[str, Any]]:
        """The value and the unknown fields of its top-level object (empty when none)."""
        try:
            return self._decoder.decode(data), {}
        except RecursionError:
            raise msgspec.DecodeError(_TOO_DEEP) from None
        except msgspec.ValidationError as exc:
            if not str(exc).startswith(_UNKNOWN_FIELD):
                raise
        if self._shape is None:
            self._shape = _shape_of(msgspec.inspect.type_info(self._decoder.type))
        value, extra = _known_only(data, self._decoder.type, self._shape)
        return value, extra


_UNKNOWN_FIELD = "Object contains unknown field"

# What a decoded value looks like, as far as unknown fields go: a struct's known field names
# (with its tag field) and the shapes of its fields; a union's structs by tag; a container's
# item shape; None where nothing below can be a struct.
_Shape = Any


def _shape_of(info: msgspec.inspect.Type) -> _Shape:
    if isinstance(info, msgspec.inspect.Metadata):
        return _shape_of(info.type)
    if isinstance(info, msgspec.inspect.StructType):
        fields = {f.encode_name: _shape_of(f.type) for f in info.fields}
        known = frozenset(fields) | ({info.tag_field} if info.tag_field else frozenset())
        return ("struct", known, {k: v for k, v in fields.items() if v is not None})
    if isinstance(info, msgspec.inspect.UnionType):
        structs = [t for t in info.types if isinstance(t, msgspec.inspect.StructType)]
        if not structs:
            shapes = [s for s in (_shape_of(t) for t in info.types) if s is not None]
            return shapes[0] if len(shapes) == 1 else None
        if len(structs) == 1:
            return _shape_of(structs[0])
        return ("union", structs[0].tag_field, {t.tag: _shape_of(t) for t in structs})
    if isinstance(
        info,
        msgspec.inspect.ListType
        | msgspec.inspect.VarTupleType
        | msgspec.inspect.SetType
        | msgspec.inspect.FrozenSetType,
    ):
        item = _shape_of(info.item_type)
        return None if item is None else ("items", item)
    if isinstance(info, msgspec.inspect.TupleType):
        items = [_shape_of(t) for t in info.item_types]
        return None if all(i is None for i in items) else ("tuple", items)
    if isinstance(info, msgspec.inspect.DictType):
        value = _shape_of(info.value_type)
        return None if value is None else ("values", value)
    return None


def _strip(value: Any, shape: _Shape, dropped: list[str]) -> Any:
    """`value` without the fields `shape` does not know (names appended to `dropped`)."""
    if shape is None:
        return value
    kind = shape[0]
    if kind == "struct":
        if not isinstance(value, dict):
            return value
        known, inner = shape[1], shape[2]
        out = {}
        for key, item in value.items():
            if key not in known:
                dropped.append(key)
                continue
            sub = inner.get(key)
            out[key] = item if sub is None else _strip(item, sub, dropped)
        return out
    if kind == "union":
        if not isinstance(value, dict):
            return value
        tag = value.get(shape[1])
        chosen = shape[2].get(tag) if isinstance(tag, str | int) else None
        return value if chosen is None else _strip(value, chosen, dropped)
    if kind == "items":
        if not isinstance(value, list):
            return value
        return [_strip(item, shape[1], dropped) for item in value]
    if kind == "tuple":
        if not isinstance(value, list):
            return value
        shapes = shape[1]
        return [
            _strip(v, shapes[i], dropped) if i < len(shapes) else v for i, v in enumerate(value)
        ]
    if not isinstance(value, dict):  # "values"
        return value
    return {key: _strip(item, shape[1], dropped) for key, item in value.items()}


def _known_only(data: str | bytes, type_: Any, shape: _Shape) -> tuple[Any, dict[str, Any]]:
    """Decode `data` as `type_` ignoring unknown fields; also the unknown fields of the
    top-level object (what a snapshot keeps, see :func:`decode_state`)."""
    try:
        raw = msgspec.json.decode(data)
        dropped: list[str] = []
        known = _strip(raw, shape, dropped)
        value = msgspec.convert(known, type=type_, strict=True, str_keys=True)
    except RecursionError:
        raise msgspec.DecodeError(_TOO_DEEP) from None
    top = shape[1] if shape is not None and shape[0] == "struct" else frozenset()
    extra = {k: v for k, v in raw.items() if k not in top} if isinstance(raw, dict) and top else {}
    return value, extra


class RunStatus(StrEnum):
    READY = "READY"
    MODEL_RUNNING = "MODEL_RUNNING"
    VALIDATING = "VALIDATING"
    TOOL_RUNNING = "TOOL_RUNNING"
    WAITING_TOOL = "WAITING_TOOL"
    WAITING_USER = "WAITING_USER"
    FINALIZING = "FINALIZING"
    PAUSED = "PAUSED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    EXPIRED = "EXPIRED"
    BUDGET_EXHAUSTED = "BUDGET_EXHAUSTED"
    CANCEL_UNKNOWN = "CANCEL_UNKNOWN"


TERMINAL: frozenset[RunStatus] = frozenset(
    {
        RunStatus.SUCCEEDED,
        RunStatus.FAILED,
        RunStatus.CANCELLED,
        RunStatus.EXPIRED,
        RunStatus.BUDGET_EXHAUSTED,
        RunStatus.CANCEL_UNKNOWN,
    }
)
NON_TERMINAL: tuple[RunStatus, ...] = tuple(s for s in RunStatus if s not in TERMINAL)
# Passed through inside one transition; never the resting status of a committed state.
TRANSIENT: frozenset[RunStatus] = frozenset({RunStatus.VALIDATING, RunStatus.FINALIZING})


class OpStatus(StrEnum):
    PROPOSED = "PROPOSED"  # validated, waiting for a user approval
    DISPATCHED = "DISPATCHED"
    ACCEPTED = "ACCEPTED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    UNKNOWN = "UNKNOWN"  # timed out: PENDING_RECONCILIATION
    CANCELLED = "CANCELLED"


IN_FLIGHT: frozenset[OpStatus] = frozenset(
    {OpStatus.DISPATCHED, OpStatus.ACCEPTED, OpStatus.RUNNING}
)
SETTLED: frozenset[OpStatus] = frozenset({OpStatus.SUCCEEDED, OpStatus.FAILED, OpStatus.CANCELLED})


class ErrorClass(StrEnum):
    PERMISSION_DENIED = "PERMISSION_DENIED"
    OBJECT_AMBIGUOUS = "OBJECT_AMBIGUOUS"
    RATE_LIMIT = "RATE_LIMIT"
    STATE_CONFLICT = "STATE_CONFLICT"
    TRANSIENT = "TRANSIENT"
    UNKNOWN = "UNKNOWN"


class TimerPurpose(StrEnum):
    DEADLINE = "DEADLINE"
    USER_EXPIRY = "USER_EXPIRY"
    MODEL_BACKOFF = "MODEL_BACKOFF"
    TOOL_BACKOFF = "TOOL_BACKOFF"
    TOOL_POLL = "TOOL_POLL"
    GAP_TIMEOUT = "GAP_TIMEOUT"  # scheduled by the processor for a seq gap (R5), never by the core


# The bounds on the fields below (R30) are checked when a task is decoded: a value out of range
# never reaches the transition function. Fields the core derives (counters it increments, sums,
# hashes) stay unbounded so a snapshot always decodes.


class ToolSpec(Frozen, frozen=True, kw_only=True, gc=False):
    name: Id
    parameters: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object"})
    permission: Id = "read"
    is_async: bool = False
    idempotent: bool = True
    cancellable: bool = False
    #: "run": a call starts a child run (agentruns.processors.children) instead of reaching a
    #: backend; UNSET (not written): an ordinary tool, so every other spec keeps its bytes.
    kind: Literal["tool", "run"] | msgspec.UnsetType = msgspec.UNSET

    @property
    def starts_run(self) -> bool:
        return self.kind == "run"


class Policy(Frozen, frozen=True, kw_only=True, gc=False):
    allowed_permissions: Ids = ("read", "write")
    approval_required: Ids = ()
    max_model_attempts: Count = 3
    max_repairs: Count = 2
    max_tool_retries: Count = 2
    require_evidence: bool = False
    required_tools: Ids = ()
    user_wait_ms: DurationMs = 600_000
    on_user_expiry: Literal["expire", "cancel"] = "expire"
    on_goal_change: Literal["continue", "new_run"] = "continue"
    on_no_progress: Literal["pause", "fail"] = "pause"
    large_output_bytes: Amount = LARGE_OUTPUT_BYTES
    poll_interval_ms: DurationMs = 30_000


class Budgets(Frozen, frozen=True, kw_only=True, gc=False):
    deadline_at: TimeMs | None = None
    max_steps: Count = 20
    max_tokens: Amount | None = None
    max_cost_micros: Amount | None = None
    max_tool_calls: Count | None = None


class LoopLimits(Frozen, frozen=True, kw_only=True, gc=False):
    max_repeat_action: Count = 3
    max_repeat_error: Count = 3
    max_steps_without_progress: Count = 5
    max_events: Count = 200
    detect_oscillation: bool = True


Tools = Annotated[tuple[ToolSpec, ...], msgspec.Meta(max_length=MAX_ITEMS)]


class RunConfig(Frozen, frozen=True, kw_only=True, gc=False):
    tools: Tools
    config_ref: str  # the frozen run configuration artifact (tools, policy, budgets, route)
    policy: Policy
    budgets: Budgets
    loop: LoopLimits
    model_route: Id
    validator_version: Count

    def tool(self, name: str) -> ToolSpec | None:
        for spec in self.tools:
            if spec.name == name:
                return spec
        return None


class Usage(Frozen, frozen=True, kw_only=True, gc=False):
    input_tokens: int = 0
    output_tokens: int = 0
    cost_micros: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def plus(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cost_micros=self.cost_micros + other.cost_micros,
        )


class TimeAccount(Frozen, frozen=True, kw_only=True, gc=False):
    """Milliseconds split by who the run was waiting for (R16)."""

    started_at: TimeMs
    last_at: TimeMs
    system_ms: int = 0
    tool_wait_ms: int = 0
    user_wait_ms: int = 0
    ended_at: TimeMs | None = None


class Operation(Frozen, frozen=True, kw_only=True, gc=False):
    key: str
    step: int
    tool: str
    call_id: str
    args_json: str
    action_hash: str
    expected_version: str | None = None
    policy_decision: Literal["allow", "approved"] = "allow"
    status: OpStatus = OpStatus.DISPATCHED
    dispatch: int = 1
    retries: int = 0
    result_ref: str | None = None
    summary_ref: str | None = None
    error_class: ErrorClass | None = None
    error_code: str | None = None
    cancel_unconfirmed: bool = False
    polls: int = 0


class Question(Frozen, frozen=True, kw_only=True, gc=False):
    question_id: str
    kind: Literal["approval", "clarification"]
    artifact_ref: str
    response_schema: dict[str, Any]
    expires_at: TimeMs  # the core caps derived times at MAX_TIME_MS
    token_id: str
    version: int
    timer_id: str


class Timer(Frozen, frozen=True, kw_only=True, gc=False):
    timer_id: str
    purpose: TimerPurpose
    due_at: TimeMs  # the core caps derived times at MAX_TIME_MS
    op_key: str | None = None


class LoopMemory(Frozen, frozen=True, kw_only=True, gc=False):
    recent_actions: tuple[str, ...] = ()
    recent_errors: tuple[str, ...] = ()
    plan_history: tuple[str, ...] = ()
    steps_without_progress: int = 0
    progress_in_step: bool = False
    last_candidate_count: int | None = None


class ValidationRecord(Frozen, frozen=True, kw_only=True, gc=False):
    validator_version: int
    candidate_ref: str
    ok: bool
    action: str
    error_code: str | None = None
    evidence_hash: str


class Message(Frozen, frozen=True, kw_only=True, gc=False):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text


Messages = Annotated[tuple[Message, ...], msgspec.Meta(max_length=MAX_ITEMS)]


class ReplacedInput(Frozen, frozen=True, kw_only=True, gc=False):
    """A record of the source the fork's state was folded with in place of the source's own:
    the event's JSON (agentruns.processors.lineage.with_replaced)."""

    seq: Count
    event: Text


class ForkEdits(Frozen, frozen=True, kw_only=True, gc=False):
    """What a fork changes of the state it copies: the records replaced before the fork point
    (folded by whoever forks, checked by audit), and what the core applies as it starts the
    fork."""

    #: Another model route for the fork's model calls (its frozen configuration is re-made).
    model_route: Id | None = None
    #: Messages added to the conversation where the fork asks the model (a fork point where
    #: the source was waiting for the model): the fork's first context carries them.
    messages: Messages = ()
    #: Records of the source replaced, by seq, before its state at the fork point was folded.
    replaced_inputs: Annotated[tuple[ReplacedInput, ...], msgspec.Meta(max_length=MAX_ITEMS)] = ()
    #: The fork's budgets, each at least the source's (a resume after a budget stop or an
    #: expired deadline goes on only with more); what the source spent carries over.
    budgets: Budgets | None = None


class Lineage(Frozen, frozen=True, kw_only=True, gc=False):
    """Where a fork comes from: its direct source, the seq it was forked at, the edits."""

    source_run_id: Id
    source_seq: Count
    edits: ForkEdits = ForkEdits()


class ParentLink(Frozen, frozen=True, kw_only=True, gc=False):
    """The run that started this one as a tool call (agentruns.processors.children): its
    operation, which this run's end answers, and the chain of runs above it."""

    run_id: Id
    trace_id: Id
    operation_key: Id
    tool: Id
    step: Count
    dispatch: Count = 1
    #: 1 for a child of a run nobody started; one more for each run above.
    depth: Count
    #: Every run above this one, the oldest first, ``run_id`` last.
    ancestors: Ids


class RunState(Frozen, frozen=True, kw_only=True, gc=False):
    run_id: Id
    trace_id: Id
    submitted_event_id: Id
    status: RunStatus
    path: tuple[RunStatus, ...] = ()
    version: int = 1
    resolution: int = 0
    # The transition rules the run was submitted under, for its whole life
    # (agentruns.processors.versions); absent (UNSET, not written) means version 1, so the
    # snapshots of version 1 runs are the bytes they always were.
    rules_version: int | msgspec.UnsetType = msgspec.UNSET
    # The version of the operator's tool catalog the task was checked against when it was
    # submitted (agentruns.processors.catalog); UNSET: none was configured.
    catalog_version: str | msgspec.UnsetType = msgspec.UNSET
    goal: Text
    config: RunConfig
    step: int = 1
    attempt: int = 1
    repairs: int = 0
    model_failures: int = 0
    context_ref: str | None = None
    candidate_ref: str | None = None
    step_inputs: tuple[str, ...] = ()
    memory_ref: str | None = None
    evidence_refs: tuple[str, ...] = ()
    usage: Usage = Usage()
    tool_calls: int = 0
    ops: tuple[Operation, ...] = ()
    completed_ops: int = 0
    result_refs: tuple[str, ...] = ()
    succeeded_tools: tuple[str, ...] = ()
    question: Question | None = None
    timers: tuple[Timer, ...] = ()
    loop: LoopMemory = LoopMemory()
    last_decision: ValidationRecord | None = None
    pending_final_ref: str | None = None
    cancel_requested: bool = False
    time: TimeAccount
    outcome: str | None = None
    result_ref: str | None = None
    recent_event_ids: tuple[str, ...] = ()
    control_event_ids: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    # The run this one was forked from (agentruns.processors.lineage); UNSET (not written) for
    # a submitted run, so the snapshots of every other run are the bytes they were.
    forked_from: Lineage | msgspec.UnsetType = msgspec.UNSET
    # The run that started this one as a tool call; UNSET (not written) for every other run.
    parent: ParentLink | msgspec.UnsetType = msgspec.UNSET
    # The child runs this run's calls started; UNSET (not written) until the first.
    children: int | msgspec.UnsetType = msgspec.UNSET
    # The tenant of the run (agentruns.processors.tenants), from its submission; a fork keeps
    # its source's. UNSET (not written): the default tenant.
    tenant: str | msgspec.UnsetType = msgspec.UNSET

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def op(self, key: str) -> Operation | None:
        for operation in self.ops:
            if operation.key == key:
                return operation
        return None

    def timer(self, tid: str) -> Timer | None:
        for t in self.timers:
            if t.timer_id == tid:
                return t
        return None

    def to_json(self) -> str:
        """Deterministic serialization (same state → same bytes)."""
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> RunState:
        """Decode a snapshot's state, ignoring fields a newer version added."""
        return decode_state(data)[0]


_STATE_DECODER: Decoder[RunState] = Decoder(msgspec.json.Decoder(RunState))


def decode_state(data: str | bytes) -> tuple[RunState, dict[str, Any]]:
    """A snapshot's state and the top-level fields of it this version does not know (kept by
    the processor when it writes the run's next snapshot, so a rollback loses none of a newer
    version's fields; unknown fields deeper down are ignored). Raises msgspec.DecodeError
    (or msgspec.ValidationError) only."""
    return _STATE_DECODER.decode_keeping(data)
