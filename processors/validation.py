"""Candidate validators, versioned and replayable without a model (R10, R28).

``revalidate(candidate, context, validator_version)`` is a pure function; the decision it
returns names the validator version and an evidence hash over everything it looked at.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, Literal

import msgspec
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.protocols import Validator

from agentruns.processors.events import Candidate, RunSubmitted, ToolCallRequest
from agentruns.processors.ids import canonical_json, derive_key
from agentruns.processors.limits import MAX_JSON_DEPTH, json_depth
from agentruns.processors.linear_schema import (
    UNSUPPORTED_COMBINATION,
    TooMuchWork,
    compiles,
    first_error,
    keywords_in,
    patterns_in,
    shared_budget,
    validator_for,
)
from agentruns.processors.state import CURRENT_VALIDATOR_VERSION, Frozen, Policy, RunState, ToolSpec

Action = Literal["dispatch", "approve", "finalize", "repair", "fail"]

# Error codes a bounded repair may fix; the rest fail at once.
REPAIRABLE: frozenset[str] = frozenset(
    {
        "EMPTY_CANDIDATE",
        "DUPLICATE_CALL_ID",
        "UNKNOWN_TOOL",
        "INVALID_ARGUMENTS_JSON",
        "ARGUMENTS_TOO_DEEP",
        "SCHEMA_VIOLATION",
        "UNRESOLVED_REFERENCE",
        "MISSING_EVIDENCE",
        "COMPLETION_UNMET",
    }
)
# When repairs are exhausted these ask the user instead of failing.
ASK_WHEN_EXHAUSTED: frozenset[str] = frozenset({"UNRESOLVED_REFERENCE", "MISSING_EVIDENCE"})
# Codes that name an input from outside the run cannot use (R30): a run failed by one ends with
# ``invalid_input:<what>`` rather than ``validation:<code>``.
INVALID_INPUT: dict[str, str] = {
    "ARGUMENTS_TOO_DEEP": "invalid_input:arguments_too_deep",
    "TOOL_SCHEMA_UNUSABLE": "invalid_input:tool_schema",
}


def failure_reason(code: str, detail: str) -> str:
    """The reason a run fails with when validation fails it with ``code``."""
    what = INVALID_INPUT.get(code)
    return f"validation:{code}" if what is None else f"{what}: {detail}"[:300]


class ValidationContext(Frozen, frozen=True, kw_only=True, gc=False):
    tools: tuple[ToolSpec, ...]
    registry_hash: str = ""
    policy: Policy
    known_refs: tuple[str, ...] = ()
    succeeded_tools: tuple[str, ...] = ()

    @classmethod
    def from_state(cls, state: RunState) -> ValidationContext:
        # state order is deterministic, so no sorting is needed for the evidence hash
        refs = (*state.evidence_refs, *state.step_inputs, *state.result_refs)
        if state.memory_ref is not None:
            refs = (*refs, state.memory_ref)
        return cls(
            tools=state.config.tools,
            registry_hash=state.config.config_ref,
            policy=state.config.policy,
            known_refs=tuple([r for r in refs if r.startswith("sha256:")]),
            succeeded_tools=state.succeeded_tools,
        )


class ValidatedCall(Frozen, frozen=True, kw_only=True, gc=False):
    call_id: str
    tool: str
    arguments_json: str  # canonical
    expected_version: str | None
    needs_approval: bool


class ValidationDecision(Frozen, frozen=True, kw_only=True, gc=False):
    validator_version: int
    ok: bool
    action: Action
    error_code: str | None = None
    detail: str = ""
    evidence_hash: str
    calls: tuple[ValidatedCall, ...] = ()


@functools.lru_cache(maxsize=256)
def _compiled(schema_json: str) -> Validator:
    # Pure memoization of a pure function (schema text → validator); no observable state.
    schema = json.loads(schema_json)
    if keywords_in(schema).issuperset(UNSUPPORTED_COMBINATION):
        raise _Unusable(" with ".join(UNSUPPORTED_COMBINATION) + " is not supported")
    return validator_for(schema)


class _Unusable(Exception):  # the schema itself cannot be evaluated; never escapes this module
    pass


def _first_error(schema: dict[str, Any], value: Any) -> str | None:
    """First violation of ``value`` (or None); :class:`_Unusable` when the schema cannot be
    evaluated (a ``$ref`` cycle or an unresolvable one, a malformed keyword)."""
    if json_depth(schema) > MAX_JSON_DEPTH:
        raise _Unusable(f"schema nested deeper than {MAX_JSON_DEPTH}")
    if json_depth(value) > MAX_JSON_DEPTH:
        return f"<root>: nested deeper than {MAX_JSON_DEPTH}"
    try:
        if fast_valid(schema, value):
            return None
        error = first_error(_compiled(canonical_json(schema)), value)
    except _Unusable:
        raise
    except TooMuchWork:
        raise _Unusable("schema needs too many evaluation steps") from None
    except Exception as exc:  # third-party evaluation of a schema from outside: any failure
        raise _Unusable(f"schema cannot be evaluated: {type(exc).__name__}") from None
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "<root>"
    return f"{where}: {error.message}"[:300]


def _schema_error(spec: ToolSpec, arguments: Any) -> str | None:
    try:
        problem = _first_error(spec.parameters, arguments)
    except _Unusable as unusable:
        raise _Fail("TOOL_SCHEMA_UNUSABLE", f"{spec.name}: {unusable}") from None
    return None if problem is None else f"{spec.name}: {problem}"


def _refs_in(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value] if value.startswith("sha256:") else []
    if isinstance(value, dict):
        return [r for v in value.values() for r in _refs_in(v)]
    if isinstance(value, list):
        return [r for v in value for r in _refs_in(v)]
    return []


class _Fail(Exception):  # internal control flow only; never escapes this module
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(code)
        self.code = code
        self.detail = detail


def _arguments(call: ToolCallRequest) -> dict[str, Any]:
    """The call's arguments: a JSON object (strict JSON, UTF-8) at most MAX_JSON_DEPTH deep."""
    too_deep = _Fail(
        "ARGUMENTS_TOO_DEEP", f"{call.name}: arguments nested deeper than {MAX_JSON_DEPTH}"
    )
    try:
        arguments = msgspec.json.decode(call.arguments_json)
    except RecursionError:
        raise too_deep from None
    except msgspec.DecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise _Fail("INVALID_ARGUMENTS_JSON", f"{call.name}: arguments are not a JSON object")
    if json_depth(arguments) > MAX_JSON_DEPTH:
        raise too_deep
    return arguments


