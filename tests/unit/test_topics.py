"""Topic specs, record keys and the run_id → partition function."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentruns.schemas import registry
from agentruns.streams.partitioning import (
    SEQ_WIDTH,
    event_key,
    murmur2,
    parse_event_key,
    partition_for,
    run_key,
    to_positive,
)
from agentruns.streams.topics import (
    CO_PARTITIONED,
    DEFAULT_PARTITIONS,
    EFFECT_KINDS,
    TopicNames,
    TopicSpec,
    effect_suffix,
    min_insync_replicas_for,
    topic_name,
    topic_specs,
)

# apache/kafka clients/src/test/java/org/apache/kafka/common/utils/UtilsTest.java, testMurmur2
KAFKA_MURMUR2_VECTORS = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


@pytest.mark.parametrize(("data", "expected"), KAFKA_MURMUR2_VECTORS.items())
def test_murmur2_matches_the_java_client(data: bytes, expected: int) -> None:
    assert murmur2(data) == expected


def test_to_positive_clears_the_sign_bit_like_java() -> None:
    assert to_positive(-1) == 0x7FFFFFFF
    assert to_positive(-(2**31)) == 0
    assert to_positive(5) == 5


@pytest.mark.parametrize(("data", "h"), KAFKA_MURMUR2_VECTORS.items())
@pytest.mark.parametrize("n", [1, 3, 6, 12, 64])
def test_partition_for_is_kafkas_default_partitioner(data: bytes, h: int, n: int) -> None:
    # Java: Utils.toPositive(Utils.murmur2(keyBytes)) % numPartitions
    assert partition_for(data.decode(), n) == (h & 0x7FFFFFFF) % n


@given(st.text(), st.integers(min_value=1, max_value=1000))
def test_partition_for_is_in_range_and_stable(run_id: str, n: int) -> None:
    p = partition_for(run_id, n)
    assert 0 <= p < n
    assert p == partition_for(run_id, n)
    assert murmur2(run_id.encode()) >= -(2**31)
    assert murmur2(run_id.encode()) < 2**31


def test_partition_for_rejects_non_positive_counts() -> None:
    with pytest.raises(ValueError):
        partition_for("run-1", 0)


def test_partition_for_spreads_runs() -> None:
    counts = [0] * 6
    for i in range(6000):
        counts[partition_for(f"run-{i}", 6)] += 1
    assert min(counts) > 800


def test_event_key_format_and_order() -> None:
    assert event_key("run-1", 42) == b"run-1:" + b"0" * (SEQ_WIDTH - 2) + b"42"
    keys = [event_key("run:with:colons", s) for s in (1, 2, 10, 99, 100, 2**63 - 1)]
    assert keys == sorted(keys)
    assert parse_event_key(keys[-1]) == ("run:with:colons", 2**63 - 1)
    with pytest.raises(ValueError):
        event_key("run-1", -1)


@given(st.text(min_size=1), st.integers(min_value=0, max_value=2**63 - 1))
def test_event_key_round_trips(run_id: str, seq: int) -> None:
    try:
        run_id.encode("utf-8")
    except UnicodeEncodeError:
        return
    assert parse_event_key(event_key(run_id, seq)) == (run_id, seq)


@pytest.mark.parametrize("key", [b"run-1", b"run-1:42", b":" + b"0" * SEQ_WIDTH, b"r:" + b"x" * 20])
def test_parse_event_key_rejects_malformed_keys(key: bytes) -> None:
    with pytest.raises(ValueError):
        parse_event_key(key)


def test_run_key_is_utf8_run_id() -> None:
    assert run_key("r\u00e9") == "r\u00e9".encode()


# --- topic specs ----------------------------------------------------------------------------


def _by_suffix(specs: list[TopicSpec]) -> dict[str, TopicSpec]:
    return {s.suffix: s for s in specs}


def test_all_topics_are_specified_once() -> None:
    specs = topic_specs()
    suffixes = [s.suffix for s in specs]
    assert len(set(suffixes)) == len(suffixes)
    assert set(suffixes) == {
        "inbox",
        "events",
        "state",
        "runs",
        "effects.model",
        "effects.tool",
        "effects.timer",
        "results",
        "dlq",
    }
    assert [s.name() for s in specs] == [f"agentruns.{x}" for x in suffixes]


def test_events_are_compacted_and_never_deleted() -> None:
    events = _by_suffix(topic_specs())["events"]
    configs = events.kafka_configs()
    assert configs["cleanup.policy"] == "compact"
    assert configs["retention.ms"] == "-1"
    assert configs["retention.bytes"] == "-1"
    assert int(configs["min.compaction.lag.ms"]) > 0
    assert events.value_record == "Event"


@pytest.mark.parametrize(
    ("suffix", "policy", "record"),
    [
        ("inbox", "delete", "Input"),
        ("events", "compact", "Event"),
        ("state", "compact", "Snapshot"),
        ("effects.model", "delete", "Effect"),
        ("effects.tool", "delete", "Effect"),
        ("effects.timer", "delete", "Effect"),
        ("results", "compact", "Result"),
        ("runs", "compact", "EndedRun"),
        ("dlq", "delete", "DeadLetter"),
    ],
)
def test_policies_and_records(suffix: str, policy: str, record: str) -> None:
    spec = _by_suffix(topic_specs())[suffix]
    assert spec.cleanup_policy == policy
    assert spec.value_record == record
    if policy == "delete":
        assert spec.retention_ms >= 7 * 24 * 3_600_000
    else:
        assert spec.retention_ms == -1


def test_dlq_outlives_the_inbox() -> None:
    specs = _by_suffix(topic_specs())
    assert specs["dlq"].retention_ms > specs["inbox"].retention_ms


def test_value_records_exist_in_the_schema_registry() -> None:
    names = set(registry().names())
    assert {s.value_record for s in topic_specs()} <= names


def test_kafka_configs_are_strings_with_kafka_names() -> None:
    for spec in topic_specs():
        configs = spec.kafka_configs()
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in configs.items())
        assert all("_" not in k and k == k.lower() for k in configs)
        assert configs["cleanup.policy"] in ("delete", "compact")
        assert int(configs["min.insync.replicas"]) <= spec.replication_factor


@pytest.mark.parametrize(("rf", "isr"), [(1, 1), (2, 1), (3, 2), (5, 2)])
def test_min_insync_replicas(rf: int, isr: int) -> None:
    assert min_insync_replicas_for(rf) == isr
    assert all(s.min_insync_replicas == isr for s in topic_specs(replication_factor=rf))


def test_partitions_configurable_and_co_partitioned() -> None:
    assert all(s.partitions == DEFAULT_PARTITIONS == 6 for s in topic_specs())
    specs = _by_suffix(topic_specs(partitions=12, replication_factor=3))
    assert {specs[s].partitions for s in CO_PARTITIONED} == {12}
    assert all(s.replication_factor == 3 for s in specs.values())


@pytest.mark.parametrize(
    "kwargs",
    [{"partitions": 0}, {"replication_factor": 0}, {"prefix": ".x"}, {"prefix": "x."}],
)
def test_topic_specs_rejects_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        topic_specs(**kwargs)  # type: ignore[arg-type]


def test_specs_are_immutable() -> None:
    spec = topic_specs()[0]
    with pytest.raises(AttributeError):
        spec.partitions = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.configs["x"] = "y"  # type: ignore[index]


def test_names_for_a_prefix() -> None:
    names = TopicNames.for_prefix("staging.agentruns")
    assert names.inbox == "staging.agentruns.inbox"
    assert names.effect("tool") == "staging.agentruns.effects.tool"
    assert set(names.all()) == {s.name("staging.agentruns") for s in topic_specs()}
    assert TopicNames.for_prefix().events == "agentruns.events"
    assert topic_name("inbox", "") == "inbox"
    assert [effect_suffix(k) for k in EFFECT_KINDS] == [
        "effects.model",
        "effects.tool",
        "effects.timer",
    ]
    with pytest.raises(ValueError):
        effect_suffix("email")
    with pytest.raises(KeyError):
        names.effect("email")
