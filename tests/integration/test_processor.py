"""The Kafka processor against the real broker."""

from __future__ import annotations

import collections
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException
from prometheus_client import REGISTRY

from agentruns.connectors.postgres.artifacts import PostgresArtifactStore
from agentruns.processors.events import CancelRequested, GoalChanged, TimerFired
from agentruns.processors.transition import Artifact, transition
from agentruns.streams.codec import encode
from agentruns.streams.processor import Processor, ProcessorConfig
from agentruns.streams.records import parse_effect_body, parse_event_body, parse_state
from agentruns.streams.topics import DLQ, EVENTS, STATE, effect_suffix, topic_name
from tests.support.pipeline import (
    ExecutorDouble,
    Inbox,
    input_record,
    now_ms,
    read_all,
    result_statuses,
    running_processor,
    submitted,
)
from tests.support.waiting import wait_for

PARTITIONS = 3


@pytest.fixture
def processor(kafka_bootstrap: str, database_url: str, prefix: str) -> Iterator[Processor]:
    config = ProcessorConfig(
        bootstrap=kafka_bootstrap, prefix=prefix, group_id=f"{prefix}-proc", gap_timeout_ms=1000
    )
    with running_processor(config, database_url) as proc:
        yield proc


def _wait_all_terminal(
    bootstrap: str, prefix: str, runs: list[str], what: str, timeout: float = 120
) -> None:
    wait_for(
        lambda: len(result_statuses(bootstrap, prefix)) == len(runs),
        timeout=timeout,
        what=what,
        every=1.0,
    )


def assert_log_consistent(bootstrap: str, prefix: str) -> dict[str, list[dict[str, object]]]:
    """Every run: gapless seq 1..n, snapshot == fold of its log, effect keys unique."""
    events = read_all(bootstrap, topic_name(EVENTS, prefix), "Event")
    by_run: dict[str, list[dict[str, object]]] = collections.defaultdict(list)
    partitions: dict[str, set[int]] = collections.defaultdict(set)
    for r in events:
        by_run[str(r.value["run_id"])].append(r.value)
        partitions[str(r.value["run_id"])].add(r.partition)
    snapshots = {
        r.value["run_id"]: r.value
        for r in read_all(bootstrap, topic_name(STATE, prefix), "Snapshot")
    }
    for run_id, log in by_run.items():
        assert len(partitions[run_id]) == 1, f"{run_id} spread over partitions"
        seqs = [int(str(e["seq"])) for e in log]
        assert seqs == list(range(1, len(log) + 1)), f"{run_id}: seq gap or duplicate {seqs}"
        state = None
        for e in log:
            result = transition(state, parse_event_body(str(e["body"])))
            assert str(result.disposition) == e["disposition"], (run_id, e["seq"])
            state = result.state
        snap = snapshots[run_id]
        assert snap["last_seq"] == len(log)
        assert state is not None and parse_state(snap["state"]) == state
        assert snap["state"] == state.model_dump_json()
    keys: collections.Counter[str] = collections.Counter()
    for kind in ("model", "tool", "timer"):
        for r in read_all(bootstrap, topic_name(effect_suffix(kind), prefix), "Effect"):
            keys[parse_effect_body(r.value["body"]).idempotency_key] += 1
    twice = [k for k, n in keys.items() if n > 1]
    assert not twice, f"effects committed more than once: {twice[:5]}"
    return by_run