def _check_call(call: ToolCallRequest, ctx: ValidationContext, check_refs: bool) -> ValidatedCall:
    spec = next((t for t in ctx.tools if t.name == call.name), None)
    if spec is None:
        raise _Fail("UNKNOWN_TOOL", f"no tool named {call.name!r}")
    arguments = _arguments(call)
    canonical = canonical_json(arguments)
    problem = _schema_error(spec, arguments)
    if problem is not None:
        raise _Fail("SCHEMA_VIOLATION", problem)
    if spec.permission not in ctx.policy.allowed_permissions:
        raise _Fail("PERMISSION_DENIED", f"{call.name}: permission {spec.permission!r} denied")
    if check_refs:
        missing = [r for r in _refs_in(arguments) if r not in ctx.known_refs]
        if missing:
            raise _Fail("UNRESOLVED_REFERENCE", f"{call.name}: unknown reference {missing[0]}")
    return ValidatedCall(
        call_id=call.id,
        tool=call.name,
        arguments_json=canonical,
        expected_version=call.expected_version,
        needs_approval=spec.permission in ctx.policy.approval_required,
    )


def _check_final(candidate: Candidate, ctx: ValidationContext, check_refs: bool) -> None:
    missing_tools = [t for t in ctx.policy.required_tools if t not in ctx.succeeded_tools]
    if missing_tools:
        raise _Fail("COMPLETION_UNMET", f"required tools not verified: {missing_tools}")
    if ctx.policy.require_evidence and not candidate.cited_refs:
        raise _Fail("MISSING_EVIDENCE", "final answer cites no evidence")
    if check_refs:
        unknown = [r for r in candidate.cited_refs if r not in ctx.known_refs]
        if unknown:
            raise _Fail("UNRESOLVED_REFERENCE", f"cited evidence not found: {unknown[0]}")


