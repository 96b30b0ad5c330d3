"""The timer service on the real broker and Postgres."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer

from agentruns.connectors.dev.stack.local_postgres import LocalPostgres
from agentruns.connectors.runtime.timers import DUE_AT_OUT_OF_RANGE, TimerService
from agentruns.processors.effects import CancelTimer, ScheduleTimer
from agentruns.processors.state import Budgets, TimerPurpose
from agentruns.streams.admin import ensure_topics
from agentruns.streams.codec import encode
from agentruns.streams.partitioning import partition_for
from agentruns.streams.processor import ProcessorConfig
from agentruns.streams.records import effect_record, parse_event_body
from agentruns.streams.topics import DLQ, INBOX, RESULTS, effect_suffix, topic_name
from tests.support.pipeline import (
    Inbox,
    input_record,
    now_ms,
    read_all,
    running_on_thread,
    running_processor,
    submitted,
)
from tests.support.waiting import wait_for

PARTITIONS = 3


def _schedule(bootstrap: str, prefix: str, effects: list[ScheduleTimer | CancelTimer]) -> None:
    _produce(bootstrap, prefix, [(e.run_id, _effect_bytes(e)) for e in effects])


def _effect_bytes(effect: ScheduleTimer | CancelTimer) -> bytes:
    return encode("Effect", effect_record(effect, seq=1, at=now_ms()))


def _produce(bootstrap: str, prefix: str, records: list[tuple[str, bytes]]) -> None:
    """Raw records on the timer effects topic, in order, on one partition (key "same")."""
    producer = Producer({"bootstrap.servers": bootstrap})
    for run_id, value in records:
        producer.produce(
            topic_name(effect_suffix("timer"), prefix),
            key=run_id.encode(),
            value=value,
            headers=[("run_id", run_id.encode())],
        )
    assert producer.flush(30) == 0


def _timer(run_id: str, timer_id: str, due_at: int) -> ScheduleTimer:
    return ScheduleTimer(
        idempotency_key=f"{timer_id}:k",
        run_id=run_id,
        step=1,
        attempt=1,
        trace_id="trace",
        timer_id=timer_id,
        due_at=due_at,
        purpose=TimerPurpose.DEADLINE,
    )


def _fired(bootstrap: str, prefix: str) -> list[dict[str, object]]:
    return [
        r.value
        for r in read_all(bootstrap, topic_name(INBOX, prefix), "Input")
        if r.value["kind"] == "TimerFired"
    ]


@pytest.fixture
def timer_thread(kafka_bootstrap: str, database_url: str, prefix: str) -> Iterator[TimerService]:
    service = TimerService(kafka_bootstrap, database_url, prefix=prefix, group_id=f"{prefix}-timer")
    with running_on_thread(service.run, "timers"):
        yield service


def test_timers_fire_at_their_due_time_and_cancelled_ones_never(
    kafka_bootstrap: str, prefix: str, timer_thread: TimerService
) -> None:
    base = now_ms()
    _schedule(
        kafka_bootstrap,
        prefix,
        [
            _timer("r1", "r1:t1", base + 300),
            _timer("r2", "r2:t1", base + 800),
            _timer("r3", "r3:t1", base + 600),
            CancelTimer(
                idempotency_key="c", run_id="r3", step=1, attempt=1, trace_id="t", timer_id="r3:t1"
            ),
        ],
    )
    wait_for(lambda: len(_fired(kafka_bootstrap, prefix)) >= 2, timeout=30, what="two timers")
    fired = {str(f["run_id"]): f for f in _fired(kafka_bootstrap, prefix)}
    assert set(fired) == {"r1", "r2"}
    assert fired["r1"]["at"] == base + 300 and fired["r2"]["at"] == base + 800
    assert parse_event_body(str(fired["r1"]["body"])).type == "TimerFired"
    assert timer_thread.fired == 2


def test_deployments_sharing_a_database_fire_only_their_own_timers(
    kafka_bootstrap: str, database_url: str, prefix: str, timer_thread: TimerService
) -> None:
    other = f"{prefix}-other"
    ensure_topics(kafka_bootstrap, prefix=other, partitions=PARTITIONS)
    base = now_ms()
    # the same run and timer ids in both: a run of the same key submitted to each deployment
    _schedule(kafka_bootstrap, other, [_timer("same", "same:t1", base + 200)])
    _schedule(kafka_bootstrap, prefix, [_timer("same", "same:t1", base + 200)])
    _schedule(kafka_bootstrap, prefix, [_timer("mine", "mine:t1", base + 400)])
    wait_for(lambda: len(_fired(kafka_bootstrap, prefix)) >= 2, timeout=30, what="two timers")
    assert sorted(str(f["run_id"]) for f in _fired(kafka_bootstrap, prefix)) == ["mine", "same"]
    assert _fired(kafka_bootstrap, other) == []  # its own timer service is not running
    service = TimerService(kafka_bootstrap, database_url, prefix=other)
    with running_on_thread(service.run, "other timers"):
        wait_for(lambda: _fired(kafka_bootstrap, other), timeout=30, what="the other's timer")
    assert [f["run_id"] for f in _fired(kafka_bootstrap, other)] == ["same"]
    assert len(_fired(kafka_bootstrap, prefix)) == 2


def _spawn(env: dict[str, str], prefix: str) -> subprocess.Popen[bytes]:
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"{prefix}-timer.log"
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "agentruns.connectors.runtime.timers", "--prefix", prefix,
             "--group", f"{prefix}-timer", "--log-level", "WARNING"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=out,
            cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip


def test_kill_9_and_restart_every_timer_fires_once_as_the_processor_sees_it(
    kafka_bootstrap: str, database_url: str, prefix: str
) -> None:
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "DATABASE_URL": database_url}
    base = now_ms()
    timers = [_timer(f"k{i}", f"k{i}:deadline", base + 200 * i) for i in range(25)]
    _schedule(kafka_bootstrap, prefix, timers)
    rng = random.Random(7)
    service = _spawn(env, prefix)
    try:
        for _ in range(2):
            threading.Event().wait(rng.uniform(1.0, 2.5))  # a random kill point
            service.send_signal(signal.SIGKILL)
            service.wait()
            service = _spawn(env, prefix)
        wait_for(
            lambda: len({f["input_id"] for f in _fired(kafka_bootstrap, prefix)}) == len(timers),
            timeout=90,
            what="every timer fired",
            every=0.5,
        )
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(timeout=60)
    copies: dict[object, set[tuple[object, ...]]] = collections.defaultdict(set)
    for f in _fired(kafka_bootstrap, prefix):
        copies[f["input_id"]].add(tuple(sorted(f.items())))
    # A re-fire after a crash is byte-identical: the processor drops it as an exact duplicate.
    assert all(len(versions) == 1 for versions in copies.values())


def test_a_run_past_its_deadline_expires_once(
    kafka_bootstrap: str, database_url: str, prefix: str, timer_thread: TimerService
) -> None:
    config = ProcessorConfig(bootstrap=kafka_bootstrap, prefix=prefix, group_id=f"{prefix}-proc")
    with running_processor(config, database_url):
        inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
        deadline = now_ms() + 1500
        for i in range(4):  # no executor answers: only the deadline can end these runs
            event = submitted(f"late-{i}").model_copy(
                update={"budgets": Budgets(deadline_at=deadline)}
            )
            inbox.send(input_record(event))
        inbox.flush()
        results = topic_name(RESULTS, prefix)
        wait_for(
            lambda: len(read_all(kafka_bootstrap, results, "Result")) == 4,
            timeout=60,
            what="four expired runs",
        )
    statuses = [r.value["status"] for r in read_all(kafka_bootstrap, results, "Result")]
    assert statuses == ["EXPIRED"] * 4


def test_effects_the_timer_cannot_ingest_are_dead_lettered_and_a_later_timer_still_fires(
    kafka_bootstrap: str, prefix: str, timer_thread: TimerService
) -> None:
    garbage = b"\x00not an effect"
    bad_body = _timer("bb", "bb:t", now_ms())
    bad_body_record = effect_record(bad_body, seq=1, at=now_ms())
    bad_body_record["body"] = '{"type": "ScheduleTimer", "due_at": "soon"'  # truncated JSON
    too_late = _effect_bytes(_timer("far", "far:deadline", 2**63))
    negative = _effect_bytes(_timer("neg", "neg:deadline", -1))
    nul = _effect_bytes(_timer("nul", "nul:\x00deadline", now_ms()))  # Postgres text refuses NUL
    good = _timer("good", "good:deadline", now_ms() + 200)
    records = [
        ("garbage", garbage),
        ("bb", encode("Effect", bad_body_record)),
        ("far", too_late),
        ("neg", negative),
        ("nul", nul),
        ("good", _effect_bytes(good)),
    ]
    _produce(kafka_bootstrap, prefix, records)
    wait_for(
        lambda: any(f["run_id"] == "good" for f in _fired(kafka_bootstrap, prefix)),
        timeout=30,
        what="the good timer after the bad effects",
    )
    dlq = topic_name(DLQ, prefix)
    wait_for(
        lambda: len(read_all(kafka_bootstrap, dlq, "DeadLetter")) >= 5,
        timeout=30,
        what="five dead letters",
    )
    dead = {
        d.value["original_value"]: d.value for d in read_all(kafka_bootstrap, dlq, "DeadLetter")
    }
    assert set(dead) == {value for _, value in records[:5]}
    # the core's bound on due_at refuses them at decode; the timer's own range check stays
    # behind it for effects written by another version
    for out_of_range in (too_late, negative):
        reason = dead[out_of_range]["reason"]
        assert reason.startswith(("invalid_input:effect_body", DUE_AT_OUT_OF_RANGE)), reason
        assert "due_at" in reason
    assert dead[encode("Effect", bad_body_record)]["reason"].startswith("invalid_input:effect_body")
    assert dead[nul]["reason"].startswith("invalid_input:unstorable")
    assert dead[garbage]["error_class"] != "INVALID_EVENT" and dead[garbage]["reason"]
    for letter in dead.values():
        assert letter["source_topic"] == topic_name(effect_suffix("timer"), prefix)
        assert letter["source_offset"] >= 0 and letter["source_partition"] >= 0
        assert letter["original_headers"][0]["key"] == "run_id"
    # keyed by the run its envelope names, on the run's partition (murmur2: under librdkafka's
    # CRC32 default "far" and "nul" would land elsewhere); the garbage names none
    for record in read_all(kafka_bootstrap, dlq, "DeadLetter"):
        run_id = record.value["run_id"]
        if record.value["original_value"] == garbage:
            assert run_id is None and record.key == b"garbage"
            continue
        assert record.key == run_id.encode()
        assert record.partition == partition_for(run_id, PARTITIONS)
    assert [f["run_id"] for f in _fired(kafka_bootstrap, prefix)] == ["good"]
    assert timer_thread.dead_letters == 5


def test_timers_consumed_while_postgres_is_down_fire_once_it_is_back(
    kafka_bootstrap: str, own_postgres: LocalPostgres, prefix: str
) -> None:
    service = TimerService(
        kafka_bootstrap, own_postgres.url, prefix=prefix, group_id=f"{prefix}-timer"
    )
    with running_on_thread(service.run, "timer"):
        _schedule(kafka_bootstrap, prefix, [_timer("up", "up:t", now_ms())])
        wait_for(lambda: len(_fired(kafka_bootstrap, prefix)) == 1, timeout=30, what="a timer")
        own_postgres.stop(mode="immediate")
        base = now_ms()
        _schedule(kafka_bootstrap, prefix, [_timer(f"d{i}", f"d{i}:t", base + i) for i in range(5)])
        wait_for(lambda: service.retries >= 3, timeout=60, what="the timer to back off")
        own_postgres.start()
        wait_for(
            lambda: len(_fired(kafka_bootstrap, prefix)) == 6,
            timeout=60,
            what="the timers consumed while Postgres was down",
        )
    assert sorted(str(f["run_id"]) for f in _fired(kafka_bootstrap, prefix)) == [
        "d0", "d1", "d2", "d3", "d4", "up"
    ]  # fmt: skip
