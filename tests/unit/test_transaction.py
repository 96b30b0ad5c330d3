"""`agentruns.streams.transaction` without a broker: what a failed Kafka call means, the back-off
schedule, the clients' settings, and the committer's order of steps, group commit and recovery,
driven through its own interfaces (units it is handed, a producer factory) by recording fakes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition

from agentruns.streams import transaction as tx
from agentruns.streams.errors import AgentrunsKafkaError, FatalConsumerError, StuckClientError
from agentruns.streams.kafka_defaults import LONG_POLL_MS
from agentruns.streams.processor import _Sealed
from agentruns.streams.transaction import Fault, Record, Timings

# --------------------------------------------------------------------------- classification


def _exc(code: int, **flags: bool) -> KafkaException:
    return KafkaException(KafkaError(code, "test", **flags))


@pytest.mark.parametrize(
    ("exc", "fault"),
    [
        (_exc(KafkaError._FENCED, fatal=True), Fault.FATAL),
        (_exc(KafkaError.PRODUCER_FENCED, fatal=True, retriable=True), Fault.FATAL),
        # a consumer's fatal event carries the code without the flag
        (_exc(KafkaError._FATAL), Fault.FATAL),
        (_exc(KafkaError._TIMED_OUT, retriable=True), Fault.RETRIABLE),
        (_exc(KafkaError._TIMED_OUT, retriable=True, txn_requires_abort=True), Fault.RETRIABLE),
        (_exc(KafkaError._FAIL, txn_requires_abort=True), Fault.ABORTABLE),
        (_exc(KafkaError.MSG_SIZE_TOO_LARGE), Fault.ABORTABLE),
        (KafkaException("a bare message"), Fault.ABORTABLE),
        (KafkaException(), Fault.ABORTABLE),
        (ValueError("a bug in the committer"), Fault.ABORTABLE),
    ],
)
def test_a_failure_is_fatal_before_retriable_before_abortable(exc: Exception, fault: Fault) -> None:
    assert tx.classify(exc) is fault


def test_the_kafka_error_of_an_exception_is_only_a_real_one() -> None:
    error = KafkaError(KafkaError._FAIL)
    assert tx.kafka_error(KafkaException(error)) is error
    assert tx.kafka_error(KafkaException("text")) is None
    assert tx.kafka_error(RuntimeError(error)) is None
    assert not tx.is_fatal(None)


def test_an_artifact_store_that_fails_fails_the_transaction_as_an_outage() -> None:
    """A processor batch whose artifacts cannot be written is retried, never isolated."""
    written: Future[object] = Future()
    written.set_exception(OSError("the store is down"))
    sealed = _Sealed([], {0: 1}, None, written, inputs=1, started=0.0, sealed=0.0)
    with pytest.raises(KafkaException) as raised:
        sealed.durable()
    assert tx.classify(raised.value) is Fault.RETRIABLE
    assert "artifact store: OSError: the store is down" in str(raised.value)


# --------------------------------------------------------------------------- back-off


def test_the_backoff_doubles_with_each_failure_in_a_row_up_to_its_maximum() -> None:
    backoff = tx.Backoff(0.1, 1.0)
    assert backoff.delay_s == 0.0 and backoff.next_s == 0.1
    waits = [backoff.failed() for _ in range(6)]
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert backoff.failures == 6 and backoff.delay_s == 1.0 and backoff.next_s == 1.0
    backoff.succeeded()
    assert backoff.failures == 0 and backoff.delay_s == 0.0 and backoff.next_s == 0.1


def test_the_backoff_stays_at_its_maximum_however_long_the_failures_go_on() -> None:
    backoff = tx.Backoff(0.1, 5.0)
    backoff.failures = 100_000
    assert backoff.failed() == 5.0


def test_a_backoff_wait_ends_when_the_loop_is_stopped() -> None:
    backoff = tx.Backoff(30.0, 30.0)
    backoff.wait()  # no failure: no wait
    backoff.failed()
    stop = threading.Event()
    stop.set()
    began = time.monotonic()
    backoff.wait(stop)
    assert time.monotonic() - began < 1.0


# --------------------------------------------------------------------------- clients


CLIENTS = tx.Clients(
    bootstrap="broker:9092",
    group_id="g",
    instance_id="3",
    session_timeout_ms=6000,
    transaction_timeout_ms=10_000,
    extra_consumer={"fetch.wait.max.ms": 7},
    extra_producer={"linger.ms": 1},
)


def test_the_consumer_reads_committed_and_takes_the_extras_last() -> None:
    config = CLIENTS.consumer_config({"partition.assignment.strategy": "range"}, 20)
    assert config["isolation.level"] == "read_committed"
    assert config["enable.auto.commit"] is False
    assert config["heartbeat.interval.ms"] == 1000
    assert config["partition.assignment.strategy"] == "range"
    assert config["fetch.wait.max.ms"] == 7  # the extra wins over the 20 ms window
    assert config["socket.nagle.disable"] is True
    assert CLIENTS.consumer_config({})["fetch.wait.max.ms"] == 7
    plain = tx.Clients("b", "g", "0", 1200, 10_000, {}, {})
    assert plain.consumer_config({})["fetch.wait.max.ms"] == LONG_POLL_MS
    assert plain.consumer_config({})["heartbeat.interval.ms"] == 500


def test_the_producers_are_transactional_with_ids_by_member_and_slot() -> None:
    config = CLIENTS.producer_config("b", {"linger.ms": 5, "compression.type": "lz4"})
    assert CLIENTS.member == "g-3"
    assert config["transactional.id"] == "g-3-b"
    assert config["enable.idempotence"] is True
    assert config["transaction.timeout.ms"] == 10_000
    assert config["compression.type"] == "lz4"
    assert config["linger.ms"] == 1  # the extra wins


# --------------------------------------------------------------------------- rewinding


class _Consumer:
    """Answers `committed` from a dict; records seeks, refusing those of `unassigned`."""

    def __init__(self, committed: dict[int, int], unassigned: frozenset[int] = frozenset()):
        self._committed = committed
        self.unassigned = unassigned
        self.seeks: list[tuple[int, int]] = []

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [
            TopicPartition(tp.topic, tp.partition, self._committed[tp.partition])
            for tp in partitions
        ]

    def seek(self, tp: TopicPartition) -> None:
        if tp.partition in self.unassigned:
            raise KafkaException(KafkaError(KafkaError._STATE, "not assigned"))
        self.seeks.append((tp.partition, tp.offset))


def test_a_partition_without_committed_offset_rewinds_to_its_beginning() -> None:
    consumer = _Consumer({0: 42, 1: -1001})
    offsets = tx.committed_offsets(cast(Any, consumer), "t", [0, 1])
    assert offsets == {0: 42, 1: OFFSET_BEGINNING}


class _Unreachable(_Consumer):
    """Times out `failures` times before answering (a broker restart, a paused coordinator)."""

    def __init__(self, committed: dict[int, int], failures: int, error: KafkaError):
        super().__init__(committed)
        self.failures = failures
        self.error = error
        self.tries = 0

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        self.tries += 1
        if self.tries <= self.failures:
            raise KafkaException(self.error)
        return super().committed(partitions, timeout)


TIMED_OUT = KafkaError(KafkaError._TIMED_OUT, "Failed to get committed offsets: Local: Timed out")


def test_committed_offsets_wait_out_a_broker_that_does_not_answer() -> None:
    consumer = _Unreachable({0: 7}, failures=3, error=TIMED_OUT)
    assert tx.committed_offsets(cast(Any, consumer), "t", [0]) == {0: 7}
    assert consumer.tries == 4


def test_committed_offsets_give_up_after_their_patience_with_the_cause() -> None:
    consumer = _Unreachable({0: 7}, failures=1_000, error=TIMED_OUT)
    with pytest.raises(AgentrunsKafkaError, match=r"could not be read.*Timed out") as raised:
        tx.committed_offsets(cast(Any, consumer), "t", [0], patience_s=0.5, hint="look here")
    assert raised.value.hint == "look here"


def test_committed_offsets_stop_waiting_when_the_service_stops() -> None:
    stop = threading.Event()
    stop.set()
    consumer = _Unreachable({0: 7}, failures=1_000, error=TIMED_OUT)
    with pytest.raises(AgentrunsKafkaError):
        tx.committed_offsets(cast(Any, consumer), "t", [0], stop=stop)
    assert consumer.tries == 1


def test_committed_offsets_raise_a_fatal_error_at_once() -> None:
    fatal = KafkaError(KafkaError._FATAL, "fenced", fatal=True)
    consumer = _Unreachable({0: 7}, failures=1_000, error=fatal)
    with pytest.raises(FatalConsumerError):
        tx.committed_offsets(cast(Any, consumer), "t", [0])
    assert consumer.tries == 1


def test_a_strict_seek_raises_where_a_lenient_one_skips_the_partition() -> None:
    consumer = _Consumer({}, unassigned=frozenset({1}))
    tx.seek(cast(Any, consumer), "t", {0: 5, 1: 6, 2: 7}, lenient=True)
    assert consumer.seeks == [(0, 5), (2, 7)]
    with pytest.raises(KafkaException):
        tx.seek(cast(Any, consumer), "t", {1: 6})


# --------------------------------------------------------------------------- the committer


@dataclass
class _Producer:
    """Records every call (with its slot) in the shared `calls`; `fail` makes a step raise,
    `hold` makes commit_transaction wait for an event."""

    slot: str
    number: int
    calls: list[tuple[Any, ...]]
    fail: dict[str, Exception] = field(default_factory=dict)
    hold: threading.Event | None = None
    entered: threading.Event = field(default_factory=threading.Event)

    def _step(self, *call: Any) -> None:
        self.calls.append((*call, self.slot, self.number))
        error = self.fail.pop(call[0], None)
        if error is not None:
            raise error

    def begin_transaction(self) -> None:
        self._step("begin")

    def produce(self, topic: str, **kwargs: Any) -> None:
        self._step("produce", topic, kwargs["key"], kwargs.get("partition"))

    def send_offsets_to_transaction(
        self, offsets: list[TopicPartition], metadata: Any, timeout: float
    ) -> None:
        positions = [
            (tp.topic, tp.partition, tp.offset, *([tp.metadata] * bool(tp.metadata)))
            for tp in offsets
        ]
        self._step("offsets", positions, metadata)

    def flush(self, timeout: float) -> int:
        self._step("flush")
        return 0

    def commit_transaction(self, timeout: float) -> None:
        self.entered.set()
        if self.hold is not None:
            assert self.hold.wait(10)
        self._step("commit")

    def abort_transaction(self, timeout: float) -> None:
        self._step("abort")


@dataclass
class _Unit:
    """A unit handed to the committer; records when its records are read and its `durable`."""

    name: str
    offsets: dict[int, int]
    calls: list[tuple[Any, ...]]
    outputs: list[Record] = field(default_factory=list)
    metadata: Any = None
    fail: Exception | None = None
    offset_notes: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.metadata = self.metadata or f"metadata of {self.name}"
        self.outputs = self.outputs or [
            ("out", f"{self.name}-1".encode(), b"v", 0, None),
            ("dlq", f"{self.name}-2".encode(), b"v", None, [("h", b"x")]),
        ]

    def records(self) -> Iterator[Record]:
        self.calls.append(("records", self.name))
        yield from self.outputs

    def durable(self) -> None:
        self.calls.append(("durable", self.name))
        if self.fail is not None:
            raise self.fail


class _Rig:
    """A committer on recording producers; `committed` holds what `on_commit` was given."""

    def __init__(self, offsets_first: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.made: list[_Producer] = []
        self.committed: list[tuple[list[str], Timings]] = []
        self.committer: tx.Committer[_Unit] = tx.Committer(
            cast(Any, self._new),
            "in",
            self._on_commit,
            name="test-commit",
            offsets_first=offsets_first,
        )

    def _new(self, slot: str) -> _Producer:
        producer = _Producer(slot, len(self.made), self.calls)
        self.made.append(producer)
        return producer

    def _on_commit(self, units: list[_Unit], timings: Timings) -> None:
        self.committed.append(([u.name for u in units], timings))

    def unit(self, name: str, offsets: dict[int, int], **kwargs: Any) -> _Unit:
        return _Unit(name, offsets, self.calls, **kwargs)

    def steps(self) -> list[tuple[Any, ...]]:
        """The calls without the slot and producer number (see `slots`)."""
        return [call[:-2] if call[0] not in ("records", "durable") else call for call in self.calls]

    def slots(self, step: str) -> list[tuple[str, int]]:
        return [(c[-2], c[-1]) for c in self.calls if c[0] == step]

    def committing(self, unit: _Unit) -> threading.Event:
        """Hand ``unit`` over; return once its transaction is committing, held there until the
        returned event is set."""
        hold = threading.Event()
        producer = cast(_Producer, self.committer.producer)
        producer.hold = hold
        assert self.committer.submit(unit)
        assert producer.entered.wait(5)
        return hold

    def failed(self, unit: _Unit) -> tx.Failure[_Unit]:
        """Hand ``unit`` over; its transaction fails: the failure, taken."""
        assert self.committer.submit(unit)
        self.committer.wait()
        failure = self.committer.take_failure()
        assert failure is not None
        return failure

    def commit(self, *units: _Unit) -> None:
        for unit in units:
            assert self.committer.submit(unit)
        self.committer.wait()

    def close(self) -> None:
        self.committer.stop(5)


@pytest.fixture
def rig() -> Iterator[_Rig]:
    made = _Rig()
    yield made
    made.close()


def test_a_transaction_produces_then_sends_the_offsets_then_waits_for_durability_then_commits(
    rig: _Rig,
) -> None:
    rig.commit(rig.unit("u", {0: 11, 2: 5}))
    assert rig.steps() == [
        ("begin",),
        ("records", "u"),
        ("produce", "out", b"u-1", 0),
        ("produce", "dlq", b"u-2", None),
        ("offsets", [("in", 0, 11), ("in", 2, 5)], "metadata of u"),
        ("durable", "u"),
        ("flush",),
        ("commit",),
    ]
    ((names, t),) = rig.committed
    assert names == ["u"]
    assert t.began <= t.produced <= t.sent <= t.durable <= t.flushed <= t.ended
    assert rig.committer.take_failure() is None


def test_with_offsets_first_the_offsets_go_before_the_records() -> None:
    rig = _Rig(offsets_first=True)
    try:
        rig.commit(rig.unit("u", {1: 3}))
        steps = [s[0] for s in rig.steps()]
        order = ["begin", "offsets", "records", "produce", "produce", "durable", "flush"]
        assert steps == [*order, "commit"]
        ((_, t),) = rig.committed
        assert t.began <= t.sent <= t.produced <= t.durable <= t.flushed <= t.ended
    finally:
        rig.close()


def test_what_is_handed_over_during_a_transaction_commits_together_in_the_next(
    rig: _Rig,
) -> None:
    """Group commit: one transaction at a time, each with every unit queued meanwhile; their
    offsets merge to the highest per partition, with the newest unit's group metadata; the
    two producers take turns."""
    hold = rig.committing(rig.unit("a", {0: 10}))
    assert not rig.committer.settled()
    assert rig.committer.submit(rig.unit("b", {0: 12, 1: 4}))
    assert rig.committer.submit(rig.unit("c", {1: 9}))
    hold.set()
    rig.committer.wait()
    assert [names for names, _ in rig.committed] == [["a"], ["b", "c"]]
    offsets = [s for s in rig.steps() if s[0] == "offsets"]
    assert offsets[1] == ("offsets", [("in", 0, 12), ("in", 1, 9)], "metadata of c")
    records = [s for s in rig.steps() if s[0] in ("records", "durable")]
    assert records[2:] == [("records", "b"), ("records", "c"), ("durable", "b"), ("durable", "c")]
    assert rig.slots("begin") == [("a", 0), ("b", 1)]
    rig.commit(rig.unit("d", {0: 13}))
    assert rig.slots("begin")[-1] == ("a", 0)


def test_an_offset_note_goes_with_its_own_units_offset_only(rig: _Rig) -> None:
    """A note describes the records above the offset it was made with: a unit of the same
    transaction that moves that partition's offset on takes the note away."""
    hold = rig.committing(rig.unit("a", {0: 10}))
    assert rig.committer.submit(rig.unit("b", {0: 12, 1: 4}, offset_notes={0: "b0", 1: "b1"}))
    assert rig.committer.submit(rig.unit("c", {0: 13}))
    hold.set()
    rig.committer.wait()
    offsets = [s for s in rig.steps() if s[0] == "offsets"]
    assert offsets[1] == ("offsets", [("in", 0, 13), ("in", 1, 4, "b1")], "metadata of c")


