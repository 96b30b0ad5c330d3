"""Validators: versioned, replayable against stored candidates without a model (R10, R28)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from agentruns.connectors.dev.servers.workload import TOOLS
from agentruns.processors.events import Candidate, ToolCallRequest
from agentruns.processors.ids import content_ref
from agentruns.processors.state import CURRENT_VALIDATOR_VERSION, Policy
from agentruns.processors.transition import load_candidate
from agentruns.processors.validation import (
    ValidationContext,
    fast_valid,
    revalidate,
    schema_problem,
)
from tests.unit._core_support import Driver

CTX = ValidationContext(
    tools=TOOLS,
    policy=Policy(allowed_permissions=("read", "write", "admin"), approval_required=("admin",)),
    known_refs=(content_ref("known"),),
)


def call(name: str, args: Any, cid: str = "c") -> ToolCallRequest:
    return ToolCallRequest(id=cid, name=name, arguments_json=json.dumps(args))


@pytest.mark.parametrize(
    ("candidate", "action", "code"),
    [
        (Candidate(tool_calls=(call("search", {"query": "q"}),)), "dispatch", None),
        (Candidate(tool_calls=(call("delete_record", {"record_id": "x"}),)), "approve", None),
        (Candidate(content="answer"), "finalize", None),
        (Candidate(), "repair", "EMPTY_CANDIDATE"),
        (Candidate(tool_calls=(call("zzz", {}),)), "repair", "UNKNOWN_TOOL"),
        (Candidate(tool_calls=(call("search", []),)), "repair", "INVALID_ARGUMENTS_JSON"),
        (Candidate(tool_calls=(call("search", {"query": 1}),)), "repair", "SCHEMA_VIOLATION"),
        (
            Candidate(tool_calls=(call("search", {"query": "a"}), call("search", {"query": "b"}))),
            "repair",
            "DUPLICATE_CALL_ID",
        ),
        (
            Candidate(tool_calls=(call("fetch_doc", {"doc_id": content_ref("nope")}),)),
            "repair",
            "UNRESOLVED_REFERENCE",
        ),
        (
            Candidate(tool_calls=(call("fetch_doc", {"doc_id": content_ref("known")}),)),
            "dispatch",
            None,
        ),
        (
            Candidate(content="a", cited_refs=(content_ref("nope"),)),
            "repair",
            "UNRESOLVED_REFERENCE",
        ),
    ],
)
def test_decisions(candidate: Candidate, action: str, code: str | None) -> None:
    decision = revalidate(candidate, CTX)
    assert (decision.action, decision.error_code) == (action, code)
    assert decision.ok is (code is None)
    assert decision.validator_version == CURRENT_VALIDATOR_VERSION
    assert decision == revalidate(candidate, CTX)  # replayable, deterministic evidence


def test_permission_denied_fails_without_repair() -> None:
    ctx = CTX.model_copy(update={"policy": Policy(allowed_permissions=("read",))})
    decision = revalidate(
        Candidate(tool_calls=(call("update_record", {"record_id": "r", "fields": {}}),)), ctx
    )
    assert (decision.action, decision.error_code) == ("fail", "PERMISSION_DENIED")


def test_newer_validator_over_stored_candidate() -> None:
    """A candidate accepted by v1 is re-checked by v2 from its stored artifact, no model."""
    stored = Candidate(tool_calls=(call("fetch_doc", {"doc_id": content_ref("nope")}),))
    artifact = stored.model_dump_json()
    candidate = load_candidate(artifact)
    v1 = revalidate(candidate, CTX, 1)
    v2 = revalidate(candidate, CTX, 2)
    assert v1.ok and v1.validator_version == 1
    assert not v2.ok and v2.error_code == "UNRESOLVED_REFERENCE"
    assert v1.evidence_hash != v2.evidence_hash


def test_unknown_validator_version() -> None:
    decision = revalidate(Candidate(content="x"), CTX, 99)
    assert decision.action == "fail" and decision.error_code == "UNKNOWN_VALIDATOR_VERSION"


def test_revalidate_against_run_state() -> None:
    d = Driver()
    d.submit()
    decision = revalidate(Candidate(content="done"), d.s, 2)
    assert decision.action == "finalize"
    ctx = ValidationContext.from_state(d.s)
    assert ctx.registry_hash == d.s.config.config_ref


def test_registry_hash_computed_when_context_has_none() -> None:
    ctx = ValidationContext(tools=TOOLS, policy=Policy())
    assert revalidate(Candidate(content="x"), ctx).ok


SCHEMAS = [t.parameters for t in TOOLS] + [
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}},
    {"type": "object", "properties": {"n": {"type": "number", "minimum": 0, "maximum": 5}}},
    {"type": "object", "properties": {"k": {"enum": ["a", 1, True]}, "s": {"maxLength": 2}}},
    {"type": "object", "properties": {"x": {"type": ["string", "null"]}}},
    {"type": "object", "properties": {"p": {"pattern": "^a"}}},
    {"type": "object", "additionalProperties": {"type": "boolean"}},
]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 60)
    | st.floats(-1, 7, allow_nan=False)
    | st.text(max_size=3)
    | st.sampled_from(["a", "q", "topic"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "query",
                    "limit",
                    "doc_id",
                    "record_id",
                    "fields",
                    "title",
                    "tags",
                    "n",
                    "k",
                    "s",
                    "x",
                    "p",
                ]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SCHEMAS), json_values)
def test_fast_path_never_accepts_what_jsonschema_rejects(
    schema: dict[str, Any], value: Any
) -> None:
    authority = Draft202012Validator(schema).is_valid(value)
    if fast_valid(schema, value):
        assert authority
    assert (schema_problem(schema, value) is None) == authority


def test_fast_path_edges() -> None:
    assert fast_valid(True, 1)
    assert not fast_valid(False, 1)
    assert not fast_valid({"type": "integer"}, True)
    assert not fast_valid({"type": "string", "minLength": 2}, "a")
    assert not fast_valid({"maximum": 1}, 2)
    assert not fast_valid({"enum": [1]}, True)


def test_a_task_with_an_invalid_tool_schema_fails_its_run_with_the_reason() -> None:
    from agentruns.processors.events import RunSubmitted
    from agentruns.processors.state import RunStatus, ToolSpec
    from agentruns.processors.transition import transition
    from agentruns.processors.validation import task_problem

    def task(*tools: ToolSpec) -> RunSubmitted:
        return RunSubmitted(
            run_id="r", event_id="e", at=1, trace_id="t", goal="g", tools=tuple(tools)
        )

    bad = task(ToolSpec(name="lookup", parameters={"type": "int"}))
    assert (task_problem(bad) or "").startswith("invalid_input:tool_schema: lookup:")
    result = transition(None, bad)
    assert result.state is not None and result.state.status is RunStatus.FAILED
    assert (result.state.outcome or "").startswith("invalid_input:tool_schema")
    twice = task(ToolSpec(name="a"), ToolSpec(name="a"))
    assert task_problem(twice) == "invalid_input:duplicate_tool: a"
    deep: dict[str, object] = {"type": "object"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"x": deep}}
    assert "nested deeper" in (task_problem(task(ToolSpec(name="d", parameters=deep))) or "")
    assert task_problem(task(ToolSpec(name="ok"))) is None
