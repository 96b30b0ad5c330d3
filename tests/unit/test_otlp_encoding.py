"""The OTLP bytes `streams/otlp_encoding.py` writes are the exporter's: decoded with the official
message classes, they equal what the OpenTelemetry exporter builds for the same spans, whatever
their attributes, events, links, status, kind, parent and trace state."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from agentruns.streams import otlp_encoding

TEXT = st.text(max_size=40) | st.sampled_from(["kafka", "agentruns.events", "chat gpt-4o", "é✓"])
SCALAR = (
    TEXT
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)
    | st.floats(allow_nan=False)
    | st.text(min_size=257, max_size=300)
)
VALUE = (
    SCALAR
    | st.lists(st.text(max_size=10), max_size=3).map(tuple)
    | st.lists(st.integers(-5, 5), max_size=3).map(tuple)
)
ATTRIBUTES = st.dictionaries(st.text(min_size=1, max_size=30), VALUE, max_size=8)
IDS = st.integers(min_value=1, max_value=(1 << 64) - 1)
TRACE_IDS = st.integers(min_value=1, max_value=(1 << 128) - 1)
STATE = st.none() | st.just(TraceState([("vendor", "v1")]))


@st.composite
def contexts(draw: Any, remote: bool | None = None) -> SpanContext:
    return SpanContext(
        draw(TRACE_IDS),
        draw(IDS),
        draw(st.booleans()) if remote is None else remote,
        TraceFlags(draw(st.sampled_from([0, 1]))),
        draw(STATE),
    )


RESOURCE = Resource.create({"service.name": "agentruns-test"})
SCOPES = [InstrumentationScope("agentruns"), InstrumentationScope("other", "1.0", "https://s")]


@st.composite
def spans(draw: Any) -> ReadableSpan:
    start = draw(st.integers(min_value=0, max_value=(1 << 63)))
    code = draw(st.sampled_from(list(StatusCode)))
    description = draw(st.none() | TEXT) if code is StatusCode.ERROR else None
    return ReadableSpan(
        name=draw(TEXT),
        context=draw(contexts(remote=False)),
        parent=draw(st.none() | contexts()),
        resource=RESOURCE,
        attributes=draw(ATTRIBUTES),
        events=[
            Event(draw(TEXT), draw(ATTRIBUTES), draw(st.integers(0, 1 << 62)))
            for _ in range(draw(st.integers(0, 2)))
        ],
        links=[Link(draw(contexts()), draw(ATTRIBUTES)) for _ in range(draw(st.integers(0, 2)))],
        kind=draw(st.sampled_from(list(SpanKind))),
        status=Status(code, description),
        start_time=start,
        end_time=start + draw(st.integers(0, 10**9)),
        instrumentation_scope=draw(st.sampled_from(SCOPES)),
    )


@settings(max_examples=300)
@given(st.lists(spans(), max_size=5))
def test_what_is_written_is_what_the_exporter_builds(batch: list[ReadableSpan]) -> None:
    ours = ExportTraceServiceRequest.FromString(otlp_encoding.encode(batch))
    assert ours == encode_spans(batch)


def test_a_value_of_no_otlp_type_is_left_out_as_the_exporter_leaves_it_out() -> None:
    span = ReadableSpan(
        name="s",
        context=SpanContext(1, 2, False, TraceFlags(1)),
        resource=RESOURCE,
        attributes={"ok": 1, "too large": 1 << 70, "object": object()},  # type: ignore[dict-item]
        instrumentation_scope=SCOPES[0],
        start_time=1,
        end_time=2,
    )
    decoded = ExportTraceServiceRequest.FromString(otlp_encoding.encode([span]))
    (written,) = decoded.resource_spans[0].scope_spans[0].spans
    assert [a.key for a in written.attributes] == ["ok"]


def test_no_span_is_an_empty_request() -> None:
    assert otlp_encoding.encode([]) == b""
    assert ExportTraceServiceRequest.FromString(b"") == encode_spans([])


def test_a_number_and_a_flag_that_compare_equal_keep_their_own_types() -> None:
    # True == 1 and False == 0: the encoded attributes kept from span to span are told apart by
    # type, or a count of 1 after a flag of True would be written as a flag
    def written(value: object) -> Any:
        span = ReadableSpan(
            name="s",
            context=SpanContext(1, 2, False, TraceFlags(1)),
            resource=RESOURCE,
            attributes={"k": value},  # type: ignore[dict-item]
            instrumentation_scope=SCOPES[0],
            start_time=1,
            end_time=2,
        )
        decoded = ExportTraceServiceRequest.FromString(otlp_encoding.encode([span]))
        return decoded.resource_spans[0].scope_spans[0].spans[0].attributes[0].value

    for first, second in ((True, 1), (1, True), (False, 0), (0, False)):
        assert written(first).WhichOneof("value") == type(first).__name__ + "_value"
        assert written(second).WhichOneof("value") == type(second).__name__ + "_value"


def test_the_kept_attribute_fields_stay_bounded_and_right_when_emptied() -> None:
    spans = [
        ReadableSpan(
            name=f"span {i % 7}",
            context=SpanContext(1, i + 1, False, TraceFlags(1)),
            resource=RESOURCE,
            attributes={"run": f"run-{i}", "seq": i % 2000 - 1000, "kept": i % 2 == 0},
            instrumentation_scope=SCOPES[0],
            start_time=1,
            end_time=2,
        )
        for i in range(3 * otlp_encoding._FIELDS_MAX)
    ]
    for start in range(0, len(spans), 512):
        batch = spans[start : start + 512]
        ours = ExportTraceServiceRequest.FromString(otlp_encoding.encode(batch))
        assert ours == encode_spans(batch)
        assert len(otlp_encoding._FIELDS) <= otlp_encoding._FIELDS_MAX