def test_a_failed_transaction_holds_what_is_queued_until_the_loop_takes_it_and_aborts(
    rig: _Rig,
) -> None:
    error = KafkaException(KafkaError(KafkaError._FAIL, "refused", txn_requires_abort=True))
    rig.made[0].fail["commit"] = error
    failing = rig.unit("a", {0: 10})
    hold = rig.committing(failing)
    behind = rig.unit("b", {0: 12})
    assert rig.committer.submit(behind)
    hold.set()
    rig.committer.wait()
    assert rig.committer.settled()
    time.sleep(0.05)
    assert rig.slots("begin") == [("a", 0)]  # nothing more began: the failure holds it
    assert not rig.committer.submit(rig.unit("c", {0: 13}))  # refused until taken
    failure = rig.committer.take_failure()
    assert failure is not None
    assert failure.error is error and failure.units == [failing, behind]
    assert rig.committer.recover(failure.error) is Fault.ABORTABLE
    assert rig.slots("abort") == [("a", 0)]  # the open transaction, on its own producer
    assert rig.committed == []
    rig.commit(rig.unit("again", {0: 12}))
    assert rig.slots("commit")[-1] == ("a", 0)  # the aborted slot's turn is not over
    assert [names for names, _ in rig.committed] == [["again"]]


def test_a_fatal_failure_replaces_the_producer_instead_of_aborting(rig: _Rig) -> None:
    rig.made[0].fail["offsets"] = KafkaException(
        KafkaError(KafkaError._FENCED, "fenced", fatal=True)
    )
    failure = rig.failed(rig.unit("a", {0: 1}))
    assert rig.committer.recover(failure.error) is Fault.FATAL
    assert rig.slots("abort") == []
    assert [(p.slot, p.number) for p in rig.made] == [("a", 0), ("b", 1), ("a", 2)]
    rig.commit(rig.unit("a2", {0: 1}))
    assert rig.slots("commit") == [("a", 2)]


