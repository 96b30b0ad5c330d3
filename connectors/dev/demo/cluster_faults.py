"""The faults of a local multi-broker cluster for `agentruns chaos --brokers 3`.

Each fault finds its broker the way an operator would, then kill -9s it and starts it again:

- ``leader``: the broker leading the most inbox partitions (topic metadata);
- ``coordinator``: the transaction coordinator of a processor's transactional id, the leader of
  the ``__transaction_state`` partition the id hashes to (as the broker places it);
- ``controller``: the active controller (the KRaft quorum leader);
- ``below_min_isr``: two of the three brokers at once, for long enough that every partition is
  below ``min.insync.replicas`` (and the controller quorum has no majority), then both back.

With a `NetLab` (each broker in a network namespace of its own; needs root), two more, each a
partition that drops packets silently, then healed:

- ``partition_broker``: the broker leading the most inbox partitions cut off from the other two
  (it still reaches and is reached by the clients);
- ``partition_clients``: every pipeline process and client (the machine's own namespace) cut
  off from the transaction coordinator of a processor's transactional id, the brokers still
  reaching each other.

`ProgressWatch` tails the run log, so that the time each fault stalled the pipeline can be told
apart from the time it was injected.
"""

from __future__ import annotations

import bisect
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient

from agentruns.connectors.dev.stack.local_kafka import LocalKafka
from agentruns.connectors.dev.stack.netlab import HOST, NetLab
from agentruns.streams.kafka_defaults import client_settings, close_consumer

CLUSTER_FAULTS = ("leader", "coordinator", "controller", "below_min_isr")
PARTITION_FAULTS = ("partition_broker", "partition_clients")
TRANSACTION_STATE = "__transaction_state"
#: After a fault is over, how long its stall may still last (what comes later is not its own).
STALL_HORIZON_S = 20.0


def java_string_hash(text: str) -> int:
    """``String.hashCode()`` of the JVM (32-bit, signed) for the BMP text of our ids."""
    h = 0
    for unit in text.encode("utf-16-be").hex(" ", 2).split():
        h = (31 * h + int(unit, 16)) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def transaction_state_partition(transactional_id: str, partitions: int) -> int:
    """The ``__transaction_state`` partition of ``transactional_id``: the broker's
    ``Utils.abs(id.hashCode()) % partitions`` (abs of the smallest int is 0 there)."""
    h = java_string_hash(transactional_id)
    return (0 if h == -(1 << 31) else abs(h)) % partitions


def _admin(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap, **client_settings(), "log_level": 0})


def leaders(bootstrap: str, topic: str) -> dict[int, int]:
    """partition -> the broker leading it (-1: none now)."""
    meta = _admin(bootstrap).list_topics(topic, timeout=30).topics[topic]
    return {p: info.leader for p, info in meta.partitions.items()}


def most_leading(bootstrap: str, topic: str, patience_s: float = 60.0) -> int:
    """The broker leading the most partitions of ``topic``; right after brokers came back no
    partition may have a leader yet, so that is waited for (up to ``patience_s``)."""
    deadline = time.monotonic() + patience_s
    while True:
        counts: dict[int, int] = {}
        for broker in leaders(bootstrap, topic).values():
            if broker >= 0:
                counts[broker] = counts.get(broker, 0) + 1
        if counts:
            return max(sorted(counts), key=lambda b: counts[b])
        if time.monotonic() > deadline:
            raise RuntimeError(f"no partition of {topic} has had a leader for {patience_s:.0f} s")
        time.sleep(1.0)


def under_replicated(bootstrap: str) -> int:
    """How many partitions of the cluster have fewer in-sync replicas than replicas."""
    topics = _admin(bootstrap).list_topics(timeout=30).topics.values()
    return sum(1 for t in topics for p in t.partitions.values() if len(p.isrs) < len(p.replicas))