def test_runs_reach_their_terminal_state(
    kafka_bootstrap: str, prefix: str, processor: Processor
) -> None:
    stages = ("flush", "commit")
    before = {stage: _stage_count(stage) for stage in stages}
    double = ExecutorDouble(kafka_bootstrap, prefix, PARTITIONS, steps=3)
    double.start()
    try:
        inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
        runs = [f"run-{i}" for i in range(6)]
        for run_id in runs:
            inbox.send(input_record(submitted(run_id)))
        inbox.flush()
        _wait_all_terminal(kafka_bootstrap, prefix, runs, "every run's terminal result", timeout=60)
    finally:
        double.close()
    assert set(result_statuses(kafka_bootstrap, prefix).values()) == {"SUCCEEDED"}
    logs = assert_log_consistent(kafka_bootstrap, prefix)
    for run_id in runs:
        types = [e["type"] for e in logs[run_id]]
        assert types[0] == "RunSubmitted" and types.count("ToolCallSucceeded") == 2
    # every transaction timed its records' acknowledgements apart from EndTxn
    flushed, ended = (_stage_count(stage) - before[stage] for stage in stages)
    assert flushed == ended >= 1


class _RecordingArtifacts:
    """The artifact store, remembering which refs each sealed batch wrote (one call per batch,
    in commit order): a new run's model call reads a context artifact of its own batch."""

    def __init__(self, store: PostgresArtifactStore) -> None:
        self.store = store
        self.batches: list[set[str]] = []

    def __call__(self, artifacts: Sequence[Artifact]) -> object:
        self.batches.append({a.ref for a in artifacts})
        return self.store.put_many(artifacts)


def test_a_transactions_model_effects_share_one_partition_in_turn(
    kafka_bootstrap: str, database_url: str, prefix: str
) -> None:
    """Each transaction writes its model effects to one partition (one produce request, not
    one per run partition); the next transaction with model effects to the next partition."""
    store = PostgresArtifactStore(database_url)
    writer = _RecordingArtifacts(store)
    config = ProcessorConfig(bootstrap=kafka_bootstrap, prefix=prefix, group_id=f"{prefix}-proc")
    inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
    runs = [f"burst{b}-run{i}" for b in range(5) for i in range(8)]
    topic = topic_name(effect_suffix("model"), prefix)
    with running_processor(config, writer):
        for b in range(5):  # each burst after the last one committed: one transaction or more each
            for run_id in runs[b * 8 : (b + 1) * 8]:
                inbox.send(input_record(submitted(run_id)))
            inbox.flush()
            wait_for(
                lambda n=(b + 1) * 8: len(read_all(kafka_bootstrap, topic, "Effect")) == n,
                timeout=60,
                what=f"a model effect per run of bursts 0-{b}",
            )
    store.close()
    by_context: dict[str, tuple[str, int]] = {}
    for r in read_all(kafka_bootstrap, topic, "Effect"):
        effect = parse_effect_body(r.value["body"])
        by_context[effect.context_ref] = (effect.run_id, r.partition)
    assert sorted(run for run, _ in by_context.values()) == sorted(runs)
    used: list[int] = []  # the model partition of each batch that had model effects
    for refs in writer.batches:
        partitions = {by_context[ref][1] for ref in refs if ref in by_context}
        assert len(partitions) <= 1, f"one batch's model effects on partitions {partitions}"
        used.extend(partitions)
    assert len(used) >= 5, f"the bursts went into {len(used)} transactions"
    assert used == [(used[0] + i) % PARTITIONS for i in range(len(used))], used


def _stage_count(stage: str) -> float:
    value = REGISTRY.get_sample_value("agentruns_commit_stage_seconds_count", {"stage": stage})
    return value or 0.0


def _spawn(env: dict[str, str], prefix: str, instance: str) -> subprocess.Popen[bytes]:
    """A processor process; its log goes to $TMPDIR/<prefix>-<instance>.log for post-mortems."""
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{prefix}-{instance}.log"
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentruns.connectors.runtime.processor",
                "--prefix",
                prefix,
                "--group",
                f"{prefix}-proc",
                "--instance-id",
                instance,
                "--log-level",
                "WARNING",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            cwd=Path(__file__).resolve().parents[2],
        )


def _service_env(kafka_bootstrap: str, database_url: str) -> dict[str, str]:
    return {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "DATABASE_URL": database_url}