def _run(candidate: Candidate, ctx: ValidationContext, check_refs: bool) -> tuple[Action, Any]:
    if not candidate.tool_calls and not candidate.content.strip():
        raise _Fail("EMPTY_CANDIDATE", "no content and no tool calls")
    if candidate.tool_calls:
        ids = [c.id for c in candidate.tool_calls]
        if check_refs and len(set(ids)) != len(ids):
            raise _Fail("DUPLICATE_CALL_ID", "tool call ids repeat")
        calls = tuple(_check_call(c, ctx, check_refs) for c in candidate.tool_calls)
        action: Action = "approve" if any(c.needs_approval for c in calls) else "dispatch"
        return action, calls
    _check_final(candidate, ctx, check_refs)
    return "finalize", ()


def _v1(candidate: Candidate, ctx: ValidationContext) -> tuple[Action, Any]:
    """v1: structure, tool name, argument schema, permission, completion condition."""
    return _run(candidate, ctx, check_refs=False)


def _v2(candidate: Candidate, ctx: ValidationContext) -> tuple[Action, Any]:
    """v2: v1 plus reference resolution and unique call ids."""
    return _run(candidate, ctx, check_refs=True)


VALIDATORS: dict[int, Callable[[Candidate, ValidationContext], tuple[Action, Any]]] = {
    1: _v1,
    2: _v2,
}


def revalidate(
    candidate: Candidate,
    context: ValidationContext | RunState,
    validator_version: int = CURRENT_VALIDATOR_VERSION,
    candidate_json: str | None = None,
) -> ValidationDecision:
    """Validate a stored candidate with a given validator version; no model involved.

    ``candidate_json`` may pass ``candidate.model_dump_json()`` when the caller has it.
    """
    ctx = (
        context if isinstance(context, ValidationContext) else ValidationContext.from_state(context)
    )
    # the run's config_ref already covers tools and policy; a bare context hashes them
    frozen = ctx.registry_hash or canonical_json(
        {
            "tools": [t.model_dump(mode="json") for t in ctx.tools],
            "policy": ctx.policy.model_dump(mode="json"),
        }
    )
    evidence = derive_key(
        "validation",
        validator_version,
        candidate_json if candidate_json is not None else candidate.model_dump_json(),
        frozen,
        ",".join(ctx.known_refs),
        ",".join(ctx.succeeded_tools),
    )
    validator = VALIDATORS.get(validator_version)
    if validator is None:
        return ValidationDecision(
            validator_version=validator_version,
            ok=False,
            action="fail",
            error_code="UNKNOWN_VALIDATOR_VERSION",
            detail=f"no validator version {validator_version}",
            evidence_hash=evidence,
        )
    try:
        with shared_budget():  # all the calls of a candidate share one validation budget
            action, calls = validator(candidate, ctx)
    except _Fail as failure:
        return ValidationDecision(
            validator_version=validator_version,
            ok=False,
            action="repair" if failure.code in REPAIRABLE else "fail",
            error_code=failure.code,
            detail=failure.detail,
            evidence_hash=evidence,
        )
    return ValidationDecision(
        validator_version=validator_version,
        ok=True,
        action=action,
        evidence_hash=evidence,
        calls=calls,
    )


