"""MCP tasks as async tools, end to end: the processor, the timer service, the API, a scripted
model and the real tool executor as a process against the example MCP server as a process.
A call of ``export_orders`` (``execution.taskSupport`` optional) starts a task, the run waits
(``WAITING_TOOL``) while the core's poll timers ask the task's state, and the task's result is
the tool's; the tool executor killed with SIGKILL while the task runs, and started again, polls
the same task (its id is kept in Postgres by the operation key) and the run ends with the one
execution; a run cancelled while its task runs cancels the task (``tasks/cancel``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentruns.connectors.catalog import configured_catalog
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.connectors.runtime.timers import TimerService
from agentruns.processors.ids import run_id_for_key
from tests.integration.test_catalog_refresh import CallingDouble
from tests.integration.test_mcp_tools import REPO, ServerProcess
from tests.support.api import Stack, pipeline
from tests.support.pipeline import running_on_thread
from tests.support.waiting import wait_for

EXPORT = "shop__export_orders"
POLICY = {"poll_interval_ms": 300}


@dataclass
class TasksEnv:
    stack: Stack
    double: CallingDouble
    server: ServerProcess
    registry: Path
    executor: subprocess.Popen[bytes] | None = None

    def start_executor(self, instance: str) -> None:
        command = [
            sys.executable, "-m", "agentruns.connectors.executors.tool",
            "--bootstrap", self.stack.bootstrap, "--database-url", self.stack.database_url,
            "--prefix", self.stack.prefix, "--instance", instance,
            "--registry", str(self.registry), "--workers", "4", "--max-batch", "8",
        ]  # fmt: skip
        self.executor = subprocess.Popen(command, cwd=REPO)

    def kill_executor(self) -> None:
        assert self.executor is not None
        os.kill(self.executor.pid, signal.SIGKILL)
        self.executor.wait(10)

    def stop_executor(self) -> None:
        if self.executor is not None and self.executor.poll() is None:
            self.executor.send_signal(signal.SIGTERM)
            self.executor.wait(30)

    def submit(self, duration_ms: int, *, cancellable: bool = False) -> str:
        """A run whose first model call calls export_orders (``cancellable``: the task says
        its calls may be cancelled, as R24 asks of a tool a cancel is sent to)."""
        key = f"task-{uuid.uuid4().hex}"
        run_id = run_id_for_key(key)
        arguments = {"since": "2026-01-01", "duration_ms": duration_ms}
        self.double.calls[run_id] = (EXPORT, arguments)
        tools = [{"name": EXPORT, "cancellable": cancellable}]
        assert self.stack.submit(key, tools=tools, policy=POLICY) == run_id
        return run_id

    def events(self, run_id: str) -> list[dict[str, Any]]:
        """The run's events as the API lists them (none before the run is projected)."""
        r = self.stack.http.get(f"/runs/{run_id}/events")
        if r.status_code == 404:
            return []
        assert r.status_code == 200, r.text
        events: list[dict[str, Any]] = r.json()["events"]
        for event in events:
            if isinstance(event["payload"], str):
                event["payload"] = json.loads(event["payload"])
        return events

    def operation_key(self, run_id: str) -> str:
        def accepted() -> str | None:
            for event in self.events(run_id):
                if event["type"] == "ToolCallAccepted":
                    return str(event["payload"]["operation_key"])
            return None

        return wait_for(accepted, 30, f"{run_id}'s call accepted")


@pytest.fixture(scope="module")
def tasks_env(
    kafka_bootstrap: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TasksEnv]:
    tmp = tmp_path_factory.mktemp("mcptasks")
    server = ServerProcess(tmp)
    server.start()
    registry = tmp / "registry.json"
    entry = {"name": "shop", "url": f"{server.url}/mcp", "timeout_ms": 3000}
    registry.write_text(json.dumps({"version": "tasks-1", "mcp_servers": [entry]}))
    catalog = configured_catalog(registry, component="test")
    assert catalog is not None and catalog.tools[EXPORT].is_async  # listed taskSupport
    doubles: list[CallingDouble] = []

    def make_double(bootstrap: str, prefix: str) -> CallingDouble:
        doubles.append(CallingDouble(bootstrap, prefix))
        return doubles[0]

    try:
        with pipeline(
            kafka_bootstrap, database_url, catalog=catalog, make_double=make_double
        ) as stack:
            timers = TimerService(kafka_bootstrap, database_url, prefix=stack.prefix)
            env = TasksEnv(stack, doubles[0], server, registry)
            with running_on_thread(timers.run, "timers"):
                env.start_executor("tasks-1")
                try:
                    yield env
                finally:
                    env.stop_executor()
    finally:
        server.stop()
        server.http.close()


def test_a_run_calling_a_task_tool_waits_for_the_task_and_succeeds(tasks_env: TasksEnv) -> None:
    env = tasks_env
    run_id = env.submit(duration_ms=3000)
    op_key = env.operation_key(run_id)
    assert env.stack.wait_status(run_id, "WAITING_TOOL")["status"] == "WAITING_TOOL"
    run = env.stack.wait_status(run_id, "SUCCEEDED", "FAILED", timeout=60)
    assert run["status"] == "SUCCEEDED", run
    types = [e["type"] for e in env.events(run_id)]
    assert "ToolCallAccepted" in types and "ToolCallSucceeded" in types
    assert "ToolStatusReported" in types  # polled while the task worked
    stats = env.server.stats()
    assert stats["calls"][op_key] == 1 and stats["executions"][op_key] == 1


def test_the_executor_killed_while_the_task_runs_completes_the_run_once(
    tasks_env: TasksEnv,
) -> None:
    env = tasks_env
    run_id = env.submit(duration_ms=5000)
    op_key = env.operation_key(run_id)  # the task started, its id in Postgres
    assert env.server.stats()["executions"].get(op_key, 0) == 0  # still working
    env.kill_executor()
    env.start_executor("tasks-2")
    run = env.stack.wait_status(run_id, "SUCCEEDED", "FAILED", timeout=90)
    assert run["status"] == "SUCCEEDED", run
    stats = env.server.stats()
    assert stats["calls"][op_key] == 1 and stats["executions"][op_key] == 1
    (succeeded,) = [e for e in env.events(run_id) if e["type"] == "ToolCallSucceeded"]
    store = PostgresArtifactStore(env.stack.database_url)
    try:  # the export the task made is the tool's result
        result = json.loads(store.get(succeeded["payload"]["result_ref"]) or "{}")
    finally:
        store.close()
    assert result["tool"] == EXPORT
    assert "exported the orders since 2026-01-01" in json.dumps(result["output"])


def test_a_run_cancelled_while_its_task_runs_cancels_the_task(tasks_env: TasksEnv) -> None:
    env = tasks_env
    run_id = env.submit(duration_ms=20_000, cancellable=True)
    op_key = env.operation_key(run_id)
    before = env.server.stats()["tasks"].get("cancelled", 0)
    r = env.stack.http.post(f"/runs/{run_id}/cancel", json={"reason": "not needed"})
    assert r.status_code in (200, 202), r.text
    run = env.stack.wait_status(run_id, "CANCELLED", timeout=60)
    assert run["status"] == "CANCELLED"
    wait_for(
        lambda: env.server.stats()["tasks"].get("cancelled", 0) == before + 1,
        30,
        "the task cancelled at the server",
    )
    assert env.server.stats()["executions"].get(op_key, 0) == 0
    types = [e["type"] for e in env.events(run_id)]
    assert "CancelConfirmed" in types, types
