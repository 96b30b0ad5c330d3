"""The pure part of MCP tasks as async tools: which tools and servers take task-augmented
calls, and what a server's task answers are taken for (hostile ones included)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentruns.connectors.executors.mcp_tasks import (
    MAX_POLL_MS,
    MIN_POLL_MS,
    MemoryTaskStore,
    TaskRef,
    created_task,
    supports_tasks,
    task_status,
    task_support,
)

TASK = {
    "taskId": "t-1",
    "status": "working",
    "createdAt": "2026-12-07T01:00:00Z",
    "lastUpdatedAt": "2026-12-07T01:00:00Z",
    "ttl": 60000,
}


@pytest.mark.parametrize(
    ("capabilities", "expected"),
    [
        ({"tasks": {"requests": {"tools": {"call": {}}}}}, True),
        ({"tasks": {"requests": {"tools": {}}}}, False),
        ({"tasks": {"cancel": {}}}, False),
        ({"tasks": {"requests": {"tools": {"call": True}}}}, False),  # not the protocol's shape
        ({}, False),
        (None, False),
        ("tasks", False),
    ],
)
def test_a_server_takes_task_calls_only_when_it_advertises_them(
    capabilities: Any, expected: bool
) -> None:
    assert supports_tasks(capabilities) is expected


@pytest.mark.parametrize(
    ("tool", "expected"),
    [
        ({"execution": {"taskSupport": "optional"}}, True),
        ({"execution": {"taskSupport": "required"}}, True),
        ({"execution": {"taskSupport": "forbidden"}}, False),
        ({"execution": {}}, False),
        ({"execution": "optional"}, False),
        ({}, False),
    ],
)
def test_a_tool_is_async_when_it_lists_task_support(tool: dict[str, Any], expected: bool) -> None:
    assert task_support(tool) is expected


def test_a_created_task_gives_its_id_and_a_bounded_poll_interval() -> None:
    assert created_task({"task": TASK}) == ("t-1", None)
    assert created_task({"task": {**TASK, "pollInterval": 1}}) == ("t-1", MIN_POLL_MS)
    assert created_task({"task": {**TASK, "pollInterval": 10**9}}) == ("t-1", MAX_POLL_MS)
    assert created_task({"task": {**TASK, "pollInterval": 500}}) == ("t-1", 500)


@pytest.mark.parametrize(
    "result",
    [
        {"task": {**TASK, "taskId": "x" * 257}},  # an id too long to keep
        {"task": {**TASK, "taskId": ""}},
        {"task": {**TASK, "status": "sleeping"}},  # a status the protocol does not have
        {"task": {"taskId": "t-1"}},  # no status, no timestamps
        {"task": "t-1"},
        {"task": None},
    ],
)
def test_a_malformed_task_is_refused_with_a_reason(result: dict[str, Any]) -> None:
    problem = created_task(result)
    assert isinstance(problem, str) and problem.startswith("bad_task")


def test_a_task_status_is_read_or_refused() -> None:
    assert task_status(TASK) == ("working", "")
    message = {**TASK, "status": "cancelled", "statusMessage": "stopped"}
    assert task_status(message) == ("cancelled", "stopped")
    assert task_status({**TASK, "status": "done"}) is None
    assert task_status({"content": []}) is None


def test_the_memory_store_keeps_the_first_task_of_an_operation() -> None:
    async def scenario() -> tuple[TaskRef | None, TaskRef | None]:
        store = MemoryTaskStore()
        await store.put("op-1", TaskRef("shop", "t-1"))
        await store.put("op-1", TaskRef("shop", "t-2"))
        return await store.get("op-1"), await store.get("op-2")

    assert asyncio.run(scenario()) == (TaskRef("shop", "t-1"), None)
