"""`agentruns topics create` against the real broker: every spec'd topic, idempotently."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from agentruns.connectors.errors import AgentrunsKafkaError
from agentruns.streams.admin import describe_topics, ensure_topics
from agentruns.streams.topics import topic_specs


def test_topics_created_with_their_configs_and_idempotent(
    kafka_bootstrap: str, unique_name: str
) -> None:
    prefix = unique_name
    first = ensure_topics(kafka_bootstrap, prefix=prefix, partitions=3)
    specs = topic_specs(prefix, 3, 1)
    assert set(first) == {s.name(prefix) for s in specs}
    assert set(first.values()) == {"created"}
    assert set(ensure_topics(kafka_bootstrap, prefix=prefix, partitions=3).values()) == {"exists"}

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    meta = admin.list_topics(timeout=10).topics
    for spec in specs:
        assert len(meta[spec.name(prefix)].partitions) == 3
        resource = ConfigResource(ResourceType.TOPIC, spec.name(prefix))
        configs = admin.describe_configs([resource])[resource].result(timeout=10)
        for key, value in spec.kafka_configs().items():
            assert configs[key].value == value, (spec.name(prefix), key)
    events = next(s for s in specs if s.suffix == "events")
    assert events.kafka_configs()["cleanup.policy"] == "compact"
    assert events.kafka_configs()["retention.ms"] == "-1"
    assert any(
        row.startswith(f"{prefix}.events")
        for row in describe_topics(kafka_bootstrap, prefix=prefix)
    )

    # a config changed by hand is set back to the spec's (and only what differs is set)
    inbox = next(s for s in specs if s.suffix == "inbox")
    drifted = ConfigResource(
        ResourceType.TOPIC,
        inbox.name(prefix),
        incremental_configs=[
            ConfigEntry("retention.ms", "1234567", incremental_operation=AlterConfigOpType.SET)
        ],
    )
    for future in admin.incremental_alter_configs([drifted]).values():
        future.result(timeout=10)
    ensure_topics(kafka_bootstrap, prefix=prefix, partitions=3)
    resource = ConfigResource(ResourceType.TOPIC, inbox.name(prefix))
    configs = admin.describe_configs([resource])[resource].result(timeout=10)
    assert configs["retention.ms"].value == inbox.kafka_configs()["retention.ms"]


def test_partition_mismatch_is_a_clear_error(kafka_bootstrap: str, unique_name: str) -> None:
    ensure_topics(kafka_bootstrap, prefix=unique_name, partitions=2)
    with pytest.raises(AgentrunsKafkaError, match="partitions"):
        ensure_topics(kafka_bootstrap, prefix=unique_name, partitions=4)
