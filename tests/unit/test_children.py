"""Child runs, the pure parts (agentruns.processors.children and the core): the child's key and
run id from the caller's operation, the budget carved from the caller's remainder, the limits
on depth and fan-out, the parent link a child may not have (itself, a cycle), and the core's
caller context, cancel and end notice."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentruns.connectors.catalog import catalog_of
from agentruns.connectors.executors.base import ExecutorError
from agentruns.connectors.executors.children import template_of
from agentruns.connectors.executors.tool import ToolRegistry
from agentruns.processors.catalog import (
    Catalog,
    CatalogTool,
    catalog_problem,
    with_catalog_defaults,
    with_catalog_fields,
)
from agentruns.processors.children import (
    CHILD_PARAMETERS,
    ChildTemplate,
    carve,
    child_key,
    child_run_id,
    child_submission,
    limit_refusal,
    parent_problem,
    remaining,
)
from agentruns.processors.effects import (
    CallTool,
    CancelTool,
    ChildCall,
    NotifyParent,
    OperationSpec,
)
from agentruns.processors.events import (
    CancelRequested,
    Candidate,
    ForkedFrom,
    ModelCallCompleted,
    ModelOutcome,
    ModelUsage,
    RunSubmitted,
    ToolCallAccepted,
    ToolCallFailed,
    ToolCallRequest,
)
from agentruns.processors.ids import derive_key, operation_key, run_id_for_key
from agentruns.processors.state import (
    Budgets,
    ErrorClass,
    ParentLink,
    Policy,
    RunState,
    RunStatus,
    ToolSpec,
    Usage,
)
from agentruns.processors.transition import transition

AT = 1_700_000_000_000
SEARCH = ToolSpec(name="search_docs", parameters={"type": "object"})
EMAIL = ToolSpec(name="send_email", parameters={"type": "object"}, permission="write")
ASK = ToolSpec(name="ask", parameters={"type": "object"}, kind="run")


def call(**fields: Any) -> ChildCall:
    values: dict[str, Any] = {
        "at": AT,
        "trace_id": "trace-p",
        "depth": 1,
        "ancestors": ("parent",),
        "ordinal": 1,
        "remaining": Budgets(max_steps=10, max_tokens=1000),
        "tools": (SEARCH, EMAIL, ASK),
        "policy": Policy(approval_required=("write",)),
        "model_route": "default",
    }
    return ChildCall(**{**values, **fields})


def effect(arguments: Any, **fields: Any) -> CallTool:
    key = operation_key("parent", 1, "ask", json.dumps(arguments, sort_keys=True))
    return CallTool(
        idempotency_key=derive_key("effect", key),
        run_id="parent",
        step=1,
        attempt=1,
        trace_id="trace-p",
        operation=OperationSpec(
            key=key,
            tool="ask",
            arguments_json=json.dumps(arguments),
            expected_version=None,
            policy_decision="allow",
            dispatch=1,
            child=call(**fields),
        ),
    )


# --------------------------------------------------------------------------- keys


def test_the_childs_key_and_run_id_derive_from_the_callers_operation_key_alone() -> None:
    key = operation_key("parent", 3, "ask", '{"goal":"x"}')
    assert child_key(key) == child_key(key) == derive_key("child", key)
    assert child_run_id(key) == run_id_for_key(child_key(key))
    other = operation_key("parent", 3, "ask", '{"goal":"y"}')
    assert child_run_id(other) != child_run_id(key)


def test_a_submission_is_deterministic_and_names_its_parent() -> None:
    args = {"goal": "find the policy", "tools": ["search_docs"], "messages": []}
    made = [child_submission(effect(args), args, ChildTemplate()) for _ in range(2)]
    first, second = made
    assert isinstance(first, RunSubmitted) and isinstance(second, RunSubmitted)
    assert first.model_dump_json() == second.model_dump_json()
    assert first.run_id == child_run_id(effect(args).operation.key)
    assert first.at == AT
    assert first.tools == (SEARCH,)
    assert first.policy == Policy(approval_required=("write",))  # the caller's approvals stay
    assert first.parent == ParentLink(
        run_id="parent",
        trace_id="trace-p",
        operation_key=effect(args).operation.key,
        tool="ask",
        step=1,
        depth=1,
        ancestors=("parent",),
    )
    assert parent_problem(first) is None
    assert isinstance(first.tenant, msgspec.UnsetType)  # the default tenant's caller


def test_a_child_belongs_to_its_callers_tenant() -> None:
    args = {"goal": "find the policy"}
    made = child_submission(effect(args, tenant="shop"), args, ChildTemplate())
    assert isinstance(made, RunSubmitted) and made.tenant == "shop"
    state = transition(None, made).state
    assert state is not None and state.tenant == "shop"


# --------------------------------------------------------------------------- budgets


def test_the_remainder_is_what_the_caller_has_not_spent() -> None:
    s = _state(Budgets(max_steps=10, max_tokens=500, max_cost_micros=90, max_tool_calls=4))
    s = msgspec.structs.replace(
        s, step=3, usage=Usage(input_tokens=100, output_tokens=50, cost_micros=30), tool_calls=1
    )
    assert remaining(s) == Budgets(
        max_steps=7, max_tokens=350, max_cost_micros=60, max_tool_calls=3
    )


@given(
    left_steps=st.integers(0, 50),
    left_tokens=st.one_of(st.none(), st.integers(0, 10_000)),
    asked_steps=st.one_of(st.none(), st.integers(1, 100)),
    asked_tokens=st.one_of(st.none(), st.integers(1, 20_000)),
    deadline=st.one_of(st.none(), st.integers(AT + 1, AT + 10**9)),
    timeout=st.one_of(st.none(), st.integers(1, 10**10)),
)
def test_a_childs_budget_never_exceeds_what_the_caller_has_left(
    left_steps: int,
    left_tokens: int | None,
    asked_steps: int | None,
    asked_tokens: int | None,
    deadline: int | None,
    timeout: int | None,
) -> None:
    left = Budgets(max_steps=left_steps, max_tokens=left_tokens, deadline_at=deadline)
    asked = {"max_steps": asked_steps, "max_tokens": asked_tokens, "timeout_ms": timeout}
    carved = carve({k: v for k, v in asked.items() if v is not None}, left, AT)
    if left_steps == 0 or left_tokens == 0:
        assert isinstance(carved, str) and carved.startswith("budget_exhausted")
        return
    assert isinstance(carved, Budgets)
    assert 1 <= carved.max_steps <= left_steps
    if asked_steps is not None:
        assert carved.max_steps == min(asked_steps, left_steps)
    if left_tokens is not None:
        assert carved.max_tokens is not None and carved.max_tokens <= left_tokens
    if deadline is not None:
        assert carved.deadline_at is not None and carved.deadline_at <= deadline
    if timeout is not None:
        assert carved.deadline_at is not None and carved.deadline_at <= AT + timeout


def test_a_caller_past_its_deadline_gives_no_child_and_bad_budgets_are_refused() -> None:
    assert carve({}, Budgets(deadline_at=AT), AT) == (
        "budget_exhausted: the caller's deadline has passed"
    )
    assert carve({"max_steps": "9"}, Budgets(), AT) == (
        "invalid_arguments: budget.max_steps is not an integer"
    )
    assert carve({"timeout_ms": True}, Budgets(), AT) == (
        "invalid_arguments: budget.timeout_ms is not a positive integer"
    )


# --------------------------------------------------------------------------- limits, arguments


@pytest.mark.parametrize(
    ("depth", "ordinal", "template", "reason"),
    [
        (1, 1, ChildTemplate(), None),
        (3, 8, ChildTemplate(), None),
        (4, 1, ChildTemplate(), "child_depth_exceeded: a child at depth 4, over the limit of 3"),
        (
            1,
            9,
            ChildTemplate(),
            "child_fanout_exceeded: the caller's child number 9, over the limit of 8",
        ),
        (1, 1, ChildTemplate(max_depth=0), "child_depth_exceeded"),
        (1, 3, ChildTemplate(max_children=2), "child_fanout_exceeded"),
    ],
)
def test_depth_and_fan_out_over_the_limits_are_refused_with_a_reason(
    depth: int, ordinal: int, template: ChildTemplate, reason: str | None
) -> None:
    found = limit_refusal(call(depth=depth, ordinal=ordinal), template)
    if reason is None:
        assert found is None
    else:
        assert found is not None and found.startswith(reason)
        args = {"goal": "g"}
        refused = child_submission(effect(args, depth=depth, ordinal=ordinal), args, template)
        assert isinstance(refused, str) and refused.startswith(reason)


@pytest.mark.parametrize(
    ("arguments", "template", "reason"),
    [
        ("goal", ChildTemplate(), "invalid_arguments: the arguments are not an object"),
        ({}, ChildTemplate(), "invalid_arguments: goal"),
        ({"goal": ""}, ChildTemplate(), "invalid_arguments: goal"),
        ({"goal": "g", "tools": ["delete_everything"]}, ChildTemplate(), "tool_not_allowed"),
        ({"goal": "g", "tools": ["send_email"]}, ChildTemplate(tools=("search_docs",)),
         "tool_not_allowed"),
        ({"goal": "g", "tools": "search_docs"}, ChildTemplate(), "invalid_arguments: tools"),
        ({"goal": "g", "messages": [{"role": "god"}]}, ChildTemplate(), "invalid_arguments"),
        ({"goal": "g", "budget": 5}, ChildTemplate(), "invalid_arguments: budget"),
    ],
)  # fmt: skip
def test_arguments_that_cannot_be_a_childs_task_are_refused(
    arguments: Any, template: ChildTemplate, reason: str
) -> None:
    refused = child_submission(effect(arguments), arguments, template)
    assert isinstance(refused, str) and refused.startswith(reason)


def test_a_child_gets_only_tools_the_caller_has_and_the_entry_allows() -> None:
    args = {"goal": "g"}
    made = child_submission(effect(args), args, ChildTemplate(tools=("search_docs", "nope")))
    assert isinstance(made, RunSubmitted) and made.tools == (SEARCH,)
    made = child_submission(effect(args), args, ChildTemplate())
    assert isinstance(made, RunSubmitted) and made.tools == (SEARCH, EMAIL, ASK)


# --------------------------------------------------------------------------- parent links


def _link(run_id: str, ancestors: tuple[str, ...], depth: int | None = None) -> ParentLink:
    return ParentLink(
        run_id=run_id,
        trace_id="t",
        operation_key="op",
        tool="ask",
        step=1,
        depth=len(ancestors) if depth is None else depth,
        ancestors=ancestors,
    )


def _submitted(run_id: str, parent: ParentLink | None) -> RunSubmitted:
    return RunSubmitted(
        run_id=run_id,
        event_id=f"{run_id}:submit",
        at=AT,
        trace_id="t",
        goal="g",
        parent=msgspec.UNSET if parent is None else parent,
    )


@pytest.mark.parametrize(
    ("parent", "reason"),
    [
        (_link("me", ("me",)), "invalid_input:child_cycle: the run names itself as its parent"),
        (_link("b", ("me", "b")), "invalid_input:child_cycle: the run names itself among"),
        (_link("b", ("a", "b", "a", "b")), "invalid_input:child_cycle: a run appears twice"),
        (_link("b", ("a", "c")), "invalid_input:child_lineage: the ancestors do not end"),
        (_link("b", ()), "invalid_input:child_lineage"),
        (_link("b", ("a", "b"), depth=7), "invalid_input:child_lineage: the depth"),
    ],
)
def test_a_child_naming_itself_or_an_ancestor_as_its_parent_fails_with_the_reason(
    parent: ParentLink, reason: str
) -> None:
    submitted = _submitted("me", parent)
    assert (parent_problem(submitted) or "").startswith(reason)
    t = transition(None, submitted)
    assert t.state is not None and t.state.status is RunStatus.FAILED
    assert (t.state.outcome or "").startswith(reason)
    # a link that cannot be answers nobody: no notice to the named parent
    assert not [e for e in t.effects if isinstance(e, NotifyParent)]
    assert isinstance(t.state.parent, msgspec.UnsetType)


# --------------------------------------------------------------------------- the core


def _state(budgets: Budgets, tools: tuple[ToolSpec, ...] = (SEARCH, ASK)) -> RunState:
    t = transition(
        None,
        RunSubmitted(
            run_id="parent", event_id="parent:submit", at=AT, trace_id="trace-p", goal="g",
            tools=tools, budgets=budgets,
        ),
    )  # fmt: skip
    assert t.state is not None
    return t.state


def _asked(s: RunState, *calls: tuple[str, dict[str, Any]]) -> Any:
    return transition(
        s,
        ModelCallCompleted(
            run_id=s.run_id,
            event_id=f"m{s.version}",
            at=AT + 10,
            trace_id="trace-p",
            step=s.step,
            attempt=s.attempt,
            outcome=ModelOutcome.FINISHED,
            candidate=Candidate(
                tool_calls=tuple(
                    ToolCallRequest(id=f"c{i}", name=name, arguments_json=json.dumps(args))
                    for i, (name, args) in enumerate(calls)
                )
            ),
        ),
    )


def test_the_core_gives_a_run_tool_call_its_callers_context_and_counts_children() -> None:
    s = _state(Budgets(max_steps=10, max_tool_calls=5))
    t = _asked(s, ("ask", {"goal": "a"}), ("ask", {"goal": "b"}), ("search_docs", {}))
    calls = [e for e in t.effects if isinstance(e, CallTool)]
    children = [c.operation.child for c in calls]
    assert isinstance(children[2], msgspec.UnsetType)  # an ordinary tool carries nothing
    first, second = children[0], children[1]
    assert isinstance(first, ChildCall) and isinstance(second, ChildCall)
    assert (first.ordinal, second.ordinal) == (1, 2)
    assert first.depth == 1 and first.ancestors == ("parent",) and first.at == AT + 10
    assert first.remaining == Budgets(max_steps=9, max_tool_calls=2)
    assert t.state.children == 2
    assert t.state.status is RunStatus.TOOL_RUNNING


def test_cancelling_a_caller_cancels_its_child_and_a_childs_end_answers_its_caller() -> None:
    s = _state(Budgets())
    t = _asked(s, ("ask", {"goal": "a"}))
    (call_effect,) = [e for e in t.effects if isinstance(e, CallTool)]
    op = call_effect.operation
    s = transition(
        t.state,
        ToolCallAccepted(
            run_id="parent", event_id="acc", at=AT + 20, trace_id="trace-p", step=1,
            operation_key=op.key,
        ),
    ).state  # fmt: skip
    assert s is not None and s.status is RunStatus.WAITING_TOOL
    cancelled = transition(
        s, CancelRequested(run_id="parent", event_id="c", at=AT + 30, trace_id="trace-p")
    )
    assert [e.operation_key for e in cancelled.effects if isinstance(e, CancelTool)] == [op.key]
    # the child: submitted as the executor makes it, then failed, answers the parent's call
    args = {"goal": "a"}
    child = child_submission(call_effect, args, ChildTemplate())
    assert isinstance(child, RunSubmitted)
    started = transition(None, child)
    assert started.state is not None
    ended = transition(
        started.state,
        CancelRequested(run_id=child.run_id, event_id="cc", at=AT + 40, trace_id=child.trace_id),
    )
    (notice,) = [e for e in ended.effects if isinstance(e, NotifyParent)]
    assert (notice.run_id, notice.operation_key, notice.child_run_id) == (
        "parent",
        op.key,
        child.run_id,
    )
    assert notice.status is RunStatus.CANCELLED
    # the parent reads the child's failure as a tool error and goes on
    failed = transition(
        s,
        ToolCallFailed(
            run_id="parent", event_id="f", at=AT + 50, trace_id="trace-p", step=1,
            operation_key=op.key, error_class=ErrorClass.UNKNOWN, error_code="child_cancelled",
        ),
    )  # fmt: skip
    assert failed.state is not None and failed.state.status is RunStatus.MODEL_RUNNING


def test_a_fork_of_a_child_answers_no_caller() -> None:
    args = {"goal": "a"}
    child = child_submission(effect(args), args, ChildTemplate())
    assert isinstance(child, RunSubmitted)
    state = transition(None, child).state
    assert state is not None and not isinstance(state.parent, msgspec.UnsetType)
    fork = transition(
        None,
        ForkedFrom(
            run_id="fork", event_id="fork:submit", at=AT + 1, trace_id="t",
            source_run_id=state.run_id, source_seq=1, state=state,
        ),
    )  # fmt: skip
    assert fork.state is not None and isinstance(fork.state.parent, msgspec.UnsetType)


# --------------------------------------------------------------------------- catalog, registry


def test_the_catalog_fills_and_holds_a_tools_kind() -> None:
    catalog = Catalog.of("v1", {"ask": CatalogTool(kind="run"), "search_docs": CatalogTool()})
    assert Catalog.of("v1", {"search_docs": CatalogTool()}).version.startswith("v1+")
    # a record that left the kind out gets the catalog's; a task declaring another is refused
    (filled,) = with_catalog_defaults((ToolSpec(name="ask"),), catalog)
    assert filled.kind == "run"
    wrong = catalog_problem((ToolSpec(name="search_docs", kind="run"),), Policy(), catalog)
    assert wrong == (
        "invalid_input:tool_differs_from_catalog: search_docs: kind run differs from the"
        " catalog's tool"
    )
    assert catalog_problem((ToolSpec(name="ask", kind="run"),), Policy(), catalog) is None
    assert with_catalog_fields({"name": "search_docs"}, catalog) == {
        "name": "search_docs",
        "parameters": {"type": "object"},
        "permission": "read",
        "idempotent": True,
        "is_async": False,
    }
    assert with_catalog_fields({"name": "ask"}, catalog)["kind"] == "run"


@pytest.mark.parametrize(
    ("run", "error"),
    [
        ([], "is not an object"),
        ({"model": "x"}, "unknown fields ['model']"),
        ({"model_route": 5}, "run.model_route"),
        ({"tools": "search_docs"}, "run.tools"),
        ({"max_depth": -1}, "run.max_depth"),
        ({"max_children": True}, "run.max_children"),
        ({"max_children": 10**6}, "run.max_children"),
    ],
)
def test_a_registry_entry_of_kind_run_that_cannot_be_is_refused(run: Any, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        template_of({"name": "ask", "kind": "run", "run": run}, "tool 'ask'")


def test_a_registry_entry_of_kind_run_loads_with_the_childs_task_schema(tmp_path: Any) -> None:
    path = tmp_path / "tools.json"
    path.write_text(
        json.dumps(
            {
                "version": "1",
                "tools": [
                    {"name": "ask", "kind": "run", "run": {"max_depth": 2, "tools": ["x"]}},
                ],
            }
        )
    )
    registry = ToolRegistry.load(path)  # no base_url: no HTTP tool needs one
    entry = registry.tools["ask"]
    assert entry.kind == "run" and entry.parameters == CHILD_PARAMETERS
    assert entry.run == ChildTemplate(max_depth=2, tools=("x",))
    assert catalog_of(registry, dict(registry.tools)).tools["ask"].kind == "run"
    path.write_text(json.dumps({"version": "1", "tools": [{"name": "ask", "kind": "agent"}]}))
    with pytest.raises(ExecutorError, match="kind of 'ask' is not tool or run"):
        ToolRegistry.load(path)


def test_what_a_child_spent_is_charged_to_its_caller() -> None:
    s = _state(Budgets(max_tokens=1000))
    t = _asked(s, ("ask", {"goal": "a"}))
    (call_effect,) = [e for e in t.effects if isinstance(e, CallTool)]
    args = {"goal": "a"}
    child = child_submission(call_effect, args, ChildTemplate())
    assert isinstance(child, RunSubmitted) and child.budgets.max_tokens == 1000
    ended = transition(
        transition(None, child).state,
        CancelRequested(run_id=child.run_id, event_id="cc", at=AT + 40, trace_id=child.trace_id),
    )
    (notice,) = [e for e in ended.effects if isinstance(e, NotifyParent)]
    assert notice.usage == Usage()
    spent = ModelUsage(input_tokens=300, output_tokens=100, cost_micros=7)
    failed = transition(
        t.state,
        ToolCallFailed(
            run_id="parent", event_id="f", at=AT + 50, trace_id="trace-p", step=1,
            operation_key=call_effect.operation.key, error_class=ErrorClass.UNKNOWN,
            error_code="child_failed", child_usage=spent,
        ),
    )  # fmt: skip
    assert failed.state is not None
    assert failed.state.usage == Usage(input_tokens=300, output_tokens=100, cost_micros=7)
    assert remaining(failed.state).max_tokens == 600
