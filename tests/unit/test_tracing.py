"""Trace context at the edges: parsing hostile traceparent values, the run's context in its
snapshot (and snapshots written before it decode), spans only when tracing is on."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentruns.streams import tracing
from agentruns.streams.codec import decode, encode
from agentruns.streams.records import RunSlot

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
