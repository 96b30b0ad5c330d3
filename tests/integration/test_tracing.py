"""One run through the pipeline is one connected trace.

The components run in this process (the processor, the model and tool executors, the timer
service, the sink, each on its own thread, with the test servers), against the real broker and
Postgres, so that one in-memory exporter sees every span. They share nothing but the topics:
the trace context reaches each of them only as it would across processes, in record and HTTP
headers and in the run's snapshot.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from agentruns.connectors.api.client import RunsProducer
from agentruns.connectors.executors.tool import ToolExecutor
from agentruns.processors.effects import CallTool
from agentruns.processors.events import ToolCallFailed, ToolCallSucceeded
from agentruns.streams import tracing
from tests.integration.test_mcp_tools import REPO, ServerProcess
from tests.support import otlp
from tests.support.executors import ids_for, make_harness
from tests.support.pipeline import running_pipeline
from tests.support.runlog import running_sink
from tests.support.waiting import wait_for

CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.configure(provider)
    try:
        yield exporter
    finally:
        tracing.configure(None)
        provider.shutdown()


def _hex(value: int, width: int) -> str:
    return f"{value:0{width}x}"


def test_one_run_is_one_connected_trace(
    spans: InMemorySpanExporter, kafka_bootstrap: str, database_url: str, tmp_path: Path
) -> None:
    key = f"traced-{time.monotonic_ns() % 10**9}"
    with (
        running_pipeline(kafka_bootstrap, database_url, tmp_path, timers=True) as pipe,
        running_sink(kafka_bootstrap, database_url, pipe.prefix),
    ):
        producer = RunsProducer(kafka_bootstrap, producer_id="tracing", prefix=pipe.prefix)
        task = {
            "goal": "The printer on floor 3 is offline: open a ticket and tell facilities.",
            "messages": [{"role": "user", "content": "The printer on floor 3 is offline."}],
            "tools": [msgspec.to_builtins(t) for t in pipe.tool_specs],
            "model_route": "scenario:multi_tool",
        }
        # a rate-limited tool call is resent after a back-off timer: the timer's input
        # carries no trace context, so the run's own (from its snapshot) is continued
        pipe.tool_fault(target="send_email", kind="429", retry_after=0.3)
        with producer:
            # a malformed context from the caller is ignored: the submit starts the trace
            run_id = producer.submit(task, idempotency_key=key, traceparent="00-xyz").run_id
        assert pipe.result(run_id)["status"] == "SUCCEEDED"
        events = pipe.events(run_id)

        def projected() -> list[ReadableSpan] | None:
            done = [s for s in spans.get_finished_spans() if s.name.startswith("project ")]
            return done if len(done) >= len(events) else None

        wait_for(projected, 60, "a projection span per event")
    assert any(e["type"] == "TimerFired" for e in events), [e["type"] for e in events]

    def run_span() -> list[ReadableSpan] | None:
        done = [s for s in spans.get_finished_spans() if s.name == "invoke_agent"]
        return done or None

    (run,) = wait_for(run_span, 30, "the run's span")
    finished = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished if s.context is not None}
    (submit,) = [s for s in finished if s.name == "submit"]
    # no caller's context: the run's span is the root of a trace whose id is the run's
    assert run.parent is None and run.context is not None
    assert f"{run.context.trace_id:032x}" == tracing.run_trace_id(run_id, None)
    assert f"{run.context.span_id:016x}" == tracing.run_span_id(run_id)
    assert submit.parent is not None and submit.parent.span_id == run.context.span_id
    assert submit.kind is SpanKind.PRODUCER
    trace_id = run.context.trace_id
    assert {s.context.trace_id for s in finished if s.context is not None} == {trace_id}
    for span in finished:  # every span's parents lead back to the run's
        chain = span
        while chain.parent is not None:
            assert chain.parent.span_id in by_id, f"{span.name}: parent not in the trace"
            chain = by_id[chain.parent.span_id]
        assert chain is run, span.name
    assert run.attributes is not None and run.attributes["agentruns.status"] == "SUCCEEDED"
    assert run.attributes["gen_ai.operation.name"] == "invoke_agent"

    processed = [
        s for s in finished if s.name.startswith("process ") and s.kind is SpanKind.CONSUMER
    ]
    transitions = [s for s in processed if s.attributes and "agentruns.seq" in s.attributes]
    assert len(transitions) == len(events)  # one per input applied
    assert sorted(s.name.removeprefix("process ") for s in transitions) == sorted(
        e["type"] for e in events
    )
    for span in transitions:
        attributes = span.attributes or {}
        assert attributes["messaging.system"] == "kafka"
        assert attributes["messaging.destination.name"] == f"{pipe.prefix}.inbox" or str(
            attributes["messaging.destination.name"]
        ).endswith("inbox")
        assert span.parent is not None and span.parent.span_id == run.context.span_id
    # the submission's input is linked to the submit span that produced it
    (first,) = [s for s in transitions if s.name == "process RunSubmitted"]
    assert [link.context.span_id for link in first.links] == [submit.context.span_id]
    names = [s.name for s in finished]
    assert names.count("project RunSubmitted") == 1
    chats = [s for s in finished if s.name.startswith("chat ")]
    assert chats and all(s.kind is SpanKind.CLIENT for s in chats)
    for chat in chats:
        attributes = chat.attributes or {}
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.request.model"]
        assert isinstance(attributes["gen_ai.usage.input_tokens"], int)
        assert "gen_ai.input.messages" not in attributes  # off by default
    tools = [s for s in finished if s.name.startswith("execute_tool ")]
    assert {s.attributes["gen_ai.tool.name"] for s in tools if s.attributes} >= {"send_email"}
    failed = [s for s in tools if not s.status.is_ok]
    assert len(failed) == 1  # the 429
    http = {
        s.context.span_id: s for s in finished if s.kind is SpanKind.CLIENT and s.name == "POST"
    }
    # the HTTP calls to the model and the tools carried the span of their exchange
    for server in (pipe.models, pipe.tools):
        seen = list(server.traceparents)
        assert seen
        for value in seen:
            _, trace, span_id, _ = value.split("-")
            assert trace == _hex(trace_id, 32)
            exchange = http[int(span_id, 16)]
            assert exchange.attributes and "url.full" in exchange.attributes
            assert exchange.parent is not None and by_id[exchange.parent.span_id].name.startswith(
                ("chat ", "execute_tool ")
            )


def _context_of(span: ReadableSpan) -> str:
    """The traceparent naming a finished span."""
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def test_an_mcp_request_is_a_client_span_whose_context_the_server_receives(
    spans: InMemorySpanExporter,
    kafka_bootstrap: str,
    database_url: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    server = ServerProcess(tmp_path)
    server.start()
    prefix = f"t-trace-mcp-{os.getpid()}-{int(time.time() * 1000) % 100000}"
    harness = make_harness(kafka_bootstrap, database_url, prefix, "tool")
    registry = tmp_path / "mcp-tools.json"
    entry = {"name": "shop", "url": f"{server.url}/mcp", "timeout_ms": 5000}
    registry.write_text(json.dumps({"version": "mcp-trace", "mcp_servers": [entry]}))
    harness.start(ToolExecutor(harness.config("tool"), registry))
    try:
        ids = ids_for(request)
        call = ids.call("shop__lookup_order", {"order_id": "o-1"})
        harness.effects.send(call)
        harness.inbox.typed(call, ToolCallSucceeded)
        server.fault(target="lookup_order", kind="error")
        failed = ids.call("shop__lookup_order", {"order_id": "o-2"})
        harness.effects.send(failed)
        harness.inbox.typed(failed, ToolCallFailed)
        received = server.stats()["traceparents"]
    finally:
        harness.close()
        server.stop()
        server.http.close()
    finished = spans.get_finished_spans()

    def mcp_call_of(effect: CallTool) -> ReadableSpan:
        (tool,) = [
            s
            for s in finished
            if s.name == "execute_tool shop__lookup_order"
            and (s.attributes or {}).get("gen_ai.tool.call.id") == effect.operation.key
        ]
        assert tool.context is not None
        children = [
            s for s in finished if s.parent is not None and s.parent.span_id == tool.context.span_id
        ]
        (mcp,) = [s for s in children if s.name.startswith("tools/call")]
        return mcp

    mcp = mcp_call_of(call)
    assert mcp.name == "tools/call lookup_order" and mcp.kind is SpanKind.CLIENT
    attributes = dict(mcp.attributes or {})
    assert attributes["mcp.method.name"] == "tools/call"
    assert attributes["gen_ai.operation.name"] == "execute_tool"
    assert attributes["gen_ai.tool.name"] == "lookup_order"
    assert int(str(attributes["jsonrpc.request.id"])) > 0
    assert attributes["mcp.session.id"] and attributes["mcp.protocol.version"]
    assert attributes["network.transport"] == "tcp"
    assert attributes["network.protocol.name"] == "http"
    assert (attributes["server.address"], attributes["server.port"]) == ("127.0.0.1", server.port)
    assert mcp.status.is_ok and "error.type" not in attributes
    # its HTTP exchange is its child; the server received its context in params._meta
    assert mcp.context is not None
    (post,) = [
        s for s in finished if s.parent is not None and s.parent.span_id == mcp.context.span_id
    ]
    assert post.name == "POST" and post.kind is SpanKind.CLIENT
    assert _context_of(mcp) in received
    # an isError result: the span is an error of type tool_error
    errored = mcp_call_of(failed)
    assert (errored.attributes or {})["error.type"] == "tool_error"
    assert not errored.status.is_ok
    assert _context_of(errored) in received
    # the session was opened by an initialize span that names it (under the call that
    # opened it, or under no effect's when the executor listed the tools at its start)
    opened = [s for s in finished if s.name == "initialize"]
    assert opened and all(s.kind is SpanKind.CLIENT for s in opened)
    assert {(s.attributes or {}).get("mcp.session.id") for s in opened} >= {
        attributes["mcp.session.id"]
    }


@pytest.mark.timeout(300)
def test_a_run_keeps_its_trace_across_a_model_executor_killed_mid_call(
    spans: InMemorySpanExporter, kafka_bootstrap: str, database_url: str, tmp_path: Path
) -> None:
    """The model executor is a process exporting over OTLP to a receiver of the test's; it is
    killed with SIGKILL while a model call is in flight and started again: the call it makes
    again continues the run's trace from the effect record's context (the span of the
    processor's transition that asked for it, under the run's span)."""
    run_id = f"traced-kill-{time.monotonic_ns() % 10**9}"
    with (
        otlp.receiving() as receiver,
        running_pipeline(kafka_bootstrap, database_url, tmp_path, model_executor=False) as pipe,
    ):
        command = [
            sys.executable, "-m", "agentruns.connectors.executors.model",
            "--bootstrap", kafka_bootstrap, "--database-url", database_url,
            "--prefix", pipe.prefix, "--base-url", pipe.models.url + "/v1",
        ]  # fmt: skip
        env = {
            **os.environ,
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_COMPRESSION": "none",
            "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: spans leave before the kill
            "OTEL_SERVICE_NAME": "agentruns-executor-model",
        }
        executor = subprocess.Popen(command, cwd=REPO, env=env)
        try:
            # the second model call (after the first tool call) is slow: ~20 s
            pipe.model_fault(kind="slow", scenario="multi_tool", turn=1, delay_ms=3000, times=1)
            pipe.submit(run_id)
            models: Any = pipe.models.app

            def in_flight() -> bool:
                return bool(models.stats()["faults"].get("slow"))

            wait_for(in_flight, 90, "the slow model call in flight")

            def first_call_exported() -> bool:
                return any(s["name"].startswith("chat ") for s in receiver.spans())

            wait_for(first_call_exported, 10, "the first model call's span exported")
            executor.send_signal(signal.SIGKILL)
            executor.wait(10)
            killed_ns = time.time_ns()
            executor = subprocess.Popen(command, cwd=REPO, env=env)
            assert pipe.result(run_id, timeout=180)["status"] == "SUCCEEDED"
        finally:
            executor.send_signal(signal.SIGTERM)  # its spans are flushed at its exit
            executor.wait(30)
        effects = sorted(pipe.effects("model", run_id), key=lambda e: e["step"])

    def run_span() -> list[ReadableSpan] | None:
        return [s for s in spans.get_finished_spans() if s.name == "invoke_agent"] or None

    (run,) = wait_for(run_span, 30, "the run's span")
    assert run.context is not None
    trace = _hex(run.context.trace_id, 32)
    exported = receiver.spans()
    # every span of both model executors is in the run's trace
    assert exported and {s["trace_id"] for s in exported} == {trace}
    parents = {_hex(s.context.span_id, 16): s for s in spans.get_finished_spans() if s.context}
    slowed = effects[1]["step"]
    chats = [
        s
        for s in exported
        if s["name"].startswith("chat ") and s["attributes"].get("agentruns.step") == slowed
    ]
    # the killed attempt's span never ended (not exported); the call made again after the
    # restart is the one chat span of that step
    (again,) = chats
    assert again["start_ns"] > killed_ns
    (first,) = [
        s
        for s in exported
        if s["name"].startswith("chat ")
        and s["attributes"].get("agentruns.step") == effects[0]["step"]
    ]
    assert first["start_ns"] < killed_ns  # the killed executor's, in the same trace
    # its parent is the effect record's context: the processor's transition, under the run's
    transition = parents[again["parent"]]
    assert transition.name.startswith("process ") and transition.parent is not None
    assert transition.parent.span_id == run.context.span_id
    # its HTTP exchange is its child and reached the model server with that context
    exchanges = [s for s in exported if s["parent"] == again["span_id"]]
    assert [s["name"] for s in exchanges] == ["POST"]
    assert any(tp.split("-")[2] == exchanges[0]["span_id"] for tp in pipe.models.traceparents)
