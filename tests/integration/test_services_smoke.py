"""The foundation talks to a real broker and a real database."""

from __future__ import annotations

import time

import psycopg
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from agentruns.connectors.postgres.artifacts import PostgresArtifactStore, StoredArtifact
from agentruns.connectors.postgres.migrate import migrate
from tests.support.pipeline import read_raw


def _create(bootstrap: str, topic: str, partitions: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(topic, partitions, 1)], operation_timeout=30)
    futures[topic].result(timeout=30)


def _drain(bootstrap: str, topic: str, isolation: str) -> list[bytes | None]:
    """Every value of the topic visible under `isolation`, read until partition EOF."""
    return [r.value for r in read_raw(bootstrap, topic, isolation=isolation)]


def test_transactional_produce_is_seen_and_abort_is_not(
    kafka_bootstrap: str, unique_name: str
) -> None:
    topic = unique_name
    _create(kafka_bootstrap, topic)
    producer = Producer(
        {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"{topic}-tx", "linger.ms": 0}
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, key=b"run-1", value=b"committed-1")
    producer.produce(topic, key=b"run-1", value=b"committed-2")
    producer.commit_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, key=b"run-1", value=b"aborted")
    assert producer.flush(30) == 0  # the aborted record really reaches the log
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, key=b"run-1", value=b"committed-3")
    producer.commit_transaction(30)

    committed = _drain(kafka_bootstrap, topic, "read_committed")
    assert committed == [b"committed-1", b"committed-2", b"committed-3"]
    uncommitted = _drain(kafka_bootstrap, topic, "read_uncommitted")
    assert b"aborted" in uncommitted


def test_postgres_round_trip_and_migrations_idempotent(database_url: str) -> None:
    assert migrate(database_url) == []  # the fixture already applied everything
    with psycopg.connect(database_url) as conn:
        conn.execute(
            "INSERT INTO artifacts (ref, media_type, size_bytes, content) VALUES (%s, %s, %s, %s)"
            " ON CONFLICT (ref) DO NOTHING",
            ("sha256:" + "0" * 64, "text/plain", 5, b"hello"),
        )
        row = conn.execute(
            "SELECT media_type, content FROM artifacts WHERE ref = %s", ("sha256:" + "0" * 64,)
        ).fetchone()
        versions = [r[0] for r in conn.execute("SELECT version FROM schema_migrations")]
    assert row == ("text/plain", b"hello")
    assert "0001_artifacts" in versions


def test_artifact_store_writes_each_ref_once(database_url: str) -> None:
    store = PostgresArtifactStore(database_url)
    try:
        shared = StoredArtifact.of('{"tools":["search"],"n":' + str(time.time_ns()) + "}")
        fresh = StoredArtifact.of('{"context":' + str(time.time_ns()) + "}")
        assert store.put_many([shared, shared]) == 1
        # a ref this store saw committed is not sent again (write-once, content-addressed)
        assert store.put_many([shared, fresh]) == 1
        assert store.get_many([shared.ref, fresh.ref]) == {
            shared.ref: shared.content,
            fresh.ref: fresh.content,
        }
    finally:
        store.close()
