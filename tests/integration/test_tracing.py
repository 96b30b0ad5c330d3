"""One run through the pipeline is one connected trace.

The components run in this process (the processor, the model and tool executors, the timer
service, the sink, each on its own thread, with the test servers), against the real broker and
Postgres, so that one in-memory exporter sees every span. They share nothing but the topics:
the trace context reaches each of them only as it would across processes, in record and HTTP
headers and in the run's snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentruns.connectors.api.client import RunsProducer
from agentruns.streams import tracing
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

    finished = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished if s.context is not None}
    (submit,) = [s for s in finished if s.name == "submit"]
    assert submit.parent is None and submit.context is not None
    trace_id = submit.context.trace_id
    assert {s.context.trace_id for s in finished if s.context is not None} == {trace_id}
    for span in finished:  # every span's parents lead back to the submit
        chain = span
        while chain.parent is not None:
            assert chain.parent.span_id in by_id, f"{span.name}: parent not in the trace"
            chain = by_id[chain.parent.span_id]
        assert chain is submit, span.name

    names = [s.name for s in finished]
    transitions = [n for n in names if n.startswith("transition ")]
    assert len(transitions) == len(events)  # one per input applied
    assert sorted(n.removeprefix("transition ") for n in transitions) == sorted(
        e["type"] for e in events
    )
    assert names.count("project RunSubmitted") == 1
    executed = {s.context.span_id for s in finished if s.name.startswith("execute ")}
    assert {"execute CallModel", "execute CallTool"} <= set(names)
    failed = [s for s in finished if s.name == "execute CallTool" and not s.status.is_ok]
    assert len(failed) == 1  # the 429
    # the HTTP calls to the model and the tools carried the span of the effect they serve
    for server in (pipe.models, pipe.tools):
        seen = list(server.traceparents)
        assert seen
        for value in seen:
            _, trace, span_id, _ = value.split("-")
            assert trace == _hex(trace_id, 32)
            assert int(span_id, 16) in executed
