"""Realistic run logs made by folding the pure core against a simulated world.

:func:`simulate` answers each effect the core emits with a plausible event (a model turn, a tool
result, a fault, a user reply...); ``chaos`` adds duplicates, stale and hostile events. The
benches measure the core and the sink on these logs; the unit tests fold them as properties and
golden files, and the sink and audit tests write them to Kafka (:mod:`.log_writer`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from typing import Any

from agentruns.processors.effects import (
    AskUser,
    CallModel,
    CallTool,
    CancelTimer,
    CancelTool,
    Effect,
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
    Event,
    GapTimedOut,
    GoalChanged,
    KnowledgeRefreshed,
    Message,
    ModelCallCompleted,
    ModelOutcome,
    ModelUsage,
    ReconcileCompleted,
    ReconcileOutcome,
    RunReopened,
    RunResolved,
    RunSubmitted,
    TimerFired,
    ToolCallAccepted,
    ToolCallFailed,
    ToolCallRequest,
    ToolCallSucceeded,
    ToolCallTimedOut,
    ToolStatusReported,
    UserReplied,
)
from agentruns.processors.ids import content_ref
from agentruns.processors.state import (
    Budgets,
    ErrorClass,
    LoopLimits,
    OpStatus,
    Policy,
    RunState,
    RunStatus,
    ToolSpec,
)
from agentruns.processors.summary import summarize
from agentruns.processors.transition import transition

START_AT = 1_767_225_600_000  # 2026-01-01T00:00:00Z, only as data

TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        name="search",
        parameters={
            "type": "object",
            "required": ["query"],
            "properties": {
                "query": {"type": "string", "minLength": 1},
                "limit": {"type": "integer", "minimum": 1, "maximum": 50},
            },
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        name="fetch_doc",
        parameters={
            "type": "object",
            "required": ["doc_id"],
            "properties": {"doc_id": {"type": "string"}},
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        name="update_record",
        permission="write",
        idempotent=True,
        parameters={
            "type": "object",
            "required": ["record_id", "fields"],
            "properties": {"record_id": {"type": "string"}, "fields": {"type": "object"}},
        },
    ),
    ToolSpec(
        name="build_report",
        permission="write",
        is_async=True,
        cancellable=True,
        parameters={
            "type": "object",
            "required": ["title"],
            "properties": {"title": {"type": "string"}},
        },
    ),
    ToolSpec(
        name="delete_record",
        permission="admin",
        cancellable=True,
        parameters={
            "type": "object",
            "required": ["record_id"],
            "properties": {"record_id": {"type": "string"}},
        },
    ),
)


def _args(tool: str, step: int, k: int) -> dict[str, object]:
    match tool:
        case "search":
            return {"query": f"topic {step}.{k}", "limit": 10}
        case "fetch_doc":
            return {"doc_id": f"doc-{step}-{k}"}
        case "update_record":
            return {"record_id": f"r{step}", "fields": {"n": k, "note": "ok"}}
        case "build_report":
            return {"title": f"report {step}"}
        case _:
            return {"record_id": f"r{step}-{k}"}


def submitted(
    run_id: str,
    *,
    at: int = START_AT,
    max_steps: int = 60,
    max_events: int = 1_000,
    policy: Policy | None = None,
    budgets: Budgets | None = None,
) -> RunSubmitted:
    return RunSubmitted(
        run_id=run_id,
        event_id=f"{run_id}:submit",
        at=at,
        trace_id=f"trace-{run_id}",
        goal="Collect the facts about the account and file a report.",
        messages=(Message(role="user", content="Please prepare the quarterly account report."),),
        tools=TOOLS,
        policy=policy
        or Policy(
            allowed_permissions=("read", "write", "admin"),
            approval_required=("admin",),
            max_model_attempts=4,
        ),
        budgets=budgets
        or Budgets(deadline_at=at + 86_400_000, max_steps=max_steps, max_tokens=10_000_000),
        loop=LoopLimits(max_events=max_events),
        model_route="gpt-x/default",
    )


class World:
    """Answers effects with events; ``chaos`` adds duplicates, stale and hostile events."""

    def __init__(
        self,
        rng: random.Random,
        run_id: str,
        *,
        steps: int,
        chaos: float = 0.0,
        faults: float = 0.08,
        submit: RunSubmitted | None = None,
        corrections: bool = True,
    ) -> None:
        self.corrections = corrections
        self.rng = rng
        self.run_id = run_id
        self.steps = steps
        self.chaos = chaos
        self.faults = faults
        self.now = START_AT if submit is None else submit.at
        self.n = 0
        self.state: RunState | None = None
        self.log: list[Event] = []
        self.pending: list[Effect] = []
        self.timers: dict[str, ScheduleTimer] = {}
        self.submit = submit or submitted(run_id, at=self.now)

    # -- plumbing
    def _id(self) -> dict[str, Any]:
        self.n += 1
        self.now += self.rng.randint(5, 1_500)
        return {
            "run_id": self.run_id,
            "event_id": f"{self.run_id}:e{self.n}",
            "at": self.now,
            "trace_id": f"trace-{self.run_id}",
        }

    def apply(self, event: Event) -> None:
        self.log.append(event)
        result = transition(self.state, event)
        self.state = result.state
        for effect in result.effects:
            match effect:
                case ScheduleTimer():
                    self.timers[effect.timer_id] = effect
                case CancelTimer():
                    self.timers.pop(effect.timer_id, None)
                case PublishResult():
                    pass
                case _:
                    self.pending.append(effect)

    def run(self, max_events: int = 10_000) -> list[Event]:
        self.apply(self.submit)
        while len(self.log) < max_events and self.state is not None:
            if self.chaos and self.rng.random() < self.chaos:
                self.apply(self._chaos())
                continue
            if self.state.terminal and not self.pending:
                break
            event = self._next()
            if event is None:
                break
            self.apply(event)
        return self.log

    def _next(self) -> Event | None:
        state = self.state
        assert state is not None
        if self.pending:
            index = self.rng.randrange(len(self.pending)) if self.chaos else 0
            return self._respond(self.pending.pop(index))
        if state.status is RunStatus.PAUSED:
            return self._operator(state)
        if self.timers:
            timer = min(self.timers.values(), key=lambda t: (t.due_at, t.timer_id))
            del self.timers[timer.timer_id]
            self.now = max(self.now, timer.due_at)
            return TimerFired(**self._id(), timer_id=timer.timer_id)
        return None

    def _operator(self, state: RunState) -> Event:
        unknown = [o for o in state.ops if o.status is OpStatus.UNKNOWN]
        if unknown:
            op = unknown[0]
            return ReconcileCompleted(
                **self._id(),
                step=op.step,
                operation_key=op.key,
                dispatch=op.dispatch,
                outcome=ReconcileOutcome.FOUND_SUCCEEDED,
                result_ref=content_ref(f"operator:{op.key}"),
            )
        return RunReopened(**self._id(), resolution=state.resolution, reason="operator")

    # -- answers
    def _fault(self) -> bool:
        return self.rng.random() < self.faults

    def _respond(self, effect: Effect) -> Event | None:
        match effect:
            case CallModel():
                return self._model(effect)
            case CallTool():
                return self._tool(effect)
            case Reconcile():
                outcome = self.rng.choice(
                    [ReconcileOutcome.FOUND_SUCCEEDED, ReconcileOutcome.NOT_EXECUTED]
                    + ([ReconcileOutcome.UNDETERMINABLE] if self.chaos else [])
                )
                return ReconcileCompleted(
                    **self._id(),
                    step=effect.step,
                    operation_key=effect.operation_key,
                    dispatch=effect.dispatch,
                    outcome=outcome,
                    result_ref=content_ref(f"reconciled:{effect.operation_key}"),
                )
            case PollTool():
                if self.rng.random() < 0.5:
                    return ToolStatusReported(
                        **self._id(),
                        step=effect.step,
                        operation_key=effect.operation_key,
                        dispatch=effect.dispatch,
                        poll=effect.poll,
                    )
                return self._success(effect.step, effect.operation_key, effect.dispatch)
            case AskUser():
                response: dict[str, object] = (
                    {"approved": self.rng.random() < 0.8}
                    if "approved" in json.dumps(effect.response_schema)
                    else {"answer": "use the first one"}
                )
                return UserReplied(
                    **self._id(),
                    question_id=effect.question_id,
                    token_id=effect.token_id,
                    state_version=effect.state_version,
                    response=response,
                )
            case CancelTool():
                cls: type[CancelConfirmed] | type[CancelUnconfirmed] = (
                    CancelConfirmed if self.rng.random() < 0.7 else CancelUnconfirmed
                )
                return cls(
                    **self._id(),
                    step=effect.step,
                    operation_key=effect.operation_key,
                    dispatch=effect.dispatch,
                )
            case _:
                return None

    def _model(self, effect: CallModel) -> Event:
        usage = ModelUsage(
            input_tokens=self.rng.randint(400, 1_600),
            output_tokens=self.rng.randint(30, 300),
            cost_micros=self.rng.randint(500, 3_000),
        )
        common: dict[str, Any] = {"step": effect.step, "attempt": effect.attempt, "usage": usage}
        if self._fault() and effect.repair is None:
            outcome = self.rng.choice(
                [
                    ModelOutcome.TRANSPORT_ERROR,
                    ModelOutcome.TRUNCATED,
                    ModelOutcome.INCOMPLETE,
                    ModelOutcome.RATE_LIMITED,
                    ModelOutcome.FINISHED,  # finished, but with schema-invalid arguments
                ]
            )
            if outcome is not ModelOutcome.FINISHED:
                return ModelCallCompleted(
                    **self._id(),
                    **common,
                    outcome=outcome,
                    retry_after_ms=2_000 if outcome is ModelOutcome.RATE_LIMITED else None,
                )
            bad = ToolCallRequest(id="c0", name="search", arguments_json='{"limit": "ten"}')
            return ModelCallCompleted(
                **self._id(),
                **common,
                outcome=ModelOutcome.FINISHED,
                candidate=Candidate(tool_calls=(bad,)),
            )
        state = self.state
        assert state is not None
        if effect.step >= self.steps:
            cited = state.result_refs[-2:]
            candidate = Candidate(content="Report filed; facts attached.", cited_refs=cited)
        else:
            n = 1 if self.rng.random() < 0.7 else 2
            names = [t.name for t in TOOLS if t.name != "delete_record" or self.chaos]
            calls = []
            for k in range(n):
                name = self.rng.choice(names)
                arguments = json.dumps(_args(name, effect.step, k))
                calls.append(ToolCallRequest(id=f"c{k}", name=name, arguments_json=arguments))
            candidate = Candidate(content="", tool_calls=tuple(calls))
        return ModelCallCompleted(
            **self._id(),
            **common,
            outcome=ModelOutcome.FINISHED,
            candidate_ref=content_ref(candidate.model_dump_json()),
            candidate=candidate,
        )

    def _success(self, step: int, key: str, dispatch: int) -> Event:
        large = self.rng.random() < 0.1
        body = ("line ok\n" * 4_000 + "ERROR boom\n") if large else f"result {key} {self.n}"
        return ToolCallSucceeded(
            **self._id(),
            step=step,
            operation_key=key,
            dispatch=dispatch,
            result_ref=content_ref(f"{key}:{dispatch}:{body[-40:]}:{self.n}"),
            result_bytes=len(body),
            summary=summarize(body) if large else None,
            candidate_count=self.rng.randint(1, 20),
        )

    def _tool(self, effect: CallTool) -> Event:
        op = effect.operation
        ids: dict[str, Any] = {
            "step": effect.step,
            "operation_key": op.key,
            "dispatch": op.dispatch,
        }
        if op.tool == "build_report" and op.dispatch == 1:
            return ToolCallAccepted(**self._id(), **ids, poll_after_ms=5_000)
        if self._fault():
            kind = self.rng.choice(["timeout", "transient", "rate", "conflict", "ambiguous"])
            if kind == "timeout":
                return ToolCallTimedOut(**self._id(), **ids)
            error_class = {
                "transient": ErrorClass.TRANSIENT,
                "rate": ErrorClass.RATE_LIMIT,
                "conflict": ErrorClass.STATE_CONFLICT,
                "ambiguous": ErrorClass.OBJECT_AMBIGUOUS,
            }[kind]
            return ToolCallFailed(
                **self._id(),
                **ids,
                error_class=error_class,
                error_code=f"E_{kind.upper()}",
                retry_after_ms=1_000,
            )
        return self._success(effect.step, op.key, op.dispatch)

    # -- chaos
    def _chaos(self) -> Event:
        state = self.state
        assert state is not None
        pick = self.rng.random()
        choices: list[Callable[[], Event]] = [
            lambda: self.rng.choice(self.log),  # a duplicate delivery
            lambda: (
                CancelRequested(**self._id(), reason="user")
                if self.rng.random() < 0.3
                else self.rng.choice(self.log)
            ),
            lambda: GoalChanged(**self._id(), step=state.step, goal=f"new goal {self.n}"),
            lambda: KnowledgeRefreshed(
                **self._id(),
                step=state.step,
                evidence_refs=(content_ref(f"kb{self.n}"),),
            ),
            lambda: UserReplied(
                **self._id(),
                question_id=state.question.question_id if state.question else "q-x",
                token_id="tok-forged",
                state_version=state.version,
                response={"approved": True},
            ),
            lambda: TimerFired(**self._id(), timer_id=f"tmr-{self.n}"),
            lambda: ModelCallCompleted(
                **self._id(),
                step=max(1, state.step - 1),
                attempt=1,
                outcome=ModelOutcome.FINISHED,
                candidate=Candidate(content="stale"),
            ),
            lambda: (
                GapTimedOut(**self._id(), expected_seq=self.n, diagnosis="missing")
                if self.rng.random() < 0.1
                else self.rng.choice(self.log)
            ),
            lambda: (
                self.rng.choice(self.log)
                if not self.corrections
                else RunReopened(**self._id(), resolution=state.resolution, reason="fix")
                if self.rng.random() < 0.2
                else RunResolved(
                    **self._id(),
                    resolution=state.resolution,
                    status=RunStatus.CANCELLED,
                    reason="operator",
                )
            ),
        ]
        return choices[int(pick * len(choices))]()


def simulate(
    rng: random.Random,
    run_id: str = "run-1",
    *,
    steps: int = 6,
    chaos: float = 0.0,
    faults: float = 0.08,
    max_events: int = 10_000,
    submit: RunSubmitted | None = None,
    corrections: bool = True,
) -> list[Event]:
    """One run's event log, produced by folding the core against a simulated world."""
    world = World(
        rng,
        run_id,
        steps=steps,
        chaos=chaos,
        faults=faults,
        submit=submit,
        corrections=corrections,
    )
    return world.run(max_events)


def interleave(runs: Sequence[Sequence[Event]], rng: random.Random) -> list[Event]:
    """All events of all runs, each run's in order, runs interleaved at random."""
    cursors = [0] * len(runs)
    live = [i for i, r in enumerate(runs) if r]
    out: list[Event] = []
    while live:
        k = rng.randrange(len(live))
        i = live[k]
        out.append(runs[i][cursors[i]])
        cursors[i] += 1
        if cursors[i] == len(runs[i]):
            live[k] = live[-1]
            live.pop()
    return out