class _FailingArtifacts:
    """The artifact store, except that writes number 2 and 5 fail with an abortable Kafka error
    after a while: the loop applies the next inputs meanwhile, and must drop them too."""

    def __init__(self, store: PostgresArtifactStore) -> None:
        self.store = store
        self.calls = 0

    def __call__(self, artifacts: Sequence[Artifact]) -> object:
        self.calls += 1
        if self.calls in (2, 5):
            time.sleep(0.5)
            raise KafkaException(
                KafkaError(KafkaError._FAIL, "injected failure", txn_requires_abort=True)
            )
        return self.store.put_many(artifacts)


def test_a_failed_transaction_drops_the_batch_applied_behind_it(
    kafka_bootstrap: str, database_url: str, prefix: str
) -> None:
    store = PostgresArtifactStore(database_url)
    writer = _FailingArtifacts(store)
    config = ProcessorConfig(bootstrap=kafka_bootstrap, prefix=prefix, group_id=f"{prefix}-proc")
    double = ExecutorDouble(kafka_bootstrap, prefix, PARTITIONS, steps=3)
    double.start()
    try:
        with running_processor(config, writer) as proc:
            inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
            runs = [f"abort-{i}" for i in range(30)]
            for run_id in runs:
                inbox.send(input_record(submitted(run_id)))
                inbox.flush()
                time.sleep(0.05)  # inputs keep coming while a transaction fails
            _wait_all_terminal(
                kafka_bootstrap, prefix, runs, "every run terminal after two failed transactions"
            )
    finally:
        double.close()
        store.close()
    assert writer.calls > 5 and proc.stats.aborts == 2
    assert set(result_statuses(kafka_bootstrap, prefix).values()) == {"SUCCEEDED"}
    assert_log_consistent(kafka_bootstrap, prefix)


def test_kill_9_at_random_points_loses_and_repeats_nothing(
    kafka_bootstrap: str, database_url: str, prefix: str
) -> None:
    env = _service_env(kafka_bootstrap, database_url)
    rng = random.Random(4)
    double = ExecutorDouble(kafka_bootstrap, prefix, PARTITIONS, steps=3)
    double.start()
    proc = _spawn(env, prefix, "0")
    kills = 0
    try:
        inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
        runs = [f"kill-{i}" for i in range(20)]
        for run_id in runs:
            inbox.send(input_record(submitted(run_id)))
        inbox.flush()
        for _ in range(5):
            threading.Event().wait(rng.uniform(1.0, 3.0))  # random kill point, not a settle
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            proc = _spawn(env, prefix, "0")
        _wait_all_terminal(kafka_bootstrap, prefix, runs, "all 20 runs terminal after 5 kills")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        double.close()
    assert kills == 5
    assert set(result_statuses(kafka_bootstrap, prefix).values()) == {"SUCCEEDED"}
    assert_log_consistent(kafka_bootstrap, prefix)


@contextlib.contextmanager
def _two_members(
    kafka_bootstrap: str, database_url: str, prefix: str, runs: list[str]
) -> Iterator[tuple[subprocess.Popen[bytes], Inbox]]:
    """Two processor processes in one group (and an executor double), both at work on the
    first six of `runs`; yields the first member and the inbox. Stops what is left running."""
    env = _service_env(kafka_bootstrap, database_url)
    double = ExecutorDouble(kafka_bootstrap, prefix, PARTITIONS, steps=4)
    double.start()
    members = (_spawn(env, prefix, "0"), _spawn(env, prefix, "1"))
    try:
        inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
        for run_id in runs[:6]:
            inbox.send(input_record(submitted(run_id)))
        inbox.flush()
        wait_for(
            lambda: len(result_statuses(kafka_bootstrap, prefix)) >= 2,
            timeout=60,
            what="both members working",
        )
        yield members[0], inbox
    finally:
        for proc in members:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a paused one handles SIGTERM only then
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
        double.close()


