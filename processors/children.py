"""Child runs: a tool of kind ``run`` whose call starts another run and waits for its end
(pure, no I/O; docs/tools.md, "Child runs", and docs/design.md, "Lineage").

- The caller's core attaches a `ChildCall` to the call (its rights, what it has left of its
  budgets, its depth and ancestors, how many children it has started): `child_call`.
- The tool executor turns the call into the child's submission (`child_submission`): the
  arguments are the child's task (``goal``, ``messages``, ``tools``, ``budget``), its tools
  are among the caller's, its budgets never more than the caller has left (`carve`), its
  depth and the caller's children within the operator's limits (`limit_refusal`). The
  child's idempotency key derives from the caller's operation key (`child_key`), so every
  resend or restart of the call submits the same run, which the processor takes once.
- The child's core refuses a parent link that names the child itself or one of its own
  ancestors (`parent_problem`), and when the child ends it answers the caller's operation
  (`agentruns.processors.effects.NotifyParent`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from agentruns.processors.effects import CallTool, ChildCall
from agentruns.processors.events import RunSubmitted
from agentruns.processors.ids import derive_key, run_id_for_key, submit_event_id, trace_id_for
from agentruns.processors.limits import MAX_DURATION_MS, MAX_ITEMS, MAX_TEXT_CHARS, MAX_TIME_MS
from agentruns.processors.state import Budgets, Message, ParentLink, RunState, ToolSpec

#: A run started by a run started by ... at most this deep, unless the catalog entry says.
DEFAULT_MAX_DEPTH = 3
#: A run starts at most this many child runs in its life, unless the catalog entry says.
DEFAULT_MAX_CHILDREN = 8
# What a refusal's text may hold (a tool error's message).
_MAX_REASON = 300
_BUDGET_FIELDS = ("max_steps", "max_tokens", "max_cost_micros", "max_tool_calls")

#: The arguments of a tool of kind run, when its catalog entry declares no schema of its own.
CHILD_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "goal": {"type": "string", "minLength": 1, "maxLength": MAX_TEXT_CHARS},
        "messages": {
            "type": "array",
            "maxItems": MAX_ITEMS,
            "items": {
                "type": "object",
                "properties": {
                    "role": {"enum": ["system", "user", "assistant", "tool"]},
                    "content": {"type": "string", "maxLength": MAX_TEXT_CHARS},
                },
                "required": ["role", "content"],
                "additionalProperties": False,
            },
        },
        "tools": {"type": "array", "maxItems": MAX_ITEMS, "items": {"type": "string"}},
        "budget": {
            "type": "object",
            "properties": {
                "max_steps": {"type": "integer", "minimum": 1},
                "max_tokens": {"type": "integer", "minimum": 1},
                "max_cost_micros": {"type": "integer", "minimum": 1},
                "max_tool_calls": {"type": "integer", "minimum": 0},
                "timeout_ms": {"type": "integer", "minimum": 1, "maximum": MAX_DURATION_MS},
            },
            "additionalProperties": False,
        },
    },
    "required": ["goal"],
    "additionalProperties": False,
}


class ChildTemplate(msgspec.Struct, frozen=True, kw_only=True):
    """What the operator's catalog entry of kind run says of the children it starts."""

    #: The children's model route; None: the caller's.
    model_route: str | None = None
    #: The tools a child may have (among the caller's); None: any of the caller's.
    tools: tuple[str, ...] | None = None
    max_depth: int = DEFAULT_MAX_DEPTH
    max_children: int = DEFAULT_MAX_CHILDREN


def child_key(operation_key: str) -> str:
    """The child's idempotency key: a function of the caller's operation key alone (which
    names the caller's run, step, tool and arguments), so a resend or a restart of the call
    names the same child."""
    return derive_key("child", operation_key)


def child_run_id(operation_key: str) -> str:
    """The child's run id, derived from its idempotency key as every submitted run's is."""
    return run_id_for_key(child_key(operation_key))