_FAST_KEYWORDS = frozenset(
    {
        "type",
        "required",
        "properties",
        "additionalProperties",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "enum",
        "items",
        "title",
        "description",
    }
)
_FAST_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def fast_valid(schema: Any, value: Any) -> bool:
    """A conservative fast path: True only if ``value`` certainly satisfies ``schema``.

    Covers the common subset of JSON Schema keywords; anything else (or any doubt) returns
    False and the caller falls back to jsonschema, which stays the authority.
    """
    if schema is True:
        return True
    if not isinstance(schema, dict) or not _FAST_KEYWORDS.issuperset(schema):
        return False
    kind = schema.get("type")
    if kind is not None:
        check = _FAST_TYPES.get(kind) if isinstance(kind, str) else None
        if check is None or not check(value):
            return False
    if "enum" in schema and not any(
        value == option and type(value) is type(option) for option in schema["enum"]
    ):
        return False
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            return False
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            return False
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and not value >= schema["minimum"]:
            return False
        if "maximum" in schema and not value <= schema["maximum"]:
            return False
    if (
        isinstance(value, list)
        and "items" in schema
        and not all(fast_valid(schema["items"], item) for item in value)
    ):
        return False
    if isinstance(value, dict):
        if any(name not in value for name in schema.get("required", ())):
            return False
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            sub = properties.get(name, extra)
            if sub is False or not fast_valid(sub, item):
                return False
    return True


def schema_problem(schema: dict[str, Any], value: Any) -> str | None:
    """First JSON Schema violation of ``value`` (or None), using the memoized validator.

    Never raises: a value nested deeper than MAX_JSON_DEPTH, or a schema that cannot be
    evaluated, is a problem like any violation."""
    try:
        return _first_error(schema, value)
    except _Unusable as unusable:
        return f"<schema>: {unusable}"[:300]


def task_problem(submitted: RunSubmitted) -> str | None:
    """Why a submitted task cannot run (``invalid_input:<what>: detail``), or None.

    The API and the client refuse such a task before producing it; the core fails a run
    submitted with it through Kafka, so the producer still receives a terminal result."""
    names = [t.name for t in submitted.tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        return f"invalid_input:duplicate_tool: {', '.join(repeated)}"
    for spec in submitted.tools:  # before the schemas are written out as text
        if json_depth(spec.parameters) > MAX_JSON_DEPTH:
            return f"invalid_input:tool_schema: {spec.name}: nested deeper than {MAX_JSON_DEPTH}"
    if not submitted.tools:
        return None
    return _tools_problem(canonical_json([[t.name, t.parameters] for t in submitted.tools]))


@functools.lru_cache(maxsize=256)
def _tools_problem(tools_json: str) -> str | None:
    """`task_problem` of a list of [name, schema]: memoized (a pure function of its text),
    since most tasks carry the same few tool lists and checking a schema against the
    metaschema costs ~0.4 ms per task."""
    with shared_budget():  # the trial evaluations of all the tools share one budget
        for name, schema in json.loads(tools_json):
            problem = _tool_schema_problem(schema)
            if problem is not None:
                return f"invalid_input:tool_schema: {name}: {problem}"[:300]
    return None


def _tool_schema_problem(schema: dict[str, Any]) -> str | None:
    """Why a tool's parameter schema cannot be used (never raises)."""
    if json_depth(schema) > MAX_JSON_DEPTH:
        return f"nested deeper than {MAX_JSON_DEPTH}"
    for pattern in patterns_in(schema):
        if not compiles(pattern):
            return f"pattern {pattern!r} is not supported (RE2: no backreferences or lookaround)"
    if keywords_in(schema).issuperset(UNSUPPORTED_COMBINATION):
        return " with ".join(UNSUPPORTED_COMBINATION) + " is not supported"
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return exc.message
    except Exception as exc:  # third-party checking of a schema from outside: any failure
        return f"schema cannot be checked: {type(exc).__name__}"
    # one evaluation finds what the metaschema cannot: $ref cycles, unresolvable references
    try:
        _first_error(schema, {})
    except _Unusable as unusable:
        return str(unusable)
    return None
