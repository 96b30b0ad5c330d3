"""What an input may be before it is produced, shared by the API and `RunsProducer`.

The size and nesting limits of request bodies and input records, `InvalidInputError`, and the
two checks every submission passes: `submitted_task` (the core's decode bounds and
`task_problem`, the operator's tool catalog when there is one, bigint range, UTF-8) and
`encoded_input` (the record's bytes under the limit). Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.json_schemas import TASK_DERIVED_FIELDS
from agentruns.processors.catalog import Catalog, submission_problem, with_catalog_fields
from agentruns.processors.events import RunSubmitted
from agentruns.processors.limits import MAX_JSON_DEPTH, json_depth
from agentruns.processors.validation import task_problem
from agentruns.streams.codec import encode

#: Largest request body read (a named default of `ApiConfig.max_body_bytes`).
MAX_BODY_BYTES = 1_048_576
#: Largest encoded input record produced (`ApiConfig.max_record_bytes`, and the client's):
#: 1 MiB, the broker's default `message.max.bytes`, less 64 KiB for the key, headers and batch
#: framing; also below librdkafka's own default (1,000,000 bytes).
MAX_RECORD_BYTES = 1_048_576 - 65_536
#: How deep a request body may nest: a JSON document the core bounds at MAX_JSON_DEPTH (a tool
#: schema, a reply) sits at most three levels down in it ({"tools": [{"parameters": ...}]}).
MAX_BODY_DEPTH = MAX_JSON_DEPTH + 3
#: Longest Idempotency-Key (it becomes part of the input's id).
MAX_KEY_CHARS = 200
#: The integers a task may carry: what Avro `long` and a Postgres bigint hold.
INT64 = range(-(2**63), 2**63)


class InvalidInputError(AgentrunsError):
    """An input refused before it is produced (the API answers 413/422 with it, RunsProducer
    raises it): `reason` is `invalid_input:<what>: detail`, what the core would fail the run
    with."""

    def __init__(self, reason: str, *, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.errors = errors or []


def submitted_task(
    fields: Mapping[str, Any], *, catalog: Catalog | None = None, **ids: Any
) -> RunSubmitted:
    """The RunSubmitted of a task (its fields, `ids` the run_id, event_id, at, trace_id), or
    InvalidInputError: a field the submitter derives (the task schema, schemas/json, leaves
    them out), nested too deep, an integer a bigint cannot hold, outside the core's decode
    bounds, refused by `agentruns.processors.validation.task_problem`, or not UTF-8.

    With the operator's `catalog`: a tool field the submitter left out is the catalog's, and
    a task that widens what the catalog allows is refused
    (`agentruns.processors.catalog.submission_problem`: its model route, its tools), as the
    processor would fail its run."""
    derived = next((name for name in TASK_DERIVED_FIELDS if name in fields), None)
    if derived is not None:
        msg = f"`{derived}` is not a task field: the submitter derives it"
        raise InvalidInputError(f"invalid_input:task: {msg}", errors=[{"loc": derived, "msg": msg}])
    if json_depth(fields, MAX_BODY_DEPTH) > MAX_BODY_DEPTH:
        raise InvalidInputError(f"invalid_input:json_too_deep: nested deeper than {MAX_BODY_DEPTH}")
    big = _outsized_int(fields)
    if big is not None:
        raise InvalidInputError(f"invalid_input:integer_out_of_range: {big} is not a bigint")
    tools = fields.get("tools")
    if catalog is not None and isinstance(tools, list):
        fields = {**fields, "tools": [with_catalog_fields(t, catalog) for t in tools]}
    try:
        event = RunSubmitted.model_validate({**fields, **ids})
    except msgspec.ValidationError as exc:
        raise InvalidInputError(
            f"invalid_input:task: {exc}", errors=_validation_detail(exc)
        ) from None
    problem = task_problem(event)
    if problem is None and catalog is not None:
        problem = submission_problem(event, catalog)
    if problem is not None:
        raise InvalidInputError(problem)
    try:
        event.model_dump_json()  # text Python holds but UTF-8 cannot (a lone surrogate)
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"invalid_input:encoding: {exc}") from None
    return event


def encoded_input(record: dict[str, Any], limit: int) -> bytes:
    """The Input record's bytes, or InvalidInputError when they cannot be produced: text that
    is not UTF-8 (a lone surrogate), or more than `limit` bytes (the broker would refuse it on
    every retry)."""
    try:
        value = encode("Input", record)
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"invalid_input:encoding: {exc}") from None
    if len(value) > limit:
        raise InvalidInputError(
            f"invalid_input:record_too_large: the input record is {len(value)} bytes, over {limit}"
        )
    return value


def _outsized_int(value: Any) -> int | None:
    """The first integer in a parsed JSON value that a bigint cannot hold, or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, int) and item not in INT64:
            return item
    return None


def _validation_detail(exc: msgspec.ValidationError) -> list[dict[str, Any]]:
    """msgspec names the first problem as "<message> - at `$.path`"."""
    msg, _, where = str(exc).partition(" - at ")
    return [{"loc": where.strip("`").removeprefix("$").lstrip("."), "msg": msg}]
