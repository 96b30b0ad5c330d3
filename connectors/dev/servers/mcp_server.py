"""Example MCP tool server (streamable HTTP, built on the MCP SDK's ``MCPServer``) with fault
injection. Used by ``agentruns run --dev-servers``, the MCP executor tests and the docs.

Tools (names as the server lists them; the executor names them ``<server>__<tool>``):

- ``lookup_order`` (``readOnlyHint``): an order's status and amount, structured output;
- ``refund_order`` (``destructiveHint``, not idempotent): refunds an order; every execution
  is counted per idempotency key (the request's ``_meta["agentruns/idempotency_key"]``), so a
  test can prove that no key was executed twice;
- ``set_order_note`` (``idempotentHint``, not destructive): sets an order's note; a repeat
  with the same note changes nothing;
- ``export_orders`` (not destructive, not idempotent, ``execution.taskSupport`` optional): a
  long job (``duration_ms``, 2 s); a call that asks for a task gets one at once and polls it
  (``tasks/get``, ``tasks/result``, ``tasks/cancel``:
  :mod:`agentruns.connectors.dev.servers.mcp_tasks`); executions counted per key.

Admin routes (plain HTTP beside the MCP endpoint ``/mcp``): ``GET /stats`` (calls and
executions per key, fault counts, tasks by status), ``POST /faults`` with ``{"target": tool
or "*", "kind": ..., "times": n or null, "delay_ms": ..., "size": ..., "run": ...}``,
``DELETE /faults``; ``/stats`` also lists the trace contexts the calls carried
(``_meta["traceparent"]``).
Fault kinds: ``slow`` (sleep ``delay_ms`` before executing), ``crash`` (the process exits in
the middle of the call, after counting the call and before answering), ``error`` (an
``isError`` result, nothing executed), ``huge`` (a text block of ``size`` bytes),
``tools_changed`` (the call adds the tool ``archive_order`` to the list and announces it:
``notifications/tools/list_changed`` on the call's own answer and on the standing ``GET``
stream of every session, so a listener that makes no call hears it too; the server
advertises ``tools.listChanged``); and, answered on the wire in the SDK's place (the tool
never called, no call counted): ``malformed`` (JSON cut short), ``wrong_id`` (a result to
another request id), ``unknown_block`` (a result whose content block has a type the protocol
does not have). A rule with ``run`` matches only that run's calls (the request's
``_meta["agentruns/run_id"]``). With ``--counts-file`` every call and execution is appended
to a file and read back at start, so the counts survive a crash.

    python -m agentruns.connectors.dev.servers.mcp_server --port 8702
    python -m agentruns.connectors.dev.servers.mcp_server --stdio   # MCP on stdin/stdout
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import sys
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import uvicorn
from mcp.server.lowlevel import NotificationOptions
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.message import SessionMessage
from mcp_types import (
    JSONRPCNotification,
    ServerTasksCapability,
    ServerTasksRequestsCapability,
    TasksCallCapability,
    TasksCancelCapability,
    TasksToolsCapability,
    ToolAnnotations,
    ToolExecution,
    ToolListChangedNotification,
)
from mcp_types import Tool as MCPTool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentruns.connectors.dev.servers.mcp_tasks import TASK_TOOLS, TaskBoard

DEFAULT_PORT = 8702
KEY_META = "agentruns/idempotency_key"
RUN_META = "agentruns/run_id"
# Answered by the MCP SDK's server, the tool's execution changed as the fault says.
TOOL_FAULTS = frozenset({"slow", "crash", "error", "huge", "tools_changed"})
# Answered on the wire in the SDK's place (the tool is not called, nothing counted as a call):
# a JSON-RPC answer the protocol does not have.
WIRE_FAULTS = frozenset({"malformed", "wrong_id", "unknown_block"})
FAULT_KINDS = TOOL_FAULTS | WIRE_FAULTS
UNKNOWN_BLOCK_TYPE = "hologram"
MAX_REQUEST_BYTES = 1024 * 1024  # a tools/call the wire faults read to match a rule
HUGE_BYTES = 1024 * 1024
MAX_DELAY_MS = 60_000


@dataclass
class Fault:
    """A rule: calls of ``target`` (a tool or ``*``), of run ``run`` when given (the request's
    ``_meta["agentruns/run_id"]``), get ``kind``, ``times`` times (None: every call)."""

    target: str
    kind: str
    times: int | None = 1
    delay_ms: float = 200.0
    size: int = HUGE_BYTES
    run: str | None = None


@dataclass
class ServerState:
    """What the server counts and the faults it was asked to inject (one lock: the tools run
    on the server's event loop, the admin routes too, but a test may read from a thread)."""

    counts_file: Path | None = None
    calls: Counter[str] = field(default_factory=Counter)
    executions: Counter[str] = field(default_factory=Counter)
    faults: list[Fault] = field(default_factory=list)
    injected: Counter[str] = field(default_factory=Counter)
    notes: dict[str, str] = field(default_factory=dict)
    #: the trace context (``_meta["traceparent"]``) of the latest tool calls that had one
    traceparents: deque[str] = field(default_factory=lambda: deque(maxlen=1000))
    lock: threading.Lock = field(default_factory=threading.Lock)
    tasks: TaskBoard = field(init=False)

    def __post_init__(self) -> None:
        self.tasks = TaskBoard(self.count)
        if self.counts_file is not None and self.counts_file.exists():
            for line in self.counts_file.read_text().splitlines():
                what, _, key = line.partition(" ")
                (self.calls if what == "call" else self.executions)[key] += 1

    def count(self, what: str, key: str) -> None:
        with self.lock:
            (self.calls if what == "call" else self.executions)[key] += 1
            if self.counts_file is not None:  # one write per line: survives os._exit
                with self.counts_file.open("a") as out:
                    out.write(f"{what} {key}\n")

    def take_fault(
        self, tool: str, run: str | None, kinds: frozenset[str] = TOOL_FAULTS
    ) -> Fault | None:
        """The first rule of one of ``kinds`` that matches this call, counted."""
        with self.lock:
            for fault in self.faults:
                if fault.kind in kinds and fault.target in (tool, "*") and fault.run in (None, run):
                    if fault.times is not None:
                        fault.times -= 1
                        if fault.times <= 0:
                            self.faults.remove(fault)
                    self.injected[fault.kind] += 1
                    return fault
        return None

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "calls": dict(self.calls),
                "executions": dict(self.executions),
                "faults_injected": dict(self.injected),
                "tasks": dict(Counter(run.status for run in self.tasks.tasks.values())),
                "traceparents": list(self.traceparents),
            }