def remaining(s: RunState, tool_calls: int | None = None) -> Budgets:
    """What ``s`` has left of its budgets: the steps after the current one (the caller needs
    the current one to read the child's answer), tokens, cost and tool calls not spent
    (``tool_calls``: the calls counted so far, the child's own included), its deadline."""
    b = s.config.budgets
    calls = s.tool_calls if tool_calls is None else tool_calls
    return Budgets(
        deadline_at=b.deadline_at,
        max_steps=max(b.max_steps - s.step, 0),
        max_tokens=None if b.max_tokens is None else max(b.max_tokens - s.usage.total_tokens, 0),
        max_cost_micros=None
        if b.max_cost_micros is None
        else max(b.max_cost_micros - s.usage.cost_micros, 0),
        max_tool_calls=None if b.max_tool_calls is None else max(b.max_tool_calls - calls, 0),
    )


def child_call(s: RunState, at: int, ordinal: int, tool_calls: int) -> ChildCall:
    """The caller's part of a child's task (``ordinal``: the caller's children, this one
    included)."""
    parent = s.parent
    ancestors = () if isinstance(parent, msgspec.UnsetType) else parent.ancestors
    depth = 1 if isinstance(parent, msgspec.UnsetType) else parent.depth + 1
    return ChildCall(
        at=at,
        trace_id=s.trace_id,
        depth=depth,
        ancestors=(*ancestors, s.run_id)[-MAX_ITEMS:],
        ordinal=ordinal,
        remaining=remaining(s, tool_calls),
        tools=s.config.tools,
        policy=s.config.policy,
        model_route=s.config.model_route,
        tenant=s.tenant,
    )


def carve(requested: Mapping[str, Any] | None, left: Budgets, at: int) -> Budgets | str:
    """The child's budgets: what the call asks for (``budget``), each no more than the caller
    has left, what it does not ask for the caller's whole remainder; the caller's deadline, or
    ``timeout_ms`` from ``at`` when sooner. A refusal (text) when the caller has nothing left
    to give."""
    asked = dict(requested or {})
    if left.max_steps < 1:
        return "budget_exhausted: the caller has no step left for a child"
    for name in ("max_tokens", "max_cost_micros"):
        if getattr(left, name) == 0:
            return f"budget_exhausted: the caller has no {name} left for a child"
    values: dict[str, Any] = {}
    for name in _BUDGET_FIELDS:
        have, want = getattr(left, name), asked.get(name)
        if not (want is None or (isinstance(want, int) and not isinstance(want, bool))):
            return f"invalid_arguments: budget.{name} is not an integer"
        values[name] = want if have is None else (have if want is None else min(want, have))
    if values["max_steps"] is None:
        values["max_steps"] = left.max_steps
    deadline = left.deadline_at
    timeout = asked.get("timeout_ms")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
            return "invalid_arguments: budget.timeout_ms is not a positive integer"
        own = min(at + min(timeout, MAX_DURATION_MS), MAX_TIME_MS)
        deadline = own if deadline is None else min(deadline, own)
    if deadline is not None and deadline <= at:
        return "budget_exhausted: the caller's deadline has passed"
    return Budgets(deadline_at=deadline, **values)


def limit_refusal(call: ChildCall, template: ChildTemplate) -> str | None:
    """Why the operator's limits refuse this child (depth, the caller's children), or None."""
    if call.depth > template.max_depth:
        return (
            f"child_depth_exceeded: a child at depth {call.depth}, over the limit of "
            f"{template.max_depth}"
        )
    if call.ordinal > template.max_children:
        return (
            f"child_fanout_exceeded: the caller's child number {call.ordinal}, over the limit "
            f"of {template.max_children}"
        )
    return None


