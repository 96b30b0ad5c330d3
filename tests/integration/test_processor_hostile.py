"""Hostile inputs against the real broker: no input wedges the processor."""

from __future__ import annotations

import json
import secrets
import time
import zlib
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from agentruns.processors.events import CancelRequested, GoalChanged, RunSubmitted
from agentruns.streams import dlq
from agentruns.streams.admin import record_limits
from agentruns.streams.inputs import RECORD_MARGIN
from agentruns.streams.partitioning import partition_for
from agentruns.streams.processor import Processor, ProcessorConfig
from agentruns.streams.records import parse_event_body
from agentruns.streams.topics import DLQ, EVENTS, RESULTS, STATE, topic_name
from tests.support.pipeline import (
    ExecutorDouble,
    Inbox,
    input_record,
    now_ms,
    read_all,
    read_raw,
    result_statuses,
    running_processor,
    submitted,
)
from tests.support.waiting import wait_for

PARTITIONS = 3


def _config(bootstrap: str, prefix: str, **options: Any) -> ProcessorConfig:
    return ProcessorConfig(bootstrap=bootstrap, prefix=prefix, group_id=f"{prefix}-proc", **options)


def _log(bootstrap: str, prefix: str, run_id: str) -> list[dict[str, object]]:
    events = read_all(bootstrap, topic_name(EVENTS, prefix), "Event")
    return [r.value for r in events if r.value["run_id"] == run_id]


def _calls(double: ExecutorDouble, run_id: str) -> int:
    return sum(n for key, n in double.answered.items() if key.startswith(run_id))


def _dead(bootstrap: str, prefix: str) -> list[dict[str, object]]:
    return [r.value for r in read_all(bootstrap, topic_name(DLQ, prefix), "DeadLetter")]


def test_a_task_with_a_400_kb_trace_id_is_dead_lettered_and_the_next_run_succeeds(
    kafka_bootstrap: str, database_url: str, prefix: str
) -> None:
    """Its event and effects would be over the broker's record limit (before, every
    transaction failed with MSG_SIZE_TOO_LARGE and was retried forever); the core's bound on
    ids refuses it at decode, before anything is written."""
    inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
    huge = submitted("huge-trace")
    huge = RunSubmitted(**{**_fields(huge), "trace_id": "t" * (400 << 10)})
    double = ExecutorDouble(kafka_bootstrap, prefix, PARTITIONS, steps=1)
    double.start()
    try:
        with running_processor(_config(kafka_bootstrap, prefix), database_url) as proc:
            inbox.send(input_record(huge))
            inbox.flush()
            wait_for(lambda: proc.stats.dead_letters >= 1, timeout=60, what="the refusal")
            inbox.send(input_record(submitted("after-huge")))
            inbox.flush()
            wait_for(
                lambda: result_statuses(kafka_bootstrap, prefix).get("after-huge") == "SUCCEEDED",
                timeout=60,
                what="the run submitted after it",
            )
    finally:
        double.close()
        inbox.close()
    (dead,) = _dead(kafka_bootstrap, prefix)
    assert dead["error_class"] == dlq.INVALID_EVENT and dead["run_id"] == "huge-trace"
    assert "trace_id" in str(dead["reason"])
    assert _log(kafka_bootstrap, prefix, "huge-trace") == []
    assert proc.stats.aborts == 0


def test_a_goal_over_the_record_limit_fails_its_run_and_the_next_run_succeeds(
    kafka_bootstrap: str, database_url: str, prefix: str
) -> None:
    inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
    config = _config(kafka_bootstrap, prefix, max_record_bytes=64 << 10)
    with running_processor(config, database_url) as proc:
        first = submitted("big-goal")
        inbox.send(input_record(first))
        inbox.flush()
        wait_for(
            lambda: len(_log(kafka_bootstrap, prefix, "big-goal")) == 1,
            timeout=60,
            what="the run's submission",
        )
        goal = GoalChanged(
            run_id="big-goal",
            event_id="big-goal:goal",
            at=first.at + 1,
            trace_id=first.trace_id,
            step=1,
            goal="g" * (100 << 10),
        )
        inbox.send(input_record(goal))
        inbox.flush()
        wait_for(
            lambda: result_statuses(kafka_bootstrap, prefix).get("big-goal") == "FAILED",
            timeout=60,
            what="the run failed by the refusal",
        )
        double = ExecutorDouble(kafka_bootstrap, prefix, PARTITIONS, steps=1)
        double.start()
        try:
            inbox.send(input_record(submitted("after-goal")))
            inbox.flush()
            wait_for(
                lambda: result_statuses(kafka_bootstrap, prefix).get("after-goal") == "SUCCEEDED",
                timeout=60,
                what="the run submitted after it",
            )
        finally:
            double.close()
            inbox.close()
    log = _log(kafka_bootstrap, prefix, "big-goal")
    assert [e["type"] for e in log[:2]] == ["RunSubmitted", "InputRefused"]
    assert all(e["disposition"] == "LATE" for e in log[2:])  # the model's late answer
    refused = parse_event_body(str(log[1]["body"]))
    assert refused.reason.startswith(  # type: ignore[union-attr]
        f"invalid_input:record_too_large: {topic_name(EVENTS, prefix)} record of "
    )
    assert proc.stats.refused == 1 and proc.stats.aborts == 0


