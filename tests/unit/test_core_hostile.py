"""Hostile input at the core's door (R30): every value out of range is refused when decoded,
and the transition function never raises for what decodes, on any state a run can reach."""

from __future__ import annotations

import functools
import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from agentruns.connectors.dev.servers.workload import TOOLS
from agentruns.processors.effects import EFFECT_DECODER, AskUser, ScheduleTimer
from agentruns.processors.events import (
    EVENT_TYPES,
    Candidate,
    ModelOutcome,
    ReconcileCompleted,
    ReconcileOutcome,
    RunSubmitted,
    ToolCallAccepted,
    ToolCallRequest,
    ToolCallTimedOut,
    UserReplied,
    parse_event,
)
from agentruns.processors.ids import canonicalize_arguments
from agentruns.processors.limits import (
    MAX_AMOUNT,
    MAX_COUNT,
    MAX_DURATION_MS,
    MAX_ID_CHARS,
    MAX_ITEMS,
    MAX_JSON_DEPTH,
    MAX_TEXT_CHARS,
    MAX_TIME_MS,
)
from agentruns.processors.state import Budgets, LoopLimits, Policy, RunState, RunStatus, ToolSpec
from agentruns.processors.transition import TABLE, Disposition, load_candidate, transition
from agentruns.processors.validation import (
    ValidationContext,
    revalidate,
    schema_problem,
    task_problem,
)
from tests.unit._core_support import Driver, only, search

