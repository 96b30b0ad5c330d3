"""stdio MCP servers: the example MCP server (the SDK's server) as a process the tool executor
starts, spoken to over its stdin and stdout (docs/tools.md). One test end to end through the
executor, the real broker and Postgres; the others on the tool handler alone (what the
executor makes of the process: restarts, limits, a start that never answers)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentruns.connectors.executors.base import Outcome
from agentruns.connectors.executors.mcp_stdio import StdioWire
from agentruns.connectors.executors.tool import ToolExecutor, ToolHandler, ToolRegistry
from agentruns.processors.events import ToolCallFailed, ToolCallSucceeded, ToolCallTimedOut
from agentruns.processors.state import ErrorClass
from tests.support.executors import Ids, ids_for, make_harness

REPO = Path(__file__).resolve().parents[2]


def _entry(tmp: Path, *faults: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """The example server over stdio, its counts in ``tmp``, its faults from the start."""
    args = ["-m", "agentruns.connectors.dev.servers.mcp_server", "--stdio"]
    args += ["--counts-file", str(tmp / "counts.txt")]
    for fault in faults:
        args += ["--fault", json.dumps(fault)]
    # the child has the executor's PATH, HOME... and these alone: where this checkout is
    env = {k: os.environ[k] for k in ("PYTHONPATH", "PYTHONSAFEPATH") if k in os.environ}
    return {
        "name": "local",
        "command": sys.executable,
        "args": args,
        "env": env,
        "timeout_ms": 10_000,
        **fields,
    }


#: Calls a person approved, as the run declared them: the stdio transport is what is tested
#: here, not the executor's approval check (refund_order and act are under approval).
APPROVED: dict[str, Any] = {"policy_decision": "approved", "permission": "write"}


def _registry(tmp: Path, entry: dict[str, Any]) -> Path:
    path = tmp / "stdio-tools.json"
    path.write_text(json.dumps({"version": "stdio-test", "mcp_servers": [entry]}))
    return path


def _counts(tmp: Path) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {"call": {}, "execution": {}}
    path = tmp / "counts.txt"
    for line in path.read_text().splitlines() if path.exists() else ():
        what, _, key = line.partition(" ")
        counts[what][key] = counts[what].get(key, 0) + 1
    return counts


def _outcomes(
    handler: ToolHandler, ids: Ids, *calls: tuple[str, dict[str, Any]], between: Any = None
) -> list[Outcome]:
    """Run ``calls`` in turn on the handler's own event loop (``between``: a coroutine
    function run after the first), then close the handler; what came of each."""

    async def run() -> list[Outcome]:
        outcomes = []
        try:
            for n, (tool, arguments) in enumerate(calls):
                if n == 1 and between is not None:
                    await between()
                call = ids.call(tool, arguments, **APPROVED)
                outcomes.append(await handler.execute(call, None, {}))
        finally:
            await handler.aclose()
            handler.close()
        return outcomes

    return asyncio.run(run())


def _calls(
    handler: ToolHandler, ids: Ids, *calls: tuple[str, dict[str, Any]], between: Any = None
) -> list[Any]:
    """The events of :func:`_outcomes`."""
    return [o.event for o in _outcomes(handler, ids, *calls, between=between)]


def _wire(handler: ToolHandler) -> StdioWire:
    wire = handler.mcp.session("local").wire
    assert isinstance(wire, StdioWire)
    return wire


@pytest.fixture
def stdio_handler(tmp_path: Path) -> Iterator[ToolHandler]:
    handler = ToolHandler(ToolRegistry.load(_registry(tmp_path, _entry(tmp_path))))
    yield handler


def test_a_call_over_stdio_end_to_end_executes_once_with_its_key(
    kafka_bootstrap: str, database_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    registry = _registry(tmp_path, _entry(tmp_path))
    listed = ToolHandler(ToolRegistry.load(registry))
    try:
        tools = listed.tools()
    finally:
        listed.close()
    refund = tools["local__refund_order"]
    assert (refund.backend, refund.mcp_server, refund.endpoint) == (
        "mcp",
        "local",
        f"stdio:{sys.executable}",
    )
    assert (refund.permission, refund.idempotent, refund.approval_required) == (
        "write",
        False,
        True,
    )
    prefix = f"t-mcp-stdio-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    harness = make_harness(kafka_bootstrap, database_url, prefix, "tool")
    harness.start(ToolExecutor(harness.config("tool"), registry))
    try:
        ids = ids_for(request)
        call = ids.call("local__refund_order", {"order_id": "o-1", "amount_cents": 700}, **APPROVED)
        harness.effects.send(call)
        event = harness.inbox.typed(call, ToolCallSucceeded, timeout=60)
        result = harness.artifact(event.result_ref)
        assert result["output"]["result"].startswith("refunded 700 cents on o-1")
        read = ids.call("local__lookup_order", {"order_id": "o-1"})
        harness.effects.send(read)
        output = harness.artifact(harness.inbox.typed(read, ToolCallSucceeded).result_ref)
        assert output["output"] == {"order_id": "o-1", "status": "delivered", "amount_cents": 4200}
    finally:
        harness.close()
    counts = _counts(tmp_path)
    assert counts["execution"][call.operation.key] == 1
    assert counts["call"][call.operation.key] == 1


def test_a_process_that_dies_is_started_again_by_the_next_call(
    stdio_handler: ToolHandler,
) -> None:
    wire = _wire(stdio_handler)
    pids: list[int] = []

    async def kill() -> None:
        assert wire.process is not None
        pids.append(wire.process.pid)
        os.kill(wire.process.pid, signal.SIGKILL)
        while wire.alive():  # its stdout ends: the wire sees it gone
            await asyncio.sleep(0.02)

    first, second = _calls(
        stdio_handler,
        Ids("run-stdio-restart"),
        ("local__lookup_order", {"order_id": "o-1"}),
        ("local__lookup_order", {"order_id": "o-2"}),
        between=kill,
    )
    assert isinstance(first, ToolCallSucceeded) and isinstance(second, ToolCallSucceeded)
    assert wire.starts == 2 and wire.process is None  # closed with the handler
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


def test_a_process_killed_mid_call_is_an_unknown_outcome_and_the_next_call_works(
    tmp_path: Path,
) -> None:
    crash = {"target": "refund_order", "kind": "crash"}
    handler = ToolHandler(ToolRegistry.load(_registry(tmp_path, _entry(tmp_path, crash))))
    ids = Ids("run-stdio-crash")
    refund, after = _calls(
        handler,
        ids,
        ("local__refund_order", {"order_id": "o-3", "amount_cents": 5}),
        ("local__lookup_order", {"order_id": "o-3"}),
    )
    assert isinstance(refund, ToolCallTimedOut), refund  # it reached the tool: reconciled
    assert isinstance(after, ToolCallSucceeded), after
    assert _wire(handler).starts == 2
    counts = _counts(tmp_path)
    assert sum(counts["call"].values()) == 2 and counts["execution"] == {}


def test_a_line_over_the_limit_is_too_large_and_the_process_goes_on(tmp_path: Path) -> None:
    huge = {"target": "lookup_order", "kind": "huge", "size": 200_000}
    entry = _entry(tmp_path, huge, max_line_bytes=65_536)
    handler = ToolHandler(ToolRegistry.load(_registry(tmp_path, entry)))
    bad, after = _calls(
        handler,
        Ids("run-stdio-huge"),
        ("local__lookup_order", {"order_id": "o-4"}),
        ("local__lookup_order", {"order_id": "o-5"}),
    )
    assert isinstance(bad, ToolCallFailed), bad
    assert (bad.error_class, bad.error_code) == (ErrorClass.UNKNOWN, "invalid_output:too_large")
    assert isinstance(after, ToolCallSucceeded), after
    assert _wire(handler).starts == 1  # the line was skipped, the process kept


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        # a program that does not exist
        ({"command": "/nonexistent/mcp-server", "args": []}, "cannot start"),
        # a program that never answers initialize: stopped at its start timeout
        (
            {"args": ["-c", "import time; time.sleep(60)"], "start_timeout_ms": 500},
            "no answer to initialize within 500 ms",
        ),
    ],
)
def test_a_server_that_does_not_start_fails_the_call_transient_and_in_time(
    tmp_path: Path, fields: dict[str, Any], says: str
) -> None:
    """Its tools could not be listed: the call is not sent, the core resends it."""
    handler = ToolHandler(ToolRegistry.load(_registry(tmp_path, {**_entry(tmp_path), **fields})))
    began = time.monotonic()
    (event,) = _calls(handler, Ids("run-stdio-no-start"), ("local__lookup_order", {}))
    assert isinstance(event, ToolCallFailed), event
    assert (event.error_class, event.error_code) == (ErrorClass.TRANSIENT, "connect_failed")
    assert says in event.message
    assert time.monotonic() - began < 5
    assert _wire(handler).process is None  # nothing left running


# A stdio server of a few lines that answers ``act`` as its ``mode`` argument says.
HOSTILE_SERVER = r"""
import json, sys

