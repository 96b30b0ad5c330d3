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
import functools
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

log = logging.getLogger("agentruns.tracing")

HEADER = "traceparent"
#: Longer values are not a trace context: the API refuses them, every other reader ignores them.
MAX_CHARS = 512
_VALUE = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
_HEX32 = re.compile(r"[0-9a-f]{32}")

#: The context of the effect being executed, for the HTTP call a handler makes (set by the
#: executor loop around each handler call, in the pool thread running it).
OUTGOING: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "agentruns_traceparent", default=None
)

#: The span the executor loop made for the effect being executed, for the handler to name and
#: describe (`current`): None when tracing is off.
CURRENT: contextvars.ContextVar[Span | None] = contextvars.ContextVar(
    "agentruns_span", default=None
)

#: Messages on model spans (`gen_ai.input.messages`, `gen_ai.output.messages`) are off by
#: default, since they may hold personal data: `AGENTRUNS_TRACE_MESSAGES=true` turns them on,
#: each attribute cut at `AGENTRUNS_TRACE_MESSAGES_MAX_CHARS` (default 16 KiB).
MESSAGES_DEFAULT_MAX_CHARS = 16 * 1024

_tracer: Any = None  # the SDK's Tracer: its sampler, ids, resource and span processors
_provider: TracerProvider | None = None
# opentelemetry.trace, imported once tracing is configured (never with tracing off)
_otel: Any = None
_messages_max_chars = 0  # 0: messages are not recorded
# The ids the next span takes (`start`): the run's span is made at the run's end with the
# id its children already name.
_NEXT_IDS: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "agentruns_next_ids", default=None
)


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


def start(
    name: str,
    parent: str | None,
    attributes: Mapping[str, Any] | None = None,
    *,
    kind: str = "INTERNAL",
    links: Sequence[str | None] = (),
    start_ms: int | None = None,
) -> Span:
    """A span (tracing must be on) as the child of `parent`, or the root of a new trace.

    `kind` names an OpenTelemetry SpanKind (INTERNAL, CLIENT, PRODUCER, CONSUMER); `links`
    are the contexts of the spans that produced what this one consumes (None ones skipped);
    `start_ms` backdates the start (a wait measured once it is over). The provider's sampler
    decides; a span it keeps is a `_Recording` handed to the provider's span processors when
    it ends, one it drops records nothing."""
    assert _tracer is not None and _otel is not None, "tracing is off"
    otel, tracer = _otel, _tracer
    context = None if parent is None else _context_of(parent)
    if _parent_decides and context is not None and not context.trace_flags.sampled:
        # the parent was dropped, and the sampler follows it: nothing to decide nor record,
        # and the parent's context, unsampled, is what the children continue
        return _dropped(parent)  # type: ignore[no-any-return]
    fixed = _NEXT_IDS.get()
    if fixed is not None:
        trace_id, span_id = fixed
    else:
        span_id = tracer.id_generator.generate_span_id()
        trace_id = tracer.id_generator.generate_trace_id() if context is None else context.trace_id
    span_kind = _KINDS[kind]
    linked = [otel.Link(_context_of(link)) for link in links if link is not None and link != parent]
    values = dict(attributes or ())
    if _parent_kept and context is not None and context.trace_flags.sampled:
        # what the sampler answers a sampled parent: kept, with the parent's trace state and
        # the span's own attributes
        trace_state = context.trace_state
    else:
        sampled = tracer.sampler.should_sample(
            _parent(parent), trace_id, name, span_kind, attributes, linked
        )
        trace_state = sampled.trace_state
        if not sampled.decision.is_sampled():
            return otel.NonRecordingSpan(  # type: ignore[no-any-return]
                otel.SpanContext(trace_id, span_id, False, _UNSAMPLED, trace_state)
            )
        if sampled.attributes:
            values.update(sampled.attributes)
    # a _Recording answers every Span call agentruns makes (tests/unit/test_tracing.py)
    return cast(
        "Span",
        _Recording(
            name,
            otel.SpanContext(trace_id, span_id, False, _SAMPLED, trace_state),
            context,
            span_kind,
            values,
            linked,
            _time_ns() if start_ms is None else start_ms * 1_000_000,
        ),
    )