CATASTROPHIC = "^(a+)+$"  # exponential in Python's backtracking re, linear in RE2
WEIRD_SCHEMAS: list[dict[str, Any]] = [
    {"type": "int"},
    {"type": "object", "properties": {"q": {"type": "string", "pattern": "(a+)+$"}}},
    {"type": "object", "properties": {"q": {"type": "string", "pattern": "(?=x)"}}},
    {"type": "object", "properties": {"q": {"pattern": "(a)\\1"}}},
    {"type": "object", "patternProperties": {CATASTROPHIC: {"type": "integer"}}},
    {"patternProperties": {"(a+)+b": {}}, "additionalProperties": False},
    {"patternProperties": {"a": {}}, "unevaluatedProperties": False},
    {"$ref": "#"},
    {"allOf": [{"$ref": "#"}]},
    {"properties": {"a": {"$ref": "#/properties/a"}}},
    {"$ref": "http://example.invalid/schema.json"},
    {"minLength": "x"},
    {"maximum": 1e308, "multipleOf": 1e-308},
    {"const": {"pattern": "(?=x)"}},
    {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
    {"type": "object"},
    {},
]


def multiplying(levels: int, root: dict[str, Any] | None = None) -> dict[str, Any]:
    """A small schema whose $refs double the work per level: anyOf of two refs to the next."""
    defs: dict[str, Any] = {
        f"a{i}": {"anyOf": [{"$ref": f"#/$defs/a{i + 1}"}, {"$ref": f"#/$defs/a{i + 1}"}]}
        for i in range(levels)
    }
    defs[f"a{levels}"] = {"type": "string"}
    return {"$defs": defs, **(root or {"$ref": "#/$defs/a0"})}


WEIRD_SCHEMAS += [multiplying(40), multiplying(40, {"properties": {"q": {"$ref": "#/$defs/a0"}}})]


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def deep_text(depth: int) -> str:
    """A JSON object ``depth`` levels deep, as text (no Python recursion to build it)."""
    return '{"a":' * depth + "1" + "}" * depth


def submitted(*tools: ToolSpec, **extra: Any) -> RunSubmitted:
    return RunSubmitted(
        run_id="r", event_id="e", at=1, trace_id="t", goal="g", tools=tools, **extra
    )


RAW = "<raw JSON>"


def body(kind: str, raw: str = "", **fields: Any) -> str:
    """An event body; a field set to RAW is replaced by the JSON text ``raw``."""
    base = {"type": kind, "run_id": "r", "event_id": "e", "at": 1, "trace_id": "t"}
    return json.dumps({**base, **fields}).replace(json.dumps(RAW), raw)


def with_tool(schema: dict[str, Any]) -> Driver:
    d = Driver()
    d.apply(
        RunSubmitted,
        goal="g",
        tools=(ToolSpec(name="lookup", parameters=schema),),
        loop=LoopLimits(max_repeat_error=10),
    )
    return d


# --------------------------------------------------------------------------- bounds at decode

SUBMIT = {"goal": "g"}
REFUSED_BODIES = {
    "at past the last time": body("RunSubmitted", **SUBMIT, at=2**63),
    "at one past the last time": body("RunSubmitted", **SUBMIT, at=MAX_TIME_MS + 1),
    "negative at": body("RunSubmitted", **SUBMIT, at=-1),
    "step past a count": body("GoalChanged", step=2**31, goal="g"),
    "deadline past the last time": body("RunSubmitted", **SUBMIT, budgets={"deadline_at": 2**63}),
    "float wait": body("RunSubmitted", **SUBMIT, policy={"user_wait_ms": 3e14}),
    "wait over a year": body(
        "RunSubmitted", **SUBMIT, policy={"user_wait_ms": MAX_DURATION_MS + 1}
    ),
    "poll interval float": body("RunSubmitted", **SUBMIT, policy={"poll_interval_ms": 1.5}),
    "400 KB trace id": body("RunSubmitted", **SUBMIT, trace_id="x" * 400_000),
    "goal over the text limit": body("RunSubmitted", goal="g" * (MAX_TEXT_CHARS + 1)),
    "too many messages": body(
        "RunSubmitted", **SUBMIT, messages=[{"role": "user", "content": "m"}] * (MAX_ITEMS + 1)
    ),
    "too many tools": body("RunSubmitted", **SUBMIT, tools=[{"name": "t"}] * (MAX_ITEMS + 1)),
    "tool name over the id limit": body(
        "RunSubmitted", **SUBMIT, tools=[{"name": "t" * (MAX_ID_CHARS + 1)}]
    ),
    "usage past an amount": body(
        "ModelCallCompleted",
        step=1,
        attempt=1,
        outcome="finished",
        usage={"input_tokens": MAX_AMOUNT + 1},
    ),
    "retry after over a year": body(
        "ModelCallCompleted", step=1, attempt=1, outcome="rate_limited", retry_after_ms=2**40
    ),
    "poll after negative": body(
        "ToolCallAccepted", step=1, operation_key="k", dispatch=1, poll_after_ms=-5
    ),
    "reply nested past the interpreter": body(
        "UserReplied",
        deep_text(5_000),
        question_id="q",
        token_id="t",
        state_version=1,
        response=RAW,
    ),
    "tool schema nested past the interpreter": body(
        "RunSubmitted", deep_text(5_000), goal="g", tools=[{"name": "t", "parameters": RAW}]
    ),
}
# where msgspec says each body is refused: the bound, not some other defect of the body
REFUSED_AT = {
    "at past the last time": "$.at",
    "at one past the last time": "$.at",
    "negative at": "$.at",
    "step past a count": "$.step",
    "deadline past the last time": "$.budgets.deadline_at",
    "float wait": "$.policy.user_wait_ms",
    "wait over a year": "$.policy.user_wait_ms",
    "poll interval float": "$.policy.poll_interval_ms",
    "400 KB trace id": "$.trace_id",
    "goal over the text limit": "$.goal",
    "too many messages": "$.messages",
    "too many tools": "$.tools",
    "tool name over the id limit": "$.tools[0].name",
    "usage past an amount": "$.usage.input_tokens",
    "retry after over a year": "$.retry_after_ms",
    "poll after negative": "$.poll_after_ms",
    "reply nested past the interpreter": "nested too deeply",
    "tool schema nested past the interpreter": "nested too deeply",
}


@pytest.mark.parametrize("name", sorted(REFUSED_BODIES))
def test_a_value_out_of_range_is_refused_when_an_event_is_decoded(name: str) -> None:
    with pytest.raises(msgspec.DecodeError) as refused:
        parse_event(REFUSED_BODIES[name])
    assert REFUSED_AT[name] in str(refused.value)


def test_values_at_every_bound_decode() -> None:
    event = parse_event(
        body(
            "RunSubmitted",
            at=MAX_TIME_MS,
            trace_id="t" * MAX_ID_CHARS,
            goal="g" * MAX_TEXT_CHARS,
            messages=[{"role": "user", "content": "m"}] * MAX_ITEMS,
            policy={"user_wait_ms": MAX_DURATION_MS, "max_repairs": MAX_COUNT},
            budgets={"deadline_at": MAX_TIME_MS, "max_tokens": MAX_AMOUNT, "max_steps": 0},
        )
    )
    assert isinstance(event, RunSubmitted) and event.at == MAX_TIME_MS


def test_a_delay_past_the_last_time_is_capped_and_its_effects_decode() -> None:
    d = Driver()
    d.now = MAX_TIME_MS - 10_000
    d.submit(
        policy=Policy(
            user_wait_ms=MAX_DURATION_MS,
            approval_required=("admin",),
            allowed_permissions=("read", "admin"),
        ),
        budgets=Budgets(),
    )
    t = d.calls(("delete_record", {"record_id": "r"}))
    ask = only(t, AskUser)
    assert ask.expires_at == MAX_TIME_MS == only(t, ScheduleTimer).due_at
    for effect in t.effects:
        assert EFFECT_DECODER.decode(effect.model_dump_json()) == effect
    assert RunState.from_json(d.s.to_json()) == d.s


def test_over_deep_json_is_a_decode_error_for_snapshots_and_candidates() -> None:
    with pytest.raises(msgspec.DecodeError):
        RunState.from_json('{"run_id":' + "[" * 5_000 + "]" * 5_000 + "}")
    with pytest.raises(msgspec.DecodeError):
        load_candidate('{"content":"x","tool_calls":' + "[" * 5_000 + "]" * 5_000 + "}")
    with pytest.raises(msgspec.DecodeError):
        load_candidate("NaN")


def test_a_candidate_loads_from_the_model_executors_artifact_as_strictly_as_the_cores() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    message = {"role": "assistant", "content": "x", "tool_calls": [call]}
    stored = json.dumps({"type": "candidate", "message": message, "usage": {}})
    candidate = load_candidate(stored)
    assert candidate.content == "x"
    assert [(c.id, c.name, c.arguments_json) for c in candidate.tool_calls] == [
        ("c1", "search", "{}")
    ]
    assert load_candidate(candidate.model_dump_json()) == candidate
    with pytest.raises(msgspec.ValidationError):
        load_candidate(json.dumps({"message": {**message, "tool_calls": [{**call, "id": 7}]}}))
    with pytest.raises(msgspec.ValidationError):
        load_candidate(
            json.dumps(
                {"message": {**message, "tool_calls": [{**call, "id": "c" * (MAX_ID_CHARS + 1)}]}}
            )
        )


# --------------------------------------------------------------------------- tool schemas


def test_a_tool_schema_of_an_unknown_type_fails_the_run_with_invalid_input_tool_schema() -> None:
    raw = body("RunSubmitted", goal="g", tools=[{"name": "lookup", "parameters": {"type": "int"}}])
    result = transition(None, parse_event(raw))
    assert result.state is not None and result.state.status is RunStatus.FAILED
    assert (result.state.outcome or "").startswith("invalid_input:tool_schema: lookup:")
    assert result.state.config.tools == ()  # the refused schema is not kept


@pytest.mark.parametrize(
    "pattern", ["(?=x)", "(?!x)y", "(?<=a)b", "(a)\\1", "\\Z"], ids=lambda p: repr(p)
)
def test_a_pattern_re2_cannot_compile_makes_the_tool_schema_invalid(pattern: str) -> None:
    schema = {"type": "object", "properties": {"q": {"type": "string", "pattern": pattern}}}
    problem = task_problem(submitted(ToolSpec(name="lookup", parameters=schema)))
    assert (problem or "").startswith("invalid_input:tool_schema: lookup: pattern ")
    names = {"type": "object", "patternProperties": {pattern: {}}}
    problem = task_problem(submitted(ToolSpec(name="lookup", parameters=names)))
    assert (problem or "").startswith("invalid_input:tool_schema: lookup: pattern ")


@pytest.mark.parametrize(
    ("schema", "detail"),
    [
        ({"$ref": "#"}, "RecursionError"),
        ({"allOf": [{"$ref": "#"}]}, "RecursionError"),
        ({"$ref": "http://example.invalid/schema.json"}, "cannot be evaluated"),
        ({"patternProperties": {"a": {}}, "unevaluatedProperties": False}, "not supported"),
    ],
)
def test_a_tool_schema_that_cannot_be_evaluated_is_refused_at_submission(
    schema: dict[str, Any], detail: str
) -> None:
    problem = task_problem(submitted(ToolSpec(name="lookup", parameters=schema)))
    assert (problem or "").startswith("invalid_input:tool_schema: lookup:") and detail in (
        problem or ""
    )


@pytest.mark.parametrize("schema", WEIRD_SCHEMAS, ids=lambda s: json.dumps(s)[:40])
def test_task_problem_and_schema_problem_never_raise(schema: dict[str, Any]) -> None:
    problem = task_problem(submitted(ToolSpec(name="t", parameters=schema)))
    assert problem is None or problem.startswith("invalid_input:tool_schema: t: ")
    values = (
        {},
        {"a": 1},
        {"q": "a" * 40 + "b"},
        {"a" * 40 + "b": "x"},
        {"q": "\ud800"},
        {"\ud800": 1},
    )
    for value in values:
        found = schema_problem(schema, value)
        assert found is None or (isinstance(found, str) and len(found) <= 300)
    too_deep = schema_problem(schema, nested(200))
    assert too_deep == f"<root>: nested deeper than {MAX_JSON_DEPTH}" or problem is not None


def test_a_catastrophic_pattern_over_model_arguments_is_decided_by_re2() -> None:
    schema = {
        "type": "object",
        "properties": {"q": {"type": "string", "pattern": CATASTROPHIC}},
        "additionalProperties": False,
    }
    assert task_problem(submitted(ToolSpec(name="lookup", parameters=schema))) is None
    d = with_tool(schema)
    d.calls(("lookup", {"q": "a" * 40 + "b"}))
    assert d.s.last_decision is not None
    assert (d.s.last_decision.action, d.s.last_decision.error_code) == (
        "repair",
        "SCHEMA_VIOLATION",
    )
    d.calls(("lookup", {"q": "a" * 40}))
    assert d.s.status is RunStatus.TOOL_RUNNING


def test_catastrophic_property_name_patterns_are_decided_by_re2() -> None:
    schema = {
        "type": "object",
        "patternProperties": {CATASTROPHIC: {"type": "integer"}},
        "additionalProperties": False,
    }
    hostile = "a" * 40 + "b"
    assert "does not match any of the regexes" in (schema_problem(schema, {hostile: 1}) or "")
    assert schema_problem(schema, {"a" * 40: 1}) is None
    assert "is not of type 'integer'" in (schema_problem(schema, {"a" * 40: "x"}) or "")


def test_a_schema_whose_refs_multiply_the_work_is_refused_at_submission() -> None:
    problem = task_problem(submitted(ToolSpec(name="lookup", parameters=multiplying(40))))
    assert problem == "invalid_input:tool_schema: lookup: schema needs too many evaluation steps"


def test_a_schema_whose_refs_multiply_the_work_for_some_arguments_fails_the_run() -> None:
    d = with_tool(multiplying(40, {"type": "object", "properties": {"q": {"$ref": "#/$defs/a0"}}}))
    assert d.s.status is RunStatus.MODEL_RUNNING  # {} never reaches the refs
    d.calls(("lookup", {"q": 1}))
    assert d.s.last_decision is not None
    assert d.s.last_decision.error_code == "TOOL_SCHEMA_UNUSABLE"
    assert d.s.outcome == (
        "invalid_input:tool_schema: lookup: schema needs too many evaluation steps"
    )


def test_the_tools_of_a_task_share_one_evaluation_budget() -> None:
    costly = multiplying(11)  # within the budget alone
    assert task_problem(submitted(ToolSpec(name="t0", parameters=costly))) is None
    many = [ToolSpec(name=f"t{i}", parameters=costly) for i in range(200)]
    problem = task_problem(submitted(*many))
    assert (problem or "").endswith("schema needs too many evaluation steps")


def test_the_calls_of_a_candidate_share_one_evaluation_budget() -> None:
    # an integer is valid, after a costly first branch (within the budget for one call)
    costly = {"anyOf": [{"$ref": "#/$defs/a0"}, {"type": "integer"}]}
    schema = multiplying(11, {"type": "object", "properties": {"q": costly}})
    ctx = ValidationContext(tools=(ToolSpec(name="lookup", parameters=schema),), policy=Policy())

    def calls(n: int) -> Candidate:
        return Candidate(
            tool_calls=tuple(
                ToolCallRequest(id=f"c{i}", name="lookup", arguments_json=json.dumps({"q": i}))
                for i in range(n)
            )
        )

    assert revalidate(calls(1), ctx).action == "dispatch"
    assert revalidate(calls(200), ctx).error_code == "TOOL_SCHEMA_UNUSABLE"


def test_unique_items_of_many_unsortable_items_are_decided_by_hashing() -> None:
    schema = {"type": "array", "uniqueItems": True}
    items: list[Any] = [{"n": i, "tags": [i, str(i)]} for i in range(20_000)]
    assert schema_problem(schema, items) is None
    assert "has non-unique elements" in (
        schema_problem(schema, [*items, {"n": 7, "tags": [7, "7"]}]) or ""
    )


@pytest.mark.parametrize(
    "items",
    [
        [1, 1.0],
        [1, True],
        [0, False],
        [{"a": [1]}, {"a": [True]}],
        [{"a": 1}, {"a": 1.0}],
        [None, None],
        ["1", 1],
        [[1, 2], [2, 1]],
    ],
)
def test_unique_items_agree_with_jsonschema_on_equality(items: list[Any]) -> None:
    schema = {"type": "array", "uniqueItems": True}
    authority = Draft202012Validator(schema).is_valid(items)
    assert (schema_problem(schema, items) is None) is authority


def test_a_tool_schema_found_unusable_at_validation_fails_the_run_as_invalid_input() -> None:
    d = with_tool({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}})
    assert d.s.status is RunStatus.MODEL_RUNNING  # the cycle only shows with an "a"
    d.calls(("lookup", {"a": 1}))
    assert d.s.status is RunStatus.FAILED
    assert (d.s.outcome or "").startswith("invalid_input:tool_schema: lookup:")