def wait_replicated(bootstrap: str, patience_s: float = 120.0) -> None:
    """Return once every partition has all its replicas in sync; raise after ``patience_s``.

    A fault lands on a fully replicated cluster: replication factor 3 with
    ``min.insync.replicas=2`` tolerates one broker down, not two more while a third catches up
    (their unclean shutdowns would take them out of the partitions' eligible leader replicas,
    Kafka 4.1's ELR, KIP-966, and with unclean leader election off a partition left with none
    waits for an operator)."""
    deadline = time.monotonic() + patience_s
    while (behind := under_replicated(bootstrap)) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{behind} partitions still under-replicated after {patience_s:.0f} s"
            )
        time.sleep(1.0)


def transaction_coordinator(bootstrap: str, transactional_id: str) -> int:
    """The broker coordinating ``transactional_id``'s transactions."""
    by_partition = leaders(bootstrap, TRANSACTION_STATE)
    if not by_partition:  # made when the cluster's first transactional producer starts
        raise RuntimeError(f"{TRANSACTION_STATE} does not exist yet")
    return by_partition[transaction_state_partition(transactional_id, len(by_partition))]


@dataclass
class FaultRecord:
    fault: str
    brokers: tuple[int, ...]
    began: float  # time.monotonic() of the kill
    ended: float = 0.0  # when the killed brokers were running again, or the partition healed
    stall_s: float | None = None

    def figures(self, origin: float) -> dict[str, Any]:
        return {
            "fault": self.fault,
            "brokers": list(self.brokers),
            "at_s": round(self.began - origin, 1),
            "down_s": round(self.ended - self.began, 1),
            "stall_s": None if self.stall_s is None else round(self.stall_s, 2),
        }


@dataclass
class ClusterFaults:
    """Injects the cluster faults in turn on ``kafka`` (a local cluster of 3+ brokers)."""

    kafka: LocalKafka
    bootstrap: str
    inbox: str
    transactional_id: str
    wait: Callable[[float], object]  # sleeps, shorter when the chaos run ends
    say: Callable[[str], object] = print
    lab: NetLab | None = None  # its members ``broker-<id>``: the brokers' namespaces
    done: list[FaultRecord] = field(default_factory=list)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The faults this cluster can be given, in the order they come."""
        return CLUSTER_FAULTS + (PARTITION_FAULTS if self.lab is not None else ())

    def next_fault(self) -> str:
        return self.kinds[len(self.done) % len(self.kinds)]

    def kinds_done(self) -> set[str]:
        return {f.fault for f in self.done}

    def inject(self, fault: str, down_s: float) -> FaultRecord:
        """Kill -9 the fault's broker(s), leave them down for ``down_s``, start them again; or
        make the fault's partition, leave it for ``down_s``, heal it."""
        wait_replicated(self.bootstrap)
        if fault in PARTITION_FAULTS:
            return self._partition(fault, down_s)
        if fault == "leader":
            victims: tuple[int, ...] = (most_leading(self.bootstrap, self.inbox),)
        elif fault == "coordinator":
            victims = (transaction_coordinator(self.bootstrap, self.transactional_id),)
        elif fault == "controller":
            controller = self.kafka.active_controller()
            if controller is None:
                raise RuntimeError("no live voter names an active controller")
            victims = (controller,)
        elif fault == "below_min_isr":
            victims = tuple(n.node_id for n in self.kafka.nodes[:2])
        else:
            raise ValueError(f"unknown cluster fault {fault}")
        record = FaultRecord(fault, victims, time.monotonic())
        self.kafka.kill(victims)
        try:
            self.wait(down_s)
        finally:
            for broker in victims:
                self.kafka.start_node(broker, timeout=120)
            record.ended = time.monotonic()
        self.done.append(record)
        self.say(
            f"chaos: {fault}: kill -9 broker {', '.join(map(str, victims))}, restarted after"
            f" {record.ended - record.began:.1f} s"
        )
        return record

    def _partition(self, fault: str, down_s: float) -> FaultRecord:
        if self.lab is None:
            raise ValueError(f"{fault} needs the brokers in network namespaces")
        lab = self.lab
        if fault == "partition_broker":
            victim = most_leading(self.bootstrap, self.inbox)
            pairs = [(f"broker-{victim}", f"broker-{n.node_id}") for n in self.kafka.nodes]
            pairs = [(a, b) for a, b in pairs if a != b]
            what = f"broker {victim} cut off from the other brokers"
        else:
            victim = transaction_coordinator(self.bootstrap, self.transactional_id)
            pairs = [(HOST, f"broker-{victim}")]
            what = f"the clients cut off from broker {victim}"
        record = FaultRecord(fault, (victim,), time.monotonic())
        try:
            for a, b in pairs:
                lab.partition(a, b)
            self.wait(down_s)
        finally:
            for a, b in pairs:
                lab.heal(a, b)
            record.ended = time.monotonic()
        self.done.append(record)
        self.say(f"chaos: {fault}: {what}, healed after {record.ended - record.began:.1f} s")
        return record


