"""Named limits on everything that comes from outside (R30).

Each bound is checked at the earliest boundary that knows it: the core's types carry the field
bounds (``msgspec.Meta``, checked when a body is decoded, so the transition function never sees
a value out of range); the API and the client refuse a task that breaks them before it is
produced; the processor refuses the same through Kafka. Record sizes depend on the broker
(``message.max.bytes``) and are derived in ``streams``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

# Times are ms since the Unix epoch: up to 9999-12-31T23:59:59.999Z, which every consumer can
# turn into a date (Python's datetime, Postgres timestamptz) and which fits a bigint.
MAX_TIME_MS = 253_402_300_799_999
# Durations a task may set (waits, poll intervals): a year at most.
MAX_DURATION_MS = 366 * 24 * 3600 * 1000
# Counts (steps, attempts, retries, events): Avro `int` on the wire.
MAX_COUNT = 2**31 - 1
# Money and tokens: anything a bigint column holds.
MAX_AMOUNT = 2**53
# Identifiers chosen outside (run ids, trace ids, input and event ids, producer ids).
MAX_ID_CHARS = 512
# Free text of a task: its goal, one message.
MAX_TEXT_CHARS = 262_144
# Items of a task: messages, tools, refs.
MAX_ITEMS = 1024
# A tool output larger than this (bytes of its canonical text) reaches the model as a summary,
# the whole output kept as an artifact (a task's policy may set its own).
LARGE_OUTPUT_BYTES = 16_384
# Nesting of any JSON document from outside (tool schemas, model arguments, tool results,
# replies): deep enough for real documents, far below the interpreter's recursion limit.
MAX_JSON_DEPTH = 64
# Work of one JSON Schema validation, in keyword evaluations: a fixed allowance plus a share per
# node of the value. Real schemas need a few per node; one whose $refs multiply the work (an
# anyOf of refs to an anyOf of refs...) runs out and is refused instead of running for hours.
SCHEMA_STEPS_BASE = 10_000
SCHEMA_STEPS_PER_VALUE_NODE = 100

TimeMs = Annotated[int, msgspec.Meta(ge=0, le=MAX_TIME_MS)]
DurationMs = Annotated[int, msgspec.Meta(ge=0, le=MAX_DURATION_MS)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Amount = Annotated[int, msgspec.Meta(ge=0, le=MAX_AMOUNT)]
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
# A list of identifiers from outside (permissions, tool names, refs).
Ids = Annotated[tuple[Id, ...], msgspec.Meta(max_length=MAX_ITEMS)]


def json_depth(value: object, limit: int = MAX_JSON_DEPTH) -> int:
    """The nesting depth of a parsed JSON value (a scalar 0, ``{}`` 1); stops at ``limit + 1``,
    so a hostile document costs at most its size and the recursion never goes deeper than
    ``limit + 1`` frames (far below the interpreter's limit)."""
    return _depth(value, 1, limit) if isinstance(value, dict | list | tuple) else 0


def _depth(item: dict[Any, Any] | list[Any] | tuple[Any, ...], depth: int, limit: int) -> int:
    if depth > limit:
        return depth
    deepest = depth
    for child in item.values() if isinstance(item, dict) else item:
        if isinstance(child, dict | list | tuple):
            found = _depth(child, depth + 1, limit)
            if found > deepest:
                deepest = found
                if deepest > limit:
                    break
    return deepest
