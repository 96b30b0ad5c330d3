"""Artifacts inlined in a CallModel record's header (`agentruns.streams.inlined`): what the
processor puts in, what the model executor keeps of a hostile header, and that a conversation
built from inlined artifacts is the one built from the store."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from agentruns.connectors.executors.model import (
    ModelHandler,
    RouteConfig,
    Routes,
    build_conversation,
)
from agentruns.processors.effects import CallModel
from agentruns.processors.ids import canonical_json, content_ref
from agentruns.processors.transition import make_artifact
from agentruns.streams import inlined
from prometheus_client import REGISTRY

# Nothing listens there: a test that reached the store would fail on connecting.
NO_DATABASE = "postgresql://agentruns@127.0.0.1:9/none?connect_timeout=1"


def _ignored(outcome: str) -> float:
    value = REGISTRY.get_sample_value("agentruns_inlined_artifacts_total", {"outcome": outcome})
    return value or 0.0


def _conversation() -> tuple[CallModel, dict[str, str]]:
    """A step-2 call and every artifact its conversation reads (ref -> content)."""
    first = canonical_json(
        {
            "run_id": "run-1",
            "step": 1,
            "goal": "fix the printer",
            "previous_context": None,
            "previous_candidate": None,
            "messages": [
                {"role": "system", "content": "scenario:multi_tool"},
                {"role": "user", "content": "The printer on floor 3 is offline."},
            ],
            "inputs": [],
        }
    )
    call = {
        "id": "call-1",
        "type": "function",
        "function": {"name": "search_docs", "arguments": '{"query":"printer"}'},
    }
    candidate = canonical_json(
        {"type": "candidate", "message": {"role": "assistant", "content": "", "tool_calls": [call]}}
    )
    result = canonical_json(
        {"tool": "search_docs", "arguments": {"query": "printer"}, "output": {"hits": ["p3"]}}
    )
    second = canonical_json(
        {
            "run_id": "run-1",
            "step": 2,
            "goal": "fix the printer",
            "previous_context": content_ref(first),
            "previous_candidate": content_ref(candidate),
            "messages": [],
            "inputs": [content_ref(result)],
        }
    )
    effect = CallModel(
        idempotency_key="run-1:model:2:1",
        run_id="run-1",
        step=2,
        attempt=1,
        trace_id="trace-1",
        context_ref=content_ref(second),
        model_route="default",
    )
    return effect, {content_ref(c): c for c in (first, candidate, result, second)}


def _from_store(store: Mapping[str, str]) -> Any:
    def load(refs: Sequence[str]) -> dict[str, Any]:
        return {r: json.loads(store[r]) for r in refs if r in store}

    return load


@pytest.fixture
def handler() -> Iterator[ModelHandler]:
    h = ModelHandler(NO_DATABASE, Routes({}, RouteConfig()))
    try:
        yield h
    finally:
        h.close()


def test_a_conversation_built_from_inlined_artifacts_is_the_one_built_from_the_store(
    handler: ModelHandler,
) -> None:
    effect, store = _conversation()
    handler.offer(inlined.encode(store.items()))
    assert build_conversation(effect, handler._cache.load) == build_conversation(
        effect, _from_store(store)
    )
    messages, _ = build_conversation(effect, _from_store(store))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]


def test_entries_of_a_hostile_header_are_ignored_and_counted() -> None:
    effect, store = _conversation()
    ref = effect.context_ref
    forged = canonical_json({"run_id": "run-1", "step": 2, "messages": [], "inputs": []})
    before = {k: _ignored(k) for k in ("mismatched", "duplicate", "malformed", "too_large")}

    # a forged content, with and without the right one beside it (duplicate refs)
    assert inlined.decode(inlined.encode([(ref, forged)])) == {}
    assert inlined.decode(inlined.encode([(ref, forged), (ref, store[ref])])) == {ref: store[ref]}
    assert inlined.decode(inlined.encode([(ref, store[ref]), (ref, forged)])) == {ref: store[ref]}
    assert _ignored("mismatched") == before["mismatched"] + 2
    assert _ignored("duplicate") == before["duplicate"] + 1

    # not the encoding: bytes, JSON of another shape, pairs of other types
    for value in (b"\xff\xfe", b"{", b'{"a": "b"}', b'[["a"]]', b"[[1, 2]]", b'"x"', b""):
        assert inlined.decode(value) == {}
    assert _ignored("malformed") == before["malformed"] + 7

    # a header over the cap is not even parsed, whatever it holds
    big = "x" * inlined.MAX_BYTES
    oversized = b'[["' + content_ref(big).encode() + b'","' + big.encode() + b'"]]'
    assert inlined.decode(oversized) == {}
    assert _ignored("too_large") == before["too_large"] + 1


@pytest.mark.parametrize(
    "header",
    [
        b"not json",
        b'[["sha256:00", "forged"]]',
        b"[" + b'["a","b"],' * (inlined.MAX_BYTES // 10) + b'["a","b"]]',
    ],
    ids=["malformed", "forged", "oversized"],
)
def test_a_hostile_header_leaves_nothing_in_the_cache(handler: ModelHandler, header: bytes) -> None:
    effect, _ = _conversation()
    handler.offer(header)
    handler.offer(inlined.encode([(effect.context_ref, "forged")]))
    assert handler._cache._items == {}


def test_the_processor_carries_the_context_first_and_what_it_names_within_the_cap() -> None:
    summary = make_artifact(canonical_json({"raw_ref": "sha256:raw", "summary": {"n": 1}}))
    other = make_artifact(canonical_json({"unrelated": True}))
    context = make_artifact(canonical_json({"step": 2, "inputs": [summary.ref]}))
    header = inlined.for_call(context.ref, [other, summary, context])
    assert header is not None
    pairs = json.loads(header)
    assert [ref for ref, _ in pairs] == [context.ref, summary.ref]
    assert inlined.decode(header) == {context.ref: context.content, summary.ref: summary.content}
    # nothing to carry without the call's context among the transition's artifacts
    assert inlined.for_call(context.ref, [other, summary]) is None
    # an artifact over the cap is left out, a smaller one after it still fits
    huge = make_artifact(canonical_json({"blob": "x" * inlined.MAX_BYTES}))
    small = make_artifact(canonical_json({"small": True}))
    header = inlined.encode([(huge.ref, huge.content), (small.ref, small.content)])
    assert header is not None and len(header) <= inlined.MAX_BYTES
    assert inlined.decode(header) == {small.ref: small.content}
    big_context = make_artifact(canonical_json({"blob": "x" * inlined.MAX_BYTES}))
    assert inlined.for_call(big_context.ref, [big_context]) is None


def test_the_first_of_two_headers_is_read() -> None:
    headers = [("trace_id", b"t"), (inlined.HEADER, b"[]"), (inlined.HEADER, b"second")]
    assert inlined.header_value(headers) == b"[]"
    assert inlined.header_value(None) is None
