"""The shipped Avro schemas: loading, fingerprints, and evolution between every version."""

from __future__ import annotations

import io
import json
from importlib import resources
from typing import Any

import fastavro
import pytest

from agentruns import schemas
from agentruns.schemas import SchemaError, fingerprint_of, load_registry, registry
from agentruns.streams.codec import Codec

# Deterministic sample records for any Avro schema, and what schema resolution should
# make of them for a given reader schema (fields it lacks dropped, new ones defaulted).

_SCALARS: dict[str, Any] = {
    "null": None,
    "boolean": True,
    "int": -(2**31),
    "long": 2**63 - 1,
    "float": 1.5,
    "double": -2.25,
    "bytes": b"\x00\xc3\x01\xff",
    "string": "s\u00e9q \U0001f600",
}


def sample(schema: Any, names: dict[str, Any] | None = None) -> Any:
    """A value of ``schema`` that exercises every field: unions take their first non-null
    branch, arrays and maps get two elements."""
    names = {} if names is None else names
    if isinstance(schema, str):
        if schema in _SCALARS:
            return _SCALARS[schema]
        return sample(names[schema], names)
    if isinstance(schema, list):
        branch = next((b for b in schema if b != "null"), "null")
        return sample(branch, names)
    kind = schema["type"]
    if kind == "record":
        full = f"{schema.get('namespace', '')}.{schema['name']}".lstrip(".")
        names[full] = names[schema["name"]] = schema
        return {f["name"]: sample(f["type"], names) for f in schema["fields"]}
    if kind == "array":
        return [sample(schema["items"], names), sample(schema["items"], names)]
    if kind == "map":
        return {"k1": sample(schema["values"], names), "k2": sample(schema["values"], names)}
    if kind == "enum":
        return schema["symbols"][0]
    if kind == "fixed":
        return b"\x01" * schema["size"]
    return sample(kind, names)


def project(value: Any, reader: Any, names: dict[str, Any] | None = None) -> Any:
    """What Avro schema resolution should give when ``value`` is read with ``reader``."""
    names = {} if names is None else names
    if isinstance(reader, str):
        if reader in _SCALARS:
            return value
        return project(value, names[reader], names)
    if isinstance(reader, list):
        if value is None:
            return None
        branch = next(b for b in reader if b != "null")
        return project(value, branch, names)
    kind = reader["type"]
    if kind == "record":
        full = f"{reader.get('namespace', '')}.{reader['name']}".lstrip(".")
        names[full] = names[reader["name"]] = reader
        out = {}
        for f in reader["fields"]:
            if f["name"] in value:
                out[f["name"]] = project(value[f["name"]], f["type"], names)
            else:
                out[f["name"]] = f["default"]
        return out
    if kind == "array":
        return [project(v, reader["items"], names) for v in value]
    if kind == "map":
        return {k: project(v, reader["values"], names) for k, v in value.items()}
    return value


EXPECTED_NAMES = ("DeadLetter", "Effect", "EndedRun", "Event", "Input", "Result", "Snapshot")
REG = registry()
ALL_VERSIONS = [sv for name in REG.names() for sv in REG.versions(name)]
OLD_VERSIONS = [sv for sv in ALL_VERSIONS if sv.version < REG.current(sv.name).version]


def _ids(sv: schemas.SchemaVersion) -> str:
    return f"{sv.name}.v{sv.version}"


def test_every_record_name_is_shipped() -> None:
    assert REG.names() == EXPECTED_NAMES


def test_at_least_one_record_has_evolved() -> None:
    assert OLD_VERSIONS, "the evolution tests need at least one vN+1"


def test_every_avsc_in_the_package_is_loaded() -> None:
    files = sorted(
        p.name for p in resources.files("agentruns.schemas").iterdir() if p.name.endswith(".avsc")
    )
    assert sorted(sv.file_name for sv in ALL_VERSIONS) == files


def test_current_is_the_highest_version() -> None:
    for name in REG.names():
        versions = REG.versions(name)
        assert [sv.version for sv in versions] == list(range(1, len(versions) + 1))
        assert REG.current(name) is versions[-1]
        assert REG.current(f"agentruns.{name}") is versions[-1]


def test_fingerprints_are_8_bytes_unique_and_indexed() -> None:
    fps = [sv.fingerprint for sv in ALL_VERSIONS]
    assert all(len(fp) == 8 for fp in fps)
    assert len(set(fps)) == len(fps)
    for sv in ALL_VERSIONS:
        assert REG.lookup(sv.fingerprint) is sv
        assert REG.get(sv.name, sv.version) is sv
    assert REG.lookup(b"\x00" * 8) is None


def test_fingerprint_matches_the_avro_spec_vector() -> None:
    # Avro's share/test/data/schema-tests.txt: CRC-64-AVRO of "null" is 7195948357588979594
    # (a Java long); single-object encoding writes it little-endian.
    fp, canonical = fingerprint_of("null")
    assert canonical == '"null"'
    assert int.from_bytes(fp, "little", signed=True) == 7195948357588979594


def test_fingerprint_ignores_docs_and_defaults_but_not_fields() -> None:
    raw = REG.current("Input").raw
    without_docs = json.loads(json.dumps(raw))
    without_docs.pop("doc", None)
    for f in without_docs["fields"]:
        f.pop("doc", None)
    assert fingerprint_of(without_docs)[0] == REG.current("Input").fingerprint
    assert fingerprint_of(REG.get("Input", 1).raw)[0] != REG.current("Input").fingerprint


