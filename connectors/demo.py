"""`agentruns demo` (what `make demo` runs).

Today (foundation): resolve Kafka and Postgres (starting local ones if none is configured),
apply the migrations, create the pipeline's topics, then produce one sample task input to the
inbox in a transaction, read it back with a read_committed consumer, decode it, store an artifact
in Postgres, and print what happened step by step. The agent scenarios replace the sample round
trip once the processor and executors exist.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
import uuid
from collections.abc import Sequence

import psycopg
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from connectors.db import migrate
from connectors.services import ServiceStack
from streams.admin import ensure_topics
from streams.codec import decode, encode
from streams.partitioning import partition_for
from streams.topics import INBOX, topic_name


def _step(text: str, began: float) -> None:
    print(f"[{time.monotonic() - began:6.1f}s] {text}", flush=True)


def _round_trip(
    bootstrap: str, topic: str, partitions: int, record: dict[str, object]
) -> dict[str, object]:
    run_id = str(record["run_id"])
    partition = partition_for(run_id, partitions)
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": f"agentruns-demo-{uuid.uuid4().hex[:8]}",
            "enable.idempotence": True,
            "log_level": 3,  # the coordinator's first "load in progress" retry is not news
        }
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, key=run_id.encode(), value=encode("Input", record), partition=partition)
    producer.commit_transaction(30)

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"agentruns-demo-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    consumer.assign([TopicPartition(topic, partition, 0)])
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            error = msg.error()
            if error is not None and error.code() != KafkaError._PARTITION_EOF:
                raise RuntimeError(str(error))
            value = msg.value()
            if error is None and value is not None:
                decoded = decode(value, expected_name="Input")
                if decoded.record["input_id"] == record["input_id"]:
                    return {
                        "partition": msg.partition(),
                        "offset": msg.offset(),
                        "schema": f"{decoded.name} v{decoded.version}",
                        "bytes": len(value),
                        "record": decoded.record,
                    }
    finally:
        consumer.close()
    raise RuntimeError("the sample record was not read back within 30 s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns demo")
    parser.add_argument("--prefix", default="agentruns")
    parser.add_argument("--partitions", type=int, default=6)
    args = parser.parse_args(list(argv or []))
    began = time.monotonic()
    _step(
        "resolving Kafka and Postgres (KAFKA_BOOTSTRAP_SERVERS/DATABASE_URL, Docker, local)", began
    )
    with ServiceStack() as stack:
        assert stack.endpoints is not None
        ep = stack.endpoints
        _step(f"kafka    {ep.kafka_bootstrap}  from {ep.kafka_source}", began)
        _step(f"postgres {ep.database_url}  from {ep.postgres_source}", began)
        applied = migrate(ep.database_url)
        _step(f"migrations applied: {', '.join(applied) or 'none new'}", began)
        for name, what in ensure_topics(
            ep.kafka_bootstrap, prefix=args.prefix, partitions=args.partitions
        ).items():
            _step(f"topic {name}: {what}", began)

        run_id = f"demo-{uuid.uuid4().hex[:12]}"
        body = {"type": "RunSubmitted", "goal": "say hello", "messages": []}
        record: dict[str, object] = {
            "input_id": f"{run_id}:submit",
            "run_id": run_id,
            "kind": "RunSubmitted",
            "trace_id": uuid.uuid4().hex,
            "producer_id": "demo",
            "producer_seq": 1,
            "at": int(time.time() * 1000),
            "body": json.dumps(body, sort_keys=True, separators=(",", ":")),
            "reply_to": None,
        }
        seen = _round_trip(
            ep.kafka_bootstrap, topic_name(INBOX, args.prefix), args.partitions, record
        )
        _step(
            f"produced a sample task for {run_id} in a transaction; read it back read_committed "
            f"from partition {seen['partition']} offset {seen['offset']} "
            f"({seen['schema']}, {seen['bytes']} bytes, Avro single-object encoding)",
            began,
        )
        content = json.dumps(body, sort_keys=True).encode()
        ref = "sha256:" + hashlib.sha256(content).hexdigest()
        with psycopg.connect(ep.database_url) as conn:
            conn.execute(
                "INSERT INTO artifacts (ref, media_type, size_bytes, content)"
                " VALUES (%s, 'application/json', %s, %s) ON CONFLICT (ref) DO NOTHING",
                (ref, len(content), content),
            )
            stored = conn.execute(
                "SELECT size_bytes FROM artifacts WHERE ref = %s", (ref,)
            ).fetchone()
        _step(
            f"stored the task body as artifact {ref[:19]}… ({stored[0] if stored else 0} bytes)",
            began,
        )
    _step(
        "done; services this demo started are stopped (a running `dev up` stack is left as is)",
        began,
    )
    return 0
