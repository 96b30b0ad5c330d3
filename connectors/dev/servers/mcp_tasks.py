"""MCP tasks (the 2025-11-25 protocol's ``tasks`` utility) for the example MCP server: a
``tools/call`` of a tool in ``TASK_TOOLS`` that carries ``params.task`` returns a task at once
(``CreateTaskResult``) and the tool runs in the background; ``tasks/get``, ``tasks/result``
and ``tasks/cancel`` answer for it. The MCP SDK has the protocol's task types but no server
side for them, so these requests are answered before the SDK's app (the server's middleware,
:class:`agentruns.connectors.dev.servers.mcp_server.WireFaults`); a call without
``params.task`` goes to the SDK as any other.

Tasks are the server's, not a session's: a client that opened a new session (an executor that
restarted) polls the task it was given before. A second task-augmented call with the same
idempotency key (``_meta["agentruns/idempotency_key"]``) returns the task of the first; the
tool is executed once per key (counted like the other tools' executions). At most
``MAX_TASKS`` tasks are kept, each for its ``ttl`` (at most ``MAX_TTL_MS``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

#: the tools a call may run as a task
TASK_TOOLS = frozenset({"export_orders"})
MAX_TASKS = 1000
MAX_TTL_MS = 3_600_000
DEFAULT_TTL_MS = 600_000
POLL_INTERVAL_MS = 300
MAX_DURATION_MS = 60_000
RESULT_WAIT_S = 30.0
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
RELATED_TASK = "io.modelcontextprotocol/related-task"


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


@dataclass
class TaskRun:
    """One task: its status, what it answers when done, and the work in the background."""

    task_id: str
    key: str
    ttl_ms: int
    status: str = "working"
    status_message: str | None = None
    created_at: str = field(default_factory=_now)
    updated_at: str = field(default_factory=_now)
    result: dict[str, Any] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    work: asyncio.Task[None] | None = None

    def wire(self) -> dict[str, Any]:
        task: dict[str, Any] = {
            "taskId": self.task_id,
            "status": self.status,
            "createdAt": self.created_at,
            "lastUpdatedAt": self.updated_at,
            "ttl": self.ttl_ms,
            "pollInterval": POLL_INTERVAL_MS,
        }
        if self.status_message is not None:
            task["statusMessage"] = self.status_message
        return task

    def finish(self, status: str, result: dict[str, Any] | None, message: str | None) -> None:
        if self.status != "working":
            return
        self.status, self.result, self.status_message = status, result, message
        self.updated_at = _now()
        self.done.set()


class TaskBoard:
    """The server's tasks (its event loop only). ``count(what, key)``: the server's call and
    execution counters."""

    def __init__(self, count: Callable[[str, str], None]) -> None:
        self.count = count
        self.tasks: dict[str, TaskRun] = {}
        self.by_key: dict[str, str] = {}

    def create(self, tool: str, arguments: dict[str, Any], key: str, ttl: Any) -> TaskRun | str:
        """The task of a call (the same key: the same task), or why none was made."""
        self.count("call", key)
        known = self.by_key.get(key) if key else None
        if known is not None and known in self.tasks:
            return self.tasks[known]
        if len(self.tasks) >= MAX_TASKS:
            return "too many tasks"
        ttl_ms = ttl if isinstance(ttl, int) and 0 < ttl <= MAX_TTL_MS else DEFAULT_TTL_MS
        run = TaskRun(task_id=uuid.uuid4().hex, key=key, ttl_ms=ttl_ms)
        self.tasks[run.task_id] = run
        if key:
            self.by_key[key] = run.task_id
        run.work = asyncio.get_running_loop().create_task(self._run(tool, arguments, run))
        return run

    async def _run(self, tool: str, arguments: dict[str, Any], run: TaskRun) -> None:
        """``export_orders``: works ``duration_ms`` (2 s), then counts its execution."""
        duration = arguments.get("duration_ms", 2000)
        if isinstance(duration, bool) or not isinstance(duration, int):
            duration = 2000
        try:
            await asyncio.sleep(min(max(duration, 0), MAX_DURATION_MS) / 1000)
        except asyncio.CancelledError:
            run.finish("cancelled", None, "cancelled by the client")
            raise
        self.count("execution", run.key)
        digest = hashlib.sha256(run.key.encode()).hexdigest()[:10]
        text = f"exported the orders since {arguments.get('since', '')} (export E-{digest})"
        result = {"content": [{"type": "text", "text": text}], "isError": False}
        run.finish("completed", result, None)
        asyncio.get_running_loop().call_later(run.ttl_ms / 1000, self._forget, run)

    def _forget(self, run: TaskRun) -> None:
        self.tasks.pop(run.task_id, None)
        if self.by_key.get(run.key) == run.task_id:
            del self.by_key[run.key]

    async def answer_body(self, body: bytes) -> bytes | None:
        """The answer to a request's body when it is a task request, else None."""
        try:
            message = json.loads(body)
        except ValueError:
            return None
        if not isinstance(message, dict) or "id" not in message:
            return None
        answer = await self.answer(message)
        return None if answer is None else json.dumps(answer).encode()

    async def answer(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """The JSON-RPC answer to a task request, or None: not one of ours (the SDK's)."""
        method, params = message.get("method"), message.get("params")
        params = params if isinstance(params, dict) else {}
        request_id = message.get("id")
        if method == "tools/call":
            tool, task = params.get("name"), params.get("task")
            if tool not in TASK_TOOLS or not isinstance(task, dict):
                return None
            arguments = params.get("arguments")
            meta = params.get("_meta")
            key = meta.get("agentruns/idempotency_key") if isinstance(meta, dict) else None
            made = self.create(
                str(tool),
                arguments if isinstance(arguments, dict) else {},
                key if isinstance(key, str) else "",
                task.get("ttl"),
            )
            if isinstance(made, str):
                return _error(request_id, INTERNAL_ERROR, made)
            return _result(request_id, {"task": made.wire()})
        if method not in ("tasks/get", "tasks/result", "tasks/cancel"):
            return None
        run = self.tasks.get(str(params.get("taskId")))
        if run is None:
            return _error(request_id, INVALID_PARAMS, "Failed to retrieve task: Task not found")
        match method:
            case "tasks/get":
                return _result(request_id, run.wire())
            case "tasks/cancel":
                if run.status != "working":
                    return _error(
                        request_id, INVALID_PARAMS, f"Cannot cancel task: already {run.status}"
                    )
                if run.work is not None:
                    run.work.cancel()
                run.finish("cancelled", None, "cancelled by the client")
                return _result(request_id, run.wire())
            case _:  # tasks/result: waits for the task to end, as the protocol says
                try:
                    await asyncio.wait_for(run.done.wait(), RESULT_WAIT_S)
                except TimeoutError:
                    return _error(request_id, INTERNAL_ERROR, "task still working")
                if run.result is None:
                    return _error(request_id, INTERNAL_ERROR, f"task {run.status}")
                meta = {RELATED_TASK: {"taskId": run.task_id}}
                return _result(request_id, {**run.result, "_meta": meta})


def _result(request_id: Any, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def _error(request_id: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}


__all__ = ["TASK_TOOLS", "TaskBoard"]