@functools.lru_cache(maxsize=4096)
def _context_of(traceparent: str) -> Any:
    """The SpanContext a traceparent names (remote); the same few (a run's span, an effect's)
    come again and again, and a SpanContext is immutable."""
    assert _otel is not None
    _, trace_id, span_id, flags = traceparent.split("-")[:4]
    return _otel.SpanContext(
        int(trace_id, 16), int(span_id, 16), True, _otel.TraceFlags(int(flags, 16))
    )


@functools.lru_cache(maxsize=4096)
def _parent(parent: str | None) -> Any:
    """The OpenTelemetry Context holding `parent` as the current span, for the sampler (a
    Context is immutable)."""
    if parent is None:
        return None
    assert _otel is not None
    return _otel.set_span_in_context(_otel.NonRecordingSpan(_context_of(parent)))


@functools.lru_cache(maxsize=4096)
def _dropped(parent: str) -> Any:
    """The span of a dropped parent's child: the parent's context, recording nothing."""
    assert _otel is not None
    return _otel.NonRecordingSpan(_context_of(parent))


def _follows_parent(sampler: Any) -> bool:
    """Whether `sampler` drops every child of a dropped remote parent: the SDK's parent-based
    samplers as the OTEL_TRACES_SAMPLER variable makes them (``parentbased_*``)."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    dropped = getattr(sampler, "_remote_parent_not_sampled", None)
    return isinstance(sampler, ParentBased) and dropped is ALWAYS_OFF


def _keeps_parent(sampler: Any) -> bool:
    """Whether `sampler` keeps every child of a sampled remote parent, adding no attribute:
    the SDK's parent-based samplers as the OTEL_TRACES_SAMPLER variable makes them."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    kept = getattr(sampler, "_remote_parent_sampled", None)
    return isinstance(sampler, ParentBased) and kept is ALWAYS_ON


#: Attribute values OpenTelemetry takes as they are (sequences of them are kept as tuples).
_PRIMITIVES = (str, bool, int, float)
_FAST = frozenset(_PRIMITIVES)


