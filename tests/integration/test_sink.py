"""`agentruns sink` against the real broker and Postgres: the projection is the fold of the log,
exactly once across kill -9 restarts and Postgres restarts."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from confluent_kafka import Producer

from agentruns.connectors.dev.stack.local_postgres import LocalPostgres
from agentruns.connectors.postgres.bulk import prefer_lz4
from agentruns.connectors.projection.audit import audit
from agentruns.processors.effects import CallModel
from agentruns.processors.events import (
    Candidate,
    Event,
    ModelCallCompleted,
    ModelOutcome,
    ToolCallRequest,
)
from agentruns.processors.limits import MAX_DURATION_MS, MAX_TIME_MS
from agentruns.processors.state import Policy
from agentruns.processors.transition import fold, transition
from agentruns.streams.codec import decode, encode
from agentruns.streams.records import event_record, parse_event_body
from agentruns.streams.topics import DLQ, EVENTS, topic_name
from tests.support.pipeline import SEARCH, now_ms, read_all, submitted
from tests.support.runlog import new_log, projected_events, running_sink, scripted_runs, write_runs
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


def test_projection_equals_the_fold_of_the_log_for_200_runs(
    kafka_bootstrap: str, database_url: str, unique_name: str
) -> None:
    prefix = unique_name
    runs = scripted_runs(prefix, 200)
    writer = new_log(kafka_bootstrap, None, prefix)
    keys = write_runs(writer, runs)
    writer.close()
    with running_sink(kafka_bootstrap, database_url, prefix) as sink:
        wait_for(lambda: sink.stats.events >= len(keys), 120, "the sink to project the log")
    report = audit(kafka_bootstrap, prefix, database_url)
    assert report.runs == 200
    assert report.differences == [], [d.line() for d in report.differences[:20]]
    with psycopg.connect(database_url) as conn:
        rows = dict(
            conn.execute(
                "SELECT run_id, status FROM runs WHERE run_id LIKE %s", (f"{prefix}-%",)
            ).fetchall()
        )
        ops = conn.execute(
            "SELECT count(*) FROM operations WHERE run_id LIKE %s", (f"{prefix}-%",)
        ).fetchone()
        # the states big enough to be compressed were compressed with lz4 where the server
        # has it (pglz cost Postgres ~4x the CPU)
        methods = {
            m
            for (m,) in conn.execute(
                "SELECT DISTINCT pg_column_compression(state) FROM runs WHERE run_id LIKE %s",
                (f"{prefix}-%",),
            )
        }
        lz4 = prefer_lz4(conn)
    # independent of the sink's code: the core's own fold of the events written
    for log in runs:
        state = fold(parse_event_body(e.model_dump_json()) for e in log)
        assert state is not None
        assert rows[state.run_id] == str(state.status)
    assert projected_events(database_url, prefix) == len(keys)
    assert ops is not None and ops[0] > 200
    assert methods - {None} == ({"lz4"} if lz4 else {"pglz"}), methods
    assert sink.stats.divergences == 0 and sink.stats.gaps == 0


def _start_sink(prefix: str, kafka_bootstrap: str, database_url: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "DATABASE_URL": database_url,
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentruns.connectors.projection.sink",
            "--prefix",
            prefix,
            "--group",
            f"{prefix}-sink",
            "--assign",
            "group",
            "--instance-id",
            "sink-0",
            "--batch-size",
            "100",
            "--log-level",
            "WARNING",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_sink_killed_at_random_points_projects_exactly_once(
    kafka_bootstrap: str, database_url: str, unique_name: str
) -> None:
    prefix = unique_name
    rng = random.Random(42)
    runs = scripted_runs(prefix, 120, seed=9)
    writer = new_log(kafka_bootstrap, None, prefix)
    half = len(runs) // 2
    keys = write_runs(writer, runs[:half])
    writer_done = threading.Event()
    written: list[tuple[str, int]] = []

    def write_rest() -> None:
        written.extend(write_runs(writer, runs[half:], per_transaction=40))
        writer_done.set()

    proc = _start_sink(prefix, kafka_bootstrap, database_url)
    background = threading.Thread(target=write_rest, daemon=True)
    background.start()
    kills = 0
    try:
        for _ in range(4):
            seen = projected_events(database_url, prefix)

            def progressed(seen: int = seen) -> bool:
                now = projected_events(database_url, prefix)
                return now > seen or (writer_done.is_set() and now >= len(keys) + len(written))

            # kill -9 at a random point after some progress, mid-batch or between batches
            wait_for(progressed, 60, "sink progress")
            threading.Event().wait(rng.uniform(0.0, 0.4))
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            kills += 1
            proc = _start_sink(prefix, kafka_bootstrap, database_url)
        wait_for(writer_done.is_set, 120, "the writer")
        total = len(keys) + len(written)
        wait_for(
            lambda: projected_events(database_url, prefix) >= total, 120, "the full projection"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    # 0 after a graceful stop; -SIGTERM if the last one was still starting up
    assert proc.returncode in (0, -signal.SIGTERM)
    writer.close()
    with psycopg.connect(database_url) as conn:
        seqs = conn.execute(
            "SELECT run_id, count(*), min(seq), max(seq) FROM events WHERE run_id LIKE %s"
            " GROUP BY run_id",
            (f"{prefix}-%",),
        ).fetchall()
        offsets = conn.execute(
            "SELECT topic, partition, next_offset FROM sink_offsets WHERE consumer = %s",
            (f"{prefix}-sink",),
        ).fetchall()
    assert kills == 4
    assert projected_events(database_url, prefix) == total  # no duplicate, none missing
    assert len(seqs) == len(runs)
    for _run_id, count, low, high in seqs:
        assert (low, high) == (1, count)  # gapless
    report = audit(kafka_bootstrap, prefix, database_url)
    assert report.differences == [], [d.line() for d in report.differences[:20]]
    _assert_offsets_at_end(kafka_bootstrap, offsets)


def _assert_offsets_at_end(bootstrap: str, offsets: list[tuple[str, int, int]]) -> None:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "offset-check"})
    try:
        for topic, partition, next_offset in offsets:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), 10)
            # the last record consumed is followed only by its transaction's commit marker
            assert high - 1 <= next_offset <= high, (topic, partition, next_offset, high)
    finally:
        consumer.close()
    # and the DLQ's, when it holds a record
    assert {t.rsplit(".", 1)[-1] for t, _, _ in offsets} - {"dlq"} == {"events", "state", "results"}


def test_postgres_restart_while_sinking_retries_and_loses_nothing(
    kafka_bootstrap: str, own_postgres: LocalPostgres, unique_name: str
) -> None:
    prefix = unique_name
    url = own_postgres.url
    runs = scripted_runs(prefix, 60, seed=3)
    writer = new_log(kafka_bootstrap, None, prefix)
    keys = write_runs(writer, runs[:30], per_transaction=30)
    with running_sink(kafka_bootstrap, url, prefix, batch_size=50) as sink:
        wait_for(lambda: sink.stats.events > 0, 60, "first batches")
        own_postgres.stop(mode="immediate")  # a crash, not a polite shutdown
        keys += write_runs(writer, runs[30:], per_transaction=30)
        writer.close()
        wait_for(lambda: sink.stats.retries >= 2, 60, "the sink to retry")
        own_postgres.start()
        wait_for(lambda: sink.stats.events >= len(keys), 120, "the sink to catch up")
    assert projected_events(url, prefix) == len(keys)
    report = audit(kafka_bootstrap, prefix, url)
    assert report.differences == [], [d.line() for d in report.differences[:20]]


def _asking(run_id: str, user_wait_ms: int, at: int | None = None) -> list[Event]:
    """A run whose model asks for a tool that needs approval: it waits for the user, with a
    question that expires `user_wait_ms` after the model's answer."""
    at = now_ms() if at is None else at
    guarded = SEARCH.model_copy(update={"permission": "write"})
    policy = Policy(approval_required=("write",), user_wait_ms=user_wait_ms)
    sub = submitted(run_id, at=at).model_copy(update={"tools": (guarded,), "policy": policy})
    call = next(e for e in transition(None, sub).effects if isinstance(e, CallModel))
    answer = ModelCallCompleted(
        run_id=run_id,
        event_id=f"{call.idempotency_key}:result",
        at=at + 1,
        trace_id=sub.trace_id,
        step=call.step,
        attempt=call.attempt,
        outcome=ModelOutcome.FINISHED,
        candidate_ref="sha256:" + "a" * 64,
        candidate=Candidate(
            tool_calls=(
                ToolCallRequest(id="c1", name="search_docs", arguments_json='{"query": "q"}'),
            )
        ),
    )
    return [sub, answer]