class ProgressWatch:
    """Tails a topic (read_committed) from its end and keeps when each record arrived: the
    pipeline's progress as a reader of its log sees it."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                **client_settings(),
                "group.id": f"progress-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "log_level": 0,
            }
        )
        partitions = self._consumer.list_topics(topic, timeout=30).topics[topic].partitions
        self._consumer.assign([TopicPartition(topic, p, OFFSET_END) for p in partitions])
        self.arrivals: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for message in self._consumer.consume(500, 0.2):
                if message.error() is None:
                    self.arrivals.append(time.monotonic())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        close_consumer(self._consumer, 10)

    def stall(self, began: float, ended: float) -> float:
        """The longest time without a new record from ``began`` (the fault) to
        ``ended + STALL_HORIZON_S``, counting the gap from the fault to the first record after
        it. A gap that runs past the window counts (up to its end) only when a record came
        after it: with none, the pipeline had nothing left to do."""
        stop = ended + STALL_HORIZON_S
        arrivals = list(self.arrivals)
        longest, last = 0.0, began
        for t in arrivals[bisect.bisect_right(arrivals, began) :]:
            longest = max(longest, min(t, stop) - last)
            if t >= stop:
                break
            last = t
        return longest


def percentiles(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    return {"p50": round(ordered[(len(ordered) - 1) // 2], 2), "max": round(ordered[-1], 2)}


def acknowledged_missing(
    bootstrap: str, topic: str, acknowledged: dict[tuple[int, int], bytes], group: str
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Of the records the broker acknowledged at (partition, offset) with that key: those not in
    ``topic`` at that place (lost), and those ``group`` has not consumed (its committed offset is
    not past them)."""
    reader = Consumer(
        {
            "bootstrap.servers": bootstrap,
            **client_settings(),
            "group.id": group,
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "log_level": 3,
        }
    )
    found: dict[tuple[int, int], bytes | None] = {}
    try:
        partitions = sorted({p for p, _ in acknowledged})
        committed = {
            tp.partition: tp.offset
            for tp in reader.committed([TopicPartition(topic, p) for p in partitions], timeout=30)
        }
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        pending = set(partitions)
        deadline = time.monotonic() + 120
        while pending and time.monotonic() < deadline:
            for message in reader.consume(500, 0.5):
                error = message.error()
                if error is not None and error.code() == KafkaError._PARTITION_EOF:
                    pending.discard(message.partition() or 0)
                elif error is None:
                    key = message.key()
                    found[(message.partition() or 0, message.offset() or 0)] = (
                        key if isinstance(key, bytes) else None
                    )
    finally:
        reader.close()
    lost = sorted(where for where, key in acknowledged.items() if found.get(where) != key)
    unconsumed = sorted((p, o) for p, o in acknowledged if committed.get(p, -1) <= o)
    return lost, unconsumed