def test_a_batch_the_broker_keeps_refusing_is_isolated_and_its_poison_dead_lettered(
    kafka_bootstrap: str, database_url: str, prefix: str
) -> None:
    """A record under the limit the processor read at start, over the one the events topic has
    now: the broker refuses the batch. After three failures the inputs go one per transaction;
    the one that fails alone is dead-lettered with the broker's error, the rest commit."""
    config = _config(kafka_bootstrap, prefix, retry_backoff_ms=20)
    inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
    with running_processor(config, database_url) as proc:
        events = topic_name(EVENTS, prefix)
        _set_topic_config(kafka_bootstrap, events, "max.message.bytes", 16384)
        wait_for(
            lambda: record_limits(kafka_bootstrap, [events]).get(events) == 16384,
            timeout=30,
            what="the lowered limit",
        )
        good = [f"good-{i}" for i in range(6)]
        poison = submitted("poison")
        # random hex: lz4 cannot make it smaller than the topic's limit
        poison = RunSubmitted(**{**_fields(poison), "goal": secrets.token_hex(20 << 10)})
        for run_id in good[:3]:
            inbox.send(input_record(submitted(run_id)))
        inbox.send(input_record(poison))
        for run_id in good[3:]:
            inbox.send(input_record(submitted(run_id)))
        inbox.flush()
        wait_for(
            lambda: any(d["run_id"] == "poison" for d in _dead(kafka_bootstrap, prefix)),
            timeout=120,
            what="the poison's dead letter",
        )
        wait_for(
            lambda: all(_log(kafka_bootstrap, prefix, run_id) for run_id in good),
            timeout=60,
            what="every good run's submission",
        )
    inbox.close()
    (dead,) = _dead(kafka_bootstrap, prefix)
    assert dead["error_class"] == dlq.TRANSACTION_FAILED
    assert "transaction failed" in str(dead["reason"])
    assert _log(kafka_bootstrap, prefix, "poison") == []
    assert proc.stats.isolations >= 1 and proc.stats.aborts >= 3
    assert proc.stats.retries == proc.stats.aborts


def _fields(event: RunSubmitted) -> dict[str, object]:
    return {f: getattr(event, f) for f in event.__struct_fields__}


