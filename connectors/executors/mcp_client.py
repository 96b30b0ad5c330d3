"""The MCP client of the tool executor: one session per MCP server (streamable HTTP), shared by
every call in flight on the executor's event loop.

Why not the SDK's ``ClientSession``: the executor must know, per call, whether a request can
have reached the tool (a connection that could not be opened, a session the server no longer
knows, vs an answer lost after sending); the SDK folds these into one error, reads a JSON
answer whole whatever its size, and a transport error there ends the session of every call in
flight. So the wire is the executor's own :class:`KeepAliveHTTP` (the same auth, proxy, TLS,
timeouts and body cap as HTTP tools) and the messages are checked with the SDK's types
(``mcp_types``) before they are used.

A request is a ``POST`` of one JSON-RPC message; the answer is one JSON message or a
server-sent event stream that ends with it (notifications before it are read:
``notifications/tools/list_changed`` marks the tool list stale). The session is opened
lazily (``initialize``, then ``notifications/initialized``), by one call while the others
wait; a ``404`` to a request that carried the session id means the server no longer knows
the session (a restart, an expiry) and took nothing in: the session is opened again and the
request sent once more, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from mcp_types import CallToolResult, InitializeResult, ListToolsResult
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, LATEST_HANDSHAKE_VERSION
from pydantic import ValidationError

from agentruns.connectors.executors import spans
from agentruns.connectors.executors.base import decode_json
from agentruns.connectors.executors.http import Answer, KeepAliveHTTP
from agentruns.connectors.executors.mcp_rules import MCPServerSpec
from agentruns.connectors.executors.tool_http import scrub_answer
from agentruns.streams import tracing

CLIENT_INFO = {"name": "agentruns-tool-executor", "version": "1"}
SESSION_HEADER = "Mcp-Session-Id"
VERSION_HEADER = "MCP-Protocol-Version"
MAX_LIST_PAGES = 16
MAX_SSE_EVENTS = 10_000
LIST_CHANGED = "notifications/tools/list_changed"


@dataclass(frozen=True)
class Reply:
    """What came of one request. ``kind``: ``result`` / ``error`` (a JSON-RPC answer),
    ``not_sent`` / ``tls`` (no connection), ``unknown`` (sent, no complete answer),
    ``too_large``, ``invalid`` (an answer that is no JSON-RPC answer to this request;
    ``detail`` says why), ``status`` (an HTTP status without a JSON-RPC answer),
    ``session_lost`` (404 to the session), ``cancelled`` (cancelled before it was sent).
    ``sent``: the request itself may have reached the server (False when the session could
    not be opened: nothing of the request left)."""

    kind: str
    value: Any = None
    status: int = 0
    detail: str = ""
    sent: bool = True
    list_changed: bool = False


@dataclass
class InFlight:
    """A ``tools/call`` of this executor, by operation key (for CancelTool)."""

    request_id: int | None = None
    cancelled: bool = False


def parse_answer(answer: Answer, request_id: int) -> Reply:
    """The JSON-RPC answer to ``request_id`` in a 2xx HTTP answer (JSON or an event stream).
    Never raises."""
    content_type = (answer.header("content-type") or "").split(";")[0].strip().lower()
    if content_type == "text/event-stream":
        messages, problem = _events(answer.body)
        if problem is not None:
            return Reply("invalid", detail=problem, status=answer.status)
    elif content_type == "application/json":
        value, problem = decode_json(answer.body)
        if problem is not None:
            return Reply("invalid", detail=problem, status=answer.status)
        messages = value if isinstance(value, list) else [value]
    else:
        return Reply("invalid", detail=f"content_type:{content_type[:50]}", status=answer.status)
    list_changed = False
    for message in messages:
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            return Reply("invalid", detail="not_jsonrpc", status=answer.status)
        if message.get("method") == LIST_CHANGED:
            list_changed = True
        if "id" not in message or "method" in message:
            continue  # a notification, or a request of the server's (not answered here)
        if message["id"] != request_id or isinstance(message["id"], bool):
            return Reply("invalid", detail="wrong_id", status=answer.status)
        return reply_of(message, answer.status, list_changed)
    if content_type == "text/event-stream":  # the stream ended before the answer: unknown
        return Reply("unknown", detail="stream ended without the answer", status=answer.status)
    return Reply("invalid", detail="no_response", status=answer.status, list_changed=list_changed)


def reply_of(message: Mapping[str, Any], status: int = 0, list_changed: bool = False) -> Reply:
    """A JSON-RPC response (a message with the request's id and no ``method``) as a reply:
    its result, its error, or ``invalid`` when it has neither in the protocol's shape."""
    if "result" in message and isinstance(message["result"], dict):
        return Reply("result", message["result"], status, list_changed=list_changed)
    error = message.get("error")
    if isinstance(error, dict) and "code" in error:
        return Reply("error", error, status, list_changed=list_changed)
    return Reply("invalid", detail="not_jsonrpc", status=status, list_changed=list_changed)


def _events(body: bytes) -> tuple[list[Any], str | None]:
    """The JSON messages of a server-sent event stream's ``data`` fields."""
    messages: list[Any] = []
    for block in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
        if not data or data == [b""]:
            continue
        if len(messages) >= MAX_SSE_EVENTS:
            return [], "too_many_events"
        value, problem = decode_json(b"\n".join(data))
        if problem is not None:
            return [], problem
        messages.append(value)
    return messages, None


def validate_call_result(result: Mapping[str, Any]) -> str | None:
    """None when ``result`` is a ``CallToolResult`` by the SDK's types, else why not."""
    if not isinstance(result.get("isError", False), bool):  # pydantic would take "yes"
        return "bad_result: isError is not a boolean"
    if not isinstance(result.get("structuredContent", {}), dict):
        return "bad_result: structuredContent is not an object"
    try:
        CallToolResult.model_validate(result, by_name=False)
    except ValidationError as exc:
        return f"bad_result: {exc.errors()[0].get('msg', '')}"[:200]
    return None


class Wire(Protocol):
    """How one server's JSON-RPC messages travel (streamable HTTP, or a process's stdin and
    stdout): the session logic (:class:`MCPSession`) is the same over either."""

    @property
    def session(self) -> object:
        """What names the server's session now; it changes when the session ends."""
        ...

    def alive(self) -> bool:
        """Whether the session opened last can still be used (False: open it again)."""
        ...

    async def exchange(
        self, message: Mapping[str, Any], timeout_s: float, *, opening: bool = False
    ) -> Reply:
        """Send one message: a request's answer, or for a notification ``accepted`` or why
        not. ``opening``: the ``initialize`` request (it starts a session). A request that
        carried a session the server no longer has is ``session_lost`` (nothing taken in)."""
        ...

    def opened(self, protocol: str) -> None:
        """The session is open with this protocol version."""
        ...

    def forget(self) -> None:
        """The session ended: the next ``initialize`` starts a new one."""
        ...

    async def close(self, timeout_s: float) -> None:
        """End the session at the server, best effort."""
        ...


@dataclass
class HTTPWire:
    """Streamable HTTP: a ``POST`` per message on the executor's :class:`KeepAliveHTTP`; the
    session is the server's ``Mcp-Session-Id``."""

    spec: MCPServerSpec
    http: KeepAliveHTTP
    session_id: str | None = None
    protocol: str | None = None

    @property
    def session(self) -> object:
        return self.session_id

    def alive(self) -> bool:
        return True  # a lost session is known by the 404 to it

    def _headers(self, with_session: bool) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            **tracing.outgoing_headers(),
        }
        if with_session and self.session_id is not None:
            headers[SESSION_HEADER] = self.session_id
        if with_session and self.protocol is not None:
            headers[VERSION_HEADER] = self.protocol
        if self.spec.conn.auth_header is not None:
            name, secret = self.spec.conn.auth_header
            headers[name] = secret.reveal()
        return headers

    async def exchange(
        self, message: Mapping[str, Any], timeout_s: float, *, opening: bool = False
    ) -> Reply:
        answer, failed = await self._post(message, timeout_s, with_session=not opening)
        if failed is not None:
            return failed
        request_id = message.get("id")
        if not isinstance(request_id, int):
            return Reply("accepted", status=answer.status)  # a notification taken in
        reply = parse_answer(answer, request_id)
        if opening and reply.kind == "result":
            self.session_id = answer.header("mcp-session-id")
        return reply

    async def _post(
        self, message: Mapping[str, Any], timeout_s: float, *, with_session: bool = True
    ) -> tuple[Answer, Reply | None]:
        """One POST: the HTTP answer, and the reply when it is a failure already."""
        answer = await self.http.send(
            "POST",
            self.spec.url,
            timeout_s=max(timeout_s, 0.001),
            headers=self._headers(with_session),
            body=msgspec.json.encode(message),
            conn=self.spec.conn,
        )
        answer = scrub_answer(answer, self.spec.conn)
        match answer.failure:
            case None:
                pass
            case "not_sent" | "tls" | "too_large":
                return answer, Reply(answer.failure, detail=answer.detail)
            case "invalid_request":  # refused by the client: nothing reached the server
                return answer, Reply("invalid", detail=answer.detail, sent=False)
            case _:
                return answer, Reply("unknown", detail=answer.detail)
        if answer.status == 404 and with_session and self.session_id is not None:
            return answer, Reply("session_lost", status=404, detail="HTTP 404 to the session")
        if answer.status == 202:
            return answer, Reply("accepted", status=202)
        if not 200 <= answer.status < 300:
            request_id = message.get("id")
            if isinstance(request_id, int) and answer.body:
                reply = parse_answer(answer, request_id)
                if reply.kind == "error":
                    return answer, reply
            detail = answer.body[:300].decode("utf-8", "replace")
            return answer, Reply("status", status=answer.status, detail=detail)
        return answer, None

    def opened(self, protocol: str) -> None:
        self.protocol = protocol

    def forget(self) -> None:
        self.session_id, self.protocol = None, None

    async def close(self, timeout_s: float) -> None:
        """``DELETE`` the session."""
        if self.session_id is None:
            return
        with contextlib.suppress(Exception):
            await self.http.send(
                "DELETE", self.spec.url, timeout_s=timeout_s, headers=self._headers(True),
                conn=self.spec.conn,
            )  # fmt: skip
        self.forget()