# --------------------------------------------------------------------------- arguments, replies


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 300, 5_000])
def test_arguments_nested_too_deep_are_a_repairable_arguments_too_deep(depth: int) -> None:
    d = Driver()
    d.submit()
    request = ToolCallRequest(id="c", name="update_record", arguments_json=deep_text(depth))
    t = d.model(candidate=Candidate(tool_calls=(request,)))
    assert d.s.last_decision is not None and d.s.last_decision.error_code == "ARGUMENTS_TOO_DEEP"
    assert d.s.status is RunStatus.MODEL_RUNNING and t.disposition is Disposition.APPLIED
    assert d.s.repairs == 1


def test_arguments_at_the_depth_limit_are_validated() -> None:
    ctx = ValidationContext(tools=TOOLS, policy=Policy())
    args = {"record_id": "r", "fields": nested(MAX_JSON_DEPTH - 1)}
    call = ToolCallRequest(id="c", name="update_record", arguments_json=json.dumps(args))
    assert revalidate(Candidate(tool_calls=(call,)), ctx).action == "dispatch"


def test_repeated_over_deep_arguments_end_the_run_by_the_loop_rules() -> None:
    d = Driver()
    d.submit()
    request = ToolCallRequest(id="c", name="search", arguments_json=deep_text(100))
    for _ in range(3):
        d.model(candidate=Candidate(tool_calls=(request,)))
    assert d.s.status is RunStatus.FAILED
    assert d.s.outcome == "loop:repeated_error:ARGUMENTS_TOO_DEEP"