class _Recording:
    """A sampled span, recorded in plain fields. When it ends it goes to the provider's span
    processors as the SDK's `ReadableSpan`; with the OTLP/HTTP export `configure_from_env`
    sets up, it is queued as it is instead (`_direct`), and its export reads the fields a
    ReadableSpan has (`name`, `attributes`, ...) off it.

    The SDK's own span guards every call with a lock and checks every attribute value as it
    is set; ours is made, described and ended by one thread, and its values are checked once,
    after its end, against the same limits (`SpanLimits`: the number of attributes, events and
    links, the length of a value). Making the SDK's span was about half of what a span cost,
    and a ReadableSpan of each a quarter of what was left (docs/benchmarks.md, Tracing on and
    off)."""

    __slots__ = (
        "_attributes",
        "_events",
        "_links",
        "_sealed",
        "_status",
        "context",
        "end_time",
        "kind",
        "name",
        "parent",
        "resource",
        "start_time",
    )

    def __init__(
        self,
        name: str,
        context: Any,
        parent: Any,
        kind: Any,
        attributes: dict[str, Any],
        links: list[Any],
        start_ns: int,
    ) -> None:
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self._attributes = attributes
        self._links = links
        self.start_time = start_ns
        self._events: list[Any] = []
        self._status: Any = None
        self.end_time: int | None = None
        self.resource: Any = None
        self._sealed: tuple[dict[str, Any], int, list[Any], list[Any]] | None = None

    def get_span_context(self) -> Any:
        return self.context

    def is_recording(self) -> bool:
        return self.end_time is None

    # An ended span changes no more, as the SDK's does not: the export thread reads it.

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_attribute(self, key: str, value: Any) -> None:
        if self.end_time is None:
            self._attributes[key] = value

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None
    ) -> None:
        if self.end_time is None:
            self._events.append((name, dict(attributes or ()), timestamp or _time_ns()))

    def set_status(self, status: Any, description: str | None = None) -> None:
        assert _otel is not None
        if self.end_time is not None:
            return
        if not isinstance(status, _otel.Status):
            status = _otel.Status(status, description)
        self._status = status

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = _time_ns() if end_time is None else end_time
        if _tracer is None:  # tracing was turned off since the span began
            return
        self.resource = _tracer.resource
        if _direct is not None:
            _direct.on_end(self)
        else:
            _tracer.span_processor.on_end(_ended(self))

    # What the OTLP encoding reads (`otlp_encoding.encode`) beyond the plain fields, named as
    # the SDK's ReadableSpan names it (so are the fields): the direct path exports it as it is.

    @property
    def status(self) -> Any:
        return self._status or _UNSET

    @property
    def instrumentation_scope(self) -> Any:
        return _scope

    @property
    def attributes(self) -> dict[str, Any]:
        return self._seal()[0]

    @property
    def dropped_attributes(self) -> int:
        return self._seal()[1]

    @property
    def events(self) -> list[Any]:
        return self._seal()[2]

    @property
    def dropped_events(self) -> int:
        return len(self._events) - len(self._seal()[2])

    @property
    def links(self) -> list[Any]:
        return self._seal()[3]

    @property
    def dropped_links(self) -> int:
        return len(self._links) - len(self._seal()[3])

    def _seal(self) -> tuple[dict[str, Any], int, list[Any], list[Any]]:
        """Its attributes within the span limits and how many were dropped, its events and
        links within them (once: an ended span changes no more)."""
        if self._sealed is None:
            limits = _span_limits
            attributes, dropped = _limited(self._attributes, limits, "span")
            events = [
                _Event(name, _limited(values, limits, "event")[0], at)
                for name, values, at in self._events[: limits.max_events]
            ]
            self._sealed = (attributes, dropped, events, self._links[: limits.max_links])
        return self._sealed


_SAMPLED: Any = None
_UNSAMPLED: Any = None


_time_ns = time.time_ns


def _limited(values: dict[str, Any], limits: Any, what: str) -> tuple[dict[str, Any], int]:
    """``values`` within `limits` (`SpanLimits`): at most ``max_span_attributes`` of them
    (``max_event_attributes`` / ``max_link_attributes`` for ``what``), strings cut at
    ``max_attribute_length``, sequences kept as tuples of primitives; a value of another type
    is dropped (logged), as the SDK drops it. Returns them (``values`` itself when nothing
    changes: an ended span's own copy, which changes no more) and how many were dropped."""
    if what == "span":
        most, length = limits.max_span_attributes, limits.max_span_attribute_length
    else:
        most, length = getattr(limits, f"max_{what}_attributes"), limits.max_attribute_length
    if length is None and (most is None or len(values) <= most):
        for value in values.values():
            if type(value) not in _FAST:
                break
        else:  # the common case: a few numbers and strings, no length limit
            return values, 0
    out: dict[str, Any] = {}
    dropped = 0
    for key, value in values.items():
        if most is not None and len(out) >= most:
            dropped += 1
            continue
        if isinstance(value, _PRIMITIVES):
            if length is not None and isinstance(value, str):
                value = value[:length]
            out[key] = value
        elif isinstance(value, list | tuple) and all(isinstance(v, _PRIMITIVES) for v in value):
            if length is not None:
                value = [v[:length] if isinstance(v, str) else v for v in value]
            out[key] = tuple(value)
        elif value is not None:
            log.warning("span attribute %s of type %s dropped", key, type(value).__name__)
    return out, dropped