@dataclass
class MCPSession:
    """One server's session on the executor's event loop (the loop's thread only), over its
    :class:`Wire`."""

    spec: MCPServerSpec
    wire: Wire
    opened: bool = False
    #: the server's ``capabilities`` as its last ``initialize`` answer gave them
    capabilities: Any = None
    in_flight: dict[str, InFlight] = field(default_factory=dict)
    #: the protocol version the server chose at its last ``initialize``
    protocol: str | None = None
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _lock: asyncio.Lock | None = None

    async def _open(self, deadline: float) -> Reply | None:
        """``initialize`` and ``notifications/initialized``; None when the session is open,
        else the failure (``sent`` False: nothing of the caller's request left)."""
        request_id = next(self._ids)
        request = {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "initialize",
            "params": {
                "protocolVersion": LATEST_HANDSHAKE_VERSION,
                "capabilities": {},
                "clientInfo": CLIENT_INFO,
            },
        }
        reply = await self._exchange(request, deadline - time.monotonic(), opening=True)
        if reply.kind == "result":
            try:
                result = InitializeResult.model_validate(reply.value, by_name=False)
            except ValidationError:
                return Reply("invalid", detail="bad_initialize_result", sent=False)
            if result.protocol_version not in HANDSHAKE_PROTOCOL_VERSIONS:
                return Reply(
                    "invalid", detail=f"protocol {result.protocol_version[:40]}", sent=False
                )
            self.wire.opened(result.protocol_version)
            self.protocol = result.protocol_version
            self.capabilities = reply.value.get("capabilities")
            note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            failed = await self._exchange(note, deadline - time.monotonic())
            if failed.kind not in ("accepted", "status"):
                return Reply(failed.kind, detail=f"initialized: {failed.detail}", sent=False)
            self.opened = True
            return None
        return Reply(
            reply.kind, reply.value, reply.status, f"initialize: {reply.detail}", sent=False
        )

    async def _exchange(
        self, message: Mapping[str, Any], timeout_s: float, *, opening: bool = False
    ) -> Reply:
        """One message on the wire, carrying the effect's trace context in ``params._meta``
        (``traceparent``, as OpenTelemetry's MCP conventions and the SDK's servers read it);
        with tracing on, in a CLIENT span of its own (the child of the effect's span, the
        parent of its HTTP exchange) whose context the server receives."""
        if not tracing.enabled():
            context = tracing.OUTGOING.get()
            sent = message if context is None else _with_context(message, context)
            return await self.wire.exchange(sent, timeout_s, opening=opening)
        session = None if opening else self.wire.session
        span = spans.mcp_span(
            message,
            tracing.OUTGOING.get(),
            url=self.spec.url,  # empty for a stdio server
            session_id=session if isinstance(session, str) else None,
            protocol=None if opening else self.protocol,
        )
        context = tracing.traceparent_of(span)
        token = tracing.OUTGOING.set(context)
        reply = Reply("cancelled", detail="cancelled while in flight")
        try:
            reply = await self.wire.exchange(
                _with_context(message, context), timeout_s, opening=opening
            )
            return reply
        finally:
            tracing.OUTGOING.reset(token)
            if opening and reply.kind == "result":  # what the server chose
                spans.mcp_opened(span, self.wire.session, reply.value.get("protocolVersion"))
            spans.mcp_done(
                span, reply.kind, reply.value, reply.status, reply.detail, self.spec.conn.redact
            )

    async def ensure_open(self, deadline: float) -> Reply | None:
        if self.opened and self.wire.alive():
            return None
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one call opens it; the others wait and share it
            if self.opened and self.wire.alive():
                return None
            self.opened = False
            return await self._open(deadline)

    def _forget(self, session: object) -> None:
        """The server lost the session ``session``: the next request opens a new one
        (unless another call has done so already)."""
        if self.wire.session == session:
            self.opened = False
            self.wire.forget()

    async def request(
        self,
        method: str,
        params: Mapping[str, Any],
        timeout_s: float,
        op_key: str | None = None,
    ) -> Reply:
        """One request and its answer, by ``timeout_s`` from now; a lost session is opened
        again and the request sent again once (the server took nothing in)."""
        deadline = time.monotonic() + timeout_s
        flight = None
        if op_key is not None:
            flight = self.in_flight.setdefault(op_key, InFlight())
        try:
            reply = Reply("session_lost", sent=False)
            for _ in range(2):
                failed = await self.ensure_open(deadline)
                if failed is not None:
                    return failed
                if flight is not None and flight.cancelled:
                    return Reply("cancelled", sent=False, detail="cancelled before it was sent")
                request_id = next(self._ids)
                if flight is not None:
                    flight.request_id = request_id
                message = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
                session = self.wire.session
                answered = await self._exchange(message, deadline - time.monotonic())
                if answered.kind == "session_lost":
                    self._forget(session)
                    reply = answered
                    continue
                return answered
            return reply
        finally:
            if flight is not None and self.in_flight.get(op_key or "") is flight:
                del self.in_flight[op_key or ""]

    async def cancel(self, op_key: str, timeout_s: float) -> str:
        """Cancel the call of ``op_key``: ``never_sent`` (it will not be sent), ``notified``
        (``notifications/cancelled`` sent for it), ``not_here`` (not in flight here)."""
        flight = self.in_flight.get(op_key)
        if flight is None:
            return "not_here"
        if flight.request_id is None:
            flight.cancelled = True
            return "never_sent"
        note = {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": flight.request_id, "reason": "the run cancelled the call"},
        }
        await self._exchange(note, timeout_s)
        return "notified"

    async def list_tools(self, timeout_s: float) -> tuple[list[dict[str, Any]] | None, str]:
        """Every tool the server lists (pages followed), or None and why not."""
        tools: list[dict[str, Any]] = []
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            params: dict[str, Any] = {} if cursor is None else {"cursor": cursor}
            reply = await self.request("tools/list", params, timeout_s)
            if reply.kind != "result":
                return None, f"tools/list: {reply.kind} {reply.detail}"[:300]
            try:
                listed = ListToolsResult.model_validate(reply.value, by_name=False)
            except ValidationError:
                return None, "tools/list: not a ListToolsResult"
            tools.extend(t for t in reply.value["tools"] if isinstance(t, dict))
            cursor = listed.next_cursor
            if cursor is None:
                return tools, ""
        return tools, f"tools/list: more than {MAX_LIST_PAGES} pages (the rest ignored)"

    async def terminate(self, timeout_s: float = 1.0) -> None:
        """End the session at the server, best effort."""
        await self.wire.close(timeout_s)
        self.opened = False


def _with_context(message: Mapping[str, Any], traceparent: str) -> dict[str, Any]:
    """``message`` with ``traceparent`` in its ``params._meta`` (unprefixed, as SEP-414 has
    it for W3C trace context), the caller's ``_meta`` kept."""
    params = message.get("params")
    params = dict(params) if isinstance(params, Mapping) else {}
    meta = params.get("_meta")
    params["_meta"] = {**(meta if isinstance(meta, Mapping) else {}), tracing.HEADER: traceparent}
    return {**message, "params": params}


__all__ = [
    "HTTPWire",
    "InFlight",
    "MCPSession",
    "Reply",
    "Wire",
    "parse_answer",
    "reply_of",
    "validate_call_result",
]