@pytest.mark.parametrize(
    "arguments",
    ['{"query": "\\ud800"}', '{"query": NaN}', '{"query": 1e400}', '{"query": "q"} x'],
)
def test_arguments_that_are_not_strict_json_are_invalid_arguments_json(arguments: str) -> None:
    ctx = ValidationContext(tools=TOOLS, policy=Policy())
    call = ToolCallRequest(id="c", name="search", arguments_json=arguments)
    decision = revalidate(Candidate(tool_calls=(call,)), ctx)
    assert (decision.action, decision.error_code) == ("repair", "INVALID_ARGUMENTS_JSON")
    assert canonicalize_arguments(arguments) is None


def asked() -> tuple[Driver, AskUser]:
    d = Driver()
    d.submit()
    return d, only(d.calls(("delete_record", {"record_id": "r1"})), AskUser)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 800])
def test_a_reply_nested_too_deep_is_rejected_and_the_state_unchanged(depth: int) -> None:
    d, ask = asked()
    before = d.s
    reply = parse_event(
        body(
            "UserReplied",
            deep_text(depth),
            run_id=d.run_id,
            question_id=ask.question_id,
            token_id=ask.token_id,
            state_version=ask.state_version,
            at=d.now + 1,
            response=RAW,
        )
    )
    assert isinstance(reply, UserReplied)
    t = transition(before, reply)
    assert t.disposition is Disposition.REJECTED and t.state == before
    assert f"nested deeper than {MAX_JSON_DEPTH}" in (t.reason or "")


