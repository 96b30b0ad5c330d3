"""A hostile MCP endpoint (a tiny HTTP server in the test) against the tool executor's MCP
handling: every bad answer becomes a classified failure and the next call still works.

The handler runs on an event loop of the test's own (no broker needed: what is tested is what
the executor makes of the endpoint's bytes, over real sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentruns.connectors.dev.servers import mcp_server
from agentruns.connectors.executors.tool import ToolHandler, ToolRegistry
from agentruns.processors.events import (
    CancelConfirmed,
    CancelUnconfirmed,
    ToolCallAccepted,
    ToolCallFailed,
    ToolCallSucceeded,
    ToolCallTimedOut,
    ToolStatusReported,
)
from agentruns.processors.state import ErrorClass
from tests.support.executors import Ids

TOOL = {
    "name": "act",
    "inputSchema": {"type": "object"},
    "annotations": {"destructiveHint": True},
}
GOOD = {"content": [{"type": "text", "text": "done"}]}
TOOL_OF_TASKS = {**TOOL, "execution": {"taskSupport": "optional"}}
TASK = {
    "taskId": "t-1",
    "status": "working",
    "createdAt": "2026-12-07T01:00:00Z",
    "lastUpdatedAt": "2026-12-07T01:00:00Z",
    "ttl": 60000,
}


def task_answer(mode: str, method: str, rid: Any) -> bytes:
    """A task server's answer: a good task to a call (or one whose id is too long to keep);
    to ``tasks/get``, a task ``mode`` says (working, completed), one no task has, or an
    error; ``tasks/result`` the good result."""
    result: Any
    match method, mode:
        case "tools/call", "long_id":
            result = {"task": {**TASK, "taskId": "x" * 300}}
        case "tools/call", _:
            result = {"task": TASK}
        case "tasks/get", "garbage_status":
            result = {**TASK, "status": "sleeping"}
        case "tasks/get", "unknown_task":
            error = {"code": -32602, "message": "Failed to retrieve task: Task not found"}
            return json.dumps({"jsonrpc": "2.0", "id": rid, "error": error}).encode()
        case "tasks/get", "completed":
            result = {**TASK, "status": "completed"}
        case "tasks/get", _:
            result = TASK
        case "tasks/result", _:
            result = GOOD
        case _:
            result = {**TASK, "status": "cancelled"}
    return json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}).encode()


class Endpoint:
    """Answers initialize and tools/list properly, and tools/call as ``mode`` says."""

    def __init__(self, tasks: bool = False) -> None:
        self.mode = "good"
        # a server of tasks: it advertises them, lists its tool as one, answers every call
        # with a task and every tasks/* request as ``mode`` says
        self.tasks = tasks
        self.sessions = 0
        self.calls = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def send(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                if status == 200 and b'"protocolVersion"' in body:
                    self.send_header("Mcp-Session-Id", f"s{endpoint.sessions}")
                self.end_headers()
                # the client stops reading a body over its cap: as it must
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(body)

            def do_POST(self) -> None:
                message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                method, rid = message.get("method"), message.get("id")

                def reply(result: Any) -> bytes:
                    return json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}).encode()

                if method == "initialize":
                    endpoint.sessions += 1
                    info = {"name": "hostile", "version": "0"}
                    capabilities: dict[str, Any] = {}
                    if endpoint.tasks:
                        capabilities["tasks"] = {"requests": {"tools": {"call": {}}}}
                    result = {
                        "protocolVersion": "2025-11-25" if endpoint.tasks else "2025-06-18",
                        "capabilities": capabilities,
                        "serverInfo": info,
                    }
                    return self.send(200, reply(result))
                if "id" not in message:
                    return self.send(202, b"")
                if method == "tools/list":
                    return self.send(
                        200, reply({"tools": [TOOL_OF_TASKS if endpoint.tasks else TOOL]})
                    )
                if endpoint.tasks:
                    return self.send(200, task_answer(endpoint.mode, method, rid))
                endpoint.calls += 1
                match endpoint.mode:
                    case "good":
                        self.send(200, reply(GOOD))
                    case "malformed":
                        self.send(200, b'{"jsonrpc": "2.0", "id": ')
                    case "other_id":
                        body = json.dumps({"jsonrpc": "2.0", "id": 999, "result": GOOD})
                        self.send(200, body.encode())
                    case "huge":
                        self.send(200, b" " * (9 * 1024 * 1024))
                    case "garbage_blocks":
                        self.send(200, reply({"content": [{"type": "hologram", "x": 1}]}))
                    case "invalid_params":
                        error = {"code": -32602, "message": "order_id is required"}
                        body = json.dumps({"jsonrpc": "2.0", "id": rid, "error": error})
                        self.send(200, body.encode())
                    case "html":
                        self.send(200, b"<html>hi</html>", "text/html")
                    case "500":
                        self.send(500, b"oops", "text/plain")
                    case "session_gone":  # the server lost the session: 404 to it, once
                        endpoint.mode = "good"
                        self.send(404, b'{"jsonrpc":"2.0","id":null,"error":{"code":-32600}}')
                    case "slow":
                        time.sleep(1.0)
                        self.send(200, reply(GOOD))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/mcp"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def endpoint() -> Iterator[Endpoint]:
    server = Endpoint()
    try:
        yield server
    finally:
        server.close()


def _handler(endpoint: Endpoint, tmp: Path) -> ToolHandler:
    path = tmp / "tools.json"
    # destructive, not idempotent, but called without a person's approval: the hostile
    # answers are what is tested here, not the executor's approval check
    override = {"act": {"approval_required": False}}
    entry = {"name": "evil", "url": endpoint.url, "timeout_ms": 600, "tools": override}
    path.write_text(json.dumps({"mcp_servers": [entry]}))
    return ToolHandler(ToolRegistry.load(path))


@pytest.mark.parametrize(
    ("mode", "code"),
    [
        ("malformed", "invalid_output:not_json"),
        ("other_id", "invalid_output:wrong_id"),
        ("huge", "invalid_output:too_large"),
        ("garbage_blocks", "invalid_output:bad_result"),
        ("invalid_params", "invalid_arguments"),
        ("html", "invalid_output:content_type"),
    ],
)
def test_a_hostile_answer_is_a_classified_failure_and_the_next_call_works(
    endpoint: Endpoint, tmp_path: Path, mode: str, code: str
) -> None:
    handler = _handler(endpoint, tmp_path)
    ids = Ids(f"run-hostile-{mode}")

    async def run() -> None:
        endpoint.mode = mode
        outcome = await handler.execute(ids.call("evil__act", {"x": 1}), None, {})
        assert isinstance(outcome.event, ToolCallFailed), outcome
        assert outcome.event.error_class is ErrorClass.UNKNOWN  # the core does not resend it
        assert outcome.event.error_code == code
        endpoint.mode = "good"
        after = await handler.execute(ids.call("evil__act", {"x": 2}), None, {})
        assert isinstance(after.event, ToolCallSucceeded), after
        await handler.aclose()

    try:
        asyncio.run(run())
    finally:
        handler.close()


def test_sessions_statuses_timeouts_and_cancels(endpoint: Endpoint, tmp_path: Path) -> None:
    handler = _handler(endpoint, tmp_path)
    ids = Ids("run-hostile-sessions")

    async def call(mode: str) -> Any:
        endpoint.mode = mode
        return (await handler.execute(ids.call("evil__act", {}), None, {})).event

    async def run() -> None:
        # a lost session is opened again and the call sent once more (it never reached a tool)
        sessions, calls = endpoint.sessions, endpoint.calls
        assert isinstance(await call("good"), ToolCallSucceeded)
        assert isinstance(await call("session_gone"), ToolCallSucceeded)
        assert endpoint.sessions >= sessions + 1 and endpoint.calls == calls + 3
        # a 500 to a tool that may not be repeated: its outcome is unknown
        assert isinstance(await call("500"), ToolCallTimedOut)
        # no answer by the tool's timeout: unknown
        assert isinstance(await call("slow"), ToolCallTimedOut)
        # a cancel of a call in flight is sent to the server and stays unconfirmed
        endpoint.mode = "slow"
        running = ids.call("evil__act", {"x": "cancel me"})
        task = asyncio.get_running_loop().create_task(handler.execute(running, None, {}))
        await asyncio.sleep(0.2)
        cancel = await handler.execute(ids.cancel(running), None, {})
        assert isinstance(cancel.event, CancelUnconfirmed) and cancel.detail == "cancel: notified"
        await task
        # a cancel of a call this executor does not hold: unconfirmed
        gone = await handler.execute(ids.cancel(ids.call("evil__act", {})), None, {})
        assert isinstance(gone.event, CancelUnconfirmed) and gone.detail == "cancel: not_here"
        await handler.aclose()

    try:
        asyncio.run(run())
    finally:
        handler.close()


def test_a_cancel_before_the_call_left_is_confirmed(endpoint: Endpoint, tmp_path: Path) -> None:
    handler = _handler(endpoint, tmp_path)
    ids = Ids("run-hostile-cancel")
    endpoint.mode = "good"

    async def run() -> None:
        session = handler.mcp.session("evil")
        session.opened = False  # the next call waits for the session to open first
        lock = session._lock = asyncio.Lock()
        await lock.acquire()
        waiting = ids.call("evil__act", {})
        task = asyncio.get_running_loop().create_task(handler.execute(waiting, None, {}))
        await asyncio.sleep(0.05)
        cancel = await handler.execute(ids.cancel(waiting), None, {})
        lock.release()
        assert isinstance(cancel.event, CancelConfirmed)
        outcome = await task
        assert isinstance(outcome.event, ToolCallFailed) and outcome.event.error_code == "cancelled"
        await handler.aclose()

    calls = endpoint.calls
    try:
        asyncio.run(run())
    finally:
        handler.close()
    assert endpoint.calls == calls  # never sent


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        ("malformed", "invalid_output:not_json"),
        ("wrong_id", "invalid_output:wrong_id"),
        ("unknown_block", "invalid_output:bad_result"),
    ],
)
def test_the_example_servers_wire_faults_are_classified_and_its_session_goes_on(
    tmp_path: Path, kind: str, code: str
) -> None:
    """The SDK-built example server answering one run's call as the fault rule says (the rule
    names the run: the other run's call beside it is not touched); the next call of the same
    session succeeds."""
    with mcp_server.serve() as server:
        path = tmp_path / "tools.json"
        entry = {"name": "shop", "url": server.mcp_url, "timeout_ms": 5000}
        path.write_text(json.dumps({"mcp_servers": [entry]}))
        handler = ToolHandler(ToolRegistry.load(path))
        hostile, other = Ids(f"run-wire-{kind}"), Ids(f"run-beside-{kind}")
        rule = {"target": "lookup_order", "kind": kind, "run": hostile.run_id, "times": 1}
        httpx.post(f"{server.url}/faults", json=rule).raise_for_status()

        async def run() -> list[Any]:
            try:
                beside = await handler.execute(
                    other.call("shop__lookup_order", {"order_id": "o-1"}), None, {}
                )
                bad = await handler.execute(
                    hostile.call("shop__lookup_order", {"order_id": "o-1"}), None, {}
                )
                after = await handler.execute(
                    hostile.call("shop__lookup_order", {"order_id": "o-2"}), None, {}
                )
                return [beside.event, bad.event, after.event]
            finally:
                await handler.aclose()
                handler.close()  # on the loop: its connections are the loop's

        beside, bad, after = asyncio.run(run())
        assert isinstance(beside, ToolCallSucceeded), beside
        assert isinstance(bad, ToolCallFailed), bad
        assert (bad.error_class, bad.error_code) == (ErrorClass.UNKNOWN, code)
        assert isinstance(after, ToolCallSucceeded), after
        stats = httpx.get(f"{server.url}/stats").json()
        assert stats["faults_injected"] == {kind: 1}
        assert sum(stats["calls"].values()) == 2  # the faulted call never reached the tool


def test_a_task_servers_hostile_answers_are_classified(tmp_path: Path) -> None:
    endpoint = Endpoint(tasks=True)
    handler = _handler(endpoint, tmp_path)
    ids = Ids("run-hostile-tasks")

    async def run() -> None:
        endpoint.mode = "long_id"  # a task id too long to keep: not accepted, not kept
        call = ids.call("evil__act", {"x": 1})
        refused = (await handler.execute(call, None, {})).event
        assert isinstance(refused, ToolCallFailed), refused
        assert refused.error_code == "invalid_output:bad_task"
        assert await handler.tasks.get(call.operation.key) is None
        endpoint.mode = "working"
        call = ids.call("evil__act", {"x": 2})
        assert isinstance((await handler.execute(call, None, {})).event, ToolCallAccepted)
        polled = (await handler.execute(ids.poll(call, 1), None, {})).event
        assert isinstance(polled, ToolStatusReported) and polled.status == "running"
        endpoint.mode = "garbage_status"  # a status the protocol does not have
        garbage = (await handler.execute(ids.poll(call, 2), None, {})).event
        assert isinstance(garbage, ToolCallFailed), garbage
        assert garbage.error_code == "invalid_output:bad_task"
        endpoint.mode = "unknown_task"  # the server forgot the task: it may have run
        lost = (await handler.execute(ids.poll(call, 3), None, {})).event
        assert isinstance(lost, ToolCallFailed) and lost.error_code == "task_lost"
        assert lost.error_class is ErrorClass.UNKNOWN
        endpoint.mode = "completed"
        done = (await handler.execute(ids.poll(call, 4), None, {})).event
        assert isinstance(done, ToolCallSucceeded), done
        cancelled = (await handler.execute(ids.cancel(call), None, {})).event
        assert isinstance(cancelled, CancelConfirmed)  # the endpoint answers it cancelled
        await handler.aclose()

    try:
        asyncio.run(run())
    finally:
        handler.close()
        endpoint.close()
