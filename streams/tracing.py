"""W3C trace context on records and HTTP calls, and OpenTelemetry spans when tracing is on.

A run is one trace. Its context travels as a `traceparent` value (W3C Trace Context,
``00-<trace id>-<span id>-<flags>``): an HTTP header into the API and out to tools and models,
a record header on the inbox, effect, event and result topics, and in the run's snapshot (so a
transition with no context of its own, after a restart or from a timer, continues the run's
trace). The pure core never sees it.

Tracing is off unless configured (`configure_from_env`, or `configure` with a provider):
then no span is made and nothing of OpenTelemetry is imported; the context is only passed on,
so that a component with tracing on continues the trace of one with it off. With it on, each
edge makes a span as the child of the context it received and passes on the span's own.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("agentruns.tracing")

HEADER = "traceparent"
#: Longer values are not a trace context: the API refuses them, every other reader ignores them.
MAX_CHARS = 512
_VALUE = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16

#: The context of the effect being executed, for the HTTP call a handler makes (set by the
#: executor loop around each handler call, in the pool thread running it).
OUTGOING: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "agentruns_traceparent", default=None
)

_tracer: Tracer | None = None
_provider: TracerProvider | None = None


def parse(value: str | bytes | None) -> str | None:
    """`value` as a version-00 traceparent, or None when it is not a valid one (malformed,
    zero ids, version ff, too long): the caller then starts a new trace."""
    if value is None or len(value) > MAX_CHARS:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    value = value.strip()
    match = _VALUE.match(value)
    if match is None:
        return None
    version, trace_id, span_id, flags = match.groups()
    if version == "ff" or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    # version 00 is exactly 55 characters; a later version may append fields after a dash
    if len(value) != 55 and (version == "00" or value[55] != "-"):
        return None
    return f"00-{trace_id}-{span_id}-{flags}"


def from_headers(
    headers: Mapping[str, str | bytes | None] | Iterable[tuple[str, str | bytes | None]] | None,
) -> str | None:
    """The valid traceparent among record headers, if any."""
    if isinstance(headers, Mapping):
        return parse(headers.get(HEADER))
    for name, value in headers or ():
        if name == HEADER:
            return parse(value)
    return None


def headers_of(traceparent: str | None) -> list[tuple[str, str | bytes | None]]:
    """Record headers carrying `traceparent` (none when there is no context)."""
    return [] if traceparent is None else [(HEADER, traceparent.encode())]


def outgoing_headers() -> dict[str, str]:
    """HTTP headers for a call made on behalf of the effect being executed."""
    value = OUTGOING.get()
    return {} if value is None else {HEADER: value}


# --------------------------------------------------------------------------- spans


def enabled() -> bool:
    return _tracer is not None


def start(name: str, parent: str | None, attributes: Mapping[str, Any] | None = None) -> Span:
    """A span (tracing must be on) as the child of `parent`, or the root of a new trace."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    assert _tracer is not None, "tracing is off"
    context = None
    if parent is not None:
        context = TraceContextTextMapPropagator().extract({HEADER: parent})
    return _tracer.start_span(name, context=context, attributes=dict(attributes or {}))


def traceparent_of(span: Span) -> str:
    """The traceparent naming `span`: what its children continue."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def end(span: Span, error: str | None = None) -> None:
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error[:500]))
    span.end()


def configure(provider: TracerProvider | None) -> None:
    """Make spans with `provider` (None: tracing off)."""
    global _tracer, _provider
    _provider = provider
    _tracer = None if provider is None else provider.get_tracer("agentruns")


def configure_from_env(service: str, env: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on with an OTLP exporter when the standard variables ask for one.

    On when `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set, or
    `OTEL_TRACES_EXPORTER` is `otlp`; off when `OTEL_SDK_DISABLED` is true or
    `OTEL_TRACES_EXPORTER` is `none`. The exporter reads the other OTEL_* variables itself
    (headers, protocol, timeouts). The service name is `OTEL_SERVICE_NAME`, else
    `agentruns-<service>`. Without the `agentruns[otel]` extra installed, it stays off (logged).
    """
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter_name = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if exporter_name == "none" or not (endpoint or exporter_name == "otlp"):
        return False
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

        exporter: SpanExporter
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as OTLPHttpSpanExporter,
            )

            exporter = OTLPHttpSpanExporter()
    except ImportError as exc:
        log.warning("OTLP export is configured but not installed (agentruns[otel]): %s", exc)
        return False
    name = env.get("OTEL_SERVICE_NAME") or f"agentruns-{service}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    configure(provider)
    atexit.register(provider.shutdown)
    log.info("tracing on: OTLP (%s) to %s", protocol, endpoint or "the default endpoint")
    return True


__all__ = [
    "HEADER",
    "MAX_CHARS",
    "OUTGOING",
    "configure",
    "configure_from_env",
    "enabled",
    "end",
    "from_headers",
    "headers_of",
    "outgoing_headers",
    "parse",
    "start",
    "traceparent_of",
]