# --------------------------------------------------------------------------- the property


@functools.cache
def reachable_states() -> tuple[RunState, ...]:
    """States the drivers reach: one of each resting status, and a terminal one."""
    states: list[RunState] = []
    d = Driver()
    d.submit()
    states.append(d.s)  # MODEL_RUNNING
    d.calls(search("a"))
    states.append(d.s)  # TOOL_RUNNING
    d = Driver()
    d.submit()
    d.calls(("build_report", {"title": "t"}))
    d.op_event(ToolCallAccepted)
    states.append(d.s)  # WAITING_TOOL
    d, _ = asked()
    states.append(d.s)  # WAITING_USER
    d = Driver()
    d.submit()
    d.model(ModelOutcome.RATE_LIMITED)
    states.append(d.s)  # READY
    d = Driver()
    d.submit()
    d.calls(search("b"))
    d.op_event(ToolCallTimedOut)
    d.op_event(ReconcileCompleted, outcome=ReconcileOutcome.UNDETERMINABLE)
    states.append(d.s)  # PAUSED
    d = Driver()
    d.submit()
    d.final()
    states.append(d.s)  # SUCCEEDED
    return tuple(states)


# Values within every bound (the bounds themselves included), and values past them: an event is
# drawn valid field by field, then one field at most is replaced by a hostile value, so most
# events decode and reach the handlers.
counts = st.sampled_from([0, 1, 2, MAX_COUNT])
durations = st.sampled_from([0, 1, 1_000, MAX_DURATION_MS])
amounts = st.sampled_from([0, 5, 10_000, MAX_AMOUNT])
times = st.sampled_from([0, MAX_TIME_MS - 1, MAX_TIME_MS])
ids = st.sampled_from(["", "x", "x" * MAX_ID_CHARS, "\u00e9\U0001f600"])
texts = ids | st.sampled_from(["t" * MAX_TEXT_CHARS])
HOSTILE: list[Any] = [-1, MAX_COUNT + 1, MAX_DURATION_MS + 1, MAX_AMOUNT + 1, MAX_TIME_MS + 1]
HOSTILE += [2**63, 2**64, 3e14, 1.5, "x" * (MAX_ID_CHARS + 1), "t" * (MAX_TEXT_CHARS + 1)]
HOSTILE += [None, "", [], {}, ["x"] * (MAX_ITEMS + 1)]
hostile = st.sampled_from(HOSTILE)