def _set_topic_config(bootstrap: str, topic: str, name: str, value: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    resource = ConfigResource(
        "TOPIC",
        topic,
        incremental_configs=[
            ConfigEntry(name, str(value), incremental_operation=AlterConfigOpType.SET)
        ],
    )
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(timeout=30)


def test_an_evicted_run_stays_ended_across_restarts_whatever_its_resubmissions_say(
    kafka_bootstrap: str, database_url: str, prefix: str, tmp_path: Path
) -> None:
    """An ended run evicted from memory and the state topic is answered LATE: by what the
    processor keeps in memory, then after a restart from its store of ended runs (read from
    the `runs` topic into a store in memory, then into an empty one on disk). Its
    submission again, with its old `at` or a fresh one, is never a second run: no second
    result, no seq written twice, the model not called again."""
    config = _config(kafka_bootstrap, prefix, terminal_retention_ms=1000)
    on_disk = _config(kafka_bootstrap, prefix, terminal_retention_ms=1000, store_dir=str(tmp_path))
    inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
    double = ExecutorDouble(kafka_bootstrap, prefix, PARTITIONS, steps=1)
    double.start()
    first = submitted("ends")
    try:
        with running_processor(config, database_url) as proc:
            inbox.send(input_record(first))
            inbox.flush()
            wait_for(
                lambda: result_statuses(kafka_bootstrap, prefix).get("ends") == "SUCCEEDED",
                timeout=60,
                what="the run's end",
            )
            time.sleep(1.2)  # event time moves past its end plus the retention
            inbox.send(input_record(submitted("later")))
            inbox.flush()
            wait_for(lambda: proc.stats.evicted >= 1, timeout=60, what="the eviction")
            assert "ends" not in {slot.run_id for slot in proc.slots()}
            ended = len(_log(kafka_bootstrap, prefix, "ends"))
            cancel = CancelRequested(run_id="ends", event_id="late", at=now_ms(), trace_id="t")
            inbox.send(input_record(cancel))
            inbox.flush()
            wait_for(
                lambda: len(_log(kafka_bootstrap, prefix, "ends")) == ended + 1,
                timeout=60,
                what="the late answer",
            )
        assert _last_state(kafka_bootstrap, prefix, "ends") is None  # a tombstone
        calls = _calls(double, "ends")
        # the restore from the store's checkpoint: tests/integration/test_resubmission.py
        for restart, settings in enumerate((config, on_disk)):
            with running_processor(settings, database_url) as proc:
                wait_for(lambda: bool(proc._assigned), timeout=60, what="the restore")
                assert "ends" not in {slot.run_id for slot in proc.slots()}
                again = RunSubmitted(**{**_fields(first), "at": now_ms()})  # a fresh `at`
                inbox.send(input_record(first))  # its submission again: not a new run
                inbox.send(input_record(again))
                inbox.send(input_record(submitted(f"after-restore-{restart}")))
                inbox.flush()
                wait_for(
                    lambda run=f"after-restore-{restart}": (
                        result_statuses(kafka_bootstrap, prefix).get(run) == "SUCCEEDED"
                    ),
                    timeout=60,
                    what="a run after the restore",
                )
                wait_for(
                    lambda n=ended + 3 + 2 * restart: (
                        len(_log(kafka_bootstrap, prefix, "ends")) == n
                    ),
                    timeout=60,
                    what="the resubmissions answered",
                )
    finally:
        double.close()
        inbox.close()
    log = _log(kafka_bootstrap, prefix, "ends")
    assert log[ended]["type"] == "CancelRequested" and log[ended]["disposition"] == "LATE"
    assert [e["type"] for e in log[ended + 1 :]] == ["RunSubmitted"] * 4
    assert all(e["disposition"] == "LATE" for e in log[ended:])
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))  # no seq written twice
    results = read_all(kafka_bootstrap, topic_name(RESULTS, prefix), "Result")
    assert [r.value["status"] for r in results if r.value["run_id"] == "ends"] == ["SUCCEEDED"]
    assert _calls(double, "ends") == calls  # the model was not called again
    assert not _dead(kafka_bootstrap, prefix)


def test_an_ended_run_is_held_as_its_snapshot_and_answered_late_across_a_restart(
    kafka_bootstrap: str, database_url: str, prefix: str
) -> None:
    """Within the retention an ended run is held parked (its encoded snapshot, not a decoded
    slot); an input for it decodes it again, is answered LATE at the next seq, and the run is
    parked again. A restart restores it parked, and it answers the same way."""
    config = _config(kafka_bootstrap, prefix)  # the default retention: nothing is evicted here
    inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
    double = ExecutorDouble(kafka_bootstrap, prefix, PARTITIONS, steps=1)
    double.start()
    partition = partition_for("held", PARTITIONS)

    def parked(proc: Processor) -> bool:
        return "held" in proc._path.parked.get(partition, {}) and "held" not in (
            proc._path.slots.get(partition, {})
        )

    def late_cancel(event_id: str) -> None:
        before = len(_log(kafka_bootstrap, prefix, "held"))
        cancel = CancelRequested(run_id="held", event_id=event_id, at=now_ms(), trace_id="t")
        inbox.send(input_record(cancel))
        inbox.flush()
        wait_for(
            lambda: len(_log(kafka_bootstrap, prefix, "held")) == before + 1,
            timeout=60,
            what=f"the late answer to {event_id}",
        )

    try:
        with running_processor(config, database_url) as proc:
            inbox.send(input_record(submitted("held")))
            inbox.flush()
            wait_for(
                lambda: result_statuses(kafka_bootstrap, prefix).get("held") == "SUCCEEDED",
                timeout=60,
                what="the run's end",
            )
            wait_for(lambda: parked(proc), timeout=30, what="the ended run parked")
            late_cancel("late-1")
            wait_for(lambda: parked(proc), timeout=30, what="the run parked again")
            (held,) = [slot for slot in proc.slots() if slot.run_id == "held"]
            assert held.state is not None and str(held.state.status) == "SUCCEEDED"
        with running_processor(config, database_url) as proc:
            wait_for(lambda: parked(proc), timeout=60, what="the run restored parked")
            late_cancel("late-2")
    finally:
        double.close()
        inbox.close()
    log = _log(kafka_bootstrap, prefix, "held")
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
    assert [(e["type"], e["disposition"]) for e in log[-2:]] == [("CancelRequested", "LATE")] * 2
    assert _dead(kafka_bootstrap, prefix) == []


