"""The doors' own checks, without services: what the API and the client refuse before anything
is stored or produced, and how the projection stores times datetime cannot hold."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from agentruns.connectors.api.errors import ApiError
from agentruns.connectors.api.http import _clean, _json_object
from agentruns.connectors.api.inputs import (
    MAX_BODY_DEPTH,
    InvalidInputError,
    encoded_input,
    submitted_task,
)
from agentruns.connectors.postgres.bulk import MAX_STORED_MS, MIN_STORED_MS, clamp_ms
from agentruns.connectors.projection.rows import ms_time
from agentruns.processors.limits import MAX_TIME_MS
from agentruns.streams.records import input_record

IDS = {"run_id": "r", "event_id": "r:submit", "at": 1, "trace_id": "t"}
TOOL = {"name": "search", "parameters": {"type": "object"}}


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("task", "reason"),
    [
        ({"goal": "g", "tools": [TOOL, TOOL]}, "invalid_input:duplicate_tool"),
        ({"goal": "g", "tools": [{**TOOL, "parameters": {"type": 3}}]},
         "invalid_input:tool_schema"),
        ({"goal": "g", "budgets": {"deadline_at": 2**63}}, "invalid_input:integer_out_of_range"),
        ({"goal": "g", "budgets": {"max_steps": -(2**63) - 1}},
         "invalid_input:integer_out_of_range"),
        ({"goal": "g", "budgets": {"max_steps": "ten"}}, "invalid_input:task"),
        ({"goal": "g", "evidence_refs": _nested(MAX_BODY_DEPTH + 1)},
         "invalid_input:json_too_deep"),
        ({"goal": "half \ud800 a pair"}, "invalid_input:encoding"),
    ],
)  # fmt: skip
def test_a_task_the_core_would_refuse_is_refused_with_its_reason(
    task: dict[str, Any], reason: str
) -> None:
    with pytest.raises(InvalidInputError) as refused:
        submitted_task(task, **IDS)
    assert refused.value.reason.startswith(reason)


def test_a_valid_task_passes_and_its_record_is_refused_only_over_the_limit() -> None:
    event = submitted_task({"goal": "g" * 5_000, "tools": [TOOL]}, **IDS)
    record = input_record(event)
    assert len(encoded_input(record, 10_000)) > 5_000
    with pytest.raises(InvalidInputError) as refused:
        encoded_input(record, 4_000)
    assert refused.value.reason.startswith("invalid_input:record_too_large")


@pytest.mark.parametrize(
    ("raw", "status", "reason"),
    [
        (b'{"goal": "caf\xe9"}', 422, "invalid_input:encoding"),
        (b"[" * 50_000 + b"]" * 50_000, 422, "invalid_input:json_too_deep"),
        (b'{"a": ' * (MAX_BODY_DEPTH + 1) + b"1" + b"}" * (MAX_BODY_DEPTH + 1), 422,
         "invalid_input:json_too_deep"),
        (b'{"goal": ', 400, None),
        (b"[1, 2]", 400, None),
    ],
)  # fmt: skip
def test_a_body_that_is_not_a_utf8_json_object_within_the_depth_is_refused(
    raw: bytes, status: int, reason: str | None
) -> None:
    with pytest.raises(ApiError) as refused:
        _json_object(raw)
    assert refused.value.status == status
    assert refused.value.extra.get("reason", "").startswith(reason or "")


def test_header_values_must_be_utf8_without_control_characters() -> None:
    assert _clean(b"key-1\tcaf\xc3\xa9")
    for value in (b"a\rb", b"a\nb", b"a\x00b", b"a\x7fb", b"\xff\xfe", b"\xc3\x28"):
        assert not _clean(value), value


def test_times_outside_datetime_are_stored_as_the_nearest_bound() -> None:
    assert clamp_ms(2**63) == MAX_STORED_MS == MAX_TIME_MS
    assert clamp_ms(-(2**63)) == MIN_STORED_MS
    assert ms_time(2**70) == datetime(9999, 12, 31, 23, 59, 59, 999000, UTC)
    assert ms_time(-(2**70)) == datetime(1, 1, 1, tzinfo=UTC)
    assert ms_time(1_000) == datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC)