def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()

def good(rid, text="done"):
    send({"jsonrpc": "2.0", "id": rid, "result": {"content": [{"type": "text", "text": text}]}})

pending = None
for line in sys.stdin:
    message = json.loads(line)
    rid, method = message.get("id"), message.get("method")
    if rid == "ping-1" and method is None and pending is not None:
        good(pending, "pong: " + json.dumps(message.get("result")))
        pending = None
    if rid is None or method is None:
        continue
    if method == "initialize":
        version = message["params"]["protocolVersion"]
        info = {"name": "hostile", "version": "0"}
        result = {"protocolVersion": version, "capabilities": {}, "serverInfo": info}
        send({"jsonrpc": "2.0", "id": rid, "result": result})
    elif method == "tools/list":
        tool = {"name": "act", "inputSchema": {"type": "object"}}
        send({"jsonrpc": "2.0", "id": rid, "result": {"tools": [tool]}})
    else:
        mode = message["params"]["arguments"].get("mode")
        if mode == "not_json":
            sys.stdout.write('{"jsonrpc": "2.0", "id": %d, "result": {"content": [\n' % rid)
            sys.stdout.flush()
        elif mode == "stray":
            good(rid + 1000)
        elif mode == "chatter":
            sys.stdout.write("a print() on stdout\n[1, 2]\n")
            good(rid)
        elif mode == "ping_first":
            pending = rid
            send({"jsonrpc": "2.0", "id": "ping-1", "method": "ping"})
        else:
            good(rid)
