"""A processor that loses its partitions to another member, and its successor (real broker).

Found by `agentruns chaos`: after a broker restart, librdkafka fenced a processor's static
member (FENCED_INSTANCE_ID, a fatal consumer error). The processor logged it and went on, its
transactional producer still able to commit, while the group gave its partitions to the other
processor, which restored the run states before the fenced one's last transaction committed:
two events with the same seq in one run's log.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from agentruns.processors.transition import transition
from agentruns.streams.codec import encode
from agentruns.streams.errors import FatalConsumerError
from agentruns.streams.kafka_defaults import release
from agentruns.streams.partitioning import partition_for
from agentruns.streams.processor import Processor, ProcessorConfig
from agentruns.streams.records import RunSlot
from agentruns.streams.topics import INBOX, STATE, topic_name
from tests.support.pipeline import submitted
from tests.support.waiting import wait_for

PARTITIONS = 2


def _no_artifacts(artifacts: object) -> None:
    return None


class _Running:
    """A processor on a thread; `error` is what its run() raised."""

    def __init__(self, processor: Processor) -> None:
        self.processor = processor
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="processor")

    def _run(self) -> None:
        try:
            self.processor.run(self.stop)
        except BaseException as exc:  # the test looks at it
            self.error = exc


@pytest.fixture
def running() -> Iterator[list[_Running]]:
    started: list[_Running] = []
    yield started
    for r in started:
        r.stop.set()
        r.thread.join(60)


def _start(config: ProcessorConfig, started: list[_Running]) -> _Running:
    r = _Running(Processor(config, _no_artifacts))
    started.append(r)
    r.thread.start()
    return r


def test_a_fenced_processor_stops_instead_of_going_on(
    kafka_bootstrap: str, prefix: str, running: list[_Running]
) -> None:
    config = ProcessorConfig(bootstrap=kafka_bootstrap, prefix=prefix, instance_id="0")
    first = _start(config, running)
    wait_for(lambda: bool(first.processor._assigned), timeout=60, what="the first assignment")
    # Another member registers the same group.instance.id: the broker fences the first one.
    impostor = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": config.group_id,
            "group.instance.id": f"{config.group_id}-{config.instance_id}",
            "session.timeout.ms": 6000,
            "log_level": 0,
        }
    )

    def stopped() -> bool:
        impostor.poll(0.2)  # the impostor holds its membership while it polls
        return not first.thread.is_alive()

    try:
        impostor.subscribe([topic_name(INBOX, prefix)])
        wait_for(stopped, 60, "the fenced processor to stop", every=0)
        assert isinstance(first.error, FatalConsumerError), first.error
        assert "fenced" in str(first.error).lower()
    finally:
        impostor.close()


def test_the_successor_restores_after_the_previous_owners_open_transaction(
    kafka_bootstrap: str, prefix: str, running: list[_Running]
) -> None:
    """The previous owner's last transaction (a snapshot and its input offsets) is still open
    when the partition is assigned: the restore must see what that transaction commits."""
    config = ProcessorConfig(bootstrap=kafka_bootstrap, prefix=prefix, instance_id="0")
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    partition = partition_for(run_id, PARTITIONS)
    slot = RunSlot(run_id, state=transition(None, submitted(run_id)).state, last_seq=1, version=1)
    # The previous owner: a transaction holding the run's snapshot and the group's offset for
    # the input it came from, produced and sent but not committed yet.
    previous = Producer(
        {"bootstrap.servers": kafka_bootstrap, "transactional.id": f"prev-{uuid.uuid4().hex}"}
    )
    previous.init_transactions(30)
    previous.begin_transaction()
    previous.produce(
        topic_name(STATE, prefix),
        key=run_id.encode(),
        value=encode("Snapshot", slot.to_record()),
        partition=partition,
    )
    group = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": config.group_id})
    previous.send_offsets_to_transaction(
        [TopicPartition(topic_name(INBOX, prefix), partition, 1)],
        group.consumer_group_metadata(),
        30,
    )
    group.close()
    assert previous.flush(30) == 0
    successor = _start(config, running)
    time.sleep(3)  # assigned by now, and waiting for the open transaction
    assert run_id not in {s.run_id for s in successor.processor.slots()}
    previous.commit_transaction(30)
    release(previous)
    wait_for(
        lambda: run_id in {s.run_id for s in successor.processor.slots()},
        timeout=60,
        what="the successor to restore the run the open transaction held",
    )
    restored = next(s for s in successor.processor.slots() if s.run_id == run_id)
    assert restored.last_seq == 1
    assert successor.error is None