def test_nothing_is_aborted_when_no_transaction_was_begun(rig: _Rig) -> None:
    rig.made[0].fail["begin"] = KafkaException(KafkaError(KafkaError._STATE, "not ready"))
    failure = rig.failed(rig.unit("a", {0: 1}))
    assert rig.committer.recover(failure.error) is Fault.ABORTABLE
    assert rig.slots("abort") == []
    rig.committer.abort()  # nothing open: nothing to do
    assert rig.slots("abort") == []


def test_a_unit_that_cannot_be_made_durable_fails_its_transaction_before_the_flush(
    rig: _Rig,
) -> None:
    error = ValueError("not durable")
    failure = rig.failed(rig.unit("a", {0: 1}, fail=error))
    assert failure.error is error  # a bug's own exception, for the loop to raise again
    assert [s[0] for s in rig.steps()][-2:] == ["offsets", "durable"]
    rig.committer.recover(failure.error)
    assert rig.slots("abort") == [("a", 0)]


def test_a_full_backlog_makes_the_loop_wait_for_the_committer(rig: _Rig) -> None:
    hold = rig.committing(rig.unit("a", {0: 1}))

    def full(queued: list[_Unit]) -> bool:
        return len(queued) >= 1

    assert rig.committer.submit(rig.unit("b", {0: 2}), full)  # the queue was empty
    handed: list[bool] = []
    waiting = threading.Thread(
        target=lambda: handed.append(rig.committer.submit(rig.unit("c", {0: 3}), full))
    )
    waiting.start()
    time.sleep(0.1)
    assert handed == []  # "b" still waits for the committer
    hold.set()
    waiting.join(5)
    assert handed == [True]
    rig.committer.wait()
    assert [names for names, _ in rig.committed] == [["a"], ["b"], ["c"]]


