"""One transactional consume -> produce loop: what the processor and the executors share.

Both consume one topic (read_committed, manual commits) and answer what they consume in Kafka
transactions that also carry the consumed offsets (KIP-447: `send_offsets_to_transaction` with
the consumer's group metadata). What each consumes, and how it turns that into records, stays
with it (`agentruns.streams.processor`, `agentruns.connectors.executors.base`); this module
holds the rest:

- the clients (`Clients`): the long-lived consumer and the transactional producers, two used in
  turn (`ProducerPair`), with `transactional.id` `<group>-<instance>-a` / `-b`;
- what a failed Kafka call means (`classify`): fatal (the producer is fenced, or the client
  can do nothing more), retriable (an outage: retried, never the fault of what was consumed) or
  abortable (the transaction is aborted and retried);
- the back-off between retries (`Backoff`): it doubles with each failure in a row;
- the committer thread (`Committer`): group commit, one transaction at a time, and what is done
  with a transaction that failed;
- rewinding the consumer (`committed_offsets`, `seek`).

The loop thread hands what it has done to the committer as units (`Outgoing`: records, the
offsets they answer, the group metadata) and goes on consuming. The committer commits every
unit handed over while its previous transaction ran in one transaction
(`Committer._transact` lists the steps). When one fails, the committer takes nothing more until
the loop has taken the failure (`Committer.take_failure`), with the units it carried and those
queued behind it, and recovered:

1. fatal: the current producer is replaced (a new one with the same id, whose
   `init_transactions` fences and aborts what the old one left open); otherwise the open
   transaction is aborted (`Committer.recover`);
2. the loop drops everything it holds that was not committed (the failed units, those queued
   behind them, its own open work);
3. it backs off, if it counts this kind of failure (`Backoff`; the processor does for
   transactions, the executors for batches whose database work failed);
4. it rewinds its consumer to where the dropped work began: the processor to the committed
   offsets of its partitions (`committed_offsets`, then `seek`) and it reloads their state; the
   executors to the first offsets of the dropped batches (`seek`, lenient: a partition no
   longer assigned is its new owner's); what was consumed comes back and is done again.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeGuard, TypeVar

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from agentruns.streams.access import transactional_id_prefix
from agentruns.streams.authorization import refused
from agentruns.streams.errors import AgentrunsKafkaError, FatalConsumerError, StuckClientError
from agentruns.streams.kafka_defaults import (
    NO_DELAY,
    TRANSACTIONAL_PRODUCER,
    ProducerPair,
    client_settings,
    commit_timed,
    fetch_settings,
    group_consumer,
    release,
)

log = logging.getLogger("agentruns.transaction")

Headers = list[tuple[str, str | bytes | None]]
# topic, key, value (None: a tombstone), partition (None: the producer's partitioner), headers
Record = tuple[str, bytes | None, bytes | None, int | None, Headers | None]

#: The bound of every blocking transactional call (seconds).
TIMEOUT_S = 30.0
#: How long an abort is resumed after it timed out, before its producer is replaced.
ABORT_PATIENCE_S = 60.0
#: How long a commit that timed out is resumed before its process stops (`Committer._commit`).
COMMIT_PATIENCE_S = 120.0
#: How long a new transactional producer retries a retriable init_transactions error.
INIT_PATIENCE_S = 120.0
#: A committer's call still running after this many times its bound (`TIMEOUT_S`) is stuck:
#: librdkafka's send_offsets_to_transaction can ignore its timeout while the group coordinator
#: is away (confluentinc/librdkafka#5456, #5511), which wedged an executor for good after a
#: broker was killed and a partition healed.
STUCK_AFTER_TIMEOUTS = 2.0
_NO_COORDINATOR = frozenset(
    {
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    }
)


# --------------------------------------------------------------------------- clients


class ClientConfig(Protocol):
    """What a loop's configuration tells about its clients (`Clients.of`)."""

    @property
    def bootstrap(self) -> str: ...
    @property
    def instance_id(self) -> str: ...
    @property
    def session_timeout_ms(self) -> int: ...
    @property
    def transaction_timeout_ms(self) -> int: ...
    @property
    def extra_consumer(self) -> Mapping[str, Any]: ...
    @property
    def extra_producer(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class Clients:
    """The settings a transactional loop's clients are made of."""

    bootstrap: str
    group_id: str
    # Stable per process slot: a restarted process with the same id aborts the transaction its
    # predecessor left open at once (instead of waiting for transaction.timeout.ms).
    instance_id: str
    session_timeout_ms: int
    transaction_timeout_ms: int
    extra_consumer: Mapping[str, Any]
    extra_producer: Mapping[str, Any]

    @classmethod
    def of(cls, config: ClientConfig, group_id: str) -> Clients:
        return cls(
            config.bootstrap,
            group_id,
            config.instance_id,
            config.session_timeout_ms,
            config.transaction_timeout_ms,
            config.extra_consumer,
            config.extra_producer,
        )

    @property
    def member(self) -> str:
        """``<group>-<instance>``: the base of the transactional ids (and of a static member id)."""
        return f"{transactional_id_prefix(self.group_id)}{self.instance_id}"

    def consumer_config(
        self, settings: Mapping[str, Any], fetch_window_ms: int = 0
    ) -> dict[str, Any]:
        """The loop's consumer: read_committed, manual commits (the offsets go with the
        transactions), fetching in windows of ``fetch_window_ms`` (0: long poll), with the
        client's own ``settings`` and then ``extra_consumer`` over the shared ones."""
        return {
            "bootstrap.servers": self.bootstrap,
            **client_settings(),
            "group.id": self.group_id,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
            "session.timeout.ms": self.session_timeout_ms,
            "heartbeat.interval.ms": max(500, self.session_timeout_ms // 6),
            **settings,
            **fetch_settings(fetch_window_ms),
            **NO_DELAY,
            **group_consumer(self.group_id),
            **self.extra_consumer,
        }

    def consumer(self, settings: Mapping[str, Any], fetch_window_ms: int = 0) -> Consumer:
        return Consumer(self.consumer_config(settings, fetch_window_ms))

    def producer_config(self, slot: str, settings: Mapping[str, Any]) -> dict[str, Any]:
        """A transactional producer, id ``<member>-<slot>`` (see `ProducerPair`), with the
        client's own ``settings`` and then ``extra_producer`` over the shared ones."""
        return {
            "bootstrap.servers": self.bootstrap,
            **client_settings(),
            "transactional.id": f"{self.member}-{slot}",
            "transaction.timeout.ms": self.transaction_timeout_ms,
            **TRANSACTIONAL_PRODUCER,
            **settings,
            "log_level": 3,
            **self.extra_producer,
        }

    def producer(self, slot: str, settings: Mapping[str, Any]) -> Producer:
        """`producer_config`'s producer, its transactions initialized."""
        # No coordinator yet (its broker is down, or the transaction log partition is still
        # loading on its new leader): tried again for INIT_PATIENCE_S. A retriable error (a
        # timeout) leaves the call in progress: the same producer resumes it; after another
        # coordinator error a new producer starts over.
        deadline = time.monotonic() + INIT_PATIENCE_S
        producer = Producer(self.producer_config(slot, settings))
        while True:
            try:
                producer.init_transactions(TIMEOUT_S)
                return producer
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                retriable = isinstance(error, KafkaError) and error.retriable()
                no_coordinator = isinstance(error, KafkaError) and error.code() in _NO_COORDINATOR
                tid = f"{self.member}-{slot}"
                denied = refused(kafka_error(exc), name=tid, operation="Write")
                if denied is not None:
                    raise denied from exc
                if not (retriable or no_coordinator) or time.monotonic() > deadline:
                    raise AgentrunsKafkaError(
                        f"cannot start a transactional producer: {exc}"
                    ) from exc
                log.warning("starting a transactional producer, trying again: %s", exc)
                if not retriable:
                    release(producer, 0)
                    time.sleep(1.0)
                    producer = Producer(self.producer_config(slot, settings))


# --------------------------------------------------------------------------- failures


class Fault(enum.Enum):
    """What a failed Kafka call means for the transaction it was part of."""

    FATAL = "fatal"  # fenced, or the client can do nothing more: a new producer
    RETRIABLE = "retriable"  # an outage (of the broker, of a store): abort, retry as is
    ABORTABLE = "abortable"  # anything else: abort, retry (perhaps one input at a time)


def is_fatal(error: KafkaError | None) -> TypeGuard[KafkaError]:
    """A fatal error: its fatal() flag is set, or its code is _FATAL (the flag is not set on
    consumer events)."""
    return error is not None and (error.fatal() or error.code() == KafkaError._FATAL)


def fatal_error(error: KafkaError) -> FatalConsumerError:
    return FatalConsumerError(
        f"fatal consumer error: {error.str()}",
        hint="the process stops; its supervisor (or you) starts it again",
    )


def kafka_error(exc: BaseException) -> KafkaError | None:
    """The KafkaError a KafkaException carries, if it carries one (not a bare message)."""
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return error if isinstance(error, KafkaError) else None


def classify(exc: BaseException) -> Fault:
    """Fatal before retriable before abortable; an exception that is not a KafkaException
    with a KafkaError (a bug in the committer, say) is abortable."""
    error = kafka_error(exc)
    if is_fatal(error):
        return Fault.FATAL
    if error is not None and error.retriable():
        return Fault.RETRIABLE
    return Fault.ABORTABLE


class Backoff:
    """The wait before a retry: the n-th failure in a row waits ``min(max_s, base_s * 2**(n-1))``;
    a success starts over."""

    def __init__(self, base_s: float, max_s: float) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.failures = 0  # in a row

    def _after(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        return min(self.max_s, self.base_s * 2.0 ** min(failures - 1, 64))

    @property
    def delay_s(self) -> float:
        """What the failures so far wait (0 after a success)."""
        return self._after(self.failures)

    @property
    def next_s(self) -> float:
        """What the next failure will wait."""
        return self._after(self.failures + 1)

    def failed(self) -> float:
        """Count a failure; return what it waits."""
        self.failures += 1
        return self.delay_s

    def succeeded(self) -> None:
        self.failures = 0

    def wait(self, stop: threading.Event | None = None) -> None:
        """Wait `delay_s`; a set ``stop`` ends the wait early."""
        delay = self.delay_s
        if delay <= 0:
            return
        if stop is not None:
            stop.wait(delay)
        else:
            time.sleep(delay)


# --------------------------------------------------------------------------- rewinding


def committed_offsets(
    consumer: Consumer,
    topic: str,
    partitions: Iterable[int],
    *,
    patience_s: float = 300.0,
    try_s: float = 10.0,
    stop: threading.Event | None = None,
    hint: str | None = None,
) -> dict[int, int]:
    """partition -> the group's committed offset (OFFSET_BEGINNING where none is).

    What keeps the fetch from answering is waited out, one bounded try after another: an
    outage of the broker or of the group coordinator (a timeout), or offsets a transaction of a
    previous owner still holds open (a read_committed consumer's fetch waits for them, KIP-447
    `require_stable`; the coordinator aborts a dead owner's within its transaction timeout).
    Giving up on the first timeout would end the process in the middle of a broker restart.
    A fatal error raises at once; anything else after `patience_s`, or once `stop` is set."""
    committed = committed_positions(
        consumer, topic, partitions, patience_s=patience_s, try_s=try_s, stop=stop, hint=hint
    )
    return {p: offset for p, (offset, _) in committed.items()}


def committed_positions(
    consumer: Consumer,
    topic: str,
    partitions: Iterable[int],
    *,
    patience_s: float = 300.0,
    try_s: float = 10.0,
    stop: threading.Event | None = None,
    hint: str | None = None,
) -> dict[int, tuple[int, str | None]]:
    """partition -> (committed offset, the metadata committed with it), as `committed_offsets`
    fetches them."""
    wanted = [TopicPartition(topic, p) for p in partitions]
    deadline = time.monotonic() + patience_s
    waits = Backoff(0.2, 2.0)
    while True:
        try:
            committed = consumer.committed(wanted, timeout=min(try_s, patience_s))
            break
        except KafkaException as exc:
            error = kafka_error(exc)
            if is_fatal(error):
                raise fatal_error(error) from exc
            if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                numbers = sorted(tp.partition for tp in wanted)
                raise AgentrunsKafkaError(
                    f"the committed offsets of {topic} {numbers} could not be read for"
                    f" {patience_s:.0f}s: {exc}",
                    hint=hint,
                ) from exc
            log.warning("the committed offsets of %s are not readable yet: %s", topic, exc)
            waits.failed()
            waits.wait(stop)
    return {
        tp.partition: (tp.offset if tp.offset >= 0 else OFFSET_BEGINNING, tp.metadata)
        for tp in committed
    }


class Watermarked(Protocol):
    """What `watermarks` asks of a consumer."""

    def get_watermark_offsets(
        self, partition: TopicPartition, timeout: float = -1, cached: bool = False
    ) -> tuple[int, int]: ...


def watermarks(
    consumer: Watermarked,
    topic: str,
    partition: int,
    *,
    patience_s: float = 120.0,
    try_s: float = 10.0,
    stop: threading.Event | None = None,
) -> tuple[int, int]:
    """(low, high) watermark of a partition, waiting out what a broker's restart or a leader's
    move answers meanwhile (NOT_LEADER, a timeout) as `committed_offsets` does."""
    deadline = time.monotonic() + patience_s
    waits = Backoff(0.2, 2.0)
    while True:
        try:
            low, high = consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=min(try_s, patience_s)
            )
            return int(low), int(high)
        except KafkaException as exc:
            error = kafka_error(exc)
            if is_fatal(error):
                raise fatal_error(error) from exc
            if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                raise AgentrunsKafkaError(
                    f"the offsets of {topic} [{partition}] could not be read for"
                    f" {patience_s:.0f}s: {exc}"
                ) from exc
            log.warning("the offsets of %s [%d] are not readable yet: %s", topic, partition, exc)
            waits.failed()
            waits.wait(stop)


def seek(
    consumer: Consumer, topic: str, offsets: Mapping[int, int], *, lenient: bool = False
) -> None:
    """Seek each partition to its offset. ``lenient``: a partition the consumer cannot seek (no
    longer assigned: its new owner reads from the committed offset) is skipped, else raises."""
    for partition, offset in offsets.items():
        try:
            consumer.seek(TopicPartition(topic, partition, offset))
        except KafkaException as exc:
            if not lenient:
                raise
            log.info("not rewinding %s partition %d: %s", topic, partition, exc)


# --------------------------------------------------------------------------- the committer


class Outgoing(Protocol):
    """One unit handed to the committer: what it adds to a transaction."""

    @property
    def offsets(self) -> Mapping[int, int]:
        """partition -> the next offset to commit of the consumed topic."""
        ...

    @property
    def metadata(self) -> Any:
        """The consumer's group metadata when the unit was made (KIP-447 fencing)."""
        ...

    @property
    def offset_notes(self) -> Mapping[int, str]:
        """partition -> the metadata committed with its offset (none: an empty one)."""
        ...

    def records(self) -> Iterable[Record]:
        """The records to produce, in order (the committer thread iterates them)."""
        ...

    def durable(self) -> None:
        """Return once what the records refer to outside Kafka is durable; raise if it cannot
        be (nothing is committed then)."""
        ...


@dataclass(frozen=True)
class Timings:
    """When each step of one transaction ended (``time.monotonic()``; see `Committer._transact`
    for their order: with ``offsets_first`` ``sent`` comes before ``produced``)."""

    began: float
    sent: float  # the offsets
    produced: float  # every record handed to the producer
    durable: float  # every unit's `durable()` returned
    flushed: float  # every record acknowledged
    ended: float  # committed


U = TypeVar("U", bound=Outgoing)


@dataclass(frozen=True)
class Failure(Generic[U]):
    """A transaction that failed, as the loop takes it (`Committer.take_failure`)."""

    error: Exception  # a KafkaException, or a bug's exception
    units: list[U]  # what the failed transaction carried, then what was queued behind it


class Committer(Generic[U]):
    """The committer thread of one loop and the producers it uses in turn (`ProducerPair`).

    Group commit: one transaction at a time, each carrying every unit handed over while the
    previous one ran, so a unit never waits for a transaction that began before it was ready
    and the loop does not wait for the broker. Transactions never overlap, so the committed
    offsets of a partition only move forward. The loop thread calls every public method; the
    committer thread runs `_transact` and `on_commit`."""

    def __init__(
        self,
        new_producer: Callable[[str], Producer],
        topic: str,
        on_commit: Callable[[list[U], Timings], None],
        *,
        name: str = "commit",
        offsets_first: bool = False,
        logger: logging.Logger = log,
        on_delivery: Mapping[str, Callable[[KafkaError | None, Message], None]] | None = None,
    ) -> None:
        self.topic = topic  # the consumed topic, whose offsets the transactions commit
        self._producers = ProducerPair(new_producer)
        self._on_commit = on_commit
        self._offsets_first = offsets_first
        # topic -> called (on the committer thread, during the flush) as each record produced
        # to it is acknowledged: who needs the offsets its records got
        self._on_delivery = dict(on_delivery or {})
        self._log = logger
        self._cond = threading.Condition()
        self._queued: list[U] = []
        self._in_flight = 0  # units in the transaction being committed
        self._failure: Failure[U] | None = None
        self._stopping = False
        self._open = False  # a transaction is begun and neither committed nor aborted
        # the committer thread's blocking call now running, and since when (None: none)
        self._call: tuple[str, float] | None = None
        self._stuck = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    @property
    def producer(self) -> Producer:
        """The producer of the next (or the open) transaction."""
        return self._producers.current

    # ------------------------------------------------------------------ the loop thread

    def submit(self, unit: U, full: Callable[[list[U]], bool] | None = None) -> bool:
        """Queue ``unit`` for the next transaction, first waiting while ``full(queued units)``.
        False, and not queued, if a transaction failed: the loop takes the failure first."""
        with self._cond:
            while self._failure is None and full is not None and full(self._queued):
                self._check_stuck()
                self._cond.wait(1.0)
            if self._failure is not None:
                return False
            if not self._started:
                self._started = True
                self._thread.start()
            self._queued.append(unit)
            self._cond.notify_all()
            return True

    def settled(self) -> bool:
        """Nothing is being committed or waits to be: idle, or held by a failure."""
        self._check_stuck()
        with self._cond:
            return self._failure is not None or not (self._queued or self._in_flight)

    def wait(self) -> None:
        """Wait until `settled`."""
        with self._cond:
            while self._failure is None and (self._queued or self._in_flight):
                if not self._thread.is_alive():
                    raise AgentrunsKafkaError("the committer thread stopped with units queued")
                self._check_stuck()
                self._cond.wait(1.0)

    def _check_stuck(self) -> None:
        """Raise StuckClientError when the committer thread's call has run for
        `STUCK_AFTER_TIMEOUTS` times its bound (the loop thread calls this as it waits)."""
        call = self._call
        if call is None:
            return
        what, began = call
        running = time.monotonic() - began
        if running > STUCK_AFTER_TIMEOUTS * TIMEOUT_S:
            self._stuck = True
            raise StuckClientError(
                f"the Kafka client's {what} has not returned in {running:.0f} s, past its"
                f" bound of {TIMEOUT_S:.0f} s: the client is stuck",
                hint="the process stops; its supervisor (or you) starts it again",
            )

    def take_failure(self) -> Failure[U] | None:
        """The transaction that failed, if one did, with every unit queued behind it (all of
        them dropped: the loop rewinds). From here the committer takes units again."""
        self._check_stuck()
        with self._cond:
            failure, self._failure = self._failure, None
            if failure is None:
                return None
            dropped, self._queued = self._queued, []
            self._cond.notify_all()
        return Failure(failure.error, failure.units + dropped)

    def recover(self, error: Exception) -> Fault:
        """After a failed transaction, the committer settled: a fatal error replaces the current
        producer (its successor's `init_transactions` aborts what it left open), any other
        aborts the open transaction. Logged; returns the fault (`classify`). A StuckClientError
        (a commit whose outcome stayed unknown) is raised: the process must stop, and so is a
        refusal for want of an ACL (`authorization.refused`): no retry grants it."""
        if isinstance(error, FatalConsumerError):  # a commit of unknown outcome: stop
            raise error
        denied = refused(kafka_error(error), operation="a transaction's Write")
        if denied is not None:  # the successor's init_transactions aborts what is open
            raise denied from error
        fault = classify(error)
        fatal = fault is Fault.FATAL
        self._log.warning("transaction failed (%s): %s", "fatal" if fatal else "abortable", error)
        if fatal:
            self._open = False
            self._producers.replace_current()
        else:
            self.abort()
        return fault

    def abort(self) -> None:
        """Abort the transaction the committer began, if one is open (the committer settled)."""
        if not self._open:
            return
        self._open = False
        # A timed-out abort is still in progress in librdkafka: every later transactional call
        # fails as conflicting with it until the abort is resumed. So it is resumed, while the
        # coordinator is unreachable; if it still fails, a new producer with the same id
        # fences this one and aborts what it left open.
        deadline = time.monotonic() + ABORT_PATIENCE_S
        while True:
            try:
                self._producers.current.abort_transaction(TIMEOUT_S)
                return
            except KafkaException as exc:
                self._log.warning("abort failed: %s", exc)
                error = exc.args[0] if exc.args else None
                if not (isinstance(error, KafkaError) and error.retriable()):
                    break
                if time.monotonic() > deadline:
                    break
        self._producers.replace_current()

    def stop(self, timeout_s: float = 60.0) -> None:
        """End the committer thread once it has committed what is queued (unless a transaction
        failed: then what is queued is left)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._started and not self._stuck:  # a stuck thread never ends: the process does
            self._thread.join(timeout_s)

    def close(self) -> None:
        """`stop`, then release both producers (not a stuck one: the process is ending)."""
        self.stop()
        if not self._stuck:
            self._producers.close()

    # ------------------------------------------------------------------ the committer thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (not self._queued or self._failure is not None):
                    self._cond.wait()
                if not self._queued or self._failure is not None:
                    return  # stopping, and nothing (more) to commit
                units, self._queued = self._queued, []
                self._in_flight = len(units)
            error: Exception | None = None
            try:
                self._transact(units)
            except KafkaException as exc:
                error = exc
            except StuckClientError as exc:  # a commit of unknown outcome: the process stops
                self._log.error("%s", exc)
                self._stuck = True
                error = exc
            except Exception as exc:  # a bug: a failed transaction all the same
                self._log.exception("commit failed unexpectedly")
                error = exc
            self._call = None  # a call that raised returned all the same
            with self._cond:
                self._in_flight = 0
                if error is not None:
                    self._failure = Failure(error, units)
                self._cond.notify_all()

    def _commit(self, producer: Producer) -> float:
        """Commit the open transaction; return when its records were acknowledged.

        A retriable error (a timeout) leaves the commit in progress inside librdkafka, its
        outcome unknown: the commit may reach the coordinator all the same. So it is resumed,
        never aborted: an abort would fail as conflicting, the producer be replaced, and the new
        one's `init_transactions` complete the commit, while the loop rewound and applied the
        batch again (the same seq committed twice for a run). Past
        COMMIT_PATIENCE_S the outcome is still unknown and the process must stop: a successor
        restores from what was committed."""
        deadline = time.monotonic() + COMMIT_PATIENCE_S
        while True:
            self._call = ("commit_transaction", time.monotonic())
            try:
                return commit_timed(producer, TIMEOUT_S)
            except KafkaException as exc:
                error = kafka_error(exc)
                if error is None or is_fatal(error) or not error.retriable():
                    raise
                if error.txn_requires_abort():
                    raise
                if time.monotonic() > deadline:
                    raise StuckClientError(
                        f"a transaction's commit did not finish in {COMMIT_PATIENCE_S:.0f} s,"
                        f" its outcome unknown: {error.str()}",
                        hint="the process stops; its supervisor (or you) starts it again",
                    ) from exc
                self._log.warning("the commit did not finish, resuming it: %s", error.str())

    def _transact(self, units: list[U]) -> None:
        """One transaction for ``units``, in this order:

        1. the offsets: per partition the highest next offset of the units, with the group
           metadata of the newest unit (none to send when no unit moved one);
        2. `begin_transaction` on the pair's current producer (from here a failure leaves the
           transaction open, for `recover` to abort);
        3. with ``offsets_first`` (the executors), `send_offsets_to_transaction` and then every
           unit's records produced, unit by unit, each unit's in its order; without it (the
           processor), the records and then the offsets;
        4. each unit's `durable()`: whatever the records refer to outside Kafka (the
           processor's artifacts, written meanwhile on its artifact thread) is durable before
           anything can see them; an error there fails the transaction;
        5. `flush` (every record acknowledged), then `commit_transaction`, within one bound of
           TIMEOUT_S for both (`commit_timed`);
        6. the next transaction uses the pair's other producer; `on_commit(units, timings)`.

        Whatever fails in 2-6 is kept (`Failure`, with ``units``) and the committer takes no
        more units until the loop has taken it (`take_failure`) and recovered (`recover`, then
        the loop's back-off and rewind: see the module's docstring)."""
        offsets: dict[int, int] = {}
        notes: dict[int, str | None] = {}  # a note goes with the offset of its own unit only
        for unit in units:
            unit_notes = unit.offset_notes
            for p, o in unit.offsets.items():
                if o >= offsets.get(p, o):
                    offsets[p] = o
                    notes[p] = unit_notes.get(p)
        positions = [_position(self.topic, p, o, notes.get(p)) for p, o in offsets.items()]
        metadata = units[-1].metadata
        producer = self._producers.current
        produce = producer.produce
        began = time.monotonic()
        producer.begin_transaction()
        self._open = True
        if self._offsets_first and positions:
            self._call = ("send_offsets_to_transaction", time.monotonic())
            producer.send_offsets_to_transaction(positions, metadata, TIMEOUT_S)
            self._call = None
        sent = time.monotonic()
        acknowledged = self._on_delivery
        for unit in units:
            for topic, key, value, partition, headers in unit.records():
                if acknowledged and topic in acknowledged:
                    produce(
                        topic,
                        key=key,
                        value=value,
                        partition=-1 if partition is None else partition,
                        headers=headers,
                        on_delivery=acknowledged[topic],
                    )
                elif partition is None:
                    produce(topic, key=key, value=value, headers=headers)
                else:
                    produce(topic, key=key, value=value, partition=partition, headers=headers)
        produced = time.monotonic()
        if not self._offsets_first and positions:
            self._call = ("send_offsets_to_transaction", time.monotonic())
            producer.send_offsets_to_transaction(positions, metadata, TIMEOUT_S)
            self._call = None
            sent = time.monotonic()
        for unit in units:
            unit.durable()
        durable = time.monotonic()
        flushed = self._commit(producer)
        self._open = False
        self._producers.committed()
        ended = time.monotonic()
        self._on_commit(units, Timings(began, sent, produced, durable, flushed, ended))


def _position(topic: str, partition: int, offset: int, note: str | None) -> TopicPartition:
    if note is None:  # the client takes no None for its metadata
        return TopicPartition(topic, partition, offset)
    return TopicPartition(topic, partition, offset, metadata=note)


__all__ = [
    "Backoff",
    "ClientConfig",
    "Clients",
    "Committer",
    "Failure",
    "Fault",
    "Headers",
    "Outgoing",
    "Record",
    "Timings",
    "Watermarked",
    "classify",
    "committed_offsets",
    "committed_positions",
    "fatal_error",
    "is_fatal",
    "kafka_error",
    "seek",
    "watermarks",
]
