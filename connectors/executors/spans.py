"""The spans of the executors, named and described as trace viewers read them (OpenTelemetry's
GenAI and messaging conventions; docs/observability.md lists every attribute).

An effect is one span, made by the executor loop around its handler (`effect_span`): a model
call is `chat {model}` (CLIENT), a tool call `execute_tool {tool}`, any other effect
`process {effect type}` (CONSUMER), each with the messaging attributes of the effect's record and
a link to the span that produced it. The handler adds what only it knows (`describe_chat`,
`describe_outcome`); the HTTP calls it makes are CLIENT spans of their own (`http_span`), and
so are the messages it sends to an MCP server (`mcp_span`: OpenTelemetry's MCP conventions),
whose HTTP exchanges are their children.

Nothing here is called with tracing off (callers check `tracing.enabled()` or `current()`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

from agentruns.processors.effects import CallModel, CallTool, Effect, PollTool, Reconcile
from agentruns.streams import tracing


def effect_span(
    effect: Effect,
    context: str | None,
    topic: str,
    position: tuple[int, int] | None,
    group: str,
) -> Any:
    """The span of one effect, the child of the span that produced its record (`context`)."""
    partition, offset = position if position is not None else (-1, -1)
    attributes = tracing.consumed(topic, partition, offset, group)
    attributes.update(
        {
            "gen_ai.conversation.id": effect.run_id,  # the run id
            "agentruns.step": effect.step,
            "agentruns.attempt": effect.attempt,
        }
    )
    if isinstance(effect, CallModel):
        attributes["gen_ai.operation.name"] = "chat"
        attributes["agentruns.model_route"] = effect.model_route
        name, kind = f"chat {effect.model_route}", "CLIENT"
    elif isinstance(effect, CallTool):
        op = effect.operation
        attributes["gen_ai.operation.name"] = "execute_tool"
        attributes["gen_ai.tool.name"] = op.tool
        attributes["gen_ai.tool.call.id"] = op.key
        attributes["agentruns.dispatch"] = op.dispatch
        name, kind = f"execute_tool {op.tool}", "INTERNAL"
    elif isinstance(effect, PollTool | Reconcile):
        attributes["gen_ai.tool.name"] = effect.tool
        attributes["agentruns.operation_key"] = effect.operation_key
        name, kind = f"process {effect.type} {effect.tool}", "CONSUMER"
    else:
        name, kind = f"process {effect.type}", "CONSUMER"
    return tracing.start(name, context, attributes, kind=kind, links=[context])


def describe_outcome(span: Any, answer: Mapping[str, Any]) -> None:
    """The answer an effect got (its Input record), on its span."""
    kind = str(answer.get("kind", ""))
    span.set_attribute("agentruns.answer", kind)
    if kind.endswith("Failed") or kind.endswith("TimedOut"):
        span.set_attribute("error.type", kind)


def describe_chat(
    span: Any,
    *,
    provider: str,
    model: str,
    payload: Mapping[str, Any],
    outcome: str,
    finish_reason: str | None,
    response_model: str | None,
    response_id: str | None,
    input_tokens: int,
    output_tokens: int,
    content: str,
    tool_calls: Sequence[Mapping[str, Any]],
) -> None:
    """A model call's GenAI attributes on its `chat` span; its messages only when turned on
    (`tracing.messages_on`), each attribute size-capped."""
    span.update_name(f"chat {model}")
    span.set_attribute("gen_ai.provider.name", provider)
    span.set_attribute("gen_ai.request.model", model)
    for key, attribute in (
        ("max_tokens", "gen_ai.request.max_tokens"),
        ("temperature", "gen_ai.request.temperature"),
    ):
        if payload.get(key) is not None:
            span.set_attribute(attribute, payload[key])
    span.set_attribute("agentruns.model_outcome", outcome)
    if response_model:
        span.set_attribute("gen_ai.response.model", response_model)
    if response_id:
        span.set_attribute("gen_ai.response.id", response_id)
    if finish_reason:
        span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
    span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
    if outcome != "finished":  # rate limited, cut off, refused: the core calls again or fails
        span.set_attribute("error.type", outcome)
        tracing.set_error(span, outcome)
    if tracing.messages_on():
        messages = [_message(m) for m in payload.get("messages", ())]
        if isinstance(payload.get("system"), str):  # Anthropic's system prompt
            messages.insert(0, {"role": "system", "parts": [_text(payload["system"])]})
        span.set_attribute("gen_ai.input.messages", tracing.capped_json(messages))
        parts: list[dict[str, Any]] = [_text(content)] if content else []
        for call in tool_calls:
            function = call.get("function", {})
            parts.append(
                {
                    "type": "tool_call",
                    "id": call.get("id"),
                    "name": function.get("name"),
                    "arguments": function.get("arguments"),
                }
            )
        out = {"role": "assistant", "parts": parts, "finish_reason": finish_reason or outcome}
        span.set_attribute("gen_ai.output.messages", tracing.capped_json([out]))


def _text(content: Any) -> dict[str, Any]:
    return {"type": "text", "content": content if isinstance(content, str) else str(content)}


def _message(message: Any) -> dict[str, Any]:
    """One request message in the GenAI conventions' form (role and parts)."""
    if not isinstance(message, Mapping):
        return {"role": "user", "parts": [_text(message)]}
    role = str(message.get("role", "user"))
    content = message.get("content")
    parts: list[dict[str, Any]] = []
    if role == "tool":
        parts.append(
            {"type": "tool_call_response", "id": message.get("tool_call_id"), "response": content}
        )
    elif isinstance(content, list):  # content blocks (Anthropic's, or OpenAI's parts)
        for block in content:
            if isinstance(block, Mapping) and block.get("type") == "text":
                parts.append(_text(block.get("text", "")))
            else:
                parts.append({"type": "generic", "content": block})
    elif content is not None:
        parts.append(_text(content))
    for call in message.get("tool_calls") or ():
        function = call.get("function", {}) if isinstance(call, Mapping) else {}
        parts.append(
            {
                "type": "tool_call",
                "id": call.get("id") if isinstance(call, Mapping) else None,
                "name": function.get("name"),
                "arguments": function.get("arguments"),
            }
        )
    return {"role": role, "parts": parts}


