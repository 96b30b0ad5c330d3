"""The model executor against the real broker, the real Postgres and the scripted model server.

The tests play the processor: they write context artifacts like READY does, produce CallModel
effects and read the ModelCallCompleted inputs the executor commits to the inbox.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from agentruns.connectors.executors.model import (
    ModelExecutor,
    RouteConfig,
    Routes,
    StreamAssembler,
    build_conversation,
)
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.connectors.testing import model_server, tool_server
from agentruns.connectors.testing.httpserver import ServerHandle
from agentruns.processors.effects import CallModel, RepairNote
from agentruns.processors.events import ModelCallCompleted, ModelOutcome
from agentruns.processors.ids import canonical_json
from agentruns.processors.transition import load_candidate

from tests.integration.test_tool_executor import Harness, make_harness, release, wait_until

TOOLS = [
    {"name": "search_docs", "parameters": {"type": "object"}, "permission": "read"},
    {"name": "create_ticket", "parameters": {"type": "object"}, "permission": "write"},
]


@dataclass
class ModelEnv:
    harness: Harness
    server: ServerHandle
    http: httpx.Client
    store: PostgresArtifactStore

    def context(
        self,
        run_id: str,
        step: int = 1,
        previous: str | None = None,
        candidate: str | None = None,
        inputs: tuple[str, ...] = (),
        scenario: str = "multi_tool",
    ) -> str:
        registry = self.store.put(canonical_json(TOOLS))
        first = previous is None
        messages = [
            {"role": "system", "content": f"scenario:{scenario}"},
            {"role": "user", "content": "The printer on floor 3 is offline."},
        ]
        body = {
            "run_id": run_id,
            "step": step,
            "goal": "fix the printer",
            "previous_context": previous,
            "previous_candidate": candidate,
            "messages": messages if first else [],
            "inputs": list(inputs),
            "memory_ref": None,
            "evidence_refs": [],
            "tool_registry": registry,
            "policy": {},
            "model_route": "default",
            "remaining": {},
        }
        return self.store.put(canonical_json(body))

    def effect(
        self,
        run_id: str,
        context_ref: str,
        step: int = 1,
        attempt: int = 1,
        route: str = "default",
        repair: RepairNote | None = None,
    ) -> CallModel:
        return CallModel(
            idempotency_key=f"{run_id}:model:{step}:{attempt}",
            run_id=run_id,
            step=step,
            attempt=attempt,
            trace_id=f"trace-{run_id}",
            context_ref=context_ref,
            model_route=route,
            repair=repair,
        )

    def call(self, effect: CallModel) -> ModelCallCompleted:
        self.harness.effects.send(effect)
        event = self.harness.inbox.typed(effect, ModelCallCompleted)
        assert (event.step, event.attempt) == (effect.step, effect.attempt)
        return event

    def fault(self, **rule: Any) -> None:
        self.http.post("/faults", json=rule).raise_for_status()

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self.http.get("/stats").json()
        return result


@pytest.fixture(scope="module")
def model_env(kafka_bootstrap: str, database_url: str) -> Iterator[ModelEnv]:
    server = model_server.serve("127.0.0.1", 0)
    prefix = f"t-model-exec-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    harness = make_harness(kafka_bootstrap, database_url, prefix, "model")
    base = server.url + "/v1"
    routes = Routes(
        {
            "default": RouteConfig(base_url=base, model="scenario:multi_tool"),
            "offline": RouteConfig(base_url="http://127.0.0.1:9/v1", connect_timeout_s=1),
            "costly": RouteConfig(
                base_url=base,
                model="scenario:multi_tool",
                input_cost_micros_per_1k=1000,
                output_cost_micros_per_1k=2000,
            ),
        },
        RouteConfig(base_url=base),
    )
    harness.start(ModelExecutor(harness.config("model"), routes, tool_server.DEFAULT_REGISTRY))
    http = httpx.Client(base_url=server.url, timeout=5.0)
    store = PostgresArtifactStore(database_url)
    try:
        yield ModelEnv(harness, server, http, store)
    finally:
        harness.stop_executor()
        harness.inbox.close()
        release(harness)
        store.close()
        http.close()
        server.close()


@pytest.fixture
def env(model_env: ModelEnv) -> ModelEnv:
    model_env.http.delete("/faults").raise_for_status()
    return model_env


def run_id_for(request: pytest.FixtureRequest) -> str:
    return f"run-{request.node.name[:40]}-{time.monotonic_ns() % 10**9}"


# --------------------------------------------------------------------------- tests


def test_finished_stream_becomes_a_candidate_with_complete_tool_calls(
    env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    run_id = run_id_for(request)
    event = env.call(env.effect(run_id, env.context(run_id), route="costly"))
    assert event.outcome is ModelOutcome.FINISHED and event.candidate is not None
    (call,) = event.candidate.tool_calls
    assert call.name == "search_docs"
    assert json.loads(call.arguments_json) == {"query": "escalation policy", "limit": 3}
    assert event.candidate.content == "Let me look up the escalation policy first."
    assert event.usage.input_tokens > 0 and event.usage.output_tokens > 0
    assert event.usage.cost_micros == event.usage.input_tokens + 2 * event.usage.output_tokens
    assert event.candidate_ref is not None
    artifact = env.harness.artifact(event.candidate_ref)
    assert artifact["finish_reason"] == "tool_calls" and artifact["outcome"] == "finished"
    message = artifact["message"]
    assert message["role"] == "assistant" and message["content"] == event.candidate.content
    assert message["tool_calls"][0]["id"] == call.id
    assert message["tool_calls"][0]["function"]["arguments"] == call.arguments_json
    stored = env.store.get(event.candidate_ref) or ""
    assert load_candidate(stored) == event.candidate  # what audit re-validates


@pytest.mark.parametrize(
    ("rule", "outcome"),
    [
        ({"kind": "disconnect", "after_chunks": 4}, ModelOutcome.INCOMPLETE),
        ({"kind": "incomplete", "after_chunks": 3}, ModelOutcome.INCOMPLETE),
        ({"kind": "length"}, ModelOutcome.TRUNCATED),
        ({"kind": "content_filter"}, ModelOutcome.BLOCKED),
        ({"kind": "429", "retry_after": 1.5}, ModelOutcome.RATE_LIMITED),
        ({"kind": "500"}, ModelOutcome.TRANSPORT_ERROR),
        ({"kind": "503"}, ModelOutcome.TRANSPORT_ERROR),
        ({"kind": "slow", "delay_ms": 5}, ModelOutcome.FINISHED),
    ],
)
def test_stream_classification(
    env: ModelEnv, request: pytest.FixtureRequest, rule: dict[str, Any], outcome: ModelOutcome
) -> None:
    run_id = run_id_for(request)
    env.fault(conversation=run_id, **rule)
    event = env.call(env.effect(run_id, env.context(run_id)))
    assert event.outcome is outcome
    assert event.candidate is not None
    if outcome is ModelOutcome.FINISHED:
        assert len(event.candidate.tool_calls) == 1
        return
    assert event.candidate.tool_calls == ()  # no tool starts on half-streamed arguments
    if outcome is ModelOutcome.RATE_LIMITED:
        assert event.retry_after_ms == 1500
    if outcome in (ModelOutcome.RATE_LIMITED, ModelOutcome.TRANSPORT_ERROR):
        assert event.candidate_ref is None
    else:
        artifact = env.harness.artifact(event.candidate_ref or "")
        assert artifact["outcome"] == outcome.value and "tool_calls" not in artifact["message"]


def test_unreachable_endpoint_is_a_transport_error(
    env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    run_id = run_id_for(request)
    event = env.call(env.effect(run_id, env.context(run_id), route="offline"))
    assert event.outcome is ModelOutcome.TRANSPORT_ERROR and event.candidate_ref is None


def test_disconnect_then_a_new_attempt_on_the_same_context(
    env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    run_id = run_id_for(request)
    context = env.context(run_id)
    env.fault(conversation=run_id, kind="disconnect", after_chunks=5)
    first = env.call(env.effect(run_id, context, attempt=1))
    assert first.outcome is ModelOutcome.INCOMPLETE
    second = env.call(env.effect(run_id, context, attempt=2))
    assert second.outcome is ModelOutcome.FINISHED and second.candidate is not None
    # one generation, not two merged: the text appears once, one tool call
    assert second.candidate.content == "Let me look up the escalation policy first."
    assert len(second.candidate.tool_calls) == 1


def test_redelivered_effect_is_answered_from_the_record(
    env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    run_id = run_id_for(request)
    effect = env.effect(run_id, env.context(run_id))
    env.call(effect)
    before = env.stats()["requests"]
    env.harness.effects.send(effect)  # the same effect again: a redelivery
    input_id = f"{effect.idempotency_key}:result"
    inbox = env.harness.inbox
    wait_until(lambda: (inbox.drain(), len(inbox.seen[input_id]) == 2)[1], 20, "second answer")
    (a, _), (b, _) = inbox.seen[input_id]
    assert a == b  # byte-identical
    assert env.stats()["requests"] == before  # no second model call


def test_conversation_is_rebuilt_from_the_context_chain(
    env: ModelEnv, request: pytest.FixtureRequest
) -> None:
    """Step 2's context links to step 1's: the model sees one tool-result group (turn 1)."""
    run_id = run_id_for(request)
    first_context = env.context(run_id)
    step1 = env.call(env.effect(run_id, first_context))
    assert step1.candidate is not None and step1.candidate_ref is not None
    (call,) = step1.candidate.tool_calls
    result = env.store.put(
        canonical_json(
            {
                "type": "tool_result",
                "operation_key": "op-1",
                "tool": "search_docs",
                "arguments": json.loads(call.arguments_json),
                "status": "succeeded",
                "output": {"hits": ["policy: printers are high priority"]},
            }
        )
    )
    second_context = env.context(
        run_id, step=2, previous=first_context, candidate=step1.candidate_ref, inputs=(result,)
    )
    step2 = env.call(env.effect(run_id, second_context, step=2))
    assert step2.outcome is ModelOutcome.FINISHED and step2.candidate is not None
    assert [c.name for c in step2.candidate.tool_calls] == ["create_ticket"]

    loads = PostgresArtifactStore(env.harness.database_url)
    try:

        def load(refs: Any) -> dict[str, Any]:
            return {k: json.loads(v) for k, v in loads.get_many(list(refs)).items()}

        repair = RepairNote(candidate_ref="sha256:x", error_code="BAD_ARGS", detail="limit > 20")
        messages, context = build_conversation(
            env.effect(run_id, second_context, step=2, repair=repair), load
        )
    finally:
        loads.close()
    assert context["step"] == 2
    roles = [m["role"] for m in messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert messages[2]["tool_calls"][0]["id"] == call.id
    assert messages[3]["tool_call_id"] == call.id
    assert json.loads(messages[3]["content"]) == {"hits": ["policy: printers are high priority"]}
    assert "BAD_ARGS" in messages[4]["content"]


def test_assembler_never_passes_half_streamed_arguments() -> None:
    assembler = StreamAssembler()
    assembler.feed({"choices": [{"delta": {"role": "assistant", "content": "Hi"}}]})
    call = {"index": 0, "id": "c1", "function": {"name": "search_docs", "arguments": '{"qu'}}
    assembler.feed({"choices": [{"delta": {"tool_calls": [call]}}]})
    cut = assembler.result(interrupted="connection lost")
    assert cut.outcome is ModelOutcome.INCOMPLETE and cut.tool_calls == ()
    more = {"index": 0, "function": {"arguments": 'ery":"x"}'}}
    assembler.feed({"choices": [{"delta": {"tool_calls": [more]}, "finish_reason": "tool_calls"}]})
    done = assembler.result()
    assert done.outcome is ModelOutcome.FINISHED
    assert done.tool_calls[0]["function"]["arguments"] == '{"query":"x"}'


# --------------------------------------------------------------------------- the whole pipeline


@dataclass
class Pipeline:
    """Processor + both executors + both servers, one topic prefix (the issue's e2e cases)."""

    bootstrap: str
    prefix: str
    models: ServerHandle
    tools: ServerHandle
    tool_specs: tuple[Any, ...]
    inbox: Any

    def submit(self, run_id: str, scenario: str = "multi_tool") -> None:
        from agentruns.processors.events import Message, RunSubmitted

        from tests.integration.pipeline import input_record

        submitted = RunSubmitted(
            run_id=run_id,
            event_id=f"{run_id}:submit",
            at=int(time.time() * 1000),
            trace_id=f"trace-{run_id}",
            goal="The printer on floor 3 is offline: open a ticket and tell facilities.",
            messages=(Message(role="user", content="The printer on floor 3 is offline."),),
            tools=self.tool_specs,
            model_route=f"scenario:{scenario}",
        )
        self.inbox.send(input_record(submitted))
        self.inbox.flush()

    def _read(self, suffix: str, name: str, run_id: str) -> list[dict[str, Any]]:
        from agentruns.streams.topics import topic_name

        from tests.integration.pipeline import read_all

        topic = topic_name(suffix, self.prefix)
        return [
            r.value for r in read_all(self.bootstrap, topic, name) if r.value["run_id"] == run_id
        ]

    def result(self, run_id: str, timeout: float = 90) -> dict[str, Any]:
        (result,) = wait_until(lambda: self._read("results", "Result", run_id), timeout, "result")
        found: dict[str, Any] = result
        return found

    def results(self, run_ids: list[str], timeout: float = 90) -> dict[str, dict[str, Any]]:
        """The terminal results of every run in ``run_ids`` (one topic read per attempt)."""
        from agentruns.streams.topics import topic_name

        from tests.integration.pipeline import read_all

        topic = topic_name("results", self.prefix)
        wanted = set(run_ids)

        def read() -> dict[str, dict[str, Any]] | None:
            found = {
                r.value["run_id"]: r.value
                for r in read_all(self.bootstrap, topic, "Result")
                if r.value["run_id"] in wanted
            }
            return found if len(found) == len(wanted) else None

        done: dict[str, dict[str, Any]] = wait_until(read, timeout, "every result")
        return done

    def effects(self, kind: str, run_id: str) -> list[dict[str, Any]]:
        """The bodies of the run's effects on ``effects.<kind>`` (model, tool, timer)."""
        from agentruns.streams.topics import effect_suffix

        return [json.loads(r["body"]) for r in self._read(effect_suffix(kind), "Effect", run_id)]

    def status(self, run_id: str) -> str | None:
        snapshots = self._read("state", "Snapshot", run_id)
        return snapshots[-1]["status"] if snapshots else None

    def events(self, run_id: str) -> list[dict[str, Any]]:
        return self._read("events", "Event", run_id)

    def tool_fault(self, **rule: Any) -> None:
        httpx.post(self.tools.url + "/faults", json=rule, timeout=5).raise_for_status()

    def model_fault(self, **rule: Any) -> None:
        httpx.post(self.models.url + "/faults", json=rule, timeout=5).raise_for_status()

    def executions(self, tool: str) -> list[tuple[int, int]]:
        """(executions, requests) per operation key of ``tool`` at the tool server."""
        app: Any = self.tools.app
        stats = app.stats()
        keys = [k for k, op in app.operations.items() if op.tool == tool]
        return [(stats["executions"].get(k, 0), stats["calls"].get(k, 0)) for k in keys]


@contextlib.contextmanager
def running_pipeline(
    kafka_bootstrap: str, database_url: str, tmp: Path, *, timers: bool = False
) -> Iterator[Pipeline]:
    """Processor, both executors (threads of this process), both servers in threads, and the
    timer service when ``timers`` (back-off and user-expiry timers fire)."""
    import threading

    from agentruns.connectors.executors.base import ExecutorConfig
    from agentruns.connectors.executors.tool import ToolExecutor
    from agentruns.connectors.runtime.timers import TimerService
    from agentruns.connectors.testing import tool_server
    from agentruns.processors.state import ToolSpec
    from agentruns.streams.admin import ensure_topics
    from agentruns.streams.processor import Processor, ProcessorConfig

    from tests.integration.pipeline import Inbox
    from tests.integration.test_tool_executor import fast_registry

    prefix = f"t-e2e-exec-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    ensure_topics(kafka_bootstrap, prefix=prefix, partitions=2)
    models = model_server.serve("127.0.0.1", 0)
    tools = tool_server.serve("127.0.0.1", 0)
    registry = fast_registry(tmp, tools.url)
    spec = json.loads(registry.read_text())
    store = PostgresArtifactStore(database_url)
    stop = threading.Event()

    def config(kind: str) -> ExecutorConfig:
        return ExecutorConfig(kafka_bootstrap, database_url, kind, prefix=prefix, workers=4)

    routes = Routes({}, RouteConfig(base_url=models.url + "/v1"))
    processor_config = ProcessorConfig(kafka_bootstrap, prefix=prefix, group_id=f"{prefix}-p")
    workers: list[Any] = [
        Processor(processor_config, store.put_many),
        ModelExecutor(config("model"), routes, registry),
        ToolExecutor(config("tool"), registry),
    ]
    if timers:
        workers.append(TimerService(kafka_bootstrap, database_url, prefix=prefix))
    threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    specs = tuple(
        ToolSpec(
            name=t["name"], parameters=t["parameters"], permission=t["permission"],
            is_async=t["async"],
        )
        for t in spec["tools"]
        if t["permission"] != "admin"
    )  # fmt: skip
    try:
        yield Pipeline(
            kafka_bootstrap, prefix, models, tools, specs, Inbox(kafka_bootstrap, prefix, 2)
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        store.close()
        models.close()
        tools.close()


@pytest.fixture(scope="module")
def pipeline(
    kafka_bootstrap: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    with running_pipeline(kafka_bootstrap, database_url, tmp_path_factory.mktemp("e2e")) as pipe:
        yield pipe


@pytest.fixture
def e2e(pipeline: Pipeline) -> Pipeline:
    httpx.delete(pipeline.tools.url + "/faults", timeout=5).raise_for_status()
    httpx.delete(pipeline.models.url + "/faults", timeout=5).raise_for_status()
    return pipeline


def test_e2e_five_tool_calls_reach_succeeded(e2e: Pipeline) -> None:
    run_id = f"e2e-ok-{time.monotonic_ns() % 10**9}"
    e2e.submit(run_id)
    result = e2e.result(run_id)
    assert result["status"] == "SUCCEEDED", result
    types = [e["type"] for e in e2e.events(run_id)]
    assert types.count("ToolCallSucceeded") == 5 and types.count("ModelCallCompleted") == 6
    for tool in ("search_docs", "create_ticket", "update_record", "send_email"):
        assert all(executed == 1 for executed, _ in e2e.executions(tool))


def test_e2e_timeout_where_the_tool_ran_is_reconciled_not_redone(e2e: Pipeline) -> None:
    before = len(e2e.executions("create_ticket"))
    e2e.tool_fault(target="create_ticket", kind="late")  # executes, answers after the timeout
    run_id = f"e2e-late-{time.monotonic_ns() % 10**9}"
    e2e.submit(run_id)
    assert e2e.result(run_id)["status"] == "SUCCEEDED"
    types = [e["type"] for e in e2e.events(run_id)]
    assert "ToolCallTimedOut" in types and "ReconcileCompleted" in types
    (counts,) = e2e.executions("create_ticket")[before:]
    assert counts == (1, 1)  # executed once, requested once: found by the look-up


def test_e2e_timeout_where_the_tool_did_not_run_is_resent_with_the_same_key(
    e2e: Pipeline,
) -> None:
    before = len(e2e.executions("send_email"))
    e2e.tool_fault(target="send_email", kind="drop")  # connection closed, nothing executed
    run_id = f"e2e-drop-{time.monotonic_ns() % 10**9}"
    e2e.submit(run_id)
    assert e2e.result(run_id)["status"] == "SUCCEEDED"
    reconciled = [e for e in e2e.events(run_id) if e["type"] == "ReconcileCompleted"]
    assert json.loads(reconciled[0]["body"])["outcome"] == "not_executed"
    (counts,) = e2e.executions("send_email")[before:]
    assert counts == (1, 2)  # two requests with the same key, one execution


def test_e2e_undeterminable_operation_pauses_the_run(e2e: Pipeline) -> None:
    e2e.tool_fault(target="update_record", kind="drop_after")  # executed, answer lost
    e2e.tool_fault(target="operations", kind="unknown", times=None)  # look-ups cannot tell
    run_id = f"e2e-pause-{time.monotonic_ns() % 10**9}"
    e2e.submit(run_id)
    wait_until(lambda: e2e.status(run_id) == "PAUSED", 90, "PAUSED")
    reconciled = [e for e in e2e.events(run_id) if e["type"] == "ReconcileCompleted"]
    assert json.loads(reconciled[-1]["body"])["outcome"] == "undeterminable"


def test_e2e_mid_stream_disconnect_retries_the_same_context(e2e: Pipeline) -> None:
    run_id = f"e2e-cut-{time.monotonic_ns() % 10**9}"
    e2e.model_fault(kind="disconnect", conversation=run_id, turn=1, after_chunks=3)
    before = len(e2e.executions("create_ticket"))
    e2e.submit(run_id)
    assert e2e.result(run_id)["status"] == "SUCCEEDED"
    completed = [
        json.loads(e["body"]) for e in e2e.events(run_id) if e["type"] == "ModelCallCompleted"
    ]
    cut = [c for c in completed if c["outcome"] == "incomplete"]
    assert len(cut) == 1 and cut[0]["step"] == 2
    retry = next(c for c in completed if c["step"] == 2 and c["attempt"] == cut[0]["attempt"] + 1)
    assert retry["outcome"] == "finished" and len(retry["candidate"]["tool_calls"]) == 1
    (counts,) = e2e.executions("create_ticket")[before:]
    assert counts == (1, 1)  # one tool call, not one per stream


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
    import random
    import signal
    import subprocess
    import sys
    import threading

    from agentruns.connectors.testing import tool_server
    from agentruns.connectors.testing.model_server import Scenario
    from agentruns.processors.state import ToolSpec
    from agentruns.streams.admin import ensure_topics
    from agentruns.streams.processor import Processor, ProcessorConfig

    from tests.integration.pipeline import Inbox
    from tests.integration.test_tool_executor import REPO, fast_registry

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

            wait_until(progressed, 120, f"{kind} progress to {threshold}")
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
