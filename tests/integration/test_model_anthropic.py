"""Anthropic Messages over real HTTP: the scripted model server's Anthropic mode judged by the
official ``anthropic`` client, and the model executor's Anthropic route against it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from agentruns.connectors.dev.servers import model_server
from agentruns.connectors.dev.servers.httpserver import ServerHandle
from agentruns.connectors.executors.model import (
    Assembled,
    ModelHandler,
    RouteConfig,
    Routes,
    anthropic_request,
)
from agentruns.processors.events import ModelOutcome

TOOLS = [{"name": "search_docs", "input_schema": {"type": "object"}}]
USER = "Please help. scenario:multi_tool"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    handle = model_server.serve("127.0.0.1", 0)
    yield handle
    handle.close()


@pytest.fixture(autouse=True)
def fresh(server: ServerHandle) -> None:
    """Each test starts with no fault rule of another's left (the tests' order varies)."""
    httpx.post(server.url + "/reset").raise_for_status()


@pytest.fixture
def client(server: ServerHandle) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key="test-key", max_retries=0) as c:
        yield c


def fault(server: ServerHandle, **rule: Any) -> None:
    httpx.post(server.url + "/faults", json=rule).raise_for_status()


# --------------------------------------------------------------------------- the official client


def test_the_official_client_assembles_text_and_tool_use_turn_by_turn(
    client: anthropic.Anthropic,
) -> None:
    messages: list[Any] = [{"role": "user", "content": USER}]
    with client.messages.stream(
        model="claude-test", max_tokens=256, messages=messages, tools=TOOLS, system="Be brief."
    ) as stream:
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    text, tool_use = first.content
    assert text.type == "text" and text.text == "Let me look up the escalation policy first."
    assert tool_use.type == "tool_use" and tool_use.name == "search_docs"
    assert tool_use.input == {"query": "escalation policy", "limit": 3}
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0

    messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
    result = {"type": "tool_result", "tool_use_id": tool_use.id, "content": '{"hits": 1}'}
    messages.append({"role": "user", "content": [result]})
    with client.messages.stream(
        model="claude-test", max_tokens=256, messages=messages, tools=TOOLS
    ) as stream:
        second = stream.get_final_message()
    assert second.content != first.content  # the next turn of the scenario


def test_the_official_client_reads_a_whole_message(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="claude-test", max_tokens=256, messages=[{"role": "user", "content": USER}]
    )
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.stop_reason == "tool_use"


def test_a_latency_fault_paces_the_anthropic_stream(
    server: ServerHandle, client: anthropic.Anthropic
) -> None:
    ms = {"median_ms": 1000, "min_ms": 1000, "max_ms": 1000, "chunk_ms": 20}
    fault(server, kind="latency", times=None, **ms)
    began = time.monotonic()
    with client.messages.stream(
        model="claude-test", max_tokens=256, messages=[{"role": "user", "content": USER}]
    ) as stream:
        message = stream.get_final_message()
    assert time.monotonic() - began >= 1.0
    text = message.content[0]
    assert text.type == "text" and text.text.endswith("the escalation policy first.")
    assert text.text.startswith("let me think")  # the filler tokens, streamed over the time


def test_the_official_client_raises_on_an_overloaded_error_event(
    server: ServerHandle, client: anthropic.Anthropic
) -> None:
    fault(server, kind="overloaded", after_chunks=3)
    messages: list[Any] = [{"role": "user", "content": USER}]
    with (
        pytest.raises(anthropic.APIStatusError, match="overloaded_error"),
        client.messages.stream(model="claude-test", max_tokens=256, messages=messages) as stream,
    ):
        stream.get_final_message()


def test_a_529_carries_its_retry_after_and_an_anthropic_error(server: ServerHandle) -> None:
    fault(server, kind="529", retry_after=2)
    answer = httpx.post(
        server.url + "/v1/messages",
        json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": USER}]},
    )
    assert answer.status_code == 529 and answer.headers["retry-after"] == "2"
    assert answer.json()["error"]["type"] == "overloaded_error"


# --------------------------------------------------------------------------- the executor's route


def call(server: ServerHandle, **route: Any) -> Assembled:
    """One call of an Anthropic route by the model handler, as the executor makes it."""
    config = RouteConfig(base_url=server.url, provider="anthropic", api_key="sk-ant-x", **route)
    handler = ModelHandler("postgresql://unused", Routes({"claude": config}, config))
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go"}]
    tools = [{"type": "function", "function": {"name": "search_docs", "parameters": {}}}]
    payload = anthropic_request(conversation, tools, config, "claude-test", "run-anthropic")

    async def once() -> Assembled:
        try:
            return await handler.stream(config, payload, "scenario:multi_tool")
        finally:
            handler.close()

    return asyncio.run(once())


def test_an_anthropic_route_streams_a_tool_call(server: ServerHandle) -> None:
    httpx.post(server.url + "/reset").raise_for_status()
    result = call(server)
    assert result.outcome is ModelOutcome.FINISHED and result.finish_reason == "tool_calls"
    assert result.content == "Let me look up the escalation policy first."
    (tool_call,) = result.tool_calls
    assert json.loads(tool_call["function"]["arguments"]) == {
        "query": "escalation policy",
        "limit": 3,
    }
    assert result.usage["prompt_tokens"] > 0 and result.usage["completion_tokens"] > 0


@pytest.mark.parametrize(
    ("rule", "outcome", "detail"),
    [
        # message_start, 6 text block events, the tool_use start, one input piece: cut there
        ({"kind": "disconnect", "after_chunks": 9}, ModelOutcome.INCOMPLETE, "connection lost"),
        ({"kind": "incomplete", "after_chunks": 9}, ModelOutcome.INCOMPLETE, "stop_reason"),
        ({"kind": "overloaded", "after_chunks": 4}, ModelOutcome.RATE_LIMITED, "overloaded"),
        # an error event that is no request to slow down: the call is incomplete (retried)
        ({"kind": "api_error", "after_chunks": 9}, ModelOutcome.INCOMPLETE, "event api_error"),
        (
            {"kind": "bad_chunk", "shape": "unknown_block", "after_chunks": 4},
            ModelOutcome.INCOMPLETE,
            "unknown content block type 'hologram'",
        ),
        ({"kind": "529", "retry_after": 2}, ModelOutcome.RATE_LIMITED, "HTTP 529"),
        ({"kind": "length"}, ModelOutcome.TRUNCATED, "max_tokens"),
        ({"kind": "content_filter"}, ModelOutcome.BLOCKED, "refusal"),
        ({"kind": "bad_chunk", "shape": "delta_string"}, ModelOutcome.INCOMPLETE, "malformed"),
        ({"kind": "bad_utf8"}, ModelOutcome.INCOMPLETE, "not utf8"),
        ({"kind": "huge_line", "size": 300_000}, ModelOutcome.INCOMPLETE, "over"),
        ({"kind": "500"}, ModelOutcome.TRANSPORT_ERROR, "HTTP 500"),
    ],
)
def test_an_anthropic_route_classifies_what_goes_wrong(
    server: ServerHandle, rule: dict[str, Any], outcome: ModelOutcome, detail: str
) -> None:
    httpx.post(server.url + "/reset").raise_for_status()
    fault(server, **rule)
    result = call(server)
    assert result.outcome is outcome, result.detail
    assert detail in result.detail
    assert result.tool_calls == ()  # no tool starts on what was not a trusted finish
    if rule["kind"] == "529":
        assert result.retry_after_ms == 2000


def test_an_anthropic_stream_past_its_deadline_is_cut(server: ServerHandle) -> None:
    httpx.post(server.url + "/reset").raise_for_status()
    fault(server, kind="keepalive", after_chunks=3, delay_ms=50)
    began = time.monotonic()
    result = call(server, total_timeout_s=1.0)
    assert result.outcome is ModelOutcome.INCOMPLETE and "total timeout" in result.detail
    assert time.monotonic() - began < 5


def test_after_each_hostile_stream_the_same_route_answers_the_next_call(
    server: ServerHandle,
) -> None:
    """A stream cut mid tool input, a block of an unknown type, an error event: each call is
    classified, and the next call of the same handler (its connections, its route) finishes."""
    config = RouteConfig(base_url=server.url, provider="anthropic", api_key="sk-ant-x")
    handler = ModelHandler("postgresql://unused", Routes({"claude": config}, config))
    conversation = [{"role": "user", "content": "Go"}]
    tools = [{"type": "function", "function": {"name": "search_docs", "parameters": {}}}]
    payload = anthropic_request(conversation, tools, config, "claude-test", "run-next")
    hostile = [
        # message_start, 6 text block events, the tool_use start, one input piece: ends there
        ({"kind": "incomplete", "after_chunks": 9}, "without a stop_reason"),
        ({"kind": "bad_chunk", "shape": "unknown_block", "after_chunks": 2}, "hologram"),
        ({"kind": "api_error", "after_chunks": 3}, "error event api_error"),
    ]

    async def calls() -> list[tuple[Assembled, Assembled]]:
        pairs = []
        try:
            for rule, _ in hostile:
                fault(server, **rule)
                bad = await handler.stream(config, payload, "scenario:multi_tool")
                good = await handler.stream(config, payload, "scenario:multi_tool")
                pairs.append((bad, good))
        finally:
            handler.close()
        return pairs

    for (bad, good), (_, detail) in zip(asyncio.run(calls()), hostile, strict=True):
        assert bad.outcome is ModelOutcome.INCOMPLETE and detail in bad.detail, bad.detail
        assert bad.tool_calls == ()
        assert good.outcome is ModelOutcome.FINISHED and len(good.tool_calls) == 1, good.detail
