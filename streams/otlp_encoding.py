"""Spans as an OTLP `ExportTraceServiceRequest` in protobuf bytes, written directly.

The OpenTelemetry exporter builds a protobuf message object per span, attribute and value, and
hashes each span's resource (a JSON dump of its attributes) to group them, which costs more than
making the span. This writes the same bytes from the spans' fields, keeping the encoded
attributes that repeat (the messaging system, a topic, a consumer group, a route), at a
fraction of that cost (docs/benchmarks.md, Tracing on and off).
`tests/unit/test_otlp_encoding.py` decodes what it writes with the official message classes and
compares it with the exporter's own encoding of the same spans.

Only the wire format of `opentelemetry/proto/trace/v1/trace.proto` and `common.proto` is
written here; which spans, their limits and their transport are the SDK's.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

log = logging.getLogger("agentruns.tracing")

_DOUBLE = struct.Struct("<d")
_FIXED64 = struct.Struct("<Q")
_FIXED32 = struct.Struct("<I")
_INT64 = 1 << 64
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _varint(value: int) -> bytes:
    if value < 0:
        value += _INT64  # int64: two's complement, ten bytes
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]
_TAGS = [_varint(number << 3 | 2) for number in range(16)]


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    size = len(payload)
    return _TAGS[number] + (_SMALL[size] if size < 0x80 else _varint(size)) + payload


def _string(number: int, text: str) -> bytes:
    return _field(number, text.encode("utf-8", "surrogatepass")) if text else b""


def _any_value(value: Any) -> bytes:
    """An `AnyValue`: string 1, bool 2, int 3, double 4, array 5, bytes 7."""
    if isinstance(value, str):
        return _field(1, value.encode("utf-8", "surrogatepass"))
    if isinstance(value, bool):
        return b"\x10" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"{value} is out of int64's range")
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE.pack(value)
    if isinstance(value, bytes):
        return _field(7, value)
    if isinstance(value, Sequence):
        return _field(5, b"".join(_field(1, _any_value(v)) for v in value))
    if isinstance(value, Mapping):
        return _field(6, b"".join(_field(1, _key_value(k, v)) for k, v in value.items()))
    if value is None:
        return b""
    raise ValueError(f"no AnyValue for a {type(value).__name__}")


#: Encoded attribute fields by (field number, key, type, value): the same strings, flags and
#: small numbers come span after span (a topic, a group, a route, a run id). Emptied when full.
_FIELDS: dict[tuple[int, str, type, Any], bytes] = {}
_FIELDS_MAX = 8192
_KEYED = frozenset((str, bool, int))


def _key_value(key: str, value: Any) -> bytes:
    """A `KeyValue` (key 1, value 2)."""
    return _field(1, key.encode("utf-8", "surrogatepass")) + _field(2, _any_value(value))


def _attribute(number: int, key: str, value: Any) -> bytes:
    """An attribute as a `KeyValue` field, kept in `_FIELDS` when it is a string, bool or small
    int (`_attributes` looks those up first)."""
    field = _field(number, _key_value(key, value))
    kind = type(value)
    if (
        (kind is str and len(value) <= 256)
        or kind is bool
        or (kind is int and -1024 <= value <= 1024)
    ):
        if len(_FIELDS) >= _FIELDS_MAX:
            _FIELDS.clear()
        _FIELDS[number, key, kind, value] = field
    return field


def _attributes(number: int, attributes: Mapping[str, Any] | None) -> bytes:
    """Each attribute as a `KeyValue` field; one that has no OTLP value is left out (logged),
    as the exporter leaves it out."""
    if not attributes:
        return b""
    out = []
    fields = _FIELDS
    for key, value in attributes.items():
        kind = type(value)
        # most are there; only these are (a list or a mapping is no key)
        field = fields.get((number, key, kind, value)) if kind in _KEYED else None
        if field is None:
            try:
                field = _attribute(number, key, value)
            except ValueError as exc:
                log.warning("span attribute %s not exported: %s", key, exc)
                continue
        out.append(field)
    return b"".join(out)


def _trace_state(number: int, state: Any) -> bytes:
    return _string(number, state.to_header()) if state else b""


_TIMES = struct.Struct("<BQBQ")  # start_time_unix_nano 7, end_time_unix_nano 8: fixed64
_KINDS = [b"\x30" + _varint(value + 1) for value in range(5)]  # SDK's 0 is the proto's 1
# `SpanFlags` as the exporter sets them: whether the parent (or the linked span) is remote,
# known (bits 8 and 9).
_SPAN_FLAGS = {
    remote: b"\x85\x01" + _FIXED32.pack(0x300 if remote else 0x100) for remote in (True, False)
}
_LINK_FLAGS = {
    remote: b"\x35" + _FIXED32.pack(0x300 if remote else 0x100) for remote in (True, False)
}
_NO_STATUS = _field(15, b"")


#: Encoded name fields by (field number, name): span and event names repeat. Emptied when full.
_NAMES: dict[tuple[int, str], bytes] = {}


def _name(number: int, text: str) -> bytes:
    """`_string`, looked up."""
    field = _NAMES.get((number, text))
    if field is None:
        field = _string(number, text)
        if len(text) <= 256:
            if len(_NAMES) >= _FIELDS_MAX:
                _NAMES.clear()
            _NAMES[number, text] = field
    return field


def _span(span: Any) -> bytes:
    context, parent = span.context, span.parent
    out = [
        # trace_id 1 (16 bytes), span_id 2 (8 bytes)
        b"\x0a\x10"
        + context.trace_id.to_bytes(16, "big")
        + b"\x12\x08"
        + context.span_id.to_bytes(8, "big"),
    ]
    if context.trace_state:
        out.append(_trace_state(3, context.trace_state))
    if parent is not None:
        out.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))  # parent_span_id 4
    out.append(_name(5, span.name))
    out.append(_KINDS[span.kind.value])
    out.append(_TIMES.pack(0x39, span.start_time, 0x41, span.end_time))
    out.append(_attributes(9, span.attributes))
    if span.dropped_attributes:
        out.append(b"\x50" + _varint(span.dropped_attributes))
    for event in span.events:
        body = b"\x09" + _FIXED64.pack(event.timestamp) + _name(2, event.name)
        body += _attributes(3, event.attributes)
        if event.dropped_attributes:
            body += b"\x20" + _varint(event.dropped_attributes)
        out.append(_field(11, body))
    if span.dropped_events:
        out.append(b"\x60" + _varint(span.dropped_events))
    for link in span.links:
        linked = link.context
        body = b"\x0a\x10" + linked.trace_id.to_bytes(16, "big") + b"\x12\x08"
        body += linked.span_id.to_bytes(8, "big")
        body += _attributes(4, link.attributes)
        if link.dropped_attributes:
            body += b"\x28" + _varint(link.dropped_attributes)
        body += _LINK_FLAGS[bool(linked.is_remote)]
        out.append(_field(13, body))
    if span.dropped_links:
        out.append(b"\x70" + _varint(span.dropped_links))
    status = span.status
    if status is not None:
        code = status.status_code.value  # UNSET 0, OK 1, ERROR 2, as the proto's
        if code or status.description:
            body = _string(2, status.description or "") + (b"\x18" + _varint(code) if code else b"")
            out.append(_field(15, body))
        else:
            out.append(_NO_STATUS)
    out.append(_SPAN_FLAGS[parent is not None and bool(parent.is_remote)])
    return _field(2, b"".join(out))


def _resource(resource: Any) -> bytes:
    return _field(1, _attributes(1, resource.attributes))


def _scope(scope: Any) -> bytes:
    if scope is None:
        return _field(1, b"")
    body = _string(1, scope.name) + _string(2, scope.version or "")
    body += _attributes(3, scope.attributes)
    return _field(1, body) + _string(3, scope.schema_url or "")


def encode(spans: Iterable[Any]) -> bytes:
    """`spans` (the SDK's ReadableSpans) as an `ExportTraceServiceRequest`: one
    `ResourceSpans` per resource, one `ScopeSpans` per instrumentation scope, in the order
    they first come."""
    groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    for span in spans:
        resource, scope = span.resource, span.instrumentation_scope
        _, scopes = groups.setdefault(id(resource), (resource, {}))
        scopes.setdefault(id(scope), (scope, []))[1].append(_span(span))
    out = []
    for resource, scopes in groups.values():
        body = _resource(resource)
        for scope, encoded in scopes.values():
            body += _field(2, _scope(scope) + b"".join(encoded))
        body += _string(3, resource.schema_url or "")
        out.append(_field(1, body))
    return b"".join(out)