def _ended(span: _Recording) -> Any:
    """The SDK's `ReadableSpan` of an ended `_Recording`, within the tracer's span limits."""
    attributes, dropped, events, links = span._seal()
    return _Ended(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=attributes,
        events=events,
        links=links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=_scope,
        dropped=(dropped, span.dropped_events, span.dropped_links),
    )


def _readable(spans: Sequence[Any]) -> list[Any]:
    """``spans`` as the SDK's ReadableSpans (a recorded one made into one), for an encoding
    other than `otlp_encoding`'s."""
    return [_ended(s) if isinstance(s, _Recording) else s for s in spans]


_span_limits: Any = None
_scope: Any = None
_parent_decides = False  # the sampler drops every child of a dropped parent (`_follows_parent`)
_parent_kept = False  # the sampler keeps every child of a sampled parent (`_keeps_parent`)
_Ended: Any = None
_UNSET: Any = None  # the status of a span nothing set one on
_Event: Any = None  # the SDK's span event
_KINDS: dict[str, Any] = {}  # SpanKind by name
# The provider's only span processor, when it queues a recorded span as it is for an exporter
# that encodes with `otlp_encoding` (`configure_from_env`): no ReadableSpan is made per span.
_direct: Any = None


def _readable_type() -> Any:
    from opentelemetry.sdk.trace import ReadableSpan

    class Ended(ReadableSpan):
        """A ReadableSpan that tells what the limits dropped (the SDK reads it off its bounded
        containers, which ours are not)."""

        def __init__(self, *, dropped: tuple[int, int, int], **fields: Any) -> None:
            super().__init__(**fields)
            self._dropped = dropped

        @property
        def dropped_attributes(self) -> int:
            return self._dropped[0]

        @property
        def dropped_events(self) -> int:
            return self._dropped[1]

        @property
        def dropped_links(self) -> int:
            return self._dropped[2]

    return Ended


def current() -> Span | None:
    """The span of the effect being executed, or None (tracing off)."""
    return CURRENT.get()


def end_at(span: Span, end_ms: int, error: str | None = None) -> None:
    """End `span` at `end_ms` (ms since the epoch)."""
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error[:500]))
    span.end(end_time=end_ms * 1_000_000)


# --------------------------------------------------------------------------- the run's span
#
# A run is one `invoke_agent` span, the parent of every span of the run. It lasts as long as
# the run (days, when it waits for a person), so no process holds it open: its id is derived
# from the run id, its children name it from the first step on, and the processor makes it
# (backdated to the submission) when the run ends. Its trace id is the run's trace id when that
# is one (32 hex digits, as the API derives it), so the run's trace is found by the run.


def _digest(text: str, chars: int) -> str:
    value = hashlib.sha256(text.encode()).hexdigest()[:chars]
    return value if value.strip("0") else "1".rjust(chars, "0")


def run_trace_id(run_id: str, trace_id: str | None) -> str:
    """The trace id of a run's trace when no caller's trace contains it: derived from the run's
    own trace id (`trace_id`; None: the one the API derives from the run id), the same
    everywhere the run is known. Not that id itself: the API's is a UUID, whose fixed version
    and variant bits sit where a ratio sampler reads the trace id (`traceidratio` below one half
    would then sample no run)."""
    if trace_id is None:
        from agentruns.processors.ids import trace_id_for

        trace_id = trace_id_for(run_id)
    return _digest(f"trace:{trace_id}", 32)


def run_span_id(run_id: str) -> str:
    return _digest(f"invoke_agent:{run_id}", 16)


def run_context(run_id: str, trace_id: str | None, first: str | None) -> str:
    """The traceparent of the run's span. `first` is the first context the run saw (the
    submitter's span, kept in the run's snapshot): the run's span is in its trace; without one,
    in the run's own trace, sampled as the tracer's sampler decides for that trace id."""
    if first is not None:
        _, trace, _, flags = first.split("-")[:4]
    else:
        trace = run_trace_id(run_id, trace_id)
        flags = "01" if _sampled(trace) else "00"
    return f"00-{trace}-{run_span_id(run_id)}-{flags}"