def fault_of(rule: Any) -> Fault:
    """A fault rule from its JSON (ValueError: why it is not one)."""
    try:
        fault = Fault(
            target=str(rule.get("target", "*")),
            kind=str(rule["kind"]),
            times=rule.get("times", 1),
            delay_ms=float(rule.get("delay_ms", 200.0)),
            size=int(rule.get("size", HUGE_BYTES)),
            run=None if rule.get("run") is None else str(rule["run"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"invalid fault: {exc!r}") from None
    if fault.kind not in FAULT_KINDS:
        raise ValueError(f"kind must be one of {sorted(FAULT_KINDS)}")
    return fault


def _meta(ctx: Context, name: str) -> str:
    meta: Any = ctx.request_context.meta
    value = meta.get(name) if isinstance(meta, dict) else None
    return value if isinstance(value, str) else ""


def _key(ctx: Context) -> str:
    return _meta(ctx, KEY_META)


def build(state: ServerState, *, tasks: bool = True) -> MCPServer:
    """The example server: its tools, their annotations and the admin routes; ``tasks``: it
    answers task-augmented calls of ``TASK_TOOLS`` (its HTTP middleware does: not on stdio)."""
    server: MCPServer = MCPServer("agentruns-example", version="1", log_level="WARNING")
    logging.getLogger("mcp").setLevel(logging.WARNING)
    _advertise(server, tasks=tasks)

    async def before(tool: str, ctx: Context) -> str | None:
        """Count the call and apply a fault (ToolError: an ``isError`` result, nothing
        executed); a huge text the tool answers instead of its own."""
        state.count("call", _key(ctx))
        if traceparent := _meta(ctx, "traceparent"):
            with state.lock:
                state.traceparents.append(traceparent)
        fault = state.take_fault(tool, _meta(ctx, RUN_META) or None)
        if fault is None:
            return None
        match fault.kind:
            case "slow":
                await asyncio.sleep(min(fault.delay_ms, MAX_DELAY_MS) / 1000)
            case "crash":
                os._exit(17)  # the process ends mid-call, the answer is never sent
            case "error":
                raise ToolError(f"{tool} failed (injected)")
            case "huge":
                return "x" * max(fault.size, 0)
            case "tools_changed":
                _add_archive(server)
                # on this request's stream, so a client without a GET stream hears it too
                await ctx.request_context.session.send_notification(
                    ToolListChangedNotification(), related_request_id=ctx.request_context.request_id
                )
                await announce_tools_changed(server)
        return None

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    async def lookup_order(order_id: str, ctx: Context) -> dict[str, Any]:
        """An order's status and amount (read-only)."""
        huge = await before("lookup_order", ctx)
        if huge is not None:
            return {"order_id": order_id, "padding": huge}
        return {"order_id": order_id, "status": "delivered", "amount_cents": 4200}

    @server.tool(annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=False))
    async def refund_order(order_id: str, amount_cents: int, ctx: Context) -> str:
        """Refund an order (destructive, not idempotent: every call refunds again)."""
        huge = await before("refund_order", ctx)
        key = _key(ctx)
        state.count("execution", key)
        digest = hashlib.sha256(key.encode()).hexdigest()[:10]
        return huge or f"refunded {amount_cents} cents on {order_id} (refund R-{digest})"

    @server.tool(annotations=ToolAnnotations(destructive_hint=False, idempotent_hint=True))
    async def set_order_note(order_id: str, note: str, ctx: Context) -> str:
        """Set an order's note (idempotent: the same note twice changes nothing)."""
        huge = await before("set_order_note", ctx)
        state.count("execution", _key(ctx))
        state.notes[order_id] = note
        return huge or f"note of {order_id}: {note}"

    @server.tool(
        annotations=ToolAnnotations(
            read_only_hint=False, destructive_hint=False, idempotent_hint=False
        )
    )
    async def export_orders(since: str, ctx: Context, duration_ms: int = 2000) -> str:
        """Export the orders since a date to a file (a long job, not idempotent: every call
        exports again). Runs as an MCP task when the call asks for one."""
        huge = await before("export_orders", ctx)
        await asyncio.sleep(min(max(duration_ms, 0), MAX_DELAY_MS) / 1000)
        key = _key(ctx)
        state.count("execution", key)
        digest = hashlib.sha256(key.encode()).hexdigest()[:10]
        return huge or f"exported the orders since {since} (export E-{digest})"

    async def stats(request: Request) -> Response:
        return JSONResponse(state.stats())

    async def faults(request: Request) -> Response:
        if request.method == "DELETE":
            with state.lock:
                state.faults.clear()
            return JSONResponse({"faults": 0})
        try:
            fault = fault_of(await request.json())
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        with state.lock:
            state.faults.append(fault)
        return JSONResponse({"faults": len(state.faults)})

    server.custom_route("/stats", methods=["GET"])(stats)
    server.custom_route("/faults", methods=["POST", "DELETE"])(faults)
    return server


def wire_answer(kind: str, request_id: Any) -> bytes:
    """The body of a wire fault's answer to the ``tools/call`` of ``request_id``."""
    match kind:
        case "malformed":  # JSON cut short
            return b'{"jsonrpc": "2.0", "id": '
        case "wrong_id":  # a good result, to a request that was never sent
            answer_id = request_id + 1000 if isinstance(request_id, int) else "other"
            result = {"content": [{"type": "text", "text": "not yours"}]}
            return json.dumps({"jsonrpc": "2.0", "id": answer_id, "result": result}).encode()
        case _:  # unknown_block: a content block of a type the protocol does not have
            block = {"type": UNKNOWN_BLOCK_TYPE, "data": "x"}
            answer = {"jsonrpc": "2.0", "id": request_id, "result": {"content": [block]}}
            return json.dumps(answer).encode()


class WireFaults:
    """ASGI middleware before the SDK's app: a ``tools/call`` POST that a wire fault rule
    matches is answered here (``200 application/json``) and never reaches the SDK, and so is
    a task request (:mod:`agentruns.connectors.dev.servers.mcp_tasks`); every other request
    goes on, its body replayed."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body, more = bytearray(), True
        while more and len(body) <= MAX_REQUEST_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        fault, request_id = self._match(bytes(body)) if not more else (None, None)
        if fault is not None:
            answer: bytes | None = wire_answer(fault.kind, request_id)
        else:
            answer = None if more else await self.state.tasks.answer_body(bytes(body))
        if answer is None:
            first = {"type": "http.request", "body": bytes(body), "more_body": more}
            await self.app(scope, _replay([first], receive), send)
            return
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    def _match(self, body: bytes) -> tuple[Fault | None, Any]:
        try:
            message = json.loads(body)
        except ValueError:
            return None, None
        if not isinstance(message, dict) or message.get("method") != "tools/call":
            return None, None
        params = message.get("params")
        params = params if isinstance(params, dict) else {}
        meta = params.get("_meta")
        run = meta.get(RUN_META) if isinstance(meta, dict) else None
        tool = params.get("name")
        if not isinstance(tool, str):
            return None, None
        fault = self.state.take_fault(tool, run if isinstance(run, str) else None, WIRE_FAULTS)
        return fault, message.get("id")


def _replay(messages: list[Message], then: Receive) -> Receive:
    """An ASGI ``receive`` that gives ``messages`` first, then what ``then`` receives (the
    rest of the body, the client's disconnect)."""
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        return await then()

    return receive


def app_of(state: ServerState) -> ASGIApp:
    """The ASGI app: the SDK's streamable HTTP app behind the wire faults."""
    return WireFaults(build(state).streamable_http_app(), state)


def _advertise(server: MCPServer, *, tasks: bool) -> None:
    """Advertise ``tools.listChanged`` in the ``initialize`` answer (the SDK's server does
    only when its initialization options are given the flag), and with ``tasks`` the tasks
    capability (task-augmented ``tools/call``, ``tasks/cancel``) and ``execution.taskSupport``
    ``optional`` on the tools of ``TASK_TOOLS`` (the SDK's server has neither)."""
    low = server._lowlevel_server
    make = low.create_initialization_options

    def options(notification_options: NotificationOptions | None = None, *args: Any) -> Any:
        made = make(notification_options or NotificationOptions(tools_changed=True), *args)
        if not tasks:
            return made
        capability = ServerTasksCapability(
            cancel=TasksCancelCapability(),
            requests=ServerTasksRequestsCapability(
                tools=TasksToolsCapability(call=TasksCallCapability())
            ),
        )
        capabilities = made.capabilities.model_copy(update={"tasks": capability})
        return made.model_copy(update={"capabilities": capabilities})

    low.create_initialization_options = options  # type: ignore[method-assign,assignment]
    if not tasks:
        return
    listed = server.list_tools

    async def list_tools() -> list[MCPTool]:
        optional = ToolExecution(task_support="optional")
        return [
            tool.model_copy(update={"execution": optional}) if tool.name in TASK_TOOLS else tool
            for tool in await listed()
        ]

    server.list_tools = list_tools  # type: ignore[method-assign]


async def announce_tools_changed(server: MCPServer) -> None:
    """``notifications/tools/list_changed`` on the standing ``GET`` stream of every session
    (a message not related to a request goes there; a session without one loses it)."""
    note = JSONRPCNotification(jsonrpc="2.0", method="notifications/tools/list_changed")
    # the SDK's server has no broadcast to every session (its own is for the 2026 wire's
    # subscriptions/listen): each session's transport is sent the message as its server would
    for transport in list(server.session_manager._server_instances.values()):
        stream = transport._write_stream
        if stream is None:
            continue
        gone = (anyio.ClosedResourceError, anyio.BrokenResourceError, TimeoutError)
        with contextlib.suppress(*gone), anyio.fail_after(1.0):
            await stream.send(SessionMessage(note))


def _add_archive(server: MCPServer) -> None:
    if any(t.name == "archive_order" for t in server._tool_manager.list_tools()):
        return

    async def archive_order(order_id: str) -> str:
        """Archive an order (added while the server runs)."""
        return f"archived {order_id}"

    server.add_tool(archive_order, annotations=ToolAnnotations(destructive_hint=True))


class MCPServerHandle:
    """The server in a background thread (uvicorn on its own event loop)."""

    def __init__(self, host: str, port: int, state: ServerState) -> None:
        self.state = state
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://{host}:{self.port}"
        app = app_of(state)
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def mcp_url(self) -> str:
        return f"{self.url}/mcp"

    def start(self) -> MCPServerHandle:
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                break
            threading.Event().wait(0.01)
        raise RuntimeError("the MCP server did not start")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def __enter__(self) -> MCPServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(
    host: str = "127.0.0.1", port: int = 0, counts_file: Path | None = None
) -> MCPServerHandle:
    """Start the server in a background thread (port 0 picks a free port)."""
    return MCPServerHandle(host, port, ServerState(counts_file)).start()


def dev_registry_entry(url: str, name: str = "shop") -> dict[str, Any]:
    """The ``mcp_servers`` entry of the dev registry for a server at ``url`` (its base)."""
    return {"name": name, "url": f"{url.rstrip('/')}/mcp", "timeout_ms": 5000}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentruns dev mcp-server",
        description="Example MCP tool server (streamable HTTP at /mcp; faults at /faults).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--counts-file", type=Path, help="keep the call counts in this file")
    parser.add_argument(
        "--stdio",
        action="store_true",
        help="speak MCP on stdin and stdout instead (no admin routes, no wire faults)",
    )
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="JSON",
        help='a fault rule from the start, as POST /faults takes it ({"target", "kind", ...})',
    )
    args = parser.parse_args(argv)
    state = ServerState(args.counts_file)
    try:
        state.faults.extend(fault_of(json.loads(rule)) for rule in args.fault)
    except ValueError as exc:
        print(f"error: --fault: {exc}", file=sys.stderr)
        return 2
    if args.stdio:
        if any(f.kind in WIRE_FAULTS for f in state.faults):
            print("error: --fault: wire faults are for HTTP", file=sys.stderr)
            return 2
        build(state, tasks=False).run("stdio")  # until stdin ends
        return 0
    app = app_of(state)
    print(f"MCP server listening on http://{args.host}:{args.port}/mcp", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["KEY_META", "RUN_META", "MCPServerHandle", "ServerState", "build", "main", "serve"]
