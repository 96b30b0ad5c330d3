"""MCP tasks (the 2025-11-25 protocol's ``tasks`` utility) as async tools (docs/tools.md, "MCP
tasks").

A tool whose listing says ``execution.taskSupport`` ``optional`` or ``required`` is async in
the catalog; when its server's ``initialize`` answer advertises task-augmented
``tools/call`` (``capabilities.tasks.requests.tools.call``), the executor calls it with
``params.task`` and the server answers at once with a task (``CreateTaskResult``). The task
id, the server's choice, is written to Postgres by the call's operation key
(:class:`PostgresTaskStore`, table ``mcp_tasks``) before the executor answers
``ToolCallAccepted``; the run waits (``WAITING_TOOL``) and the core's poll timers send
``PollTool``, which any executor (one restarted since, on a new session) answers with
``tasks/get`` and, once the task ended, ``tasks/result``. ``CancelTool`` sends
``tasks/cancel``. Nothing here does the protocol's I/O: the session is
:class:`agentruns.connectors.executors.mcp_client.MCPSession`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from mcp_types import CreateTaskResult, GetTaskResult
from pydantic import ValidationError

from agentruns.connectors.executors.base import ExecutorError
from agentruns.connectors.postgres.bulk import Conn, RetryingConnection

#: how long the executor asks a server to keep a task (a run's tool wait is shorter)
TASK_TTL_MS = 24 * 3_600_000
MAX_TASK_ID = 256
#: a server's ``pollInterval`` taken within these bounds (the run's policy polls after that)
MIN_POLL_MS, MAX_POLL_MS = 100, 60_000
#: the task is over; ``tasks/result`` has its answer
ENDED = frozenset({"completed", "failed"})


@dataclass(frozen=True)
class TaskRef:
    """The task an operation's call started: its server (registry name) and its id."""

    server: str
    task_id: str


class TaskStore(Protocol):
    """Where the executor keeps the task of each operation (by operation key)."""

    async def put(self, op_key: str, ref: TaskRef) -> None: ...

    async def get(self, op_key: str) -> TaskRef | None: ...

    def close(self) -> None: ...


class MemoryTaskStore:
    """The tasks of one process (tests, and an executor without Postgres): lost with it."""

    def __init__(self) -> None:
        self._refs: dict[str, TaskRef] = {}

    async def put(self, op_key: str, ref: TaskRef) -> None:
        self._refs.setdefault(op_key, ref)

    async def get(self, op_key: str) -> TaskRef | None:
        return self._refs.get(op_key)

    def close(self) -> None:
        pass


class PostgresTaskStore:
    """The table ``mcp_tasks`` (migration 0014): one row per operation, the first task
    written kept. One connection, used from a worker thread (the event loop never waits on
    Postgres), one statement at a time."""

    def __init__(self, database_url: str) -> None:
        self._db = RetryingConnection(database_url, ExecutorError)
        self._lock = threading.Lock()

    def _put(self, op_key: str, ref: TaskRef) -> None:
        def write(conn: Conn) -> None:
            conn.execute(
                "INSERT INTO mcp_tasks (operation_key, server, task_id) VALUES (%s, %s, %s)"
                " ON CONFLICT (operation_key) DO NOTHING",
                (op_key, ref.server, ref.task_id),
            )

        with self._lock:
            self._db.run("recording an MCP task", write)

    def _get(self, op_key: str) -> TaskRef | None:
        def read(conn: Conn) -> TaskRef | None:
            row = conn.execute(
                "SELECT server, task_id FROM mcp_tasks WHERE operation_key = %s", (op_key,)
            ).fetchone()
            return None if row is None else TaskRef(str(row[0]), str(row[1]))

        with self._lock:
            found: TaskRef | None = self._db.run("reading an MCP task", read)
        return found

    async def put(self, op_key: str, ref: TaskRef) -> None:
        await asyncio.to_thread(self._put, op_key, ref)

    async def get(self, op_key: str) -> TaskRef | None:
        return await asyncio.to_thread(self._get, op_key)

    def close(self) -> None:
        self._db.close()


def supports_tasks(capabilities: Any) -> bool:
    """Whether an ``initialize`` answer's capabilities allow task-augmented ``tools/call``."""
    node: Any = capabilities
    for name in ("tasks", "requests", "tools", "call"):
        if not isinstance(node, Mapping) or name not in node:
            return False
        node = node[name]
    return isinstance(node, Mapping)


def task_support(tool: Mapping[str, Any]) -> bool:
    """Whether a listed tool may be called as a task (``execution.taskSupport``)."""
    execution = tool.get("execution")
    if not isinstance(execution, Mapping):
        return False
    return execution.get("taskSupport") in ("optional", "required")


def created_task(result: Mapping[str, Any]) -> tuple[str, int | None] | str:
    """A ``tools/call`` answer that is a task: (task id, poll after ms); else why it is not
    a valid one (a str)."""
    try:
        created = CreateTaskResult.model_validate(result, by_name=False)
    except ValidationError as exc:
        return f"bad_task: {exc.errors()[0].get('msg', '')}"[:200]
    task = created.task
    if not task.task_id or len(task.task_id) > MAX_TASK_ID:
        return "bad_task: task id empty or too long"
    poll = task.poll_interval
    return task.task_id, None if poll is None else min(max(poll, MIN_POLL_MS), MAX_POLL_MS)


def task_status(result: Mapping[str, Any]) -> tuple[str, str] | None:
    """A ``tasks/get`` answer: (status, status message), or None when it is not one."""
    try:
        task = GetTaskResult.model_validate(result, by_name=False)
    except ValidationError:
        return None
    return task.status, task.status_message or ""


__all__ = [
    "ENDED",
    "TASK_TTL_MS",
    "MemoryTaskStore",
    "PostgresTaskStore",
    "TaskRef",
    "TaskStore",
    "created_task",
    "supports_tasks",
    "task_status",
    "task_support",
]