leaves = st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=4)
small_json = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
json_objects = (
    st.dictionaries(st.sampled_from(["approved", "answer", "query", "a"]), small_json, max_size=3)
    | st.integers(MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH + 40).map(lambda n: nested(n, "x"))
    | st.builds(
        lambda approved, answer: {"approved": approved, "answer": answer}, st.booleans(), texts
    )
)
schemas = st.sampled_from(WEIRD_SCHEMAS + [t.parameters for t in TOOLS])
tool_names = st.sampled_from(
    ["search", "lookup", "search", "lookup", "delete_record", "build_report"]
)
tools = st.lists(
    st.fixed_dictionaries(
        {"name": tool_names, "parameters": schemas},
        optional={
            "permission": st.sampled_from(["read", "admin"]),
            "cancellable": st.booleans(),
            "is_async": st.booleans(),
        },
    ),
    max_size=3,
)
# hostile documents twice as often as small generated ones
HOSTILE_ARGUMENTS = st.sampled_from(
    [
        json.dumps({"q": "a" * 40 + "b"}),
        json.dumps({"query": "q"}),
        json.dumps({"record_id": "r"}),
        json.dumps({"title": "t"}),
        deep_text(MAX_JSON_DEPTH),
        deep_text(MAX_JSON_DEPTH + 1),
        deep_text(3_000),
        '{"query": "\\udfff"}',
        '{"query": NaN}',
        "{",
    ]
)
arguments = st.one_of(small_json.map(json.dumps), HOSTILE_ARGUMENTS, HOSTILE_ARGUMENTS)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {"id": st.sampled_from(["c", "d", "e"]), "name": tool_names, "arguments_json": arguments}
    ),
    max_size=3,
    unique_by=lambda call: str(call["id"]),
)
candidates = st.fixed_dictionaries(
    {},
    optional={"content": texts, "tool_calls": tool_calls, "cited_refs": st.lists(ids, max_size=2)},
)