def test_a_killed_member_is_replaced_by_the_other(
    kafka_bootstrap: str, database_url: str, prefix: str
) -> None:
    runs = [f"pair-{i}" for i in range(12)]
    with _two_members(kafka_bootstrap, database_url, prefix, runs) as (first, inbox):
        first.send_signal(signal.SIGKILL)
        first.wait()
        for run_id in runs[6:]:
            inbox.send(input_record(submitted(run_id)))
        inbox.flush()
        _wait_all_terminal(kafka_bootstrap, prefix, runs, "the survivor finishing every run")
    assert set(result_statuses(kafka_bootstrap, prefix).values()) == {"SUCCEEDED"}
    assert_log_consistent(kafka_bootstrap, prefix)


def test_a_paused_member_comes_back_as_a_zombie_and_commits_nothing_twice(
    kafka_bootstrap: str, database_url: str, prefix: str
) -> None:
    """SIGSTOP one of two members past its session timeout while runs flow, then SIGCONT: the
    group gave its partitions to the other meanwhile, so whatever it applied or had in flight
    must be refused (its offsets carry the old generation), and it rejoins."""
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{prefix}-0.log"
    runs = [f"zombie-{i}" for i in range(18)]
    with _two_members(kafka_bootstrap, database_url, prefix, runs) as (first, inbox):
        first.send_signal(signal.SIGSTOP)
        for run_id in runs[6:12]:  # taken over by the other member once the session expires
            inbox.send(input_record(submitted(run_id)))
            inbox.flush()
            time.sleep(1.0)
        time.sleep(4.0)  # 10 s in all, past the 6 s session timeout
        first.send_signal(signal.SIGCONT)
        wait_for(
            lambda: "] lost;" in log_path.read_text(errors="replace"),  # its own warning
            timeout=60,
            what="the resumed member to find its partitions lost",
        )
        for run_id in runs[12:]:
            inbox.send(input_record(submitted(run_id)))
        inbox.flush()
        _wait_all_terminal(kafka_bootstrap, prefix, runs, "every run terminal after the pause")
    assert set(result_statuses(kafka_bootstrap, prefix).values()) == {"SUCCEEDED"}
    assert_log_consistent(kafka_bootstrap, prefix)


def test_out_of_order_duplicates_conflicts_and_gap_timeout(
    kafka_bootstrap: str, prefix: str, processor: Processor
) -> None:
    inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
    at = now_ms()
    # Run A: producer "api" numbers its inputs; 3 arrives before 2, 2 arrives twice, and once
    # more with other content (a conflicting duplicate).
    sub = submitted("ooo-a", at=at)
    trace = sub.trace_id
    goal = GoalChanged(
        run_id="ooo-a", event_id="a-goal", at=at + 1, trace_id=trace, step=1, goal="g2"
    )
    cancel = CancelRequested(run_id="ooo-a", event_id="a-cancel", at=at + 2, trace_id=trace)
    forged = GoalChanged(
        run_id="ooo-a", event_id="a-goal", at=at + 1, trace_id=trace, step=1, goal="evil"
    )
    inbox.send(input_record(sub, producer_id="api", producer_seq=1))
    inbox.send(input_record(cancel, producer_id="api", producer_seq=3))
    inbox.send(input_record(goal, producer_id="api", producer_seq=2))
    inbox.send(input_record(goal, producer_id="api", producer_seq=2))
    inbox.send(input_record(forged, producer_id="api", producer_seq=2))
    # Run B: input 2 never comes; the gap timer (played here by the test) diagnoses it.
    sub_b = submitted("ooo-b", at=at)
    cancel_b = CancelRequested(
        run_id="ooo-b", event_id="b-cancel", at=at + 5, trace_id=sub_b.trace_id
    )
    inbox.send(input_record(sub_b, producer_id="api", producer_seq=1))
    inbox.send(input_record(cancel_b, producer_id="api", producer_seq=3))
    inbox.flush()

    events_topic = topic_name(EVENTS, prefix)

    def log_of(run_id: str) -> list[dict[str, object]]:
        return [
            r.value
            for r in read_all(kafka_bootstrap, events_topic, "Event")
            if r.value["run_id"] == run_id
        ]

    wait_for(lambda: len(log_of("ooo-a")) == 3, timeout=30, what="run A's three events")
    assert [e["type"] for e in log_of("ooo-a")] == [
        "RunSubmitted",
        "GoalChanged",
        "CancelRequested",
    ]

    timers = [
        parse_effect_body(r.value["body"])
        for r in read_all(kafka_bootstrap, topic_name(effect_suffix("timer"), prefix), "Effect")
    ]
    gap_timer = next(
        t for t in timers if t.run_id == "ooo-b" and ":gap:" in getattr(t, "timer_id", "")
    )
    assert log_of("ooo-b")[-1]["type"] == "RunSubmitted"  # input 3 is held, not applied
    fired = TimerFired(
        run_id="ooo-b",
        event_id=f"{gap_timer.timer_id}:fired",
        at=gap_timer.due_at,
        trace_id=sub_b.trace_id,
        timer_id=gap_timer.timer_id,
    )
    inbox.send(input_record(fired))
    inbox.flush()
    wait_for(lambda: len(log_of("ooo-b")) == 3, timeout=30, what="the gap diagnosis")
    log_b = log_of("ooo-b")
    assert [e["type"] for e in log_b] == ["RunSubmitted", "GapTimedOut", "CancelRequested"]
    assert "did not arrive" in str(parse_event_body(str(log_b[1]["body"])).diagnosis)  # type: ignore[union-attr]

    dead = read_all(kafka_bootstrap, topic_name(DLQ, prefix), "DeadLetter")
    assert [d.value["error_class"] for d in dead] == ["CONFLICTING_DUPLICATE"]
    assert processor.stats.duplicates >= 1
    assert_log_consistent(kafka_bootstrap, prefix)


