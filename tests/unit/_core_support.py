"""Helpers for the core unit tests: build events, drive a run, inspect effects."""

from __future__ import annotations

import itertools
import json
from typing import Any

from agentruns.connectors.dev.servers.workload import START_AT, TOOLS
from agentruns.processors.effects import CallModel, CallTool, Effect
from agentruns.processors.events import (
    Candidate,
    ModelCallCompleted,
    ModelOutcome,
    ModelUsage,
    RunSubmitted,
    ToolCallRequest,
    ToolCallSucceeded,
)
from agentruns.processors.ids import content_ref
from agentruns.processors.state import Budgets, LoopLimits, Policy, RunState
from agentruns.processors.transition import Disposition, Transition, transition

RUN = "run-t"


class Driver:
    """Feeds events to the core for one run and keeps the state and the last transition."""

    def __init__(self, run_id: str = RUN) -> None:
        self.run_id = run_id
        self.state: RunState | None = None
        self.now = START_AT
        self.counter = itertools.count(1)
        self.last: Transition | None = None
        self.log: list[Any] = []

    def make(self, cls: type[Any], **fields: Any) -> Any:
        self.now += 100
        base = {
            "run_id": self.run_id,
            "event_id": f"{self.run_id}:{next(self.counter)}",
            "at": self.now,
            "trace_id": "trace-t",
        }
        base.update(fields)
        return cls(**base)

    def send(self, event: Any) -> Transition:
        self.log.append(event)
        self.last = transition(self.state, event)
        self.state = self.last.state
        return self.last

    def apply(self, cls: type[Any], **fields: Any) -> Transition:
        return self.send(self.make(cls, **fields))

    @property
    def s(self) -> RunState:
        assert self.state is not None
        return self.state

    # -- common steps
    def submit(
        self,
        policy: Policy | None = None,
        budgets: Budgets | None = None,
        loop: LoopLimits | None = None,
        **extra: Any,
    ) -> Transition:
        return self.apply(
            RunSubmitted,
            goal="g",
            tools=TOOLS,
            policy=policy
            or Policy(allowed_permissions=("read", "write", "admin"), approval_required=("admin",)),
            budgets=budgets or Budgets(deadline_at=START_AT + 3_600_000, max_steps=10),
            loop=loop or LoopLimits(),
            **extra,
        )

    def model(
        self,
        outcome: ModelOutcome = ModelOutcome.FINISHED,
        candidate: Candidate | None = None,
        **extra: Any,
    ) -> Transition:
        return self.apply(
            ModelCallCompleted,
            step=extra.pop("step", self.s.step),
            attempt=extra.pop("attempt", self.s.attempt),
            outcome=outcome,
            candidate=candidate,
            usage=extra.pop("usage", ModelUsage(input_tokens=100, output_tokens=10)),
            **extra,
        )

    def calls(self, *calls: tuple[str, dict[str, Any]], **extra: Any) -> Transition:
        requests = tuple(
            ToolCallRequest(id=f"c{i}", name=name, arguments_json=json.dumps(args))
            for i, (name, args) in enumerate(calls)
        )
        return self.model(candidate=Candidate(tool_calls=requests), **extra)

    def final(self, content: str = "done", cited: tuple[str, ...] = ()) -> Transition:
        return self.model(candidate=Candidate(content=content, cited_refs=cited))

    def succeed(self, op_index: int = 0, result: str | None = None, **extra: Any) -> Transition:
        op = self.s.ops[op_index]
        return self.apply(
            ToolCallSucceeded,
            step=op.step,
            operation_key=op.key,
            dispatch=op.dispatch,
            result_ref=content_ref(result or f"result-{op.key}-{op.dispatch}-{self.now}"),
            **extra,
        )

    def op_event(self, cls: type[Any], op_index: int = 0, **extra: Any) -> Transition:
        op = self.s.ops[op_index]
        fields = {"step": op.step, "operation_key": op.key, "dispatch": op.dispatch}
        fields.update(extra)
        return self.apply(cls, **fields)


def effects_of(t: Transition, kind: type[Any]) -> list[Any]:
    return [e for e in t.effects if isinstance(e, kind)]


def only(t: Transition, kind: type[Any]) -> Any:
    found = effects_of(t, kind)
    assert len(found) == 1, (kind, t.effects)
    return found[0]


def search(q: str = "x") -> tuple[str, dict[str, Any]]:
    return ("search", {"query": q})


def applied(t: Transition) -> bool:
    return t.disposition is Disposition.APPLIED


__all__ = [
    "RUN",
    "CallModel",
    "CallTool",
    "Driver",
    "Effect",
    "applied",
    "effects_of",
    "only",
    "search",
]