def own(value: Any, other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The run's own value three times in four, so most events reach past the lookups."""
    return st.one_of(st.just(value), st.just(value), st.just(value), other)


def fields_for(kind: str, s: RunState) -> dict[str, st.SearchStrategy[Any]]:
    """Valid fields of an event of ``kind``, the run's own values often (so handlers run)."""
    q = s.question
    op = s.ops[0] if s.ops else None
    op_fields = {
        "step": own(op.step if op else s.step, counts),
        "operation_key": own(op.key if op else "k", ids),
        "dispatch": own(op.dispatch if op else 1, counts),
    }
    by_kind: dict[str, dict[str, st.SearchStrategy[Any]]] = {
        "RunSubmitted": {
            "goal": texts,
            "tools": tools,
            "policy": st.fixed_dictionaries(
                {},
                optional={
                    "user_wait_ms": durations,
                    "poll_interval_ms": durations,
                    "max_repairs": counts,
                    "approval_required": st.lists(ids, max_size=2),
                    "allowed_permissions": st.just(["read", "write", "admin"]),
                },
            ),
            "budgets": st.fixed_dictionaries(
                {}, optional={"deadline_at": times, "max_steps": counts, "max_tokens": amounts}
            ),
            "loop": st.fixed_dictionaries({}, optional={"max_events": counts}),
        },
        "ModelCallCompleted": {
            "step": own(s.step, counts),
            "attempt": own(s.attempt, counts),
            "outcome": st.sampled_from([o.value for o in ModelOutcome]),
            "candidate": candidates,
            "usage": st.fixed_dictionaries({"input_tokens": amounts, "cost_micros": amounts}),
            "retry_after_ms": durations,
        },
        "ToolCallAccepted": {**op_fields, "poll_after_ms": durations},
        "ToolStatusReported": {**op_fields, "poll": own(op.polls if op else 1, counts)},
        "ToolCallSucceeded": {
            **op_fields,
            "result_ref": ids,
            "result_bytes": amounts,
            "candidate_count": counts,
            "summary": st.fixed_dictionaries(
                {
                    "head": texts,
                    "tail": ids,
                    "error_lines": st.lists(ids, max_size=2),
                    "line_count": amounts,
                    "byte_count": amounts,
                    "error_count": amounts,
                }
            ),
        },
        "ToolCallFailed": {
            **op_fields,
            "error_class": st.sampled_from(["RATE_LIMIT", "TRANSIENT", "PERMISSION_DENIED"]),
            "error_code": ids,
            "retry_after_ms": durations,
        },
        "ToolCallTimedOut": op_fields,
        "ReconcileCompleted": {
            **op_fields,
            "outcome": st.sampled_from([o.value for o in ReconcileOutcome]),
        },
        "UserReplied": {
            "question_id": own(q.question_id if q else "q", ids),
            "token_id": own(q.token_id if q else "t", ids),
            "state_version": own(q.version if q else 1, counts),
            "response": json_objects,
        },
        "CancelRequested": {"reason": texts},
        "CancelConfirmed": op_fields,
        "CancelUnconfirmed": op_fields,
        "TimerFired": {"timer_id": own(s.timers[0].timer_id if s.timers else "t", ids)},
        "GoalChanged": {"step": own(s.step, counts), "goal": texts},
        "KnowledgeRefreshed": {
            "step": own(s.step, counts),
            "evidence_refs": st.lists(ids, max_size=2),
        },
        "RunReopened": {"resolution": own(s.resolution, counts), "reason": texts},
        "RunResolved": {
            "resolution": own(s.resolution, counts),
            "status": st.sampled_from([r.value for r in RunStatus]),
            "reason": texts,
        },
        "RedriveRequested": {"version": own(s.version, counts), "reason": texts},
        "GapTimedOut": {"expected_seq": counts, "diagnosis": texts},
        "InputRefused": {"reason": texts, "input_id": ids},
        "ForkedFrom": {
            "run_id": st.sampled_from(["fork-1", s.run_id]),
            "source_run_id": own(s.run_id, ids),
            "source_seq": counts,
            "state": st.sampled_from(reachable_states()).map(lambda r: r.model_dump()),
            "edits": st.fixed_dictionaries({}, optional={"model_route": ids}),
        },
    }
    base = {
        "run_id": st.just(s.run_id),
        "event_id": st.sampled_from(["e1", "e2"]) | ids,
        "at": own(s.time.last_at + 100, times),
        "trace_id": ids,
    }
    return {**base, **by_kind[kind]}


@st.composite
def hostile_inputs(draw: st.DrawFn) -> tuple[RunState | None, str]:
    kind = draw(st.sampled_from(EVENT_TYPES))
    accepting: list[RunState | None] = [s for s in reachable_states() if (s.status, kind) in TABLE]
    if kind in ("RunSubmitted", "ForkedFrom"):
        accepting = [None]
    fitting = st.sampled_from(accepting or [None])
    state = draw(st.one_of(fitting, fitting, fitting, st.sampled_from((None, *reachable_states()))))
    strategies = fields_for(kind, state or reachable_states()[0])
    fields = {"type": kind, **{name: draw(value) for name, value in strategies.items()}}
    for name in draw(st.sets(st.sampled_from(sorted(strategies)), max_size=1)):
        fields[name] = draw(hostile)
    return state, json.dumps(fields)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_inputs())
