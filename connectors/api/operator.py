"""Operator actions on a run: resolve, reopen, re-drive (`POST /runs/{id}/resolve|reopen|redrive`).

Each action becomes one core input, built here from the request body and the run's committed
state; `ApiService.operator_action` stores and produces it like every other input. What the
state allows is checked here first, so a refusal is a clear 409 with the run's status; the core
checks again when it applies the input and stays the judge (compare-and-set on the resolution
for resolve and reopen, on the state version for a re-drive).

- **resolve** a PAUSED run: ``continue`` (reopen it to READY: `RunReopened`), ``fail`` or
  ``succeed`` (`RunResolved`; also a correction of an ended run's status), or, when it paused
  on a tool call whose outcome no look-up could tell, ``reconcile`` with the operator's verdict
  (`ReconcileCompleted`: ``found_succeeded``, optionally with the call's ``result``, or
  ``not_executed``, which sends the call again with the same key).
- **reopen** an ended run to READY with a new resolution (`RunReopened`, optionally a new goal).
- **redrive** a run that waits for a model or tool answer that is not coming and has no timer
  that would move it (`RedriveRequested`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from agentruns.connectors.api.errors import ApiError
from agentruns.processors.events import (
    Event,
    ReconcileCompleted,
    ReconcileOutcome,
    RedriveRequested,
    RunReopened,
    RunResolved,
)
from agentruns.processors.limits import MAX_ID_CHARS, MAX_TEXT_CHARS
from agentruns.processors.lineage import RESUMABLE
from agentruns.processors.state import TERMINAL, OpStatus, RunState, RunStatus, TimerPurpose

#: The longest reason an operator may give (it goes into the run's outcome and result).
MAX_REASON_CHARS = 500

Reason = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REASON_CHARS)]
OpKey = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]

ACTIONS = ("resolve", "reopen", "redrive")
RESOLVE_CHOICES = ("continue", "fail", "succeed", "reconcile")
#: Where a stuck run may be re-driven: it waits for a model or a tool answer.
REDRIVABLE = frozenset(
    {RunStatus.READY, RunStatus.MODEL_RUNNING, RunStatus.TOOL_RUNNING, RunStatus.WAITING_TOOL}
)


class _Body(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    reason: Reason = "operator"


class ResolveBody(_Body, frozen=True, kw_only=True):
    action: Literal["continue", "fail", "succeed", "reconcile"]
    outcome: Literal["found_succeeded", "not_executed"] | None = None
    operation_key: OpKey | None = None
    result: Any = None  # with found_succeeded: the call's output, stored as its result artifact


class ReopenBody(_Body, frozen=True, kw_only=True):
    goal: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TEXT_CHARS)] | None = None


class RedriveBody(_Body, frozen=True, kw_only=True):
    pass


_BODIES: dict[str, type[_Body]] = {
    "resolve": ResolveBody,
    "reopen": ReopenBody,
    "redrive": RedriveBody,
}


def parse_body(action: str, body: dict[str, Any]) -> _Body:
    """The request body as the action's struct; anything else is a 422 `invalid_body` with the
    first problem and its place."""
    try:
        return msgspec.convert(body, _BODIES[action])
    except msgspec.ValidationError as exc:
        text = str(exc)
        loc = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else ""
        raise ApiError(
            422, "invalid_body", f"{action}: {text}", errors=[{"loc": loc, "msg": text}]
        ) from None


def unknown_operations(state: RunState) -> list[str]:
    """Keys of the tool calls whose outcome the run waits for someone to tell."""
    return [o.key for o in state.ops if o.status is OpStatus.UNKNOWN]


def driving_timers(state: RunState) -> list[str]:
    """Purposes of the pending timers that will move the run by themselves."""
    return [t.purpose.value for t in state.timers if t.purpose is not TimerPurpose.DEADLINE]


def allowed(state: RunState) -> dict[str, Any]:
    """What an operator may do with the run in its committed state: the API's checks, and what
    the console offers."""
    paused = state.status is RunStatus.PAUSED
    unknown = unknown_operations(state) if paused else []
    resolve: list[str] = []
    if paused:
        resolve = ["reconcile", "fail", "succeed"] if unknown else ["continue", "fail", "succeed"]
    elif state.status in TERMINAL:
        resolve = [
            c for c, s in (("fail", "FAILED"), ("succeed", "SUCCEEDED")) if s != state.status
        ]
    return {
        "resolve": resolve,
        "unknown_operations": unknown,
        "reopen": state.status in TERMINAL,
        "redrive": state.status in REDRIVABLE and not driving_timers(state),
        # a fork from any seq of any run; a resume of a run that failed (agentruns resume)
        "fork": True,
        "resume": state.status in RESUMABLE,
    }


def _refused(state: RunState, message: str, **extra: Any) -> ApiError:
    return ApiError(409, "action_not_allowed", message, run_status=state.status.value, **extra)


@dataclass(frozen=True, slots=True)
class Plan:
    """The input an action becomes, and the artifact it needs stored first (a verdict's
    result)."""

    event: Event
    artifact: tuple[str, str] | None = None  # (ref, content)


def plan(
    action: str,
    state: RunState,
    body: _Body,
    *,
    ids: dict[str, Any],
    actor: str,
    result_artifact: Callable[[str, str, Any], tuple[str, str]] | None = None,
) -> Plan:
    """The core input for ``action`` on ``state``; a 409 when the state does not allow it.
    ``ids`` are the event's run_id, event_id, at and trace_id; ``result_artifact`` makes the
    stored (ref, content) of a verdict's result (`StoredArtifact.of`)."""
    can = allowed(state)
    status = state.status.value
    if action == "redrive":
        if state.status not in REDRIVABLE:
            raise _refused(state, f"a {status} run waits for no model or tool answer")
        timers = driving_timers(state)
        if timers:
            raise _refused(state, f"a {timers[0]} timer will move the run", timers=timers)
        return Plan(RedriveRequested(**ids, version=state.version, reason=body.reason, actor=actor))
    if action == "reopen":
        assert isinstance(body, ReopenBody)
        if not can["reopen"]:
            hint = "; resolve it with continue" if state.status is RunStatus.PAUSED else ""
            raise _refused(state, f"only an ended run can be reopened, this one is {status}{hint}")
        return Plan(
            RunReopened(
                **ids, resolution=state.resolution, reason=body.reason, goal=body.goal, actor=actor
            )
        )
    assert isinstance(body, ResolveBody)
    if body.action not in can["resolve"]:
        if state.status is RunStatus.PAUSED and body.action == "continue":
            raise _refused(
                state,
                "the run waits for a verdict on a tool call first: resolve with reconcile",
                unknown_operations=can["unknown_operations"],
            )
        raise _refused(state, f"resolve {body.action} is not allowed for a {status} run")
    if body.action in ("fail", "succeed"):
        target = RunStatus.FAILED if body.action == "fail" else RunStatus.SUCCEEDED
        return Plan(
            RunResolved(
                **ids, resolution=state.resolution, status=target, reason=body.reason, actor=actor
            )
        )
    if body.action == "continue":
        return Plan(
            RunReopened(**ids, resolution=state.resolution, reason=body.reason, actor=actor)
        )
    if body.outcome is None:
        raise ApiError(
            422, "invalid_body", "reconcile needs an outcome: found_succeeded or not_executed"
        )
    unknown = can["unknown_operations"]
    key = body.operation_key or (unknown[0] if len(unknown) == 1 else None)
    if key is None:
        raise ApiError(
            422,
            "invalid_body",
            "several tool calls wait for a verdict: name one with operation_key",
            unknown_operations=unknown,
        )
    op = state.op(key)
    if op is None or op.status is not OpStatus.UNKNOWN:
        raise _refused(
            state, f"no tool call {key[:80]} waits for a verdict", unknown_operations=unknown
        )
    stored: tuple[str, str] | None = None
    if body.result is not None:
        if body.outcome != "found_succeeded" or result_artifact is None:
            raise ApiError(422, "invalid_body", "a result goes only with found_succeeded")
        stored = result_artifact(op.key, op.tool, body.result)
    event = ReconcileCompleted(
        **ids,
        step=op.step,
        operation_key=op.key,
        dispatch=op.dispatch,
        outcome=ReconcileOutcome(body.outcome),
        result_ref=None if stored is None else stored[0],
        actor=actor,
    )
    return Plan(event, stored)
