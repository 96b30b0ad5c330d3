"""The compiled Avro reader returns fastavro's values for every shipped schema version, and
raises on malformed input where fastavro would raise or (being laxer) return something."""

from __future__ import annotations

import io
import json
import random
from typing import Any

import pytest
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentruns.schemas import load_registry, registry
from agentruns.streams import codec as codec_module
from agentruns.streams.avro_reader import Read, compile_reader, reader_source
from agentruns.streams.codec import MAGIC, Codec, CorruptRecordError, decode, encode
from tests.unit.test_avro_writer import VERSIONS, _value

IDS = [f"{sv.name}-v{sv.version}" for sv in VERSIONS]
MALFORMED = (EOFError, IndexError, ValueError, UnicodeDecodeError)
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
READERS: dict[str, Read] = {sv.file_name: compile_reader(sv.raw) for sv in VERSIONS}


def _fastavro(parsed: Any, data: bytes) -> tuple[Any, int]:
    buf = io.BytesIO(data)
    return schemaless_reader(buf, parsed, None), buf.tell()


def _fastavro_bytes(parsed: Any, record: Any) -> bytes:
    buf = io.BytesIO()
    schemaless_writer(buf, parsed, record)
    return buf.getvalue()


def _field(ftype: Any) -> dict[str, Any]:
    return {"type": "record", "name": "R", "fields": [{"name": "f", "type": ftype}]}


# --- values from the schema ----------------------------------------------------------------

# 0..63 bytes have a one-byte length, up to 8191 two bytes, beyond that three
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=20) | st.builds(
    str.__mul__, st.sampled_from(["x", "é", "✓", "\U0001f600", "\x00"]), st.integers(0, 9000)
)
BINARY = st.binary(max_size=70) | st.builds(bytes.__mul__, st.just(b"\xff"), st.integers(0, 9000))
LONG = st.integers(-(2**63), 2**63 - 1) | st.sampled_from([0, -1, 63, -64, 64, 2**63 - 1, -(2**63)])