def test_the_core_never_raises_for_any_decoded_event_on_any_reached_state(
    case: tuple[RunState | None, str],
) -> None:
    state, raw = case
    try:
        event = parse_event(raw)
    except msgspec.DecodeError:  # ValidationError included: refused at the door
        return
    result = transition(state, event)
    if result.state is not None:
        assert RunState.from_json(result.state.to_json()) == result.state
    for effect in result.effects:
        assert EFFECT_DECODER.decode(effect.model_dump_json()) == effect


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(schemas, min_size=1, max_size=2), tool_calls, st.booleans())
def test_model_calls_of_tools_with_any_schema_never_make_the_core_raise(
    parameters: list[dict[str, Any]], calls: list[dict[str, Any]], approve: bool
) -> None:
    d = Driver()
    names = ["lookup", "search"]
    permission = "admin" if approve else "read"
    task = [
        {"name": n, "parameters": p, "permission": permission}
        for n, p in zip(names, parameters, strict=False)
    ]
    d.send(
        parse_event(
            body(
                "RunSubmitted",
                run_id=d.run_id,
                goal="g",
                tools=task,
                policy={"allowed_permissions": ["read", "admin"], "approval_required": ["admin"]},
            )
        )
    )
    if d.s.status is not RunStatus.MODEL_RUNNING:
        assert (d.s.outcome or "").startswith("invalid_input:")
        return
    raw = body(
        "ModelCallCompleted",
        run_id=d.run_id,
        event_id="m",
        at=d.now + 1,
        step=1,
        attempt=1,
        outcome="finished",
        candidate={"tool_calls": calls, "content": "x"},
    )
    t = d.send(parse_event(raw))
    assert t.disposition is Disposition.APPLIED and d.s.last_decision is not None
    assert RunState.from_json(d.s.to_json()) == d.s