def test_bad_input_goes_to_the_dlq_and_processing_goes_on(
    kafka_bootstrap: str, prefix: str, processor: Processor
) -> None:
    inbox = Inbox(kafka_bootstrap, prefix, PARTITIONS)
    inbox.send_raw("bad-1", b"\x00garbage bytes")
    inbox.send_raw("bad-2", b"\xc3\x01" + b"\x01" * 8 + b"body")  # unknown fingerprint
    invalid = input_record(submitted("bad-3"))
    invalid["body"] = '{"type": "RunSubmitted", "run_id": "bad-3"}'  # misses required fields
    inbox.send(invalid)
    orphan = input_record(CancelRequested(run_id="bad-4", event_id="x", at=now_ms(), trace_id="t"))
    inbox.send(orphan)  # a cancel for a run that does not exist
    inbox.send_raw("bad-5", encode("Input", input_record(submitted("bad-6"))))  # key != run_id
    double = ExecutorDouble(kafka_bootstrap, prefix, PARTITIONS, steps=1)
    double.start()
    try:
        inbox.send(input_record(submitted("good-1")))
        inbox.flush()
        wait_for(
            lambda: "good-1" in result_statuses(kafka_bootstrap, prefix), timeout=60, what="good-1"
        )
    finally:
        double.close()
    dead = read_all(kafka_bootstrap, topic_name(DLQ, prefix), "DeadLetter")
    classes = sorted(d.value["error_class"] for d in dead)
    assert len(dead) == 5, classes
    assert "UNKNOWN_FINGERPRINT" in classes and classes.count("INVALID_EVENT") >= 3
    by_offset = {d.value["original_value"]: d.value for d in dead}
    assert by_offset[b"\x00garbage bytes"]["source_topic"].endswith(".inbox")
    assert all(d.value["reason"] for d in dead)
    # the process's Prometheus series see the same counts (published once per transaction)
    assert processor.stats.dead_letters == 5
    assert (REGISTRY.get_sample_value("agentruns_dead_letters_total") or 0) >= 5
    applied = REGISTRY.get_sample_value("agentruns_transitions_total", {"disposition": "applied"})
    assert applied is not None and applied >= processor.stats.applied > 0
