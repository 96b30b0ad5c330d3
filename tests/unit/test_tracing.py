"""Trace context at the edges: parsing hostile traceparent values, the run's context in its
snapshot (and snapshots written before it decode), spans only when tracing is on; the span
model (the run's span and its ids, HTTP spans without secrets, model messages opt-in and capped,
MCP requests' spans and their context in ``params._meta``) and no tracing work at all with
tracing off."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from mcp_types.version import LATEST_HANDSHAKE_VERSION
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBasedTraceIdRatio
from opentelemetry.trace import SpanKind

from agentruns.connectors.executors import spans as executor_spans
from agentruns.connectors.executors.mcp_client import MCPSession, Reply
from agentruns.connectors.executors.mcp_rules import MCPServerSpec, StdioCommand
from agentruns.processors.ids import trace_id_for
from agentruns.processors.state import RunStatus
from agentruns.streams import tracing
from agentruns.streams.codec import decode, encode
from agentruns.streams.inputs import Batch
from agentruns.streams.records import RunSlot
from tests.unit.test_processor_inputs import AT, new_path, of_event, submit

VALID = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "garbage",
        VALID.upper(),
        VALID + "-extra",  # version 00 has exactly four fields
        "ff" + VALID[2:],
        "00-" + "0" * 32 + "-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-" + "0" * 16 + "-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333-01",
        VALID + "x" * 10_000,
        b"\xff\xfe",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0\u00e9",
    ],
)
def test_a_malformed_traceparent_is_no_context(value: str | bytes | None) -> None:
    assert tracing.parse(value) is None


def test_valid_traceparents() -> None:
    assert tracing.parse(VALID) == VALID
    assert tracing.parse(VALID.encode()) == VALID
    # a later version may add fields: its first four are read as version 00's
    assert tracing.parse("01" + VALID[2:] + "-future") == VALID
    assert tracing.from_headers([("trace_id", b"x"), ("traceparent", VALID.encode())]) == VALID
    assert tracing.from_headers(None) is None
    assert tracing.headers_of(None) == []


def test_the_runs_context_is_kept_in_its_snapshot() -> None:
    slot = RunSlot("run-1", traceparent=VALID)
    record = decode(encode("Snapshot", slot.to_record()), "Snapshot").record
    assert RunSlot.from_record(record).traceparent == VALID
    assert slot.copy().traceparent == VALID


def test_a_snapshot_written_before_the_context_decodes_without_one() -> None:
    old = {k: v for k, v in RunSlot("run-1").to_record().items() if k != "traceparent"}
    data = encode("Snapshot", old, version=3)
    assert RunSlot.from_record(decode(data, "Snapshot").record).traceparent is None


def test_spans_only_when_configured() -> None:
    assert not tracing.enabled()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.configure(provider)
    try:
        span = tracing.start("child", VALID)
        child = tracing.traceparent_of(span)
        tracing.end(span, "failed")
    finally:
        tracing.configure(None)
    assert not tracing.enabled()
    (finished,) = exporter.get_finished_spans()
    assert finished.context is not None and finished.parent is not None
    assert f"{finished.context.trace_id:032x}" == VALID.split("-")[1]
    assert f"{finished.parent.span_id:016x}" == VALID.split("-")[2]
    assert child.split("-")[2] == f"{finished.context.span_id:016x}"


def test_export_is_off_unless_the_environment_asks_for_it() -> None:
    assert not tracing.configure_from_env("test", {})
    assert not tracing.configure_from_env(
        "test", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "true"}
    )
    assert not tracing.configure_from_env("test", {"OTEL_TRACES_EXPORTER": "none"})
    assert not tracing.enabled()


# --------------------------------------------------------------------------- the span model


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.configure(provider, {})
    try:
        yield exporter
    finally:
        tracing.configure(None)


def test_a_runs_span_ids_come_from_the_run() -> None:
    own = "4bf92f3577b34da6a3ce929d0e0e4736"
    trace = tracing.run_trace_id("run-1", own)
    assert tracing.parse(f"00-{trace}-{tracing.run_span_id('run-1')}-01") is not None
    assert trace == tracing.run_trace_id("run-2", own) != tracing.run_trace_id("run-1", None)
    assert tracing.run_trace_id("run-1", None) == tracing.run_trace_id(
        "run-1", trace_id_for("run-1")
    )
    assert tracing.run_trace_id("run-1", "not hex") != tracing.run_trace_id("run-1", "other")
    assert tracing.run_span_id("run-1") == tracing.run_span_id("run-1") != "0" * 16
    assert tracing.run_span_id("run-1") != tracing.run_span_id("run-2")
    # without a first context the run's span is in its own trace; with one, in that trace
    assert tracing.run_context("run-1", own, None) == (
        f"00-{trace}-{tracing.run_span_id('run-1')}-01"
    )
    assert tracing.run_context("run-1", own, VALID).split("-")[1] == VALID.split("-")[1]


def test_the_runs_span_is_made_at_its_end_with_the_ids_its_children_name(
    spans: InMemorySpanExporter,
) -> None:
    own = tracing.run_trace_id("run-1", None)
    child = tracing.start("process RunSubmitted", tracing.run_context("run-1", None, None))
    tracing.end(child)
    tracing.record_run("run-1", None, None, AT, AT + 5000, {"agentruns.run_id": "run-1"})
    tracing.record_run("run-2", None, VALID, AT, AT + 10, {}, error="FAILED")  # a caller's trace
    first, run, other = spans.get_finished_spans()
    assert run.context is not None and first.parent is not None
    assert run.parent is None and f"{run.context.trace_id:032x}" == own
    assert first.parent.span_id == run.context.span_id
    assert run.start_time == AT * 1_000_000 and run.end_time == (AT + 5000) * 1_000_000
    assert other.parent is not None and f"{other.parent.span_id:016x}" == VALID.split("-")[2]
    assert other.context is not None and f"{other.context.span_id:016x}" == tracing.run_span_id(
        "run-2"
    )
    assert not other.status.is_ok
    # the next span takes the SDK's ids again
    again = tracing.start("next", None)
    tracing.end(again)
    assert again.get_span_context().span_id != run.context.span_id


def test_the_runs_trace_is_sampled_as_the_sampler_says() -> None:
    provider = TracerProvider(sampler=ALWAYS_OFF)
    tracing.configure(provider, {})
    try:
        assert tracing.run_context("run-1", None, None).endswith("-00")
    finally:
        tracing.configure(None)
    # a ratio: about that share of the runs (the API's UUID trace ids included)
    tracing.configure(TracerProvider(sampler=ParentBasedTraceIdRatio(0.1)), {})
    try:
        sampled = [tracing.run_context(f"run-{i}", None, None) for i in range(2000)]
    finally:
        tracing.configure(None)
    assert 120 < sum(c.endswith("-01") for c in sampled) < 280


def test_an_http_span_names_no_secret_of_the_url(spans: InMemorySpanExporter) -> None:
    span = executor_spans.http_span(
        "POST", "https://user:hunter2@api.example.com:8443/v1/chat?key=sk-secret#frag", VALID
    )
    executor_spans.http_done(span, 429, None)
    (done,) = spans.get_finished_spans()
    attributes = done.attributes or {}
    assert attributes["url.full"] == "https://api.example.com:8443/v1/chat"
    assert "hunter2" not in str(attributes) and "sk-secret" not in str(attributes)
    assert attributes["http.response.status_code"] == 429 and not done.status.is_ok
    assert done.kind is SpanKind.CLIENT


def test_http_spans_of_one_url_share_its_parsed_parts_and_keep_their_own_attributes(
    spans: InMemorySpanExporter,
) -> None:
    url = "http://user:pw@127.0.0.1:8080/v1/chat/completions?key=k1"
    first = executor_spans.http_span("POST", url, VALID)
    executor_spans.http_done(first, 500, None)
    second = executor_spans.http_span("GET", url, VALID)
    executor_spans.http_done(second, 200, None)
    one, two = spans.get_finished_spans()
    assert one.attributes is not None and two.attributes is not None
    for done in (one, two):
        assert done.attributes["url.full"] == "http://127.0.0.1:8080/v1/chat/completions"
        assert done.attributes["server.address"] == "127.0.0.1"
        assert done.attributes["server.port"] == 8080
    assert (one.attributes["http.request.method"], two.attributes["http.request.method"]) == (
        "POST",
        "GET",
    )
    assert one.attributes["http.response.status_code"] == 500
    assert two.attributes["http.response.status_code"] == 200
    assert "error.type" in one.attributes and "error.type" not in two.attributes
    # the parsed parts are kept once per URL, read-only and bounded
    assert "http.response.status_code" not in executor_spans._endpoint(url)
    with pytest.raises(TypeError):
        executor_spans._endpoint(url)["url.full"] = "elsewhere"  # type: ignore[index]
    for i in range(1000):
        executor_spans._endpoint(f"http://127.0.0.1:{1000 + i}/")
    assert executor_spans._endpoint.cache_info().currsize <= 256


def _chat(span: Any, content: str) -> None:
    executor_spans.describe_chat(
        span,
        provider="openai",
        model="gpt-x",
        payload={"messages": [{"role": "user", "content": content}], "max_tokens": 10},
        outcome="finished",
        finish_reason="stop",
        response_model="gpt-x-1",
        response_id="c1",
        input_tokens=3,
        output_tokens=4,
        content="answer",
        tool_calls=[],
    )


def test_model_messages_are_off_by_default_and_capped_when_on(
    spans: InMemorySpanExporter,
) -> None:
    span = tracing.start("chat route", None, kind="CLIENT")
    _chat(span, "my card number is 4111")
    tracing.end(span)
    (off,) = spans.get_finished_spans()
    assert off.name == "chat gpt-x" and off.attributes is not None
    assert off.attributes["gen_ai.usage.input_tokens"] == 3
    assert off.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert "4111" not in str(off.attributes)

    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.configure(
        provider,
        {"AGENTRUNS_TRACE_MESSAGES": "true", "AGENTRUNS_TRACE_MESSAGES_MAX_CHARS": "200"},
    )
    span = tracing.start("chat route", None, kind="CLIENT")
    _chat(span, "x" * 10_000)
    tracing.end(span)
    (on,) = exporter.get_finished_spans()
    assert on.attributes is not None
    sent = str(on.attributes["gen_ai.input.messages"])
    assert len(sent) <= 200  # still JSON: its long strings were shortened
    assert json.loads(sent)[0]["parts"][0]["content"].endswith("...[truncated]")
    assert json.loads(str(on.attributes["gen_ai.output.messages"]))[0]["role"] == "assistant"


def test_with_tracing_off_the_processor_builds_no_span_nor_attribute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not tracing.enabled()

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("tracing work with tracing off")

    for name in ("start", "consumed", "run_context", "record_run", "sent", "end"):
        monkeypatch.setattr(tracing, name, refuse)
    path, batch = new_path(), Batch()
    path.handle(of_event(submit("r1")), batch)
    state = path.slots[0]["r1"].state
    assert state is not None and state.status is RunStatus.MODEL_RUNNING


def test_a_span_keeps_to_the_providers_limits_and_drops_what_otlp_cannot_carry() -> None:
    exporter = InMemorySpanExporter()
    limits = SpanLimits(max_span_attributes=3, max_span_attribute_length=5, max_events=1)
    provider = TracerProvider(span_limits=limits)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.configure(provider)
    try:
        span = tracing.start("s", VALID, {"a": "abcdefgh", "b": ["long value", 1]})
        span.set_attribute("c", object())  # no OTLP value: dropped, as the SDK drops it
        span.set_attribute("d", ("xyzxyzxyz",))
        span.set_attribute("e", 1)
        span.set_attribute("f", 2)  # the fourth kept value: over the limit of three
        span.add_event("first", {"n": 1})
        span.add_event("second")
        span.end()
        span.end()  # a second end is nothing
    finally:
        tracing.configure(None)
    (finished,) = exporter.get_finished_spans()
    assert dict(finished.attributes or {}) == {"a": "abcde", "b": ("long ", 1), "d": ("xyzxy",)}
    assert finished.dropped_attributes == 2
    assert [e.name for e in finished.events] == ["first"] and finished.dropped_events == 1


def test_a_span_the_sampler_drops_records_nothing_and_passes_on_an_unsampled_context() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.configure(provider)
    try:
        span = tracing.start("s", None, {"a": 1}, kind="CLIENT")
        span.set_attribute("b", 2)
        context = tracing.traceparent_of(span)
        tracing.end(span, "failed")
    finally:
        tracing.configure(None)
    assert not span.is_recording() and context.endswith("-00")
    assert exporter.get_finished_spans() == ()


def _context_of(span: ReadableSpan) -> str:
    """The traceparent naming a finished span."""
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class ScriptedWire:
    """A wire that answers as told and keeps the messages sent (the session logic under test,
    no server)."""

    def __init__(self, answers: dict[str, Reply]) -> None:
        self.answers = answers
        self.sent: list[dict[str, Any]] = []

    @property
    def session(self) -> object:
        return 1  # a stdio wire's process generation: no MCP session id

    def alive(self) -> bool:
        return True

    def opened(self, protocol: str) -> None:
        pass

    def forget(self) -> None:
        pass

    async def close(self, timeout_s: float) -> None:
        pass

    async def exchange(
        self, message: Mapping[str, Any], timeout_s: float, *, opening: bool = False
    ) -> Reply:
        self.sent.append(dict(message))
        return self.answers.get(str(message.get("method")), Reply("accepted"))


INITIALIZED = Reply(
    "result",
    {
        "protocolVersion": LATEST_HANDSHAKE_VERSION,
        "capabilities": {},
        "serverInfo": {"name": "s", "version": "1"},
    },
)


def _stdio_session(answers: dict[str, Reply]) -> tuple[MCPSession, ScriptedWire]:
    wire = ScriptedWire({"initialize": INITIALIZED, **answers})
    spec = MCPServerSpec(name="files", stdio=StdioCommand(command="files-server"))
    return MCPSession(spec, wire), wire


def test_an_mcp_request_is_a_client_span_and_its_context_rides_in_meta(
    spans: InMemorySpanExporter,
) -> None:
    error = {"code": -32602, "message": "unknown order o-9"}
    session, wire = _stdio_session({"tools/call": Reply("error", error)})
    token = tracing.OUTGOING.set(VALID)  # the effect's span
    try:
        params = {"name": "lookup", "arguments": {}, "_meta": {"agentruns/run_id": "r1"}}
        reply = asyncio.run(session.request("tools/call", params, 5.0))
    finally:
        tracing.OUTGOING.reset(token)
    assert reply.kind == "error"
    finished = {s.name: s for s in spans.get_finished_spans()}
    assert set(finished) == {"initialize", "notifications/initialized", "tools/call lookup"}
    call = finished["tools/call lookup"]
    assert call.kind is SpanKind.CLIENT and call.parent is not None
    assert f"{call.parent.span_id:016x}" == VALID.split("-")[2]
    attributes = dict(call.attributes or {})
    assert attributes["mcp.method.name"] == "tools/call"
    assert attributes["gen_ai.tool.name"] == "lookup"
    assert attributes["network.transport"] == "pipe" and "server.address" not in attributes
    assert attributes["mcp.protocol.version"] == LATEST_HANDSHAKE_VERSION
    assert "mcp.session.id" not in attributes  # stdio has none
    assert attributes["rpc.response.status_code"] == attributes["error.type"] == "-32602"
    assert call.status.description == "unknown order o-9"
    assert "jsonrpc.request.id" not in dict(finished["notifications/initialized"].attributes or {})
    # every message carries its own span's context; the caller's _meta is kept
    (sent,) = [m for m in wire.sent if m["method"] == "tools/call"]
    assert sent["params"]["_meta"] == {
        "agentruns/run_id": "r1",
        "traceparent": _context_of(call),
    }
    assert params["_meta"] == {"agentruns/run_id": "r1"}  # not changed in place
    notified = [m for m in wire.sent if m["method"] == "notifications/initialized"]
    assert notified[0]["params"]["_meta"]["traceparent"] == _context_of(
        finished["notifications/initialized"]
    )


def test_an_mcp_request_that_got_no_answer_is_an_error_span(
    spans: InMemorySpanExporter,
) -> None:
    lost = Reply("unknown", detail="the server process ended")
    session, _ = _stdio_session({"tools/list": lost})
    assert asyncio.run(session.request("tools/list", {}, 5.0)).kind == "unknown"
    (listed,) = [s for s in spans.get_finished_spans() if s.name == "tools/list"]
    assert (listed.attributes or {})["error.type"] == "unknown"
    assert not listed.status.is_ok and "gen_ai.tool.name" not in (listed.attributes or {})
    assert listed.parent is None  # no effect's context: a trace of its own


def test_with_tracing_off_an_mcp_request_passes_the_effects_context_on() -> None:
    session, wire = _stdio_session({"tools/call": Reply("result", {"content": []})})
    token = tracing.OUTGOING.set(VALID)
    try:
        asyncio.run(session.request("tools/call", {"name": "lookup", "arguments": {}}, 5.0))
    finally:
        tracing.OUTGOING.reset(token)
    assert [m["params"]["_meta"] for m in wire.sent] == [{"traceparent": VALID}] * 3
    session, wire = _stdio_session({})
    asyncio.run(session.request("tools/list", {}, 5.0))  # no effect: the messages unchanged
    assert all("_meta" not in m.get("params", {}) for m in wire.sent)


@pytest.mark.parametrize("follows", [True, False])
def test_a_child_of_a_dropped_parent_is_dropped_only_when_the_sampler_follows_the_parent(
    follows: bool,
) -> None:
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    exporter = InMemorySpanExporter()
    sampler = ParentBased(ALWAYS_ON) if follows else ParentBased(ALWAYS_ON, ALWAYS_ON, ALWAYS_ON)
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.configure(provider)
    dropped = VALID[:-2] + "00"
    try:
        span = tracing.start("child", dropped, {"a": 1}, kind="CONSUMER", links=[VALID])
        context = tracing.traceparent_of(span)
        tracing.end(span)
    finally:
        tracing.configure(None)
    if follows:  # the parent's own context passes on, unsampled, and nothing is recorded
        assert context == dropped and exporter.get_finished_spans() == ()
    else:
        (finished,) = exporter.get_finished_spans()
        assert context.split("-")[1] == VALID.split("-")[1] and context.endswith("-01")
        assert finished.parent is not None and finished.parent.span_id == int(VALID[36:52], 16)


@pytest.mark.parametrize("keeps", [True, False])
def test_a_child_of_a_sampled_parent_is_kept_without_the_sampler_only_when_it_keeps_the_parent(
    keeps: bool,
) -> None:
    from opentelemetry.sdk.trace.sampling import ParentBased

    exporter = InMemorySpanExporter()
    # the shortcut answers for a parent-based sampler that keeps a sampled parent's children;
    # any other is asked (this one drops them)
    sampler = ParentBased(ALWAYS_OFF) if keeps else ParentBased(ALWAYS_OFF, ALWAYS_OFF)
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.configure(provider)
    try:
        child = tracing.start("child", VALID, {"a": 1}, kind="CONSUMER")  # VALID is sampled
        root = tracing.start("root", None, {"a": 1})  # the root sampler: ALWAYS_OFF
        tracing.end(child)
        tracing.end(root)
    finally:
        tracing.configure(None)
    assert not root.is_recording() and tracing.traceparent_of(root).endswith("-00")
    if keeps:
        (finished,) = exporter.get_finished_spans()
        assert finished.name == "child" and dict(finished.attributes or {}) == {"a": 1}
        assert finished.kind is SpanKind.CONSUMER
        assert finished.parent is not None and finished.parent.span_id == int(VALID[36:52], 16)
    else:
        assert exporter.get_finished_spans() == ()


def test_an_exported_span_is_encoded_as_it_was_recorded_as_the_sdk_encodes_its_readable_span(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With OTLP/HTTP configured, a recorded span goes to the batch processor as it is (no
    ReadableSpan made per span); its OTLP bytes equal the SDK encoder's of the ReadableSpan
    made of it, within the span limits the environment sets."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from agentruns.streams import otlp_encoding

    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",  # nothing is sent here
        "OTEL_BSP_SCHEDULE_DELAY": "3600000",
        "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "4",
        "OTEL_SPAN_EVENT_COUNT_LIMIT": "1",
        "OTEL_SPAN_LINK_COUNT_LIMIT": "1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert tracing.configure_from_env("test", env)
    try:
        processor = tracing._direct
        assert processor is not None
        linked = VALID[:36] + "00f067aa0ba902b7-01"
        span = tracing.start(
            "process X", VALID, {"a": "x", "b": 2, "c": 1.5}, kind="CONSUMER", links=[linked]
        )
        span.set_attribute("d", ("p", "q"))
        span.set_attribute("e", True)  # over the limit of four
        span.add_event("wait", {"n": 1})
        span.add_event("dropped")
        tracing.end(span, "failed")
        span.set_attribute("late", 1)  # an ended span changes no more: it waits for export
        span.add_event("late")
        queued = list(processor._batch_processor._queue)
        assert queued == [span]  # the recorded span itself
        ours = ExportTraceServiceRequest.FromString(otlp_encoding.encode(queued))
        assert ours == encode_spans(tracing._readable(queued))
        (written,) = ours.resource_spans[0].scope_spans[0].spans
        assert [a.key for a in written.attributes] == ["a", "b", "c", "d"]
        assert written.dropped_attributes_count == 1 and written.dropped_events_count == 1
        assert written.status.message == "failed" and len(written.links) == 1
        processor._batch_processor._queue.clear()
    finally:
        assert tracing._provider is not None
        tracing._provider.shutdown()
        tracing.configure(None)
    assert tracing._direct is None


def test_flush_with_tracing_off_has_nothing_to_wait_for() -> None:
    tracing.configure(None)
    assert tracing.flush(0.1) is True
