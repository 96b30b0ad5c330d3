"""docs/contract.md: every worked example in it is what the code computes."""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path
from typing import Any

import fastavro
import pytest
from jsonschema import Draft202012Validator

from agentruns.connectors.json_schemas import DIRECTORY
from agentruns.processors.events import RunSubmitted, parse_event
from agentruns.processors.ids import (
    RUN_NAMESPACE,
    effect_key,
    run_id_for_key,
    submit_event_id,
    trace_id_for,
)
from agentruns.schemas import registry
from agentruns.streams import dlq
from agentruns.streams.codec import InvalidRecordError, decode, encode
from agentruns.streams.inputs import Batch
from agentruns.streams.kafka_defaults import KEYED_PARTITIONER, TRANSACTIONAL_PRODUCER
from agentruns.streams.partitioning import murmur2, partition_for, to_positive
from agentruns.streams.records import input_record
from tests.unit.test_processor_inputs import TOPICS, inbound, new_path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "contract.md").read_text(encoding="utf-8")


def test_the_run_id_example_is_derived_as_documented() -> None:
    run_id = run_id_for_key("order-42")
    assert run_id == "run-afc2e0f17bac52aabaa3475862e80808"
    assert f"RUN_NAMESPACE = {RUN_NAMESPACE}" in DOC
    assert f"the key `order-42` names the run `{run_id}`" in DOC
    assert f"default trace id is `{trace_id_for(run_id)}`" in DOC
    assert f"(`{submit_event_id(run_id)}`)" in DOC


def test_the_partition_examples_are_what_partition_for_computes() -> None:
    rows = re.findall(
        r"^\| `([^`]+)` \| `(run-[0-9a-f]{32})` \| `(-?\d+)` \| `(\d+)` \| `(\d+)`", DOC, re.M
    )
    assert len(rows) == 2
    assert any(int(murmur) < 0 for _, _, murmur, _, _ in rows), "an example with the sign bit"
    for key, run_id, murmur, positive, partition in rows:
        assert run_id == run_id_for_key(key)
        assert murmur2(run_id.encode()) == int(murmur)
        assert to_positive(int(murmur)) == int(positive)
        assert partition_for(run_id, 6) == int(partition)


def test_the_fingerprint_table_lists_every_shipped_schema() -> None:
    rows = re.findall(r"^\| `(\w+)` \| v(\d+) \| `([0-9a-f]{16})` \|$", DOC, re.M)
    shipped = [
        (sv.name, str(sv.version), sv.fingerprint.hex())
        for name in registry().names()
        for sv in registry().versions(name)
    ]
    assert rows == shipped, "docs/contract.md: update the fingerprint table"
    current = registry().current("Input")
    assert f"an Input v{current.version} value starts `c3 01 {current.fingerprint.hex(' ')}`" in DOC


def test_the_example_body_is_a_valid_task_of_its_run() -> None:
    (body,) = re.findall(r"```json\n(.*?)\n```", DOC, re.S)
    event = parse_event(body)
    assert isinstance(event, RunSubmitted)
    run_id = run_id_for_key("order-42")
    assert (event.run_id, event.event_id, event.trace_id) == (
        run_id,
        submit_event_id(run_id),
        trace_id_for(run_id),
    )
    assert event.at == 1_767_225_600_000  # 2026-01-01T00:00Z
    task = json.loads((ROOT / "examples" / "tasks" / "order-42.json").read_text(encoding="utf-8"))
    assert {k: v for k, v in json.loads(body).items() if k in task} == task
    schema = json.loads((DIRECTORY / "event.schema.json").read_text(encoding="utf-8"))
    Draft202012Validator(schema).validate(json.loads(body))
    record = input_record(event, producer_id="orders-service", producer_seq=1)
    assert record["input_id"] == submit_event_id(run_id)
    assert encode("Input", record).startswith(b"\xc3\x01" + registry().current("Input").fingerprint)


def test_the_java_example_uses_the_documented_namespace() -> None:
    java = (ROOT / "examples" / "java" / "ResultsReader.java").read_text(encoding="utf-8")
    assert f'UUID.fromString("{RUN_NAMESPACE}")' in java


def _one_input(record: dict[str, Any], key: bytes | None) -> Batch:
    """`record` through the processor's input path, as the inbox would hand it over."""
    batch = Batch()
    new_path().handle(inbound(encode("Input", record), key=key), batch)
    return batch