def test_all_namespaced_agentruns() -> None:
    assert all(sv.full_name == f"agentruns.{sv.name}" for sv in ALL_VERSIONS)


def test_snapshot_buffer_carries_the_current_input_schema() -> None:
    # Bumping Input requires a new Snapshot version whose buffer items are that Input.
    inputs = {v.fingerprint for v in REG.versions("Input")}
    for snap in REG.versions("Snapshot"):
        buffer = next(f for f in snap.raw["fields"] if f["name"] == "buffer")
        items = buffer["type"]["items"]
        assert fingerprint_of(items)[0] in inputs
    current_items = next(f for f in REG.current("Snapshot").raw["fields"] if f["name"] == "buffer")
    assert fingerprint_of(current_items["type"]["items"])[0] == REG.current("Input").fingerprint


@pytest.mark.parametrize("sv", ALL_VERSIONS, ids=_ids)
def test_fields_added_after_v1_have_defaults(sv: schemas.SchemaVersion) -> None:
    v1_fields = {f["name"] for f in REG.get(sv.name, 1).raw["fields"]}
    for f in sv.raw["fields"]:
        if f["name"] not in v1_fields:
            assert "default" in f, f"{sv.file_name}: new field {f['name']} needs a default"


@pytest.mark.parametrize("sv", ALL_VERSIONS, ids=_ids)
def test_every_writer_version_is_readable_by_the_current_reader(
    sv: schemas.SchemaVersion,
) -> None:
    codec = Codec()
    current = REG.current(sv.name)
    record = sample(sv.raw)
    data = codec.encode(sv.name, record, version=sv.version)
    decoded = codec.decode(data, sv.name)
    assert decoded.name == sv.name
    assert decoded.version == sv.version
    assert decoded.record == project(record, current.raw)


@pytest.mark.parametrize("sv", ALL_VERSIONS, ids=_ids)
def test_every_writer_version_is_readable_by_every_other_version(
    sv: schemas.SchemaVersion,
) -> None:
    # Backward AND forward: old data with new readers, new data with old readers (a reader
    # that was deployed before the writer upgraded, given the writer's schema).
    record = sample(sv.raw)
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, sv.parsed, record)
    for reader in REG.versions(sv.name):
        got = fastavro.schemaless_reader(io.BytesIO(buf.getvalue()), sv.parsed, reader.parsed)
        assert got == project(record, reader.raw), f"v{sv.version} read as v{reader.version}"


@pytest.mark.parametrize("name", [n for n in EXPECTED_NAMES if len(REG.versions(n)) > 1])
def test_current_writer_is_readable_by_the_previous_reader(name: str) -> None:
    current = REG.current(name)
    previous = REG.versions(name)[-2]
    record = sample(current.raw)
    data = Codec().encode(name, record)
    body = io.BytesIO(data[10:])
    got = fastavro.schemaless_reader(body, current.parsed, previous.parsed)
    assert got == project(record, previous.raw)


def test_input_v1_record_gets_reply_to_default() -> None:
    codec = Codec()
    v1 = {
        "input_id": "in-1",
        "run_id": "run-1",
        "kind": "SubmitRun",
        "trace_id": "t",
        "at": 1,
        "body": "{}",
    }
    decoded = codec.decode(codec.encode("Input", v1, version=1), "Input")
    assert decoded.version == 1
    assert decoded.record == {**v1, "producer_id": None, "producer_seq": None, "reply_to": None}


def _files() -> dict[str, str]:
    return {sv.file_name: json.dumps(sv.raw) for sv in ALL_VERSIONS}


def test_loader_rejects_two_versions_with_the_same_canonical_form() -> None:
    files = _files()
    files["agentruns.Effect.v2.avsc"] = files["agentruns.Effect.v1.avsc"]
    with pytest.raises(SchemaError, match="same canonical form"):
        load_registry(files)


def test_loader_rejects_a_version_gap() -> None:
    files = _files()
    raw = json.loads(files["agentruns.Effect.v1.avsc"])
    raw["fields"].append({"name": "extra", "type": ["null", "string"], "default": None})
    files["agentruns.Effect.v3.avsc"] = json.dumps(raw)
    with pytest.raises(SchemaError, match="without gaps"):
        load_registry(files)


def test_loader_rejects_a_file_name_that_does_not_match_the_record() -> None:
    files = _files()
    files["agentruns.Other.v1.avsc"] = files["agentruns.Effect.v1.avsc"]
    with pytest.raises(SchemaError, match=r"declares agentruns\.Effect"):
        load_registry(files)


@pytest.mark.parametrize("bad_name", ["Effect.avsc", "agentruns.Effect.v0.avsc", "x.v1.json"])
def test_loader_rejects_badly_named_files(bad_name: str) -> None:
    with pytest.raises(SchemaError):
        load_registry({bad_name: json.dumps(REG.current("Effect").raw)})


def test_loader_rejects_an_invalid_schema() -> None:
    bad = {"type": "record", "name": "Bad", "namespace": "agentruns", "fields": [{"name": "x"}]}
    with pytest.raises(SchemaError):
        load_registry({"agentruns.Bad.v1.avsc": json.dumps(bad)})