"""


@pytest.mark.parametrize(
    ("mode", "ends"),
    [
        ("not_json", "invalid_output:not_json"),
        ("stray", "timed_out"),  # another id: whose, nobody knows; the call's deadline
        ("chatter", "done"),  # lines that are no message are dropped
        ("ping_first", "pong: {}"),  # the server's ping answered before its answer
    ],
)
def test_hostile_lines_of_a_stdio_server_and_the_next_call(
    tmp_path: Path, mode: str, ends: str
) -> None:
    script = tmp_path / "hostile_server.py"
    script.write_text(HOSTILE_SERVER)
    entry = {"name": "local", "command": sys.executable, "args": [str(script)], "timeout_ms": 1500}
    handler = ToolHandler(ToolRegistry.load(_registry(tmp_path, entry)))
    outcome, after = _outcomes(
        handler,
        Ids(f"run-stdio-{mode}"),
        ("local__act", {"mode": mode}),
        ("local__act", {"mode": "good"}),
    )
    event = outcome.event
    if ends == "timed_out":
        assert isinstance(event, ToolCallTimedOut), event
    elif ends.startswith("invalid_output"):
        assert isinstance(event, ToolCallFailed) and event.error_code == ends, event
    else:
        assert isinstance(event, ToolCallSucceeded), event
        (artifact,) = outcome.artifacts
        assert json.loads(artifact.content)["output"] == ends
    assert isinstance(after.event, ToolCallSucceeded), after
    assert _wire(handler).starts == 1  # one process all along
