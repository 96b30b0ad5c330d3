"""The processor's rebalance callbacks and its recovery after a failed transaction, without a
broker: a real `Processor` (its input path, committer thread, restore, eviction) on the
in-memory clients of `tests.support.memory_kafka`, whose transactions become visible only when
committed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition

from agentruns.processors.events import Event, GoalChanged
from agentruns.streams.codec import decode, encode
from agentruns.streams.processor import Processor, ProcessorConfig
from agentruns.streams.records import input_record
from agentruns.streams.transaction import Fault, classify
from tests.support.memory_kafka import (
    MemoryClients,
    MemoryCluster,
    MemoryConsumer,
    MemoryProducer,
    abortable,
)
from tests.unit.test_processor_inputs import AT, submit

PREFIX = "t"


class Rig:
    """A processor on a memory cluster, assigned inbox partitions 0 and 1."""

    def __init__(self) -> None:
        self.cluster = MemoryCluster()
        self.clients = MemoryClients(self.cluster)
        config = ProcessorConfig(
            bootstrap="memory",
            prefix=PREFIX,
            max_record_bytes=1 << 20,
            retry_backoff_ms=1,
            retry_backoff_max_ms=2,
        )
        self.proc = Processor(config, lambda artifacts: None, clients=self.clients)
        self.topics = self.proc.topics
        (consumer,) = self.clients.consumers
        self.consumer: MemoryConsumer = consumer
        self.proc._open_store()
        self.proc._rebalance.on_assign(cast(Any, consumer), self.partitions(0, 1))

    def partitions(self, *numbers: int) -> list[TopicPartition]:
        return [TopicPartition(self.topics.inbox, p) for p in numbers]

    def apply(self, partition: int, event: Event) -> int:
        """Write `event` to the inbox and hand it to the processor, as its loop does."""
        value = encode("Input", input_record(event))
        offset = self.cluster.append(self.topics.inbox, partition, event.run_id.encode(), value, AT)
        self.proc._handle(cast(Any, self.cluster.message(self.topics.inbox, partition, offset)))
        return offset

    def producer(self) -> MemoryProducer:
        """The producer of the next transaction."""
        return cast(MemoryProducer, self.proc._committer.producer)

    def events(self, partition: int) -> list[tuple[str, int]]:
        """(run_id, seq) of the committed events of `partition`."""
        out = []
        for stored in self.cluster.log(self.topics.events, partition):
            assert stored.value is not None
            record = decode(stored.value, "Event").record
            out.append((record["run_id"], record["seq"]))
        return out

    def snapshots(self, partition: int) -> list[str]:
        return [(s.key or b"").decode() for s in self.cluster.log(self.topics.state, partition)]

    def last_seq(self, partition: int, run_id: str) -> int:
        return self.proc._slots[partition][run_id].last_seq


@pytest.fixture
def rig() -> Iterator[Rig]:
    rig = Rig()
    yield rig
    rig.proc.close()


def goal(run_id: str, n: int) -> GoalChanged:
    return GoalChanged(
        run_id=run_id, event_id=f"g{n}", at=AT + n, trace_id="t", step=1, goal=f"goal {n}"
    )


def test_a_failed_transaction_is_aborted_and_the_loop_rewinds_to_the_committed_offsets(
    rig: Rig,
) -> None:
    inbox = rig.topics.inbox
    rig.apply(0, submit("r1"))
    rig.proc._commit(wait=True)
    assert rig.cluster.committed == {(inbox, 0): 1}
    assert rig.events(0) == [("r1", 1)]

    rig.apply(0, goal("r1", 1))
    rig.apply(1, submit("r2"))
    assert rig.last_seq(0, "r1") == 2 and "r2" in rig.proc._slots[1]
    failing = rig.producer()
    failing.fail["commit"] = abortable()
    with pytest.raises(KafkaException) as raised:
        rig.proc._commit(wait=True)
    assert classify(raised.value) is Fault.ABORTABLE

    rig.proc._recover(raised.value)  # what the loop does with it

    # the open transaction is aborted: none of its records or offsets are visible
    assert failing.calls[-2:] == ["commit", "abort"]
    assert rig.cluster.committed == {(inbox, 0): 1}
    assert rig.events(0) == [("r1", 1)] and rig.events(1) == []
    assert rig.snapshots(0) == ["r1"] and rig.snapshots(1) == []
    # rewound to the committed offsets, the in-memory state to the committed snapshots
    assert sorted(rig.consumer.seeks) == [(inbox, 0, 1), (inbox, 1, OFFSET_BEGINNING)]
    assert rig.last_seq(0, "r1") == 1 and rig.proc._slots[1] == {}
    assert rig.proc._batch is None and rig.proc._in_flight_batch is None
    assert rig.proc.stats.aborts == 1 and rig.proc.stats.retries == 1
    assert rig.proc._backoff.failures == 1 and rig.proc._isolating == {}

    # the inputs come again and commit once, with the seqs the failed transaction had
    rig.proc._handle(cast(Any, rig.cluster.message(inbox, 0, 1)))
    rig.proc._handle(cast(Any, rig.cluster.message(inbox, 1, 0)))
    rig.proc._commit(wait=True)
    assert rig.events(0) == [("r1", 1), ("r1", 2)] and rig.events(1) == [("r2", 1)]
    assert rig.cluster.committed == {(inbox, 0): 2, (inbox, 1): 1}
    assert rig.proc._backoff.failures == 0


def test_a_batch_that_keeps_failing_is_retried_one_input_per_transaction(rig: Rig) -> None:
    inbox = rig.topics.inbox
    rig.apply(0, submit("r1"))
    rig.apply(0, submit("r2"))
    for attempt in range(rig.proc.config.isolate_after):
        if attempt:  # redelivered after the rewind
            for offset in (0, 1):
                rig.proc._handle(cast(Any, rig.cluster.message(inbox, 0, offset)))
        rig.producer().fail["commit"] = abortable()
        with pytest.raises(KafkaException) as raised:
            rig.proc._commit(wait=True)
        rig.proc._recover(raised.value)
    assert rig.proc._isolating == {0: 2} and rig.proc.stats.isolations == 1
    assert rig.cluster.committed == {} and rig.proc._slots[0] == {}


def test_a_revoke_commits_what_was_applied_and_drops_the_revoked_partitions_runs(
    rig: Rig,
) -> None:
    inbox = rig.topics.inbox
    rig.apply(0, submit("r1"))
    rig.apply(1, submit("r2"))
    rig.proc._evictor.track(1, "r2", AT, terminal=False)
    rig.proc._isolating[1] = 5

    rig.proc._rebalance.on_revoke(cast(Any, rig.consumer), rig.partitions(1))

    # the next owner of partition 1 starts from what was applied: committed first
    assert rig.cluster.committed == {(inbox, 0): 1, (inbox, 1): 1}
    assert rig.snapshots(1) == ["r2"] and rig.events(1) == [("r2", 1)]
    # then everything of partition 1 is dropped, partition 0 kept
    assert rig.proc._assigned == {0}
    assert 1 not in rig.proc._slots and 1 not in rig.proc._path.parked
    assert 1 not in rig.proc._evictor.watermark and 1 not in rig.proc._isolating
    assert set(rig.proc._slots[0]) == {"r1"}
    assert rig.proc.membership.state == (False, 0)


def test_a_fenced_processor_drops_the_revoked_partitions_without_committing(rig: Rig) -> None:
    rig.apply(0, submit("r1"))
    rig.proc._rebalance.fenced = True
    rig.proc._rebalance.on_revoke(cast(Any, rig.consumer), rig.partitions(0, 1))
    assert rig.cluster.committed == {} and rig.events(0) == []
    assert rig.proc._assigned == set() and rig.proc._slots == {}


def test_lost_partitions_drop_the_open_batch_and_commit_nothing(rig: Rig) -> None:
    rig.apply(0, submit("r1"))
    rig.proc._rebalance.on_lost(cast(Any, rig.consumer), rig.partitions(0))
    assert rig.proc._batch is None
    assert rig.cluster.committed == {} and rig.events(0) == []
    assert rig.proc._assigned == {1} and 0 not in rig.proc._slots


def test_an_assignment_restores_what_the_previous_owner_committed(rig: Rig) -> None:
    rig.apply(1, submit("r2"))
    rig.apply(1, goal("r2", 1))
    rig.proc._commit(wait=True)
    rig.proc._rebalance.on_revoke(cast(Any, rig.consumer), rig.partitions(1))
    assert 1 not in rig.proc._slots

    rig.proc._rebalance.on_assign(cast(Any, rig.consumer), rig.partitions(1))

    assert rig.proc._assigned == {0, 1} and rig.last_seq(1, "r2") == 2
    assert rig.proc.membership.state == (True, 1)


def test_a_stopped_partition_is_paused_and_resumed_once_restored(rig: Rig) -> None:
    inbox = rig.topics.inbox
    rig.proc._path.stop(1, "a snapshot this build cannot continue")
    rig.proc._rebalance.sync_stopped()
    assert rig.consumer.paused == {(inbox, 1)}
    assert rig.proc.membership.stopped_partitions == {1: "a snapshot this build cannot continue"}
    rig.proc.restore({1})  # tried again: nothing stops it now
    rig.proc._rebalance.sync_stopped()
    assert rig.consumer.paused == set() and rig.proc.membership.stopped_partitions == {}