def _strategy(schema: Any, named: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Records fitting ``schema`` (raw JSON): unicode, long strings, extreme longs, nulls."""
    if isinstance(schema, list):
        return st.one_of(*(_strategy(b, named) for b in schema))
    if isinstance(schema, str):
        primitives: dict[str, st.SearchStrategy[Any]] = {
            "null": st.none(),
            "boolean": st.booleans(),
            "int": st.integers(-(2**31), 2**31 - 1),
            "long": LONG,
            "string": TEXT,
            "bytes": BINARY,
        }
        return primitives[schema] if schema in primitives else st.deferred(lambda: named[schema])
    kind = schema["type"]
    if kind == "record":
        fields = {f["name"]: _strategy(f["type"], named) for f in schema["fields"]}
        named[schema["name"]] = strategy = st.fixed_dictionaries(fields)
        return strategy
    if kind == "array":
        return st.lists(_strategy(schema["items"], named), max_size=4)
    if kind == "map":
        return st.dictionaries(TEXT, _strategy(schema["values"], named), max_size=4)
    return _strategy(kind, named)


STRATEGIES = {sv.file_name: _strategy(sv.raw, {}) for sv in VERSIONS}


@pytest.mark.parametrize("sv", VERSIONS, ids=IDS)
@SETTINGS
@given(data=st.data())
def test_same_values_as_fastavro(sv: Any, data: st.DataObject) -> None:
    record = data.draw(STRATEGIES[sv.file_name])
    encoded = _fastavro_bytes(sv.parsed, record)
    start = data.draw(st.integers(0, 3))  # the codec starts after its header
    framed = b"\xaa" * start + encoded
    value, end = READERS[sv.file_name](framed, start)
    assert end == len(framed)
    assert value == _fastavro(sv.parsed, encoded)[0] == record
    assert list(value) == [f["name"] for f in sv.raw["fields"]]  # keys in schema order


@pytest.mark.parametrize("sv", VERSIONS, ids=IDS)
def test_same_values_as_fastavro_for_the_writer_samples(sv: Any) -> None:
    rng = random.Random(sv.version * 31 + len(sv.name))
    read = READERS[sv.file_name]
    for _ in range(200):
        encoded = _fastavro_bytes(sv.parsed, _value(sv.raw, rng, {}))
        value, end = read(encoded, 0)
        assert (value, end) == _fastavro(sv.parsed, encoded)
        assert end == len(encoded)


@pytest.mark.parametrize("sv", VERSIONS, ids=IDS)
def test_a_reader_of_some_fields_gives_those_of_the_whole_record(sv: Any) -> None:
    rng = random.Random(sv.version * 17 + len(sv.name))
    names = [f["name"] for f in sv.raw["fields"]]
    for _ in range(40):
        only = rng.sample(names, rng.randint(1, len(names)))
        read = compile_reader(sv.raw, only)
        for _ in range(5):
            encoded = _fastavro_bytes(sv.parsed, _value(sv.raw, rng, {}))
            whole = _fastavro(sv.parsed, encoded)[0]
            picked, _end = read(encoded, 0)
            assert picked == {name: whole[name] for name in names if name in only}


def test_a_reader_of_fields_the_record_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="no field"):
        compile_reader(registry().current("Snapshot").raw, ["run_id", "nope"])
    with pytest.raises(ValueError, match="no field"):
        compile_reader(registry().current("Snapshot").raw, [])


def test_types_of_the_values() -> None:
    sv = registry().current("DeadLetter")
    record = {
        "reason": "é✓",
        "error_class": "",
        "source_topic": "t",
        "source_partition": -(2**31),
        "source_offset": 2**63 - 1,
        "original_key": b"",
        "original_value": None,
        "original_headers": [{"key": "k", "value": b"\x00\xff"}, {"key": "", "value": None}],
        "original_timestamp": -(2**63),
        "run_id": None,
        "at": 0,
    }
    value, _ = compile_reader(sv.raw)(_fastavro_bytes(sv.parsed, record), 0)
    assert value == record
    assert type(value["original_key"]) is bytes
    assert type(value["original_headers"][0]["value"]) is bytes
    assert type(value["reason"]) is str


# --- negative block counts (Avro: |count| items, preceded by the block's byte size) --------


def _varint(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _blocky(schema: Any, value: Any, named: dict[str, Any], rng: random.Random) -> bytes:
    """``value`` encoded with arrays and maps split into random blocks, about half of them with
    a negative count and a byte size: valid Avro that fastavro can read but never writes."""
    if isinstance(schema, list):  # our unions are ["null", X]: null is the null branch
        index = next(k for k, b in enumerate(schema) if (b == "null") == (value is None))
        return _varint(index) + _blocky(schema[index], value, named, rng)
    if isinstance(schema, str):
        if schema in ("int", "long"):
            return _varint(value)
        if schema in ("string", "bytes"):
            raw = value.encode() if schema == "string" else value
            return _varint(len(raw)) + raw
        if schema == "null":
            return b""
        if schema == "boolean":
            return b"\x01" if value else b"\x00"
        return _blocky(named[schema], value, named, rng)
    kind = schema["type"]
    if kind == "record":
        named[schema["name"]] = schema
        return b"".join(_blocky(f["type"], value[f["name"]], named, rng) for f in schema["fields"])
    if kind in ("array", "map"):
        if kind == "array":
            items = [_blocky(schema["items"], v, named, rng) for v in value]
        else:
            items = [
                _blocky("string", k, named, rng) + _blocky(schema["values"], v, named, rng)
                for k, v in value.items()
            ]
        out = bytearray()
        while items:
            n = rng.randint(1, len(items))
            block, items = b"".join(items[:n]), items[n:]
            if rng.random() < 0.5:
                out += _varint(-n) + _varint(len(block)) + block
            else:
                out += _varint(n) + block
        return bytes(out) + b"\x00"
    return _blocky(kind, value, named, rng)


@pytest.mark.parametrize("sv", VERSIONS, ids=IDS)
@SETTINGS
@given(data=st.data(), seed=st.integers(0, 2**32))
def test_negative_block_counts(sv: Any, data: st.DataObject, seed: int) -> None:
    record = data.draw(STRATEGIES[sv.file_name])
    encoded = _blocky(sv.raw, record, {}, random.Random(seed))
    assert (
        READERS[sv.file_name](encoded, 0)
        == _fastavro(sv.parsed, encoded)
        == (
            record,
            len(encoded),
        )
    )


ARRAY = _field({"type": "array", "items": "long"})
MAP = _field({"type": "map", "values": "long"})


@pytest.mark.parametrize(
    ("schema", "data", "expected"),
    [
        (ARRAY, b"\x03\x04\x02\x04\x00", {"f": [1, 2]}),  # -2 items in 2 bytes: 1, 2
        (ARRAY, b"\x01\x02\x06\x04\x02\x08\x00", {"f": [3, 1, 4]}),  # -1 item, then 2
        (MAP, b"\x01\x06\x02k\x0e\x00", {"f": {"k": 7}}),  # -1 entry in 3 bytes
        (MAP, b"\x04\x02k\x02\x02k\x04\x00", {"f": {"k": 2}}),  # a repeated key: the last wins
    ],
)
def test_hand_built_blocks(schema: Any, data: bytes, expected: Any) -> None:
    assert (
        compile_reader(schema)(data, 0)
        == _fastavro(parse_schema(schema), data)
        == (
            expected,
            len(data),
        )
    )


# --- malformed input ---------------------------------------------------------------------


@pytest.mark.parametrize("sv", VERSIONS, ids=IDS)
def test_every_truncation_raises(sv: Any) -> None:
    rng = random.Random(sv.version)
    read = READERS[sv.file_name]
    for _ in range(8):
        encoded = _fastavro_bytes(sv.parsed, _value(sv.raw, rng, {}))
        for cut in range(len(encoded)):
            with pytest.raises(MALFORMED):
                read(encoded[:cut], 0)


def _same_as_fastavro_or_raises(sv: Any, data: bytes) -> None:
    try:
        got = READERS[sv.file_name](data, 0)
    except MALFORMED:
        return
    # it returned: fastavro must read the same value, ending at the same byte
    assert got == _fastavro(sv.parsed, data), data.hex()


@pytest.mark.parametrize("sv", VERSIONS, ids=IDS)
@SETTINGS
@given(data=st.data())
def test_corrupted_bytes_raise_or_read_as_fastavro_does(sv: Any, data: st.DataObject) -> None:
    encoded = bytearray(_fastavro_bytes(sv.parsed, data.draw(STRATEGIES[sv.file_name])))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(encoded) - 1))
        encoded[at] ^= data.draw(st.integers(1, 255))
    _same_as_fastavro_or_raises(sv, bytes(encoded))


@pytest.mark.parametrize("sv", VERSIONS, ids=IDS)
def test_every_single_byte_corruption_of_a_sample(sv: Any) -> None:
    rng = random.Random(sv.version * 7 + 1)
    encoded = _fastavro_bytes(sv.parsed, _value(sv.raw, rng, {}))
    for at in range(0, len(encoded), max(1, len(encoded) // 150)):
        for flip in (0x01, 0x02, 0x80, 0xFF, rng.randrange(1, 256)):
            corrupted = bytearray(encoded)
            corrupted[at] ^= flip
            _same_as_fastavro_or_raises(sv, bytes(corrupted))


@pytest.mark.parametrize("sv", VERSIONS, ids=IDS)
@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=120))
def test_arbitrary_bytes_raise_or_read_as_fastavro_does(sv: Any, data: bytes) -> None:
    _same_as_fastavro_or_raises(sv, data)


@pytest.mark.parametrize(
    ("ftype", "data", "error"),
    [
        ("string", b"\x01", ValueError),  # length -1
        ("bytes", b"\x03ab", ValueError),  # length -2
        ("string", b"\x81\x01" + b"x" * 64, ValueError),  # a two-byte negative length
        ("string", b"\x08abc", EOFError),  # 4 bytes, 3 left: a slice would just be short
        ("bytes", b"\xd0\x0f" + b"x" * 999, EOFError),  # 1000 bytes, 999 left
        ("string", b"\x04\xff\xfe", UnicodeDecodeError),
        ("string", b"\x06\xed\xa0\x80", UnicodeDecodeError),  # an encoded surrogate
        ("long", b"\x80" * 10 + b"\x01", ValueError),  # 11 bytes: fastavro reads 32
        ("long", b"\xff" * 9 + b"\x7f", ValueError),  # beyond 64 bits: fastavro wraps around
        ("long", b"\xff" * 9, IndexError),
        ("int", b"\x80\x80\x80\x80\x10", ValueError),  # 2**31: fastavro returns it
        ("int", b"\x81\x80\x80\x80\x10", ValueError),  # -(2**31) - 1
        ("boolean", b"\x02", ValueError),  # fastavro: True
        ("boolean", b"\xff", ValueError),
        (["null", "string"], b"\x04", ValueError),  # branch 2 of 2
        (["null", "string"], b"\x01\x00", ValueError),  # branch -1: fastavro reads a string
        (["null", "string"], b"\x80\x00", ValueError),  # non-canonical: never written
        ({"type": "array", "items": "long"}, b"\x03\x06\x02\x04\x00", ValueError),  # size 3 != 2
        ({"type": "array", "items": "long"}, b"\x03\x03\x02\x04\x00", ValueError),  # size < -1
        ({"type": "array", "items": "long"}, b"\x03\x40\x02\x04\x00", EOFError),  # size > left
        ({"type": "array", "items": "string"}, b"\xfe\xff\xff\xff\x0f\x00", EOFError),
        ({"type": "map", "values": "long"}, b"\x02\x02k", IndexError),
    ],
)
def test_malformed_input_raises(ftype: Any, data: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        compile_reader(_field(ftype))(data, 0)


def test_a_huge_count_fails_without_looping() -> None:
    # fastavro would loop (and allocate) up to the count before running out of bytes
    data = b"\xfe\xff\xff\xff\xff\xff\xff\xff\x7f" + b"\x00" * 10
    with pytest.raises(EOFError):
        compile_reader(_field({"type": "array", "items": "long"}))(data, 0)


# --- schemas -----------------------------------------------------------------------------

NODE = {
    "type": "record",
    "name": "Node",
    "namespace": "t",
    "fields": [
        {"name": "label", "type": "string"},
        {
            "name": "meta",
            "type": {
                "type": "record",
                "name": "Meta",
                "fields": [{"name": "k", "type": "long"}, {"name": "up", "type": ["null", "Node"]}],
            },
        },
        {"name": "kids", "type": {"type": "array", "items": "t.Node"}},
        {"name": "metas", "type": {"type": "map", "values": ["null", "Meta"]}},
        {"name": "flag", "type": "boolean"},
        {"name": "blob", "type": {"type": "bytes"}},
    ],
}


def _node(depth: int) -> dict[str, Any]:
    leaf = {"label": "é", "meta": {"k": -1, "up": None}, "kids": [], "metas": {}}
    leaf |= {"flag": False, "blob": b""}
    if depth == 0:
        return leaf
    return {
        "label": f"n{depth}",
        "meta": {"k": 2**40, "up": _node(depth - 1)},
        "kids": [_node(depth - 1), leaf],
        "metas": {"a": {"k": 1, "up": leaf}, "b": None},
        "flag": True,
        "blob": b"\x00\x01",
    }


def test_recursive_and_nested_named_records() -> None:
    read = compile_reader(NODE)
    for depth in range(4):
        encoded = _fastavro_bytes(parse_schema(NODE), _node(depth))
        assert read(encoded, 0) == (_node(depth), len(encoded))
    source = reader_source(NODE)
    assert source.count("def ") == 2  # read() and one function for the recursive Node
    assert "def _read_0_Node(data, i, end):" in source


def test_the_generated_source_is_deterministic() -> None:
    for sv in VERSIONS:
        assert reader_source(sv.raw) == reader_source(sv.raw)
        compile(reader_source(sv.raw), "<test>", "exec")


@pytest.mark.parametrize(
    "ftype",
    [
        "float",
        "double",
        {"type": "enum", "name": "E", "symbols": ["A"]},
        {"type": "fixed", "name": "F", "size": 4},
        {"type": "long", "logicalType": "timestamp-millis"},
        "Unknown",
        ["null", "string", *(["long"] * 63)],
    ],
)
def test_unsupported_schemas_are_refused_when_compiling(ftype: Any) -> None:
    with pytest.raises(ValueError):
        compile_reader(_field(ftype))


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "record", "name": "R", "fields": [{"name": "a'}; import os; {'", "type": "long"}]},
        {"type": "record", "name": "R(); import os", "fields": []},
        {"type": "record", "name": "R", "namespace": "x\nimport os", "fields": []},
        {"type": "record", "name": "R", "fields": [{"name": "a", "type": "long"}] * 2},
    ],
    ids=["field-name", "record-name", "namespace", "repeated-field"],
)
def test_names_outside_the_avro_grammar_are_refused(schema: Any) -> None:
    with pytest.raises(ValueError):
        compile_reader(schema)


# --- the codec -------------------------------------------------------------------------------


def test_the_codec_reads_the_current_versions_without_fastavro(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_fastavro(*args: object) -> None:
        raise AssertionError("fastavro was used")

    monkeypatch.setattr(codec_module, "schemaless_reader", no_fastavro)
    codec = Codec()
    record = {"input_id": "i", "run_id": "r", "kind": "k", "trace_id": "t", "at": 1, "body": "{}"}
    full = {**record, "producer_id": None, "producer_seq": None, "reply_to": None}
    assert codec.decode(codec.encode("Input", record)).record == full
    # an old writer version needs schema resolution: that is still fastavro's job
    with pytest.raises(CorruptRecordError, match="fastavro was used"):
        codec.decode(codec.encode("Input", record, version=1))


def test_the_codec_falls_back_to_fastavro_for_what_the_compiled_reader_lacks() -> None:
    schema = _field("double") | {"namespace": "t"}
    reg = load_registry({"t.R.v1.avsc": json.dumps(schema)})
    sv = reg.current("R")
    data = MAGIC + sv.fingerprint + _fastavro_bytes(sv.parsed, {"f": 1.5})
    assert Codec(reg).decode(data).record == {"f": 1.5}


def test_the_codec_reads_bytearray_and_memoryview_into_bytes() -> None:
    record = {"reason": "r", "error_class": "E", "source_topic": "t", "source_partition": 0}
    record |= {"source_offset": 1, "original_value": b"\x00v", "at": 2}
    data = encode("DeadLetter", record)
    for buffer in (bytearray(data), memoryview(data)):
        value = decode(buffer, "DeadLetter").record  # type: ignore[arg-type]
        assert type(value["original_value"]) is bytes
        assert value == decode(data).record