def _last_state(bootstrap: str, prefix: str, run_id: str) -> bytes | None:
    """The value of the last committed state record of `run_id` (None: a tombstone)."""
    partition = partition_for(run_id, PARTITIONS)
    records = read_raw(bootstrap, topic_name(STATE, prefix), partitions=[partition])
    found = [r.value for r in records if r.key == run_id.encode()]
    assert found, f"no state record of {run_id}"
    return found[-1]


def test_the_record_limit_of_each_topic_is_read_from_the_broker(
    kafka_bootstrap: str, prefix: str
) -> None:
    events = topic_name(EVENTS, prefix)
    _set_topic_config(kafka_bootstrap, events, "max.message.bytes", 50_000)
    wait_for(  # a config change reaches the broker's answers a moment after it is accepted
        lambda: record_limits(kafka_bootstrap, [events]).get(events) == 50_000,
        timeout=30,
        what="the new limit",
    )
    found = record_limits(kafka_bootstrap, [events, topic_name(STATE, prefix)])
    assert found[""] > 50_000 and found[topic_name(STATE, prefix)] == found[""]
    proc = Processor(_config(kafka_bootstrap, prefix), lambda artifacts: None)
    try:
        limits = proc._path.limits
        assert limits.of(events) == 50_000 - RECORD_MARGIN
        assert limits.of(topic_name(STATE, prefix)) == 1_000_000 - RECORD_MARGIN  # the producer's
    finally:
        proc.close()


def _crc32_disagrees(stem: str) -> str:
    """A key whose partition under librdkafka's default partitioner (CRC32) is not its
    partition under Kafka's (murmur2), so a dead letter on the wrong one shows."""
    return next(
        f"{stem}-{i}"
        for i in range(100)
        if zlib.crc32(f"{stem}-{i}".encode()) % PARTITIONS
        != partition_for(f"{stem}-{i}", PARTITIONS)
    )


def test_a_dead_letter_of_a_known_run_is_keyed_and_partitioned_like_the_run(
    kafka_bootstrap: str, database_url: str, prefix: str
) -> None:
    """Its key is the run id and its partition the run's (Kafka's murmur2 over the run id); a
    record whose run is not known keeps its own key, on that key's murmur2 partition."""
    inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
    run_id = _crc32_disagrees("known")
    invalid = input_record(submitted(run_id))
    invalid["body"] = json.dumps({"type": "RunSubmitted", "run_id": run_id})  # misses fields
    stranger = _crc32_disagrees("stranger")
    try:
        with running_processor(_config(kafka_bootstrap, prefix), database_url) as proc:
            inbox.send(invalid)
            inbox.send_raw(stranger, b"\x00not an Input")  # no run can be read from it
            inbox.flush()
            wait_for(lambda: proc.stats.dead_letters >= 2, timeout=60, what="both refusals")
    finally:
        inbox.close()
    dead = {
        r.value["original_key"]: r
        for r in read_all(kafka_bootstrap, topic_name(DLQ, prefix), "DeadLetter")
    }
    known = dead[run_id.encode()]
    assert known.value["run_id"] == run_id and known.value["error_class"] == dlq.INVALID_EVENT
    assert known.key == run_id.encode()
    assert known.partition == partition_for(run_id, PARTITIONS)
    unknown = dead[stranger.encode()]
    assert unknown.value["run_id"] is None
    assert unknown.key == stranger.encode()
    assert unknown.partition == partition_for(stranger, PARTITIONS)
