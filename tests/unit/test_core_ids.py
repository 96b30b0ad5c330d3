"""Canonical JSON, content hashes, idempotency keys, summaries."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentruns.processors.ids import (
    canonical_json,
    canonicalize_arguments,
    content_ref,
    effect_key,
    operation_key,
    resume_token_id,
)
from agentruns.processors.summary import summarize

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=10,
)


def test_canonical_json_sorted_and_compact() -> None:
    assert (
        canonical_json({"b": 1, "a": [1, {"d": 2, "c": "é"}]}) == '{"a":[1,{"c":"é","d":2}],"b":1}'
    )


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(max_size=4), json_values, max_size=4))
def test_canonical_arguments_are_order_and_space_independent(value: dict[str, object]) -> None:
    spaced = json.dumps(value, indent=2)
    reordered = json.dumps(dict(reversed(list(value.items()))))
    assert canonicalize_arguments(spaced) == canonicalize_arguments(reordered)
    assert canonicalize_arguments(spaced) == canonical_json(value)


def test_canonicalize_rejects_non_objects() -> None:
    assert canonicalize_arguments("[1]") is None
    assert canonicalize_arguments("{") is None


def test_operation_key_depends_on_every_part() -> None:
    base = operation_key("r", 1, "t", '{"a":1}')
    assert base == operation_key("r", 1, "t", '{"a":1}')
    assert (
        len(
            {
                base,
                operation_key("r2", 1, "t", '{"a":1}'),
                operation_key("r", 2, "t", '{"a":1}'),
                operation_key("r", 1, "u", '{"a":1}'),
                operation_key("r", 1, "t", '{"a":2}'),
            }
        )
        == 5
    )


def test_effect_and_token_keys_deterministic() -> None:
    assert effect_key("call_model", "r", 1, 1) == effect_key("call_model", "r", 1, 1)
    assert effect_key("call_model", "r", 1, 1) != effect_key("call_model", "r", 1, 2)
    assert resume_token_id("r", "q", 3).startswith("tok-")
    assert resume_token_id("r", "q", 3) != resume_token_id("r", "q", 4)
    assert (
        content_ref("x")
        == "sha256:" + "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881"
    )


def test_summary_is_deterministic_with_head_tail_errors_counts() -> None:
    text = "start\n" + "ok line\n" * 2_000 + "Traceback: ERROR here\n" + "end"
    first, second = summarize(text), summarize(text)
    assert first == second
    assert first.head.startswith("start") and first.tail.endswith("end")
    assert first.error_lines == ("Traceback: ERROR here",) and first.error_count == 1
    assert first.line_count == 2_003 and first.byte_count == len(text)
    small = summarize("tiny")
    assert small.head == "tiny" and small.tail == ""


_REFERENCE = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_JSON_VALUES)
def test_canonical_json_is_the_reference_encoding(value: object) -> None:
    # keys and content refs already stored were derived from Python's json: the fast path
    # must give the same bytes for every JSON value, floats with exponents and NaN included
    assert canonical_json(value) == _REFERENCE.encode(value)


@pytest.mark.parametrize("value", [1e16, 1e-05, 0.0001, float("inf"), {"a": [None, float("nan")]}])
def test_canonical_json_floats_python_writes_differently(value: object) -> None:
    assert canonical_json(value) == _REFERENCE.encode(value)