def test_stopping_commits_what_is_queued_first(rig: _Rig) -> None:
    hold = rig.committing(rig.unit("a", {0: 1}))
    assert rig.committer.submit(rig.unit("b", {0: 2}))
    stopper = threading.Thread(target=rig.committer.stop)
    stopper.start()
    hold.set()
    stopper.join(5)
    assert not stopper.is_alive()
    assert [names for names, _ in rig.committed] == [["a"], ["b"]]


def test_waiting_on_a_committer_that_stopped_with_units_queued_raises() -> None:
    rig = _Rig()
    rig.made[0].fail["begin"] = KafkaException(KafkaError(KafkaError._FAIL, "x"))
    rig.committer.submit(rig.unit("a", {0: 1}))
    rig.committer.wait()
    rig.committer.stop(5)  # held by the failure: it ends without committing what follows
    assert rig.committer.take_failure() is not None
    rig.committer.submit(rig.unit("b", {0: 1}))
    with pytest.raises(AgentrunsKafkaError, match="committer thread stopped"):
        rig.committer.wait()


def test_a_call_that_never_returns_stops_the_loop_instead_of_wedging_it(
    rig: _Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # librdkafka's send_offsets_to_transaction can ignore its timeout; here commit stands still
    monkeypatch.setattr(tx, "TIMEOUT_S", 0.05)
    hold = rig.committing(rig.unit("a", {0: 1}))
    try:
        with pytest.raises(StuckClientError, match="commit_transaction has not returned"):
            rig.committer.wait()
        with pytest.raises(StuckClientError):
            rig.committer.settled()
        with pytest.raises(StuckClientError):
            rig.committer.take_failure()
        began = time.monotonic()
        rig.committer.close()  # no join of the stuck thread, no release of its producers
        assert time.monotonic() - began < 1.0
        assert not any(c[0] == "flush" and c[-1] == 1 for c in rig.calls)
    finally:
        hold.set()


def test_a_call_that_raised_is_not_taken_for_a_stuck_one(
    rig: _Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tx, "TIMEOUT_S", 0.05)
    rig.made[0].fail["commit"] = KafkaException(KafkaError(KafkaError._FAIL, "x"))
    failure = rig.failed(rig.unit("a", {0: 1}))
    time.sleep(0.2)  # well past the bound: the call that raised is over
    assert rig.committer.settled()
    rig.committer.recover(failure.error)
    assert rig.committer.submit(rig.unit("b", {0: 1}))
    rig.committer.wait()
    assert [names for names, _ in rig.committed] == [["b"]]


def _timed_out() -> KafkaException:
    return KafkaException(KafkaError(KafkaError._TIMED_OUT, "retry call to resume", retriable=True))


def test_a_commit_that_timed_out_is_resumed_not_aborted(rig: _Rig) -> None:
    # its outcome is unknown: aborted, it could still commit, and the batch be applied twice
    rig.made[0].fail["commit"] = _timed_out()
    assert rig.committer.submit(rig.unit("a", {0: 1}))
    rig.committer.wait()
    assert rig.committer.take_failure() is None
    assert [names for names, _ in rig.committed] == [["a"]]
    assert [c[0] for c in rig.calls].count("commit") == 2
    assert not any(c[0] == "abort" for c in rig.calls)


def test_a_commit_that_never_finishes_stops_the_process_without_an_abort(
    rig: _Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tx, "COMMIT_PATIENCE_S", 0.0)
    rig.made[0].fail["commit"] = _timed_out()
    failure = rig.failed(rig.unit("a", {0: 1}))
    assert isinstance(failure.error, StuckClientError)
    with pytest.raises(StuckClientError, match="outcome unknown"):
        rig.committer.recover(failure.error)
    assert not any(c[0] == "abort" for c in rig.calls)
    assert rig.committed == []


def test_a_commit_refused_as_abortable_is_aborted(rig: _Rig) -> None:
    rig.made[0].fail["commit"] = KafkaException(
        KafkaError(KafkaError._FENCED, "x", retriable=True, txn_requires_abort=True)
    )
    failure = rig.failed(rig.unit("a", {0: 1}))
    rig.committer.recover(failure.error)
    assert any(c[0] == "abort" for c in rig.calls)
