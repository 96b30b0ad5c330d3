"""The single-object codec: framing, round trips, errors, and the DLQ records built from them."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentruns.schemas import registry
from agentruns.streams import codec as codec_module
from agentruns.streams.codec import (
    HEADER_LEN,
    MAGIC,
    Codec,
    CodecError,
    CorruptRecordError,
    Decoded,
    InvalidRecordError,
    NotSingleObjectError,
    UnknownFingerprintError,
    UnknownRecordNameError,
    WrongRecordTypeError,
    decode,
    encode,
    fingerprint_of,
)
from agentruns.streams.dlq import (
    CONFLICTING_DUPLICATE,
    DEAD_LETTER_RECORD,
    INVALID_EVENT,
    dead_letter,
    dead_letter_for_error,
)

BODY = '{"type":"ToolCallCompleted","run_id":"run-1","step":3,"attempt":1,"at":1733160000000}'

SAMPLES: dict[str, dict[str, Any]] = {
    "Input": {
        "input_id": "in-1",
        "run_id": "run-1",
        "kind": "SubmitRun",
        "trace_id": "trace-1",
        "producer_id": "api",
        "producer_seq": 7,
        "at": 1733160000000,
        "body": '{"goal":"\u00e9t\u00e9 \U0001f600"}',
        "reply_to": "req-9",
    },
    "Event": {
        "run_id": "run-1",
        "seq": 42,
        "event_id": "run-1:42",
        "type": "ToolCallCompleted",
        "step": 3,
        "attempt": 1,
        "trace_id": "trace-1",
        "at": 1733160000000,
        "disposition": "APPLIED",
        "reason": None,
        "body": BODY,
        "input_id": "in-1",
    },
    "Snapshot": {
        "run_id": "run-1",
        "last_seq": 42,
        "version": 43,
        "status": "WAITING_TOOL",
        "state": '{"status":"WAITING_TOOL"}',
        "buffer": [
            {
                "input_id": "in-3",
                "run_id": "run-1",
                "kind": "UserReplied",
                "trace_id": "trace-1",
                "producer_id": "api",
                "producer_seq": 9,
                "at": 1733160000500,
                "body": "{}",
                "reply_to": None,
            }
        ],
        "gap_since": 1733160000500,
        "producer_marks": {"api": 7, "tool-executor": 12},
        "seen_input_ids": ["in-1", "in-2"],
        "updated_at": 1733160000000,
        "recent_inputs": [{"key": "p:api:7", "digest": "0123456789abcdef"}],
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    },
    "Effect": {
        "idempotency_key": "run-1:3:call_tool:ab12",
        "run_id": "run-1",
        "seq": 42,
        "step": 3,
        "attempt": 1,
        "type": "CallTool",
        "trace_id": "trace-1",
        "at": 1733160000000,
        "body": "{}",
    },
    "Result": {
        "run_id": "run-1",
        "status": "SUCCEEDED",
        "seq": 50,
        "version": 1,
        "result_ref": "sha256:00ff",
        "summary": "done",
        "trace_id": "trace-1",
        "at": 1733160009000,
        "body": "{}",
    },
    "DeadLetter": {
        "reason": "unknown writer schema fingerprint 0000000000000000",
        "error_class": "UNKNOWN_FINGERPRINT",
        "source_topic": "agentruns.inbox",
        "source_partition": 3,
        "source_offset": 12345,
        "original_key": b"run-1",
        "original_value": b"\xc3\x01\x00\x00\x00\x00\x00\x00\x00\x00\x02",
        "original_headers": [{"key": "trace_id", "value": b"trace-1"}, {"key": "x", "value": None}],
        "original_timestamp": 1733160000000,
        "run_id": "run-1",
        "at": 1733160001000,
    },
    "EndedRun": {
        "run_id": "run-1",
        "status": "SUCCEEDED",
        "last_seq": 51,
        "ended_at": 1733160009000,
        "result_ref": "sha256:00ff",
    },
}


def test_samples_cover_every_record_name() -> None:
    assert sorted(SAMPLES) == sorted(registry().names())


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip_every_record(name: str) -> None:
    data = encode(name, SAMPLES[name])
    assert decode(data) == Decoded(name, registry().current(name).version, SAMPLES[name])
    assert decode(data, name).record == SAMPLES[name]


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_framing_is_avro_single_object_encoding(name: str) -> None:
    data = encode(name, SAMPLES[name])
    assert data[:2] == b"\xc3\x01" == MAGIC
    assert data[2:HEADER_LEN] == registry().current(name).fingerprint
    assert fingerprint_of(data) == registry().current(name).fingerprint


def test_nullable_and_defaulted_fields_may_be_omitted() -> None:
    minimal = {
        "input_id": "in-1",
        "run_id": "run-1",
        "kind": "CancelRun",
        "trace_id": "t",
        "at": 0,
        "body": "{}",
    }
    record = decode(encode("Input", minimal), "Input").record
    assert record == {**minimal, "producer_id": None, "producer_seq": None, "reply_to": None}


def test_encode_an_older_version_on_request() -> None:
    v1 = {k: v for k, v in SAMPLES["Input"].items() if k != "reply_to"}
    data = encode("Input", v1, version=1)
    assert data[2:HEADER_LEN] == registry().get("Input", 1).fingerprint
    assert decode(data) == Decoded("Input", 1, {**v1, "reply_to": None})


def test_encoding_is_deterministic() -> None:
    assert encode("Event", SAMPLES["Event"]) == encode("Event", dict(SAMPLES["Event"]))


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc3", b"\xc3\x01", b"\xc3\x01" + b"\x00" * 7, b"{}", b"\x00\x01" + b"\x00" * 20],
    ids=["empty", "one-byte", "magic-only", "short-fingerprint", "json", "bad-magic"],
)
def test_not_single_object(data: bytes) -> None:
    with pytest.raises(NotSingleObjectError) as info:
        decode(data)
    assert info.value.error_class == "NOT_SINGLE_OBJECT"
    assert fingerprint_of(data) is None


def test_unknown_fingerprint() -> None:
    data = MAGIC + b"\x01\x02\x03\x04\x05\x06\x07\x08" + b"\x02x"
    with pytest.raises(UnknownFingerprintError) as info:
        decode(data)
    assert info.value.error_class == "UNKNOWN_FINGERPRINT"
    assert info.value.fingerprint == b"\x01\x02\x03\x04\x05\x06\x07\x08"
    assert "0102030405060708" in str(info.value)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_truncation_is_a_corrupt_record(name: str) -> None:
    data = encode(name, SAMPLES[name])
    for cut in range(HEADER_LEN, len(data)):
        with pytest.raises(CorruptRecordError) as info:
            decode(data[:cut])
        assert info.value.error_class == "CORRUPT_RECORD"


def test_trailing_bytes_are_a_corrupt_record() -> None:
    with pytest.raises(CorruptRecordError, match="trailing"):
        decode(encode("Event", SAMPLES["Event"]) + b"\x00")


def test_invalid_utf8_is_a_corrupt_record() -> None:
    fp = registry().current("Effect").fingerprint
    with pytest.raises(CorruptRecordError, match="UnicodeDecodeError"):
        decode(MAGIC + fp + b"\x04\xff\xfe")


def test_wrong_record_type() -> None:
    data = encode("Event", SAMPLES["Event"])
    with pytest.raises(WrongRecordTypeError) as info:
        decode(data, expected_name="Input")
    assert info.value.error_class == "WRONG_RECORD_TYPE"
    assert (info.value.expected, info.value.actual) == ("Input", "Event")


def test_error_classes_are_distinct_and_rooted() -> None:
    classes: list[type[CodecError]] = [
        NotSingleObjectError,
        UnknownFingerprintError,
        CorruptRecordError,
        WrongRecordTypeError,
        UnknownRecordNameError,
        InvalidRecordError,
    ]
    assert all(issubclass(c, CodecError) for c in classes)
    assert len({c.error_class for c in classes}) == len(classes)
    assert not any(c.retryable for c in classes)


def test_encode_unknown_name_or_version() -> None:
    with pytest.raises(UnknownRecordNameError):
        encode("Nope", {})
    with pytest.raises(UnknownRecordNameError):
        encode("Input", SAMPLES["Input"], version=99)


@pytest.mark.parametrize(
    ("name", "patch"),
    [
        ("Event", {"step": 2**31}),
        ("Event", {"attempt": -(2**31) - 1}),
        ("Event", {"seq": 1.5}),
        ("Event", {"at": 2**63}),
        ("Event", {"seq": "1"}),
        ("Event", {"run_id": 1}),
        ("Event", {"reason": 5}),
        ("Event", {"unexpected": "x"}),
        ("Event", {"body": None}),
        ("Input", {"producer_seq": 2**64}),
        ("Snapshot", {"producer_marks": {"api": 2**63}}),
        ("Snapshot", {"buffer": [{**SAMPLES["Snapshot"]["buffer"][0], "at": 0.5}]}),
        ("DeadLetter", {"original_value": "not bytes"}),
    ],
)
def test_encode_rejects_records_that_do_not_fit_the_schema(
    name: str, patch: dict[str, Any]
) -> None:
    with pytest.raises(InvalidRecordError):
        encode(name, {**SAMPLES[name], **patch})


def test_encode_rejects_a_missing_required_field() -> None:
    record = dict(SAMPLES["Event"])
    del record["seq"]
    with pytest.raises(InvalidRecordError):
        encode("Event", record)


def test_default_codec_is_shared() -> None:
    assert codec_module.default_codec() is codec_module.default_codec()


# --- properties ---------------------------------------------------------------------------

TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
LONG = st.integers(min_value=-(2**63), max_value=2**63 - 1)

INPUTS = st.fixed_dictionaries(
    {
        "input_id": TEXT,
        "run_id": TEXT,
        "kind": TEXT,
        "trace_id": TEXT,
        "producer_id": st.none() | TEXT,
        "producer_seq": st.none() | LONG,
        "at": LONG,
        "body": TEXT,
        "reply_to": st.none() | TEXT,
    }
)


@settings(max_examples=300, deadline=None)
@given(INPUTS)
def test_input_round_trip_is_identity(record: dict[str, Any]) -> None:
    assert decode(encode("Input", record), "Input") == Decoded("Input", 2, record)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_decode_of_arbitrary_bytes_raises_only_codec_errors(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        decode(data)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(sorted(SAMPLES)), st.binary(max_size=64))
def test_decode_of_a_valid_header_with_garbage_body_raises_only_codec_errors(
    name: str, body: bytes
) -> None:
    data = MAGIC + registry().current(name).fingerprint + body
    try:
        decoded = decode(data, name)
    except CodecError:
        return
    assert decode(encode(name, decoded.record)) == decoded  # whatever decodes re-encodes


# --- DLQ records (garbage, unknown fingerprint, invalid input) --------------------------

HEADERS = [("trace_id", b"trace-1"), ("x-null", None), ("x-str", "v"), ("trace_id", b"again")]


@pytest.mark.parametrize(
    "value",
    [
        b"\x00garbage",
        MAGIC + b"\xee" * 8 + b"\x00",
        MAGIC + registry().current("Input").fingerprint,
    ],
    ids=["garbage", "unknown-fingerprint", "truncated"],
)
def test_codec_errors_become_dead_letters_with_the_original_bytes(value: bytes) -> None:
    with pytest.raises(CodecError) as info:
        decode(value, "Input")
    record = dead_letter_for_error(
        info.value, "agentruns.inbox", 2, 99, b"run-1", value, HEADERS, 1733160001000
    )
    round_tripped = decode(encode(DEAD_LETTER_RECORD, record), DEAD_LETTER_RECORD).record
    assert round_tripped == record
    assert record["error_class"] == info.value.error_class
    assert record["reason"] == str(info.value)
    assert record["original_value"] == value
    assert record["original_key"] == b"run-1"
    assert (record["source_topic"], record["source_partition"], record["source_offset"]) == (
        "agentruns.inbox",
        2,
        99,
    )
    assert record["original_headers"] == [
        {"key": "trace_id", "value": b"trace-1"},
        {"key": "x-null", "value": None},
        {"key": "x-str", "value": b"v"},
        {"key": "trace_id", "value": b"again"},
    ]


def test_dead_letter_for_a_schema_invalid_input() -> None:
    value = encode("Input", {**SAMPLES["Input"], "body": '{"not": "a SubmitRun"}'})
    record = dead_letter(
        "body: field required: goal",
        INVALID_EVENT,
        "agentruns.inbox",
        0,
        7,
        None,
        value,
        None,
        1733160001000,
        original_timestamp=1733160000000,
        run_id="run-1",
    )
    assert decode(encode(DEAD_LETTER_RECORD, record)).record == record
    assert record["original_key"] is None
    assert record["original_headers"] == []
    assert record["run_id"] == "run-1"


def test_dead_letter_accepts_memoryview_and_bytearray() -> None:
    record = dead_letter(
        "conflicting duplicate",
        CONFLICTING_DUPLICATE,
        "agentruns.inbox",
        0,
        1,
        bytearray(b"k"),  # type: ignore[arg-type]
        memoryview(b"v"),  # type: ignore[arg-type]
        [],
        0,
    )
    assert (record["original_key"], record["original_value"]) == (b"k", b"v")
    assert decode(encode(DEAD_LETTER_RECORD, record)).record == record


def test_custom_registry_codec() -> None:
    codec = Codec(registry(), validate_on_encode=False)
    assert codec.registry is registry()
    assert codec.decode(codec.encode("Event", SAMPLES["Event"])).record == SAMPLES["Event"]


SNAPSHOT_HEAD = ("run_id", "last_seq", "version", "status", "updated_at")


def test_decode_fields_picks_fields_of_the_current_version() -> None:
    data = encode("Snapshot", SAMPLES["Snapshot"])
    picked = Codec().decode_fields(data, "Snapshot", SNAPSHOT_HEAD)
    assert picked == {name: SAMPLES["Snapshot"][name] for name in SNAPSHOT_HEAD}
    assert list(picked) == list(SNAPSHOT_HEAD)


def test_decode_fields_of_an_old_version_resolves_first() -> None:
    v1 = {k: v for k, v in SAMPLES["Input"].items() if k != "reply_to"}
    data = encode("Input", v1, version=1)
    picked = Codec().decode_fields(data, "Input", ("run_id", "reply_to"))
    assert picked == {"run_id": v1["run_id"], "reply_to": None}


def test_decode_fields_reads_nothing_after_the_last_field_it_picks() -> None:
    data = encode("Snapshot", SAMPLES["Snapshot"])
    # cut inside `recent_inputs`, after `updated_at`: the picked fields are intact
    cut = data[:-3]
    assert Codec().decode_fields(cut, "Snapshot", ("run_id", "version")) == {
        "run_id": "run-1",
        "version": 43,
    }
    with pytest.raises(CorruptRecordError):
        decode(cut, "Snapshot")


@pytest.mark.parametrize("cut", [HEADER_LEN + 1, HEADER_LEN + 4, HEADER_LEN + 12])
def test_decode_fields_refuses_a_record_cut_before_its_fields_end(cut: int) -> None:
    data = encode("Snapshot", SAMPLES["Snapshot"])
    with pytest.raises(CorruptRecordError):
        Codec().decode_fields(data[:cut], "Snapshot", SNAPSHOT_HEAD)


def test_decode_fields_checks_header_and_record_name() -> None:
    with pytest.raises(NotSingleObjectError):
        Codec().decode_fields(b"nope", "Snapshot", SNAPSHOT_HEAD)
    with pytest.raises(WrongRecordTypeError):
        Codec().decode_fields(encode("Event", SAMPLES["Event"]), "Snapshot", SNAPSHOT_HEAD)
    with pytest.raises(UnknownFingerprintError):
        Codec().decode_fields(MAGIC + b"\x00" * 8 + b"\x02", "Snapshot", SNAPSHOT_HEAD)
