"""The whole pipeline while its executors are killed -9 and restarted: the executors run as
processes of their own, the processor and both test servers as threads of this process."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentruns.connectors.dev.servers import model_server, tool_server
from agentruns.connectors.dev.servers.model_server import Scenario
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.processors.events import ToolCallSucceeded
from agentruns.processors.state import ToolSpec
from agentruns.streams.admin import ensure_topics
from agentruns.streams.processor import Processor, ProcessorConfig
from tests.support.executors import Ids, fast_registry, make_harness
from tests.support.pipeline import Inbox, Pipeline
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]

KILL_SCENARIO: dict[str, Any] = {
    "name": "kill_short",
    "description": "Two side effects (a ticket, an email), then a final answer.",
    "turns": [
        {"tool_calls": [{"name": "create_ticket", "arguments": {"title": "Printer offline"}}]},
        {
            "tool_calls": [
                {
                    "name": "send_email",
                    "arguments": {"to": "it@example.com", "subject": "Printer", "body": "Open."},
                }
            ]
        },
        {"content": "Ticket opened and IT emailed."},
    ],
}
KILL_RUNS = 50
# (executor, progress counter value at which it is killed): tool calls reach ~100 and model
# requests ~150 over the 50 runs, so every kill lands mid-work, two per executor.
KILLS = (("tool", 12), ("model", 45), ("tool", 60), ("model", 110))


@pytest.mark.timeout(600)
def test_e2e_kill_9_of_each_executor_during_runs(
    kafka_bootstrap: str, database_url: str, tmp_path: Any
) -> None:
    """Executors as processes, each killed with SIGKILL twice at random points while 50 runs
    (two side-effecting tool calls each) are under way, and restarted: every run ends
    SUCCEEDED, and at the tool server every executed operation key was executed once and
    requested once (a started key is looked up, never called blindly again)."""
    prefix = f"t-e2e-kill-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    ensure_topics(kafka_bootstrap, prefix=prefix, partitions=2)
    models = model_server.serve("127.0.0.1", 0)
    models.app.add_scenario(Scenario.model_validate(KILL_SCENARIO))  # type: ignore[attr-defined]
    tools = tool_server.serve("127.0.0.1", 0)
    tools.app.report_delay_ms = 50  # type: ignore[attr-defined]
    registry = fast_registry(tmp_path, tools.url)
    spec = json.loads(registry.read_text())
    for tool in spec["tools"]:
        tool["timeout_ms"] = 5000  # no timeouts here: a timed-out call may be resent (same key)
    registry.write_text(json.dumps(spec))
    common = ["--bootstrap", kafka_bootstrap, "--database-url", database_url, "--prefix", prefix]
    commands = {
        "model": [sys.executable, "-m", "agentruns.connectors.executors.model", *common,
                  "--base-url", models.url + "/v1", "--registry", str(registry)],
        "tool": [sys.executable, "-m", "agentruns.connectors.executors.tool", *common,
                 "--registry", str(registry)],
    }  # fmt: skip
    procs = {kind: subprocess.Popen(cmd, cwd=REPO) for kind, cmd in commands.items()}
    store = PostgresArtifactStore(database_url)
    stop = threading.Event()
    processor = Processor(
        ProcessorConfig(kafka_bootstrap, prefix=prefix, group_id=f"{prefix}-p"), store.put_many
    )
    thread = threading.Thread(target=processor.run, args=(stop,), daemon=True)
    thread.start()
    # a little latency per tool call so kills land while calls are in flight
    httpx.post(tools.url + "/faults", json={"kind": "slow", "delay_ms": 30, "times": None})
    pipe = Pipeline(
        kafka_bootstrap,
        prefix,
        models,
        tools,
        tuple(
            ToolSpec(name=t["name"], parameters=t["parameters"], permission=t["permission"])
            for t in spec["tools"]
            if t["permission"] != "admin"
        ),
        Inbox(kafka_bootstrap, prefix, 2),
    )
    runs = [f"kill-{i}-{time.monotonic_ns() % 10**9}" for i in range(KILL_RUNS)]
    rng = random.Random(7)
    app: Any = tools.app
    try:
        for run_id in runs:
            pipe.submit(run_id, scenario=KILL_SCENARIO["name"])
        for kind, threshold in KILLS:
            counter = "tool_calls" if kind == "tool" else "requests"
            source: Any = app if kind == "tool" else models.app

            def progressed(s: Any = source, c: str = counter, n: int = threshold) -> bool:
                return bool(s.stats()[c] >= n)

            wait_for(progressed, 120, f"{kind} progress to {threshold}")
            time.sleep(rng.uniform(0, 0.05))  # a random point in the batch
            procs[kind].send_signal(signal.SIGKILL)
            procs[kind].wait(10)
            procs[kind] = subprocess.Popen(commands[kind], cwd=REPO)
        results = pipe.results(runs, timeout=240)
        assert {r: results[r]["status"] for r in runs} == dict.fromkeys(runs, "SUCCEEDED")
        stats = app.stats()
        executed = stats["executions"]
        assert len(executed) == 2 * KILL_RUNS, len(executed)  # a ticket and an email per run
        assert set(executed.values()) == {1}, executed
        # never a blind second request for an operation that ran: a started key is looked up
        assert all(stats["calls"][k] == 1 for k in executed), (stats["calls"], executed)
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            assert proc.wait(30) == 0
        stop.set()
        thread.join(30)
        store.close()
        models.close()
        tools.close()


HUNDREDS = 300


@pytest.mark.timeout(300)
def test_e2e_kill_9_of_the_tool_executor_with_hundreds_of_calls_in_flight(
    kafka_bootstrap: str, database_url: str, tmp_path: Any
) -> None:
    """300 tool calls of 1.5 to 3 s each, all in flight in one executor process, which is
    killed with SIGKILL once most of them have executed and restarted: every effect is
    answered (identical bytes when answered twice), every ticket was created once, and no
    operation that ran was requested again (a started key is looked up, not called)."""
    prefix = f"t-e2e-hundreds-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    harness = make_harness(kafka_bootstrap, database_url, prefix, "tool")
    tools = tool_server.serve("127.0.0.1", 0)
    registry = fast_registry(tmp_path, tools.url)
    spec = json.loads(registry.read_text())
    for tool in spec["tools"]:
        tool["timeout_ms"] = 10_000
    registry.write_text(json.dumps(spec))
    rule = {"target": "*", "kind": "latency", "times": None, "min_ms": 1500, "max_ms": 3000}
    httpx.post(tools.url + "/faults", json=rule, timeout=5).raise_for_status()
    command = [
        sys.executable, "-m", "agentruns.connectors.executors.tool",
        "--bootstrap", kafka_bootstrap, "--database-url", database_url, "--prefix", prefix,
        "--registry", str(registry), "--max-in-flight", "512",
    ]  # fmt: skip
    proc = subprocess.Popen(command, cwd=REPO)
    app: Any = tools.app
    base = f"hundreds-{time.monotonic_ns() % 10**9}"
    calls = [
        Ids(f"{base}-{i}").call("create_ticket", {"title": f"ticket {i}"}) for i in range(HUNDREDS)
    ]
    try:
        harness.effects.send(*calls)
        wait_for(lambda: app.stats()["tool_calls"] >= 250, 120, "250 calls in flight")
        harness.inbox.drain()
        in_flight = app.stats()["tool_calls"] - len(harness.inbox.seen)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = subprocess.Popen(command, cwd=REPO)

        def answered() -> bool:
            harness.inbox.drain()
            return all(f"{c.idempotency_key}:result" in harness.inbox.seen for c in calls)

        wait_for(answered, 180, "every answer")
        stats = app.stats()
        keys = [c.operation.key for c in calls]
        assert in_flight >= 100  # the kill landed with calls in flight
        assert {stats["executions"].get(k) for k in keys} == {1}
        assert {stats["calls"].get(k) for k in keys} == {1}
        for call in calls:
            copies = {raw for raw, _ in harness.inbox.seen[f"{call.idempotency_key}:result"]}
            assert len(copies) == 1
            harness.inbox.typed(call, ToolCallSucceeded)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        harness.close()
        tools.close()