def _sampled(trace: str) -> bool:
    if _tracer is None:
        return True
    sampler = getattr(_tracer, "sampler", None)
    if sampler is None:
        return True
    result = sampler.should_sample(None, int(trace, 16), "invoke_agent")
    return bool(result.decision.is_sampled())


def record_run(
    run_id: str,
    trace_id: str | None,
    first: str | None,
    start_ms: int,
    end_ms: int,
    attributes: Mapping[str, Any],
    error: str | None = None,
) -> None:
    """Make the run's `invoke_agent` span (tracing must be on), from `start_ms` to `end_ms`:
    the root of the run's own trace, or the child of `first` when that is another trace (a
    caller's)."""
    own = run_trace_id(run_id, trace_id)
    parent = None if first is None or first.split("-")[1] == own else first
    trace = own if parent is None else first.split("-")[1]  # type: ignore[union-attr]
    token = _NEXT_IDS.set((int(trace, 16), int(run_span_id(run_id), 16)))
    try:
        span = start("invoke_agent", parent, attributes, start_ms=start_ms)
    finally:
        _NEXT_IDS.reset(token)
    end_at(span, max(end_ms, start_ms), error)


# --------------------------------------------------------------------------- attributes


def consumed(topic: str, partition: int, offset: int, group: str) -> dict[str, Any]:
    """The OpenTelemetry messaging attributes of a record processed from Kafka."""
    return {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.destination.name": topic,
        "messaging.destination.partition.id": str(partition),
        "messaging.consumer.group.name": group,
        "messaging.kafka.offset": offset,
    }


def sent(topic: str, partition: int | None = None) -> dict[str, Any]:
    """The OpenTelemetry messaging attributes of a record sent to Kafka."""
    out: dict[str, Any] = {
        "messaging.system": "kafka",
        "messaging.operation.type": "send",
        "messaging.destination.name": topic,
    }
    if partition is not None:
        out["messaging.destination.partition.id"] = str(partition)
    return out


def messages_on() -> bool:
    """Whether model spans carry the input and output messages (opt-in)."""
    return _messages_max_chars > 0


_CUT = "...[truncated]"


