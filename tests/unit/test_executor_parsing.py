"""What the executors make of a backend's bytes, without services: Retry-After, JSON from
backends, stream chunks of unexpected shapes."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from agentruns.connectors.executors.base import clean_text, decode_json
from agentruns.connectors.executors.http import (
    BodyTooLargeError,
    HTTPWireError,
    _Connection,
    _read_response,
    _Wire,
)
from agentruns.connectors.executors.model import MalformedChunkError, Routes, StreamAssembler
from agentruns.connectors.executors.tool import MAX_RETRY_AFTER_MS, retry_after_ms
from agentruns.processors.events import ModelOutcome
from agentruns.processors.limits import MAX_AMOUNT, MAX_JSON_DEPTH


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("inf", None),
        ("-inf", None),
        ("NaN", None),
        ("garbage", None),
        ("1" * 200, None),
        ("1e300", None),
        ("9" * 40, None),
        ("86400", MAX_RETRY_AFTER_MS),
        ("86401", None),
        ("-1", 0),
        ("0.25", 250),
        ("3", 3000),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0),
        ("Fri, 31 Dec 9999 23:59:59 GMT", None),
        ("Mon, 99 Foo 2015 99:99:99 GMT", None),
    ],
)
def test_retry_after_is_clamped_to_its_bound_or_ignored(
    value: str | None, expected: int | None
) -> None:
    assert retry_after_ms(value) == expected


def test_json_from_a_backend_never_raises() -> None:
    assert decode_json(b'{"a": [1, 2]}') == ({"a": [1, 2]}, None)
    assert decode_json(b"[" * 1000 + b"]" * 1000) == (None, "too_deep")
    assert decode_json(b"[" * 100_000) == (None, "too_deep")
    depth = MAX_JSON_DEPTH + 1
    assert decode_json(b"[" * depth + b"]" * depth) == (None, "too_deep")
    assert decode_json(b'"\xff\xfe"') == (None, "not_utf8")
    assert decode_json(b"NaN") == (None, "not_json")
    assert decode_json(b"{not json") == (None, "not_json")
    # brackets in strings count toward the quick bound, never toward the depth
    text = b'{"a": "' + b"[{" * 100 + b'"}'
    assert decode_json(text) == ({"a": "[{" * 100}, None)
    depth = MAX_JSON_DEPTH
    assert decode_json(b"[" * depth + b"]" * depth)[1] is None


def test_text_for_the_database_has_no_nul_and_is_bounded() -> None:
    assert clean_text("a\x00b" + "x" * 2000) == "a\\0b" + "x" * 997


def chunk(choices: Any) -> dict[str, Any]:
    return {"id": "c1", "model": "m", "choices": choices}


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2, 3],
        "text",
        chunk("oops"),
        chunk(["oops"]),
        chunk([{"index": 0, "delta": "oops"}]),
        chunk([{"index": 0, "delta": {"content": {"text": "x"}}}]),
        chunk([{"index": 0, "delta": {"tool_calls": [{"function": {"arguments": "{}"}}]}}]),
        chunk([{"index": 0, "delta": {"tool_calls": [{"index": "0"}]}}]),
        chunk([{"index": 0, "delta": {"tool_calls": [{"index": 10**30}]}}]),
        chunk(
            [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": {}}}]}}]
        ),
        chunk([{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": 1}}]}}]),
        chunk([{"index": 0, "delta": {}, "finish_reason": 7}]),
        {"id": 5, "choices": []},
    ],
)
def test_a_chunk_of_an_unexpected_shape_is_refused(bad: Any) -> None:
    with pytest.raises(MalformedChunkError):
        StreamAssembler().feed(bad)


def test_an_untrusted_stream_is_incomplete_even_after_a_finish() -> None:
    assembler = StreamAssembler()
    assembler.feed(chunk([{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]))
    assert assembler.result().outcome is ModelOutcome.FINISHED
    assert assembler.result(untrusted="malformed").outcome is ModelOutcome.INCOMPLETE


def test_usage_from_a_model_is_bounded() -> None:
    assembler = StreamAssembler()
    huge = {"prompt_tokens": 10**30, "completion_tokens": -5, "total_tokens": True}
    assembler.feed({"id": "c", "choices": [], "usage": huge})
    assert assembler.usage == {"prompt_tokens": MAX_AMOUNT, "completion_tokens": 0}


def test_a_non_streamed_message_needs_no_tool_call_index() -> None:
    assembler = StreamAssembler()
    call = {"id": "a", "function": {"name": "search_docs", "arguments": "{}"}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    assembler.feed(chunk([{"index": 0, "message": message, "finish_reason": "tool_calls"}]))
    result = assembler.result()
    assert result.outcome is ModelOutcome.FINISHED and len(result.tool_calls) == 1


def test_a_routes_file_sets_the_bounds_of_a_call(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    bounds = {"total_timeout_s": 5, "max_stream_bytes": 1000, "max_line_bytes": 10}
    path.write_text(json.dumps({"r": bounds}))
    route = Routes.from_env(str(path)).get("r")
    assert (route.total_timeout_s, route.max_stream_bytes, route.max_line_bytes) == (5, 1000, 10)


def read_answer(raw: bytes, limit: int = 1000, deadline_s: float = 5.0) -> Any:
    """`_read_response` of ``raw`` over a real socket pair (no server)."""

    async def read() -> Any:
        ours, theirs = socket.socketpair()
        try:
            theirs.sendall(raw)
            loop = asyncio.get_running_loop()
            transport, wire = await loop.create_connection(_Wire, sock=ours)
            conn = _Connection(wire)
            conn.limit, conn.deadline = limit, time.monotonic() + deadline_s
            try:
                return await _read_response(conn, "POST")
            finally:
                transport.close()
                await asyncio.sleep(0)
        finally:
            theirs.close()

    return asyncio.run(read())


def test_a_body_over_the_limit_is_not_read() -> None:
    with pytest.raises(BodyTooLargeError):
        read_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 1001\r\n\r\n")
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    with pytest.raises(BodyTooLargeError):
        read_answer(chunked + b"200\r\n" + b"x" * 512 + b"\r\n200\r\n")
    with pytest.raises(HTTPWireError):
        read_answer(chunked + b"-1\r\n")
    with pytest.raises(HTTPWireError):
        read_answer(b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n")
    head = b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 300 + b"\r\n"
    with pytest.raises(HTTPWireError):
        read_answer(head)


def test_an_answer_that_does_not_come_ends_at_the_deadline() -> None:
    with pytest.raises(TimeoutError):
        read_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", deadline_s=0.05)
    assert read_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc")[2] == b"abc"
