"""Anthropic Messages routes: the stream parser's classification and the request mapping."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentruns.connectors.executors.model import (
    AnthropicAssembler,
    Assembled,
    MalformedChunkError,
    RouteConfig,
    Routes,
    _fold_line,
    anthropic_messages,
    anthropic_request,
    candidate_artifact,
)
from agentruns.processors.events import ModelOutcome
from agentruns.processors.limits import MAX_JSON_DEPTH

MAX_LINE = 256 * 1024


def start(index: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


def delta(index: int, kind: str, **fields: str) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": {"type": kind, **fields}}


def stop(index: int) -> dict[str, Any]:
    return {"type": "content_block_stop", "index": index}


MESSAGE_START = {
    "type": "message_start",
    "message": {
        "id": "msg_1",
        "model": "claude-x",
        "usage": {"input_tokens": 12, "output_tokens": 1},
    },
}


def finish(reason: str | None = "end_turn", output_tokens: int = 30) -> list[dict[str, Any]]:
    message_delta: dict[str, Any] = {"type": "message_delta", "delta": {}}
    if reason is not None:
        message_delta["delta"]["stop_reason"] = reason
    message_delta["usage"] = {"output_tokens": output_tokens}
    return [message_delta, {"type": "message_stop"}]


def tool_use_events(pieces: list[str], index: int = 1) -> list[dict[str, Any]]:
    block = {"type": "tool_use", "id": "toolu_1", "name": "search_docs", "input": {}}
    deltas = [delta(index, "input_json_delta", partial_json=p) for p in pieces]
    return [start(index, block), *deltas, stop(index)]


def text_events(*pieces: str) -> list[dict[str, Any]]:
    block = {"type": "text", "text": ""}
    return [start(0, block), *(delta(0, "text_delta", text=p) for p in pieces), stop(0)]


def fold(events: list[Any]) -> Assembled:
    """Events as SSE lines through the same line reader the executor uses."""
    assembler = AnthropicAssembler()
    for event in events:
        raw = event if isinstance(event, bytes) else json.dumps(event).encode()
        kind = json.loads(raw).get("type", "x") if raw.startswith(b"{") else "x"
        assert not _fold_line(f"event: {kind}".encode(), assembler, MAX_LINE)
        if _fold_line(b"data: " + raw, assembler, MAX_LINE):
            break
    return assembler.result()


def test_a_tool_use_stream_becomes_text_and_a_complete_tool_call() -> None:
    events = [
        MESSAGE_START,
        {"type": "ping"},
        *text_events("Let me ", "look."),
        *tool_use_events(['{"query": "esc', 'alation", "limit": 3}']),
        *finish("tool_use"),
    ]
    result = fold(events)
    assert result.outcome is ModelOutcome.FINISHED and result.finish_reason == "tool_calls"
    assert result.content == "Let me look."
    (call,) = result.tool_calls
    assert call["id"] == "toolu_1" and call["function"]["name"] == "search_docs"
    assert json.loads(call["function"]["arguments"]) == {"query": "escalation", "limit": 3}
    assert (result.completion_id, result.model) == ("msg_1", "claude-x")
    assert result.usage["prompt_tokens"] == 12 and result.usage["completion_tokens"] == 30


def test_a_tool_without_input_pieces_gets_its_start_input() -> None:
    result = fold([MESSAGE_START, *tool_use_events([]), *finish("tool_use")])
    assert result.tool_calls[0]["function"]["arguments"] == "{}"


def test_cached_prompt_tokens_count_as_prompt_tokens() -> None:
    begin = json.loads(json.dumps(MESSAGE_START))
    begin["message"]["usage"] |= {"cache_read_input_tokens": 100, "cache_creation_input_tokens": 5}
    result = fold([begin, *text_events("hi"), *finish()])
    assert result.usage["prompt_tokens"] == 117


@pytest.mark.parametrize(
    ("reason", "outcome", "finish_reason"),
    [
        ("end_turn", ModelOutcome.FINISHED, "stop"),
        ("stop_sequence", ModelOutcome.FINISHED, "stop"),
        ("max_tokens", ModelOutcome.TRUNCATED, "length"),
        ("refusal", ModelOutcome.BLOCKED, "content_filter"),
        ("pause_turn", ModelOutcome.INCOMPLETE, "pause_turn"),
    ],
)
def test_stop_reasons_are_classified(
    reason: str, outcome: ModelOutcome, finish_reason: str
) -> None:
    result = fold([MESSAGE_START, *text_events("hi"), *finish(reason)])
    assert (result.outcome, result.finish_reason) == (outcome, finish_reason)


def test_thinking_blocks_are_kept_verbatim_with_their_signature() -> None:
    thinking = [
        start(0, {"type": "thinking", "thinking": ""}),
        delta(0, "thinking_delta", thinking="I should "),
        delta(0, "thinking_delta", thinking="search."),
        delta(0, "signature_delta", signature="EqQBCgIYAhIM"),
        stop(0),
        start(1, {"type": "redacted_thinking", "data": "opaque"}),
        stop(1),
    ]
    result = fold([MESSAGE_START, *thinking, *tool_use_events(["{}"], 2), *finish("tool_use")])
    assert result.outcome is ModelOutcome.FINISHED
    assert result.thinking == (
        {"type": "thinking", "thinking": "I should search.", "signature": "EqQBCgIYAhIM"},
        {"type": "redacted_thinking", "data": "opaque"},
    )
    assert result.content == ""  # thinking is not the answer's text
    effect = type("E", (), {"run_id": "r", "step": 1, "attempt": 1, "context_ref": None})()
    _, message = candidate_artifact(result, effect, "claude")  # type: ignore[arg-type]
    _, mapped = anthropic_messages([{"role": "user", "content": "go"}, message])
    assistant = mapped[1]["content"]
    assert [b["type"] for b in assistant] == ["thinking", "redacted_thinking", "tool_use"]
    assert assistant[0]["signature"] == "EqQBCgIYAhIM"


# --------------------------------------------------------------------------- hostile streams


def test_an_input_json_delta_that_never_closes_gives_no_tool_call() -> None:
    block = {"type": "tool_use", "id": "toolu_1", "name": "search_docs", "input": {}}
    events = [MESSAGE_START, start(1, block), delta(1, "input_json_delta", partial_json='{"q":')]
    result = fold([*events, *finish("tool_use")])
    assert result.outcome is ModelOutcome.INCOMPLETE and result.tool_calls == ()
    assert "content block 1 never closed" in result.detail


def test_a_stream_cut_mid_input_json_delta_is_incomplete() -> None:
    block = {"type": "tool_use", "id": "toolu_1", "name": "search_docs", "input": {}}
    assembler = AnthropicAssembler()
    for event in [MESSAGE_START, start(0, block), delta(0, "input_json_delta", partial_json="{")]:
        assembler.feed(event)
    result = assembler.result(interrupted="connection lost: EOF")
    assert result.outcome is ModelOutcome.INCOMPLETE and result.tool_calls == ()
    assert result.detail == "connection lost: EOF"


def test_an_unknown_content_block_type_makes_the_stream_untrusted() -> None:
    with pytest.raises(MalformedChunkError, match="unknown content block type 'server_magic'"):
        fold([MESSAGE_START, start(0, {"type": "server_magic"})])


@pytest.mark.parametrize(
    ("events", "match"),
    [
        ([delta(0, "text_delta", text="x")], "content block 0 is not open"),
        ([*text_events("a"), delta(0, "text_delta", text="x")], "content block 0 is not open"),
        (
            [start(0, {"type": "text"}), delta(0, "input_json_delta", partial_json="{")],
            "'input_json_delta' delta in a text block",
        ),
        ([start(0, {"type": "text"}), start(0, {"type": "text"})], "started twice"),
        ([{"type": "content_block_start", "index": True, "content_block": {}}], "valid index"),
        ([{"type": "content_block_start", "index": 10**9, "content_block": {}}], "valid index"),
        ([start(0, {"type": "text"}), {**delta(0, "text_delta"), "delta": "oops"}], "delta is"),
        ([start(0, {"type": "text"}), delta(0, "text_delta", text=7)], "not a string"),  # type: ignore[arg-type]
        ([{"type": "message_delta", "delta": {"stop_reason": ["end_turn"]}}], "not a string"),
        ([{"type": "brand_new"}], "unknown event type"),
        ([[1, 2]], "not an object"),
    ],
)
def test_events_of_a_shape_the_protocol_does_not_have_are_refused(
    events: list[Any], match: str
) -> None:
    with pytest.raises(MalformedChunkError, match=match):
        fold([MESSAGE_START, *events])


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"{not json", "not json"),
        (b'{"type": "ping", "x": "\xff\xfe"}', "not utf8"),
        (b"[" * (MAX_JSON_DEPTH + 2) + b"]" * (MAX_JSON_DEPTH + 2), "too deep"),
    ],
)
def test_a_data_line_that_is_not_good_json_is_refused(data: bytes, problem: str) -> None:
    with pytest.raises(MalformedChunkError, match=problem):
        _fold_line(b"data: " + data, AnthropicAssembler(), MAX_LINE)


def test_a_line_over_the_limit_is_refused() -> None:
    with pytest.raises(MalformedChunkError, match="over 100 bytes"):
        _fold_line(b"data: " + b"x" * 100, AnthropicAssembler(), 100)


def test_an_overloaded_error_event_ends_the_stream_rate_limited() -> None:
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    result = fold([MESSAGE_START, *text_events("half"), error, *finish()])
    assert result.outcome is ModelOutcome.RATE_LIMITED
    assert result.detail == "error event overloaded_error: Overloaded"


def test_another_error_event_is_incomplete() -> None:
    error = {"type": "error", "error": {"type": "api_error", "message": "boom"}}
    result = fold([MESSAGE_START, *text_events("half"), error])
    assert result.outcome is ModelOutcome.INCOMPLETE and "api_error" in result.detail


def test_a_message_delta_without_stop_reason_is_not_a_finish() -> None:
    result = fold([MESSAGE_START, *text_events("hi"), *finish(None)])
    assert result.outcome is ModelOutcome.INCOMPLETE
    assert result.detail == "stream ended without a stop_reason"


def test_a_whole_message_answer_is_read_like_a_stream() -> None:
    assembler = AnthropicAssembler()
    assembler.feed(
        {
            "type": "message",
            "id": "msg_2",
            "model": "claude-x",
            "content": [
                {"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "t1", "name": "search_docs", "input": {"q": 1}},
            ],
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 3, "output_tokens": 4},
        }
    )
    result = assembler.result()
    assert result.outcome is ModelOutcome.FINISHED and result.content == "ok"
    assert json.loads(result.tool_calls[0]["function"]["arguments"]) == {"q": 1}


@given(
    st.lists(st.text(max_size=8), max_size=12), st.dictionaries(st.text(max_size=5), st.integers())
)
def test_tool_input_split_anywhere_is_reassembled_exactly(
    cut: list[str], arguments: dict[str, int]
) -> None:
    text = json.dumps(arguments)
    pieces, at = [], 0
    for piece in cut:
        step = len(piece) % 7
        pieces.append(text[at : at + step])
        at += step
    pieces.append(text[at:])
    result = fold([MESSAGE_START, *tool_use_events(pieces, 0), *finish("tool_use")])
    assert result.tool_calls[0]["function"]["arguments"] == text


EVENT = st.one_of(
    st.sampled_from(
        [
            MESSAGE_START,
            {"type": "ping"},
            start(0, {"type": "text"}),
            start(1, {"type": "tool_use", "id": "t", "name": "n", "input": {}}),
            delta(0, "text_delta", text="a"),
            delta(1, "input_json_delta", partial_json="{"),
            stop(0),
            stop(1),
            *finish("tool_use"),
            {"type": "error", "error": {"type": "overloaded_error"}},
        ]
    ),
    st.dictionaries(st.sampled_from(["type", "index", "delta", "content_block"]), st.integers()),
)


@given(st.lists(EVENT, max_size=20))
def test_any_event_sequence_is_classified_or_refused_never_crashes(events: list[Any]) -> None:
    assembler = AnthropicAssembler()
    try:
        for event in events:
            assembler.feed(event)
    except MalformedChunkError:
        return
    result = assembler.result()
    if result.tool_calls:
        assert result.outcome is ModelOutcome.FINISHED
        assert all(b["closed"] is not False for b in assembler.blocks.values())


# --------------------------------------------------------------------------- request mapping


def test_the_conversation_maps_to_anthropic_messages() -> None:
    call = {
        "id": "t1",
        "type": "function",
        "function": {"name": "search", "arguments": '{"q":"x"}'},
    }
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Find x."},
        {"role": "assistant", "content": "Searching.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "t1", "content": '{"hits":1}'},
        {"role": "user", "content": "Your previous answer was rejected."},
        {"role": "assistant", "content": "Done."},
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": "search", "description": "d", "parameters": {"type": "object"}},
        }
    ]
    route = RouteConfig(provider="anthropic", max_tokens=256, temperature=0.5)
    payload = anthropic_request(conversation, tools, route, "claude-x", "run-1")
    assert payload["system"] == "Be brief."
    assert payload["model"] == "claude-x" and payload["max_tokens"] == 256
    assert payload["stream"] is True and payload["metadata"] == {"user_id": "run-1"}
    assert payload["tools"] == [
        {"name": "search", "input_schema": {"type": "object"}, "description": "d"}
    ]
    assert payload["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Find x."}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Searching."},
                {"type": "tool_use", "id": "t1", "name": "search", "input": {"q": "x"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": '{"hits":1}'},
                {"type": "text", "text": "Your previous answer was rejected."},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
    ]


@pytest.mark.parametrize("arguments", ["not json", "[1]", '{"a": NaN}', None])
def test_recorded_arguments_that_are_not_an_object_go_back_as_an_empty_input(
    arguments: Any,
) -> None:
    call = {"id": "t1", "function": {"name": "search", "arguments": arguments}}
    _, mapped = anthropic_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert mapped[0]["content"][0]["input"] == {}


def test_an_anthropic_route_without_max_tokens_sends_the_default() -> None:
    payload = anthropic_request([], [], RouteConfig(provider="anthropic"), "m", "r")
    assert payload["max_tokens"] == 4096 and "system" not in payload and "tools" not in payload


# --------------------------------------------------------------------------- routes


def test_the_messages_url_takes_a_base_with_or_without_v1() -> None:
    assert RouteConfig(base_url="https://api.anthropic.com").messages_url() == (
        "https://api.anthropic.com/v1/messages"
    )
    assert RouteConfig(base_url="http://h:1/v1/").messages_url() == "http://h:1/v1/messages"


def test_an_unknown_provider_is_refused_at_load() -> None:
    with pytest.raises(ValueError, match="unknown provider 'bedrock'"):
        RouteConfig(provider="bedrock")


def test_a_task_route_picks_among_configured_routes_and_never_names_the_model() -> None:
    routes = Routes(
        {"fast": RouteConfig(model="gpt-4.1-mini"), "plain": RouteConfig()}, RouteConfig()
    )
    assert routes.known("fast") and routes.model_of("fast") == "gpt-4.1-mini"
    assert routes.model_of("plain") == "plain"  # the entry's name is configuration
    assert not routes.known("gpt-4-32k")
    wildcard = Routes({"*": RouteConfig()}, RouteConfig())
    assert wildcard.known("gpt-4-32k") and wildcard.model_of("gpt-4-32k") == "default"
    no_file = Routes({}, RouteConfig())
    assert no_file.known("scenario:x") and no_file.model_of("scenario:x") == "default"


def test_route_keys_come_from_the_environment_by_provider(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AGENTRUNS_MODEL_API_KEY", raising=False)
    monkeypatch.delenv("AGENTRUNS_MODEL_BASE_URL", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret")
    monkeypatch.setenv("OPENAI_BASE_URL", "https://example.test/v1")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-secret")
    path = tmp_path / "routes.json"
    path.write_text(json.dumps({"gpt": {}, "claude": {"provider": "anthropic", "model": "c"}}))
    routes = Routes.from_env(str(path))
    assert routes.get("gpt").api_key == "sk-openai-secret"
    assert routes.get("gpt").base_url == "https://example.test/v1"
    assert routes.get("claude").api_key == "sk-ant-secret"
    assert routes.get("claude").base_url == "https://api.anthropic.com"
    assert "secret" not in repr(routes)


def test_a_route_scrubs_its_key_and_headers_from_text() -> None:
    route = RouteConfig(api_key="sk-ant-api03-XYZ", headers={"X-Team-Token": "team-token-123"})
    text = "401: invalid x-api-key sk-ant-api03-XYZ (team-token-123)"
    assert route.redact(text) == "401: invalid x-api-key [redacted] ([redacted])"