def http_span(method: str, url: str, parent: str | None) -> Any:
    """A CLIENT span of one HTTP exchange; `url.full` without its user info nor its query (a
    key may be passed in either)."""
    attributes = {"http.request.method": method, **_endpoint(url)}
    return tracing.start(method, parent, attributes, kind="CLIENT")


@functools.lru_cache(maxsize=256)
def _endpoint(url: str) -> Mapping[str, Any]:
    """``url.full`` and the server of a URL: the same few come call after call, and parsing
    one each time was most of what an HTTP span cost to make."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return MappingProxyType(
        {"url.full": urlunsplit((parts.scheme, netloc, parts.path, "", "")), **_server(parts)}
    )


def _server(parts: SplitResult) -> dict[str, Any]:
    """``server.address`` and ``server.port`` of a URL (its scheme's port when it names none)."""
    return {
        "server.address": parts.hostname or "",
        "server.port": parts.port or (443 if parts.scheme == "https" else 80),
    }


def http_done(span: Any, status: int, failure: str | None) -> None:
    if status:
        span.set_attribute("http.response.status_code", status)
    error = None
    if failure is not None:
        error = failure
        span.set_attribute("error.type", failure)
    elif status >= 400:
        error = str(status)
        span.set_attribute("error.type", str(status))
    tracing.end(span, error)


def mcp_span(
    message: Mapping[str, Any],
    parent: str | None,
    *,
    url: str,
    session_id: str | None,
    protocol: str | None,
) -> Any:
    """A CLIENT span of one MCP request or notification (OpenTelemetry's MCP conventions):
    named ``{mcp.method.name} {tool}`` for a tool call, else ``{mcp.method.name}``; ``url``
    is the server's (streamable HTTP), empty for a stdio server."""
    method = str(message.get("method", ""))
    params = message.get("params")
    tool = params.get("name") if method == "tools/call" and isinstance(params, Mapping) else None
    attributes: dict[str, Any] = {"mcp.method.name": method}
    request_id = message.get("id")
    if request_id is not None:
        attributes["jsonrpc.request.id"] = str(request_id)
    if isinstance(tool, str):
        attributes["gen_ai.operation.name"] = "execute_tool"
        attributes["gen_ai.tool.name"] = tool
    if session_id is not None:
        attributes["mcp.session.id"] = session_id
    if protocol is not None:
        attributes["mcp.protocol.version"] = protocol
    if url:
        attributes["network.transport"] = "tcp"
        attributes["network.protocol.name"] = "http"
        attributes["network.protocol.version"] = "1.1"  # KeepAliveHTTP speaks HTTP/1.1
        attributes.update(_server(urlsplit(url)))
    else:
        attributes["network.transport"] = "pipe"  # stdio
    name = method if not isinstance(tool, str) else f"{method} {tool}"
    return tracing.start(name, parent, attributes, kind="CLIENT")


def mcp_opened(span: Any, session: object, protocol: Any) -> None:
    """The session and protocol version an ``initialize`` answer opened, on its span."""
    if isinstance(session, str):
        span.set_attribute("mcp.session.id", session)
    if isinstance(protocol, str):
        span.set_attribute("mcp.protocol.version", protocol)


def mcp_done(
    span: Any, kind: str, value: Any, status: int, detail: str, redact: Callable[[str], str]
) -> None:
    """End an MCP span by what came of its message (an ``mcp_client.Reply``'s fields): a
    JSON-RPC error is ``error.type`` and ``rpc.response.status_code`` its code, the status
    its message; an ``isError`` tool result ``tool_error``; a message that got no answer the
    reply's kind (``unknown``, ``not_sent``, ``session_lost``, ...) or its HTTP status. The
    texts pass through ``redact`` (the server's secrets)."""
    error: str | None = None
    if kind == "error" and isinstance(value, Mapping):
        code = str(value.get("code"))
        span.set_attribute("rpc.response.status_code", code)
        span.set_attribute("error.type", code)
        error = str(value.get("message", "")) or code
    elif kind == "result":
        if isinstance(value, Mapping) and value.get("isError") is True:
            span.set_attribute("error.type", "tool_error")
            error = "tool_error"
    elif kind != "accepted":
        error_type = str(status) if kind == "status" and status else kind
        span.set_attribute("error.type", error_type)
        error = f"{error_type}: {detail}" if detail else error_type
    tracing.end(span, None if error is None else redact(error))
