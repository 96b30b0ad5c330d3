"""MCP tool servers as tool backends, without services: the registry's ``mcp_servers``, the
annotations' rules, what a ``tools/call`` answer becomes (docs/tools.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentruns.connectors.executors.base import ExecutorError
from agentruns.connectors.executors.http import Answer
from agentruns.connectors.executors.mcp_client import parse_answer, validate_call_result
from agentruns.connectors.executors.mcp_rules import (
    ToolOverride,
    output_of,
    parse_mcp_servers,
    rpc_error_class,
    rules_for,
    status_class,
    text_of,
)
from agentruns.connectors.executors.tool import ToolEntry, ToolRegistry
from agentruns.connectors.executors.tool_mcp import entries_of
from agentruns.processors.state import ErrorClass

HINT = st.sampled_from([True, False, None])
SHOP = {"name": "shop", "url": "http://x"}


def _hints(read_only: bool | None, destructive: bool | None, idempotent: bool | None) -> Any:
    names = ("readOnlyHint", "destructiveHint", "idempotentHint")
    values = (read_only, destructive, idempotent)
    return {n: v for n, v in zip(names, values, strict=True) if v is not None}


@settings(max_examples=200)
@given(HINT, HINT, HINT)
def test_annotations_decide_the_rules_and_unknown_means_unsafe(
    read_only: bool | None, destructive: bool | None, idempotent: bool | None
) -> None:
    rules = rules_for(_hints(read_only, destructive, idempotent), None, 5000)
    if read_only is True:
        assert (rules.permission, rules.idempotent, rules.approval_required) == (
            "read",
            True,
            False,
        )
    else:
        assert rules.permission == "write"
        # a repeat is allowed only when the server says so
        assert rules.idempotent is (idempotent is True)
        # a person approves unless the server says the tool destroys nothing
        assert rules.approval_required is (destructive is not False)
    assert rules.timeout_ms == 5000


def test_no_hints_at_all_are_the_mcp_defaults_destructive_and_not_idempotent() -> None:
    for hints in (None, {}, {"title": "Refund"}, {"readOnlyHint": "yes"}):
        rules = rules_for(hints, None, 1000)
        assert (rules.permission, rules.idempotent, rules.approval_required) == (
            "write",
            False,
            True,
        )


@given(HINT, HINT, HINT, HINT, st.sampled_from(["read", "write", None]))
def test_the_operators_override_wins_field_by_field(
    read_only: bool | None,
    idempotent: bool | None,
    approval: bool | None,
    override_idempotent: bool | None,
    permission: str | None,
) -> None:
    override = ToolOverride(
        permission=permission,
        approval_required=approval,
        idempotent=override_idempotent,
        timeout_ms=250,
    )
    base = rules_for(_hints(read_only, None, idempotent), None, 5000)
    rules = rules_for(_hints(read_only, None, idempotent), override, 5000)
    assert rules.permission == (permission or base.permission)
    assert rules.approval_required == (base.approval_required if approval is None else approval)
    assert rules.idempotent == (
        base.idempotent if override_idempotent is None else override_idempotent
    )
    assert rules.timeout_ms == 250


def test_registry_entries_are_read_with_their_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MCP_TOKEN", "s3cret")
    servers = parse_mcp_servers(
        {
            "mcp_servers": [
                {
                    "name": "shop",
                    "url": "http://127.0.0.1:9/mcp",
                    "timeout_ms": 1500,
                    "auth": {"type": "bearer", "token_env": "MCP_TOKEN"},
                    "tools": {
                        "refund_order": {"approval_required": False, "max_in_flight": 2},
                    },
                }
            ]
        },
        "test",
    )
    shop = servers["shop"]
    assert shop.timeout_ms == 1500 and shop.agent_name("x") == "shop__x"
    assert shop.conn.auth_header is not None
    assert shop.conn.auth_header[1].reveal() == "Bearer s3cret"
    assert "s3cret" not in repr(shop)
    assert shop.tools["refund_order"].approval_required is False
    assert shop.tools["refund_order"].limits.max_in_flight == 2


def test_a_stdio_entry_is_read_with_its_limits_and_secret_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOCAL_TOKEN", "t0ken")
    entry = {
        "name": "local",
        "command": "/usr/bin/local-mcp",
        "args": ["--stdio", "-v"],
        "env": {"MODE": "test", "TOKEN": {"value_env": "LOCAL_TOKEN"}},
        "max_line_bytes": 65536,
        "start_timeout_ms": 2000,
    }
    local = parse_mcp_servers({"mcp_servers": [entry]}, "test")["local"]
    assert local.url == "" and local.endpoint == "stdio:/usr/bin/local-mcp"
    assert local.stdio is not None
    assert (local.stdio.args, local.stdio.max_line_bytes) == (("--stdio", "-v"), 65536)
    assert local.stdio.start_timeout_ms == 2000
    assert {k: v.reveal() for k, v in local.stdio.env.items()} == {"MODE": "test", "TOKEN": "t0ken"}
    assert "t0ken" not in repr(local)
    assert local.conn.redact("the token t0ken leaked") == "the token [redacted] leaked"
    default = parse_mcp_servers({"mcp_servers": [{"name": "d", "command": "x"}]}, "test")["d"]
    assert default.stdio is not None and default.stdio.max_line_bytes == 8 * 1024 * 1024
    assert default.stdio.start_timeout_ms == 10_000


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"name": "a.b", "url": "http://x/mcp"}, "letters, digits"),
        ({"name": "a__b", "url": "http://x/mcp"}, "letters, digits"),
        ({"name": "x" * 40, "url": "http://x/mcp"}, "letters, digits"),
        ({"name": "shop", "url": "ftp://x/mcp"}, "url must be"),
        ({"name": "shop", "url": "http://x", "timeout_ms": 0}, "timeout_ms"),
        ({"name": "shop", "url": "http://x", "timeout_ms": True}, "timeout_ms"),
        ({"name": "shop", "url": "http://x", "refresh_s": 0}, "refresh_s"),
        ({"name": "shop", "url": "http://x", "tools": []}, "tools must be"),
        ({**SHOP, "tools": {"t": {"idempotent": "yes"}}}, "idempotent"),
        ({**SHOP, "tools": {"t": {"permission": "admin"}}}, "permission"),
        ({**SHOP, "tools": {"t": {"endpoint": "/x"}}}, "unknown fields"),
        ({**SHOP, "auth": {"type": "bearer", "token_env": "NOPE_X"}}, "NOPE_X"),
        # a server the executor starts
        ({"name": "local"}, "exactly one of url and command"),
        ({**SHOP, "command": "srv"}, "exactly one of url and command"),
        ({"name": "local", "command": ""}, "command must be"),
        ({"name": "local", "command": ["srv"]}, "command must be"),
        ({"name": "local", "command": "srv", "args": "-x"}, "args must be"),
        ({"name": "local", "command": "srv", "args": [1]}, "args must be"),
        ({"name": "local", "command": "srv", "args": ["a"] * 65}, "args must be"),
        ({"name": "local", "command": "srv", "env": {"A=B": "x"}}, "not a variable name"),
        ({"name": "local", "command": "srv", "env": {"A": 1}}, "env A must be"),
        ({"name": "local", "command": "srv", "env": {"A": "x\x00y"}}, "env A must be"),
        ({"name": "local", "command": "srv", "env": {"A": {"value_env": "NOPE_X"}}}, "NOPE_X"),
        ({"name": "local", "command": "srv", "max_line_bytes": 10}, "max_line_bytes"),
        ({"name": "local", "command": "srv", "start_timeout_ms": 0}, "start_timeout_ms"),
        ({"name": "local", "command": "srv", "auth": {"type": "bearer"}}, "auth is for an HTTP"),
        ({"name": "local", "command": "srv", "proxy": ""}, "proxy is for an HTTP"),
    ],
)  # fmt: skip
def test_invalid_registry_entries_are_refused_naming_what(entry: Any, says: str) -> None:
    with pytest.raises(ExecutorError, match=says):
        parse_mcp_servers({"mcp_servers": [entry]}, "test")


def test_a_server_named_twice_and_http_tools_in_its_namespace_are_refused(tmp_path: Path) -> None:
    twice = [{"name": "shop", "url": "http://x/mcp"}] * 2
    with pytest.raises(ExecutorError, match="named twice"):
        parse_mcp_servers({"mcp_servers": twice}, "test")
    path = tmp_path / "tools.json"
    path.write_text(
        json.dumps(
            {
                "base_url": "http://x",
                "tools": [{"name": "shop__refund"}],
                "mcp_servers": [{"name": "shop", "url": "http://x/mcp"}],
            }
        )
    )
    with pytest.raises(ExecutorError, match="named like the tools"):
        ToolRegistry.load(path)


def test_a_registry_of_mcp_servers_alone_needs_no_base_url(tmp_path: Path) -> None:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps({"mcp_servers": [{"name": "shop", "url": "http://x/mcp"}]}))
    registry = ToolRegistry.load(path)
    assert registry.tools == {} and list(registry.mcp_servers) == ["shop"]


def test_listed_tools_become_entries_and_bad_names_are_left_out() -> None:
    spec = parse_mcp_servers(
        {"mcp_servers": [{**SHOP, "tools": {"refund": {"approval_required": False}}}]},
        "test",
    )["shop"]  # fmt: skip
    listed = [
        {
            "name": "lookup",
            "inputSchema": {"type": "object"},
            "annotations": {"readOnlyHint": True},
        },
        {"name": "refund", "description": "Refund", "annotations": {"destructiveHint": True}},
        {"name": "has.dot"},
        {"name": "x" * 70},
        {"name": 5},
        {"name": "taken"},
    ]
    entries = entries_of(spec, listed, lambda name: name == "shop__taken", ToolEntry)
    assert sorted(entries) == ["shop__lookup", "shop__refund"]
    lookup, refund = entries["shop__lookup"], entries["shop__refund"]
    assert (lookup.permission, lookup.idempotent, lookup.approval_required) == ("read", True, False)
    assert (refund.permission, refund.idempotent, refund.approval_required) == (
        "write",
        False,
        False,
    )
    assert refund.backend == "mcp" and refund.mcp_server == "shop" and refund.mcp_tool == "refund"
    assert refund.parameters == {"type": "object"}


# --------------------------------------------------------------------------- results


def test_structured_content_is_the_output_else_the_text_else_the_blocks() -> None:
    assert output_of(
        {"content": [{"type": "text", "text": "{}"}], "structuredContent": {"a": 1}}
    ) == {"a": 1}
    assert output_of({"content": [{"type": "text", "text": "done"}]}) == "done"
    blocks = output_of(
        {
            "content": [
                {"type": "text", "text": "see"},
                {"type": "image", "data": "aGk=", "mimeType": "image/png"},
                {"type": "resource", "resource": {"uri": "u:a", "text": "A", "mimeType": "t/p"}},
                {"type": "resource", "resource": {"uri": "file:///b", "blob": "Qg=="}},
                {"type": "resource_link", "uri": "file:///c", "name": "c"},
            ]
        }
    )  # fmt: skip
    assert blocks == [
        {"type": "text", "text": "see"},
        {"type": "image", "mime_type": "image/png", "data": "aGk="},
        {"type": "resource", "uri": "u:a", "mime_type": "t/p", "text": "A"},
        {"type": "resource", "uri": "file:///b", "mime_type": None, "blob": "Qg=="},
        {"type": "resource_link", "uri": "file:///c", "name": "c"},
    ]
    assert output_of({"content": []}) == []
    assert (
        text_of([{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}])
        == "a\nb"
    )
    assert text_of("nonsense") == ""


@pytest.mark.parametrize(
    "result",
    [
        {"content": [{"type": "nonsense"}]},
        {"content": [{"type": "text"}]},
        {"content": "text"},
        {"content": [{"type": "image", "data": 5}]},
        {"content": [], "isError": "yes"},
        {"content": [], "structuredContent": [1]},
    ],
)
def test_garbage_content_blocks_are_no_call_tool_result(result: Any) -> None:
    assert validate_call_result(result) is not None


def test_a_good_call_tool_result_passes() -> None:
    assert validate_call_result({"content": [{"type": "text", "text": "ok"}]}) is None


def test_json_rpc_errors_and_statuses_are_classified() -> None:
    assert rpc_error_class(-32602) == (ErrorClass.UNKNOWN, "invalid_arguments")
    assert rpc_error_class(-32601) == (ErrorClass.UNKNOWN, "method_not_found")
    assert rpc_error_class(-32603) == (ErrorClass.UNKNOWN, "internal_error")
    assert rpc_error_class(-1) == (ErrorClass.UNKNOWN, "mcp_error:-1")
    assert rpc_error_class("x") == (ErrorClass.UNKNOWN, "mcp_error")
    assert status_class(401, False) == (ErrorClass.PERMISSION_DENIED, "permission_denied")
    assert status_class(429, False) == (ErrorClass.RATE_LIMIT, "rate_limited")
    assert status_class(503, False) == (ErrorClass.TRANSIENT, "http_503")
    # a 500 after the request went in: unknown for a tool that may not be repeated
    assert status_class(500, False) is None and status_class(502, False) is None
    assert status_class(500, True) == (ErrorClass.TRANSIENT, "http_500")
    assert status_class(418, False) == (ErrorClass.UNKNOWN, "http_418")


# --------------------------------------------------------------------------- wire


def _answer(body: bytes, content_type: str = "application/json", status: int = 200) -> Answer:
    return Answer(status, {"content-type": content_type}, body)


def test_answers_as_json_or_as_an_event_stream() -> None:
    message = {"jsonrpc": "2.0", "id": 7, "result": {"content": []}}
    assert parse_answer(_answer(json.dumps(message).encode()), 7).kind == "result"
    stream = (
        b'event: message\ndata: {"jsonrpc":"2.0","method":"notifications/tools/list_changed"}\n\n'
        b"event: message\r\ndata: " + json.dumps(message).encode() + b"\r\n\r\n"
    )
    reply = parse_answer(_answer(stream, "text/event-stream; charset=utf-8"), 7)
    assert reply.kind == "result" and reply.list_changed
    error = {"jsonrpc": "2.0", "id": 7, "error": {"code": -32602, "message": "bad"}}
    assert parse_answer(_answer(json.dumps(error).encode()), 7).value["code"] == -32602


@pytest.mark.parametrize(
    ("body", "content_type", "detail"),
    [
        (b"{not json", "application/json", "not_json"),
        (b'{"jsonrpc":"2.0","id":8,"result":{}}', "application/json", "wrong_id"),
        (b'{"jsonrpc":"2.0","id":true,"result":{}}', "application/json", "wrong_id"),
        (b'{"jsonrpc":"1.0","id":7,"result":{}}', "application/json", "not_jsonrpc"),
        (b'{"jsonrpc":"2.0","id":7}', "application/json", "not_jsonrpc"),
        (b'{"jsonrpc":"2.0","id":7,"result":[1]}', "application/json", "not_jsonrpc"),
        (b'{"jsonrpc":"2.0","id":7,"error":"bad"}', "application/json", "not_jsonrpc"),
        (b"[1, 2]", "application/json", "not_jsonrpc"),
        (b'{"jsonrpc":"2.0","method":"notifications/x"}', "application/json", "no_response"),
        (b"data: [[[[" + b"[" * 200 + b"\n\n", "text/event-stream", "not_json"),
        (b"[" * 100 + b"]" * 100, "application/json", "too_deep"),
        (b"<html>", "text/html", "content_type:text/html"),
    ],
)
def test_answers_that_are_no_answer_to_the_request_are_invalid(
    body: bytes, content_type: str, detail: str
) -> None:
    reply = parse_answer(_answer(body, content_type), 7)
    assert (reply.kind, reply.detail) == ("invalid", detail)


@settings(max_examples=300)
@given(st.binary(max_size=400), st.sampled_from(["application/json", "text/event-stream"]))
def test_any_bytes_make_a_reply_and_never_raise(body: bytes, content_type: str) -> None:
    reply = parse_answer(_answer(body, content_type), 1)
    assert reply.kind in ("result", "error", "invalid", "unknown")


def test_an_event_stream_that_ends_before_the_answer_is_an_unknown_outcome() -> None:
    reply = parse_answer(_answer(b": ping\n\n", "text/event-stream"), 7)
    assert reply.kind == "unknown"