def capped_json(value: Any) -> str:
    """`value` as JSON of at most the configured size (messages on model spans): its long
    strings are shortened first, so that it stays JSON a viewer can show; cut as text last."""
    limit = _messages_max_chars
    text = json.dumps(value, ensure_ascii=False, default=str)
    if len(text) <= limit:
        return text
    strings = _count_strings(value)
    budget = max(16, limit // (2 * max(strings, 1)))
    text = json.dumps(_shortened(value, budget), ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: max(limit - len(_CUT), 0)] + _CUT


def _count_strings(value: Any) -> int:
    if isinstance(value, str):
        return 1
    if isinstance(value, Mapping):
        return sum(_count_strings(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_count_strings(v) for v in value)
    return 0


def _shortened(value: Any, budget: int) -> Any:
    if isinstance(value, str):
        return value if len(value) <= budget else value[:budget] + _CUT
    if isinstance(value, Mapping):
        return {k: _shortened(v, budget) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_shortened(v, budget) for v in value]
    return value


def traceparent_of(span: Span) -> str:
    """The traceparent naming `span`: what its children continue."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def set_error(span: Span, error: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, error[:500]))


def end(span: Span, error: str | None = None) -> None:
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error[:500]))
    span.end()


def flush(timeout_s: float = 30.0) -> bool:
    """Export the spans that wait in the batch queue now (a process about to stop or to read
    its own CPU); True when there were none left or all went out in time."""
    if _provider is None:
        return True
    return bool(_provider.force_flush(int(timeout_s * 1000)))


def configure(provider: TracerProvider | None, env: Mapping[str, str] | None = None) -> None:
    """Make spans with `provider` (None: tracing off); `env` (default: the process's) says
    whether model spans carry messages (`AGENTRUNS_TRACE_MESSAGES`)."""
    global _tracer, _provider, _messages_max_chars, _direct
    env = os.environ if env is None else env
    _provider = provider
    _tracer = None
    _direct = None
    _messages_max_chars = 0
    if provider is None:
        return
    global _otel, _SAMPLED, _UNSAMPLED, _span_limits, _scope, _Ended, _parent_decides
    global _parent_kept, _UNSET, _KINDS, _Event
    import opentelemetry.trace
    from opentelemetry.sdk.trace import Event, SpanLimits
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    _otel = opentelemetry.trace
    _SAMPLED, _UNSAMPLED = _otel.TraceFlags(1), _otel.TraceFlags(0)
    _UNSET = _otel.Status(_otel.StatusCode.UNSET)
    _KINDS = {kind.name: kind for kind in _otel.SpanKind}
    _Event = Event
    _context_of.cache_clear()
    _parent.cache_clear()
    _span_limits = getattr(provider, "_span_limits", None) or SpanLimits()
    _scope = InstrumentationScope("agentruns")
    _Ended = _readable_type()
    _tracer = provider.get_tracer("agentruns")
    _dropped.cache_clear()
    sampler = getattr(_tracer, "sampler", None)
    _parent_decides = _follows_parent(sampler)
    _parent_kept = _keeps_parent(sampler)
    if env.get("AGENTRUNS_TRACE_MESSAGES", "").strip().lower() in ("1", "true", "yes"):
        try:
            limit = int(env.get("AGENTRUNS_TRACE_MESSAGES_MAX_CHARS", MESSAGES_DEFAULT_MAX_CHARS))
        except ValueError:
            log.warning("AGENTRUNS_TRACE_MESSAGES_MAX_CHARS is not a number: the default")
            limit = MESSAGES_DEFAULT_MAX_CHARS
        _messages_max_chars = max(0, min(limit, 1 << 20))


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
            exporter = _http_exporter()
    except ImportError as exc:
        log.warning("OTLP export is configured but not installed (agentruns[otel]): %s", exc)
        return False
    name = env.get("OTEL_SERVICE_NAME") or f"agentruns-{service}"
    # the sampler is the SDK's, from OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    processor = BatchSpanProcessor(exporter)
    provider.add_span_processor(processor)
    configure(provider, env)
    if protocol != "grpc":  # ours: it encodes a recorded span as it is
        global _direct
        _direct = processor
    atexit.register(provider.shutdown)
    log.info("tracing on: OTLP (%s) to %s", protocol, endpoint or "the default endpoint")
    return True


def _http_exporter() -> Any:
    """The OTLP/HTTP exporter of the OpenTelemetry SDK (its endpoint, headers, compression,
    timeouts and retries from the OTEL_* variables), with the request body written by
    `otlp_encoding` at a fraction of the exporter's own encoding's cost."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    from agentruns.streams import otlp_encoding

    class Exporter(OTLPSpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            client = getattr(self, "_client", None)
            if client is None or getattr(self, "_shutdown", True):
                return super().export(_readable(spans))  # another SDK's: its own encoding
            data = otlp_encoding.encode(spans)
            most = getattr(self, "_max_request_size", None)
            if most is not None and len(data) > most:
                log.warning("%d spans dropped: %d bytes, over %d", len(spans), len(data), most)
                return SpanExportResult.FAILURE
            if client.export(data).success:
                return SpanExportResult.SUCCESS
            return SpanExportResult.FAILURE

    return Exporter()


__all__ = [
    "CURRENT",
    "HEADER",
    "MAX_CHARS",
    "OUTGOING",
    "capped_json",
    "configure",
    "configure_from_env",
    "consumed",
    "current",
    "enabled",
    "end",
    "end_at",
    "flush",
    "from_headers",
    "headers_of",
    "messages_on",
    "outgoing_headers",
    "parse",
    "record_run",
    "run_context",
    "run_span_id",
    "run_trace_id",
    "sent",
    "set_error",
    "start",
    "traceparent_of",
]