def test_an_input_cannot_be_produced_without_a_trace_id() -> None:
    """The envelope's trace_id is a required string (no default, not nullable): no Avro writer
    can leave it out, and the body, the event, must carry one too."""
    run_id = run_id_for_key("order-42")
    event = RunSubmitted(
        run_id=run_id,
        event_id=submit_event_id(run_id),
        at=1,
        trace_id=trace_id_for(run_id),
        goal="g",
    )
    record = input_record(event, producer_id="orders-service", producer_seq=1)
    (field,) = [f for f in registry().current("Input").raw["fields"] if f["name"] == "trace_id"]
    assert field["type"] == "string" and "default" not in field
    with pytest.raises(InvalidRecordError):
        encode("Input", {k: v for k, v in record.items() if k != "trace_id"})
    with pytest.raises(ValueError):
        fastavro.schemaless_writer(
            io.BytesIO(),
            fastavro.parse_schema(registry().current("Input").raw),
            {k: v for k, v in record.items() if k != "trace_id"},
        )
    body = {k: v for k, v in json.loads(record["body"]).items() if k != "trace_id"}
    batch = _one_input({**record, "body": json.dumps(body)}, run_id.encode())
    dead = [decode(r[2], "DeadLetter").record for r in batch.records if r[0] == TOPICS.dlq]
    assert [d["error_class"] for d in dead] == [dlq.INVALID_EVENT]
    assert "trace_id" in dead[0]["reason"] and dead[0]["run_id"] == run_id
    assert not [r for r in batch.records if r[0] == TOPICS.events]


def test_the_run_takes_the_trace_id_of_the_body() -> None:
    """An envelope whose trace_id differs from its body's: the run's events carry the body's."""
    run_id = run_id_for_key("order-42")
    event = RunSubmitted(
        run_id=run_id, event_id=submit_event_id(run_id), at=1, trace_id="from-the-body", goal="g"
    )
    record = {**input_record(event), "trace_id": "from-the-envelope"}
    batch = _one_input(record, run_id.encode())
    (logged,) = [decode(r[2], "Event").record for r in batch.records if r[0] == TOPICS.events]
    assert logged["trace_id"] == "from-the-body"


def test_a_dead_letter_is_keyed_by_its_run_when_the_run_is_known() -> None:
    """Known run: the run id as key (the producer partitions by it, `KEYED_PARTITIONER`); an
    input whose run cannot be read keeps its own key."""
    run_id = run_id_for_key("order-42")
    event = RunSubmitted(
        run_id=run_id,
        event_id=submit_event_id(run_id),
        at=1,
        trace_id=trace_id_for(run_id),
        goal="g",
    )
    record = input_record(event)
    body = {k: v for k, v in json.loads(record["body"]).items() if k != "goal"}
    batch = _one_input({**record, "body": json.dumps(body)}, None)  # a record without a key
    (known,) = [r for r in batch.records if r[0] == TOPICS.dlq]
    assert known[1] == run_id.encode() and known[3] is None  # partitioned by its key
    garbage = Batch()
    new_path().handle(inbound(b"\x00not an Input", key=b"someone-else"), garbage)
    (unknown,) = [r for r in garbage.records if r[0] == TOPICS.dlq]
    assert unknown[1] == b"someone-else"
    assert decode(unknown[2], "DeadLetter").record["run_id"] is None
    assert KEYED_PARTITIONER == {"partitioner": "murmur2_random"}
    assert TRANSACTIONAL_PRODUCER["partitioner"] == "murmur2_random"


def test_the_result_key_example_is_the_publication_key_the_core_derives() -> None:
    """A Result's idempotency_key is the PublishResult effect's key, as documented, and the
    JSON schema describes every field of a Result's body."""
    run_id = run_id_for_key("order-42")
    (example,) = re.findall(r"attempt 1, resolution 0 it is\n`([0-9a-f]{64})`", DOC)
    assert effect_key("publish", run_id, 1, 1, 0, "SUCCEEDED") == example
    joined = "\x1f".join(["effect", "publish", run_id, "1", "1", "0", "SUCCEEDED"])
    assert hashlib.sha256(joined.encode()).hexdigest() == example
    schema = json.loads((DIRECTORY / "result.schema.json").read_text(encoding="utf-8"))
    assert all(prop.get("description") for prop in schema["properties"].values())
    assert "not the submitter's" in schema["properties"]["idempotency_key"]["description"]
    for name in schema["properties"]:
        assert f"`{name}`" in DOC, f"docs/contract.md, Reading results: {name}"


def test_a_dead_letter_of_a_huge_run_id_is_keyed_by_its_digest() -> None:
    """An envelope naming a 100 KB run id: the dead letter's key and run_id are its digest, so
    the dead letter still fits; a 512-character id of multi-byte characters stays whole."""
    huge = "r" * (100 << 10)
    letter = dlq.dead_letter("why", dlq.INVALID_EVENT, "t", 0, 0, None, None, None, 1, run_id=huge)
    digest = "sha256:" + hashlib.sha256(huge.encode()).hexdigest()
    assert letter["run_id"] == digest and dlq.key_of(letter) == digest.encode()
    wide = "é" * 512
    letter = dlq.dead_letter("why", dlq.INVALID_EVENT, "t", 0, 0, None, None, None, 1, run_id=wide)
    assert letter["run_id"] == wide and dlq.key_of(letter) == wide.encode()