def _raw(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for key, value in records:
        producer.produce(topic, key=key, value=value, headers=[("origin", b"test")])
    assert producer.flush(30) == 0


def _runs(database_url: str, prefix: str) -> dict[str, str]:
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT run_id, status FROM runs WHERE run_id LIKE %s", (f"{prefix}-%",)
        ).fetchall()
    return {str(r): str(s) for r, s in rows}


def test_records_the_sink_cannot_project_are_dead_lettered_and_the_next_runs_are_projected(
    kafka_bootstrap: str, database_url: str, unique_name: str
) -> None:
    prefix = unique_name
    events_topic = topic_name(EVENTS, prefix)
    writer = new_log(kafka_bootstrap, None, prefix)
    # a question that would expire past year 9999 (the last valid time and the longest wait):
    # the core caps it, the sink clamps what Python's datetime cannot hold
    writer.send(writer.plan(_asking(f"{prefix}-wait", MAX_DURATION_MS, at=MAX_TIME_MS - 10)))
    # a goal with a NUL character: Postgres text (and jsonb) refuse it, the batch's SQL fails
    writer.send(writer.plan([submitted(f"{prefix}-nul").model_copy(update={"goal": "a\x00b"})]))
    garbage = b"\x00not an event"
    unfoldable = encode(
        "Event",
        event_record(
            f"{prefix}-body",
            1,
            submitted(f"{prefix}-body"),
            transition(None, submitted(f"{prefix}-body")),
            input_id=None,
        )
        | {"body": '{"type": "RunSubmitted"}'},
    )
    _raw(
        kafka_bootstrap, events_topic, [(b"junk", garbage), (f"{prefix}-body".encode(), unfoldable)]
    )
    writer.send(writer.plan([submitted(f"{prefix}-good")]))
    with running_sink(kafka_bootstrap, database_url, prefix) as sink:
        wait_for(
            lambda: {f"{prefix}-good", f"{prefix}-wait"} <= set(_runs(database_url, prefix)),
            60,
            "the good runs to be projected past the bad records",
        )
        writer.send(writer.plan([submitted(f"{prefix}-after")]))  # a later batch goes on too
        wait_for(lambda: f"{prefix}-after" in _runs(database_url, prefix), 60, "a later run")
    writer.close()
    runs = _runs(database_url, prefix)
    assert runs == {
        f"{prefix}-wait": "WAITING_USER",
        f"{prefix}-good": "MODEL_RUNNING",
        f"{prefix}-after": "MODEL_RUNNING",
    }
    with psycopg.connect(database_url) as conn:
        expires = conn.execute(
            "SELECT expires_at FROM questions WHERE run_id = %s", (f"{prefix}-wait",)
        ).fetchone()
    assert expires is not None and expires[0] == datetime(9999, 12, 31, 23, 59, 59, 999000, UTC)
    dead = read_all(kafka_bootstrap, topic_name(DLQ, prefix), "DeadLetter")
    by_value = {d.value["original_value"]: d.value for d in dead}
    assert len(dead) == 3, [d.value["reason"] for d in dead]
    assert by_value[garbage]["reason"] and by_value[garbage]["source_topic"] == events_topic
    assert by_value[unfoldable]["reason"].startswith("invalid_input:unprojectable")
    (nul,) = [v for v in by_value.values() if v["reason"].startswith("invalid_input:unwritable")]
    assert decode(nul["original_value"], "Event").record["run_id"] == f"{prefix}-nul"
    assert nul["source_topic"] == events_topic and nul["source_offset"] >= 0
    assert nul["original_headers"] == [] and by_value[garbage]["original_headers"] == [
        {"key": "origin", "value": b"test"}
    ]
    assert sink.stats.dead_letters == 3
