"""The compiled Avro writer gives fastavro's bytes for every shipped schema version."""

from __future__ import annotations

import io
import random
from typing import Any

import pytest
from fastavro import schemaless_writer

from agentruns.schemas import registry
from agentruns.streams.avro_writer import compile_writer

VERSIONS = sorted(registry().by_fingerprint.values(), key=lambda sv: (sv.name, sv.version))


def _value(schema: Any, rng: random.Random, named: dict[str, Any], depth: int = 0) -> Any:
    """A random value fitting ``schema`` (raw JSON schema), with edge cases mixed in."""
    if isinstance(schema, list):
        return _value(rng.choice(schema), rng, named, depth)
    if isinstance(schema, str):
        match schema:
            case "null":
                return None
            case "boolean":
                return rng.random() < 0.5
            case "int":
                return rng.choice([0, 1, -1, 63, 64, -65, 8191, 8192, 2**31 - 1, -(2**31)])
            case "long":
                return rng.choice([0, 7, -8, 16383, 16384, 2**40 + 3, 2**63 - 1, -(2**63)])
            case "string":
                return rng.choice(["", "a", "run-000042", "é✓ unicode", "x" * 300])
            case "bytes":
                return bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 40])))
        return _value(named[schema], rng, named, depth)
    kind = schema["type"]
    if kind == "record":
        named[schema["name"]] = schema
        return {f["name"]: _value(f["type"], rng, named, depth + 1) for f in schema["fields"]}
    if kind == "array":
        n = 0 if depth > 3 else rng.choice([0, 1, 3])
        return [_value(schema["items"], rng, named, depth + 1) for _ in range(n)]
    if kind == "map":
        n = 0 if depth > 3 else rng.choice([0, 1, 3])
        return {f"k{i}": _value(schema["values"], rng, named, depth + 1) for i in range(n)}
    return _value(kind, rng, named, depth)


@pytest.mark.parametrize("sv", VERSIONS, ids=lambda sv: f"{sv.name}-v{sv.version}")
def test_same_bytes_as_fastavro(sv: Any) -> None:
    write = compile_writer(sv.raw)
    rng = random.Random(sv.version * 7919 + len(sv.name))
    for _ in range(300):
        record = _value(sv.raw, rng, {})
        expected = io.BytesIO()
        schemaless_writer(expected, sv.parsed, record)
        out = bytearray()
        write(record, out)
        assert bytes(out) == expected.getvalue(), record


def test_missing_fields_take_their_defaults_like_fastavro() -> None:
    sv = next(v for v in VERSIONS if v.name.endswith("Event"))
    sparse = {"run_id": "r", "seq": 1, "event_id": "e", "type": "T", "step": 1, "attempt": 1}
    sparse |= {"trace_id": "t", "at": 5, "disposition": "APPLIED", "body": "{}"}
    expected = io.BytesIO()
    schemaless_writer(expected, sv.parsed, sparse)
    out = bytearray()
    compile_writer(sv.raw)(sparse, out)
    assert bytes(out) == expected.getvalue()


@pytest.mark.parametrize(
    "bad",
    [{"seq": "1"}, {"run_id": 5}, {"seq": True}, {"at": None}, {"reason": 5}, {"body": b"{}"}],
)
def test_values_that_do_not_fit_are_refused(bad: dict[str, Any]) -> None:
    sv = next(v for v in VERSIONS if v.name.endswith("Event"))
    record = {"run_id": "r", "seq": 1, "event_id": "e", "type": "T", "step": 1, "attempt": 1}
    record |= {"trace_id": "t", "at": 5, "disposition": "APPLIED", "body": "{}", **bad}
    with pytest.raises(TypeError):
        compile_writer(sv.raw)(record, bytearray())


def test_nested_records_that_do_not_fit_are_refused() -> None:
    sv = next(v for v in VERSIONS if v.name.endswith("Snapshot") and v.version == 3)
    record = _value(sv.raw, random.Random(3), {})
    record["recent_inputs"] = [{"key": "k", "digest": 7}]
    with pytest.raises(TypeError):
        compile_writer(sv.raw)(record, bytearray())
