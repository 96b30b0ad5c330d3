"""MCP tool servers through the tool executor, against the example MCP server as a process,
the real broker and the real Postgres (docs/tools.md).

The tests play the processor: they produce Effect records to ``effects.tool`` and read the
Input records the executor commits to the inbox.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from agentruns.connectors.catalog import catalog_of, catalog_rows
from agentruns.connectors.executors.model import ModelHandler, RouteConfig, Routes
from agentruns.connectors.executors.tool import ToolExecutor, ToolHandler, ToolRegistry, tools_of
from agentruns.processors.catalog import catalog_problem
from agentruns.processors.events import (
    ReconcileCompleted,
    ReconcileOutcome,
    ToolCallFailed,
    ToolCallSucceeded,
    ToolCallTimedOut,
)
from agentruns.processors.state import ErrorClass, Policy, ToolSpec
from tests.support.executors import Harness, ids_for, make_harness
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
#: A call of a tool under approval that a person approved (refund_order).
APPROVED_WRITE: dict[str, Any] = {"policy_decision": "approved", "permission": "write"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """The example MCP server as a process; restarted on the same port and counts file."""

    def __init__(self, tmp: Path) -> None:
        self.port = _free_port()
        self.counts = tmp / "counts.txt"
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=5.0)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [
            sys.executable, "-m", "agentruns.connectors.dev.servers.mcp_server",
            "--port", str(self.port), "--counts-file", str(self.counts),
        ]  # fmt: skip
        self.process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL)

        def up() -> bool:
            try:
                return self.http.get("/stats").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 30, "the MCP server")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(10)

    def fault(self, **rule: Any) -> None:
        self.http.post("/faults", json=rule).raise_for_status()

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self.http.get("/stats").json()
        return result


@dataclass
class MCPEnv:
    harness: Harness
    server: ServerProcess
    registry: Path


def _registry(tmp: Path, url: str) -> Path:
    path = tmp / "mcp-tools.json"
    entry = {"name": "shop", "url": f"{url}/mcp", "timeout_ms": 1500}
    path.write_text(json.dumps({"version": "mcp-test", "mcp_servers": [entry]}))
    return path


@pytest.fixture(scope="module")
def mcp_env(
    kafka_bootstrap: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MCPEnv]:
    tmp = tmp_path_factory.mktemp("mcp")
    server = ServerProcess(tmp)
    server.start()
    registry = _registry(tmp, server.url)
    prefix = f"t-mcp-exec-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    harness = make_harness(kafka_bootstrap, database_url, prefix, "tool")
    harness.start(ToolExecutor(harness.config("tool"), registry))
    try:
        yield MCPEnv(harness, server, registry)
    finally:
        harness.close()
        server.stop()
        server.http.close()


@pytest.fixture
def env(mcp_env: MCPEnv) -> MCPEnv:
    if mcp_env.server.process is None or mcp_env.server.process.poll() is not None:
        mcp_env.server.start()
    mcp_env.server.http.delete("/faults").raise_for_status()
    return mcp_env


# --------------------------------------------------------------------------- tests


def test_discovery_names_the_tools_and_reads_their_annotations(env: MCPEnv) -> None:
    handler = ToolHandler(ToolRegistry.load(env.registry))
    try:
        tools = handler.tools()
    finally:
        handler.close()
    assert {"shop__lookup_order", "shop__refund_order", "shop__set_order_note"} <= set(tools)
    lookup, refund, note = (
        tools[f"shop__{n}"] for n in ("lookup_order", "refund_order", "set_order_note")
    )
    assert (lookup.permission, lookup.idempotent, lookup.approval_required) == ("read", True, False)
    assert (refund.permission, refund.idempotent, refund.approval_required) == (
        "write",
        False,
        True,
    )
    assert (note.permission, note.idempotent, note.approval_required) == ("write", True, False)
    assert refund.backend == "mcp" and refund.mcp_tool == "refund_order"
    assert refund.parameters["required"] == ["order_id", "amount_cents"]
    assert refund.timeout_ms == 1500


def test_the_catalog_holds_the_listed_tools_and_refuses_a_task_that_widens_one(
    env: MCPEnv,
) -> None:
    registry = ToolRegistry.load(env.registry)
    catalog = catalog_of(registry)
    refund = catalog.tools["shop__refund_order"]
    assert (refund.permission, refund.approval_required, refund.idempotent) == (
        "write",
        True,
        False,
    )
    spec = ToolSpec(
        name="shop__refund_order",
        parameters=dict(refund.parameters),
        permission="read",  # narrower than the tool does: refused
        idempotent=False,
    )
    problem = catalog_problem((spec,), Policy(approval_required=("write",)), catalog)
    assert problem is not None and "shop__refund_order: permission read" in problem
    honest = msgspec.structs.replace(spec, permission="write")
    assert catalog_problem((honest,), Policy(approval_required=("write",)), catalog) is None
    rows = {r["name"]: r for r in catalog_rows(tools_of(registry), catalog)}
    assert rows["shop__refund_order"]["backend"] == "mcp shop refund_order"


def test_the_model_is_offered_an_mcp_tool_with_its_description(
    env: MCPEnv, database_url: str
) -> None:
    routes = Routes({}, RouteConfig(base_url="http://127.0.0.1:9/v1"))
    handler = ModelHandler(database_url, routes, ToolRegistry.load(env.registry))
    try:
        described = handler.described["shop__lookup_order"].description
    finally:
        handler.close()
    assert "read-only" in described


def test_a_call_end_to_end_executes_once_with_its_key_in_meta(
    env: MCPEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    # refund_order is under approval: a call without a person's approval is not made
    unapproved = ids.call("shop__refund_order", {"order_id": "o-0", "amount_cents": 1})
    env.harness.effects.send(unapproved)
    refused = env.harness.inbox.typed(unapproved, ToolCallFailed)
    assert refused.error_class is ErrorClass.PERMISSION_DENIED
    assert refused.error_code == "not_approved"
    assert unapproved.operation.key not in env.server.stats()["calls"]
    call = ids.call(
        "shop__refund_order", {"order_id": "o-1", "amount_cents": 1200}, **APPROVED_WRITE
    )
    env.harness.effects.send(call)
    event = env.harness.inbox.typed(call, ToolCallSucceeded)
    result = env.harness.artifact(event.result_ref)
    assert result["tool"] == "shop__refund_order" and result["status"] == "succeeded"
    assert result["output"]["result"].startswith("refunded 1200 cents on o-1")
    assert env.harness.record(call.idempotency_key)[:3] == ("completed", 1, "ToolCallSucceeded")
    stats = env.server.stats()
    assert stats["executions"][call.operation.key] == 1 and stats["calls"][call.operation.key] == 1
    read = ids.call("shop__lookup_order", {"order_id": "o-1"})
    env.harness.effects.send(read)
    output = env.harness.artifact(env.harness.inbox.typed(read, ToolCallSucceeded).result_ref)
    assert output["output"] == {"order_id": "o-1", "status": "delivered", "amount_cents": 4200}


def test_is_error_huge_content_and_bad_arguments_are_classified(
    env: MCPEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    env.server.fault(target="lookup_order", kind="error")
    failed = ids.call("shop__lookup_order", {"order_id": "o-2"})
    env.harness.effects.send(failed)
    event = env.harness.inbox.typed(failed, ToolCallFailed)
    assert (event.error_class, event.error_code) == (ErrorClass.UNKNOWN, "tool_error")
    assert "lookup_order failed (injected)" in event.message
    env.server.fault(target="lookup_order", kind="huge", size=100_000)
    large = ids.call("shop__lookup_order", {"order_id": "o-3"})
    env.harness.effects.send(large)
    summarized = env.harness.inbox.typed(large, ToolCallSucceeded)
    assert summarized.summary is not None and summarized.result_bytes > 100_000
    env.server.fault(target="lookup_order", kind="huge", size=9 * 1024 * 1024)
    too_large = ids.call("shop__lookup_order", {"order_id": "o-4"})
    env.harness.effects.send(too_large)
    event = env.harness.inbox.typed(too_large, ToolCallFailed)
    assert event.error_code == "invalid_output:too_large"
    not_object = ids.call("shop__lookup_order", {"order_id": "o-5"})
    operation = msgspec.structs.replace(not_object.operation, arguments_json="[1, 2]")
    not_object = msgspec.structs.replace(not_object, operation=operation)
    env.harness.effects.send(not_object)
    event = env.harness.inbox.typed(not_object, ToolCallFailed)
    assert event.error_code == "invalid_arguments_json"
    unknown = ids.call("shop__no_such_tool", {})
    env.harness.effects.send(unknown)
    assert env.harness.inbox.typed(unknown, ToolCallFailed).error_code == "unknown_tool"


def test_server_killed_mid_call_is_an_unknown_outcome_never_called_again(
    env: MCPEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    env.server.fault(target="refund_order", kind="crash")
    call = ids.call("shop__refund_order", {"order_id": "o-6", "amount_cents": 5}, **APPROVED_WRITE)
    env.harness.effects.send(call)
    env.harness.inbox.typed(call, ToolCallTimedOut)
    assert env.server.process is not None and env.server.process.wait(10) == 17
    env.server.start()  # the same counts: the call reached the tool, nothing executed after
    reconcile = ids.reconcile(call)
    env.harness.effects.send(reconcile)
    outcome = env.harness.inbox.typed(reconcile, ReconcileCompleted).outcome
    assert outcome is ReconcileOutcome.UNDETERMINABLE  # not idempotent: a person decides
    # the executor's session died with the server: the next call opens a new one (404)
    after = ids.call("shop__refund_order", {"order_id": "o-7", "amount_cents": 5}, **APPROVED_WRITE)
    env.harness.effects.send(after)
    env.harness.inbox.typed(after, ToolCallSucceeded)
    stats = env.server.stats()
    assert stats["calls"][call.operation.key] == 1  # never a second call
    assert call.operation.key not in stats["executions"]
    # an idempotent tool's unknown outcome may be sent again
    note = ids.call("shop__set_order_note", {"order_id": "o-7", "note": "n"})
    reconcile = ids.reconcile(note)
    env.harness.effects.send(reconcile)
    outcome = env.harness.inbox.typed(reconcile, ReconcileCompleted).outcome
    assert outcome is ReconcileOutcome.NOT_EXECUTED


def test_a_changed_tool_list_is_listed_again(env: MCPEnv, request: pytest.FixtureRequest) -> None:
    ids = ids_for(request)
    env.server.fault(target="lookup_order", kind="tools_changed")
    first = ids.call("shop__lookup_order", {"order_id": "o-8"})
    env.harness.effects.send(first)
    env.harness.inbox.typed(first, ToolCallSucceeded)
    added = ids.call("shop__archive_order", {"order_id": "o-8"}, **APPROVED_WRITE)
    env.harness.effects.send(added)  # unlisted when sent: its server's tools are listed again
    output = env.harness.artifact(env.harness.inbox.typed(added, ToolCallSucceeded).result_ref)
    assert output["output"] == {"result": "archived o-8"}


def test_kill_9_of_the_executor_mid_calls_executes_no_key_twice(
    env: MCPEnv, request: pytest.FixtureRequest
) -> None:
    ids = ids_for(request)
    calls = [
        ids.call("shop__refund_order", {"order_id": f"o-{i}", "amount_cents": i}, **APPROVED_WRITE)
        for i in range(20)
    ]
    keys = [c.operation.key for c in calls]
    env.server.fault(target="refund_order", kind="slow", delay_ms=400, times=None)
    command = env.harness.tool_executor_command(env.registry, "k9mcp", workers=8, max_batch=8)
    env.harness.stop_executor()  # the subprocesses take over the executor group
    try:
        first = subprocess.Popen(command, cwd=REPO)
        env.harness.effects.send(*calls)

        def reached() -> int:
            return sum(env.server.stats()["calls"].get(k, 0) for k in keys)

        wait_for(lambda: reached() >= 4, 60, "calls in flight")
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        second = subprocess.Popen(command, cwd=REPO)
        try:
            events = [env.harness.inbox.event(call, timeout=60) for call in calls]
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
    finally:
        env.server.http.delete("/faults")
        env.harness.start(ToolExecutor(env.harness.config("tool"), env.registry))
    stats = env.server.stats()
    for call, event in zip(calls, events, strict=True):
        key = call.operation.key
        assert stats["calls"].get(key, 0) <= 1, key  # never a blind second call
        assert stats["executions"].get(key, 0) <= 1, key
        assert isinstance(event, ToolCallSucceeded | ToolCallTimedOut), event
        if isinstance(event, ToolCallSucceeded):
            assert stats["executions"][key] == 1
    # the kill landed mid-call: those calls' outcome is unknown, for the core to reconcile
    assert any(isinstance(e, ToolCallTimedOut) for e in events)