def _tools(call: ChildCall, named: Any, template: ChildTemplate) -> tuple[ToolSpec, ...] | str:
    """The child's tools: those the call names (all the template allows when it names none),
    each one the caller has, with the caller's spec (a child never holds more rights)."""
    mine = {t.name: t for t in call.tools}
    allowed = set(mine if template.tools is None else template.tools) & set(mine)
    if named is None:
        return tuple(t for t in call.tools if t.name in allowed)
    if not isinstance(named, list) or not all(isinstance(n, str) for n in named):
        return "invalid_arguments: tools is not a list of tool names"
    outside = sorted({n for n in named if n not in allowed})
    if outside:
        return f"tool_not_allowed: the caller may not give a child {', '.join(outside)[:200]}"
    return tuple(mine[n] for n in dict.fromkeys(named))


def _messages(given: Any) -> tuple[Message, ...] | str:
    if given is None:
        return ()
    try:
        return msgspec.convert(given, type=tuple[Message, ...])
    except msgspec.ValidationError as exc:
        return f"invalid_arguments: messages: {exc}"[:_MAX_REASON]


def child_submission(
    effect: CallTool, arguments: Any, template: ChildTemplate
) -> RunSubmitted | str:
    """The child's submission for a call of a tool of kind run, or why it is refused
    (``<code>: <reason>``, the caller's tool error). Deterministic: the same call gives the
    same bytes, whenever and however often it is made."""
    op, call = effect.operation, effect.operation.child
    if isinstance(call, msgspec.UnsetType):
        return "not_a_child_call: the call carries no caller context (a tool of kind run?)"
    refusal = limit_refusal(call, template)
    if refusal is not None:
        return refusal
    if not isinstance(arguments, dict):
        return "invalid_arguments: the arguments are not an object"
    goal = arguments.get("goal")
    if not isinstance(goal, str) or not goal or len(goal) > MAX_TEXT_CHARS:
        return "invalid_arguments: goal is not a text of 1 to 262144 characters"
    tools = _tools(call, arguments.get("tools"), template)
    if isinstance(tools, str):
        return tools
    messages = _messages(arguments.get("messages"))
    if isinstance(messages, str):
        return messages
    budget = arguments.get("budget")
    if budget is not None and not isinstance(budget, dict):
        return "invalid_arguments: budget is not an object"
    budgets = carve(budget, call.remaining, call.at)
    if isinstance(budgets, str):
        return budgets
    run_id = child_run_id(op.key)
    if run_id in call.ancestors:  # a digest collision, but never a loop
        return "child_cycle: the child would be one of its own ancestors"
    return RunSubmitted(
        run_id=run_id,
        event_id=submit_event_id(run_id),
        at=call.at,
        trace_id=trace_id_for(run_id),
        goal=goal,
        messages=messages,
        tools=tools,
        policy=call.policy,
        model_route=template.model_route or call.model_route,
        budgets=budgets,
        tenant=call.tenant,
        parent=ParentLink(
            run_id=effect.run_id,
            trace_id=call.trace_id,
            operation_key=op.key,
            tool=op.tool,
            step=effect.step,
            dispatch=op.dispatch,
            depth=call.depth,
            ancestors=call.ancestors,
        ),
    )


def parent_problem(e: RunSubmitted) -> str | None:
    """Why a submission's parent link cannot be (``invalid_input:<what>: detail``), or None:
    a run that names itself as its parent or among its ancestors (a cycle), or a link whose
    chain does not end with the parent it names."""
    parent = e.parent
    if isinstance(parent, msgspec.UnsetType):
        return None
    if parent.run_id == e.run_id:
        return "invalid_input:child_cycle: the run names itself as its parent"
    if e.run_id in parent.ancestors:
        return "invalid_input:child_cycle: the run names itself among its ancestors"
    if not parent.ancestors or parent.ancestors[-1] != parent.run_id:
        return "invalid_input:child_lineage: the ancestors do not end with the parent"
    if len(set(parent.ancestors)) != len(parent.ancestors):
        return "invalid_input:child_cycle: a run appears twice among the ancestors"
    if parent.depth != len(parent.ancestors) or parent.depth < 1:
        return "invalid_input:child_lineage: the depth is not the number of ancestors"
    return None
