"""What our Kafka clients share: the transactional producers' settings and ids used in turn, the
long-lived consumers' fetch settings, bounded commit, release and close."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

from agentruns.streams.consumer_lag import lag_settings
from agentruns.streams.errors import AgentrunsKafkaError
from agentruns.streams.kafka_logs import KAFKA_LOG

log = logging.getLogger("agentruns.kafka")

#: In every client config of ours, producers, consumers and admin clients alike: librdkafka's log
#: lines go to the ``agentruns.kafka`` logger, rate limited (see ``kafka_logs``), never straight
#: to stderr.
KAFKA_LOGS: dict[str, Any] = {"logger": KAFKA_LOG}

#: The operator's client properties (security: SASL, TLS), set once when the process starts
#: (`use_client_properties`).
_CLIENT_PROPERTIES: dict[str, str] = {}


def use_client_properties(properties: Mapping[str, str]) -> None:
    """From now on every client of this process is made with ``properties`` (librdkafka
    settings: ``security.protocol``, ``sasl.*``, ``ssl.*``, ...)."""
    _CLIENT_PROPERTIES.clear()
    _CLIENT_PROPERTIES.update(properties)


def client_properties() -> dict[str, str]:
    """The operator's client properties in force (`use_client_properties`)."""
    return dict(_CLIENT_PROPERTIES)


def _on_error(error: KafkaError) -> None:
    # librdkafka retries a refused login for ever, one log line after another; the caller of
    # poll/consume/flush gets this instead and the command ends with one line.
    if error.code() == KafkaError._AUTHENTICATION:
        raise AgentrunsKafkaError(
            f"Kafka refused the client's credentials: {error.str()}",
            hint="check sasl.username/sasl.password (or the TLS settings) in the file "
            "AGENTRUNS_KAFKA_CONFIG names",
        )


def client_settings() -> dict[str, Any]:
    """What every client config of ours (producers, consumers, admin clients) is made of, before
    its own settings: the log routing (`KAFKA_LOGS`), the operator's client properties, and a
    refused login ending the command."""
    return {**KAFKA_LOGS, **_CLIENT_PROPERTIES, "error_cb": _on_error}


#: librdkafka's log level for a service's long-lived group consumer: warnings as well as errors
#: (routed and rate limited, see ``kafka_logs``). A member that leaves its group on its own
#: ("Application maximum poll interval exceeded", a session lost) says so only as a warning.
GROUP_CONSUMER_LOG_LEVEL = 4


def group_consumer(group_id: str) -> dict[str, Any]:
    """What every long-lived group consumer of ours has beside its own settings: its log level
    (`GROUP_CONSUMER_LOG_LEVEL`) and librdkafka's statistics, which give its lag per partition
    to the metrics (`consumer_lag`)."""
    return {"log_level": GROUP_CONSUMER_LOG_LEVEL, **lag_settings(group_id)}


#: In every long-lived client of ours. librdkafka leaves Nagle's algorithm on (the Java client
#: sets TCP_NODELAY on every connection), so a request written while an earlier one on the
#: connection is unacknowledged, such as the next of a transaction's produce requests, waits
#: for that acknowledgement. Five interleaved processor-bench pairs with it on the processor's
#: clients: latency p99 lower in 5 of 5 (62-93 against 75-102 ms), p50 in 4 of 5; executors
#: bench, eight pairs: no difference beyond the noise.
NO_DELAY: dict[str, Any] = {"socket.nagle.disable": True}

#: In every producer of ours that writes a record without choosing its partition (dead
#: letters): Kafka's default partitioner, the Java client's murmur2 of the key (random for a null
#: key), not librdkafka's default (CRC32). So a dead letter keyed by its run id lands on
#: ``partition_for(run_id, n)``, the run's partition of every other topic.
KEYED_PARTITIONER: dict[str, Any] = {"partitioner": "murmur2_random"}

TRANSACTIONAL_PRODUCER: dict[str, Any] = {
    **NO_DELAY,
    **KEYED_PARTITIONER,
    **KAFKA_LOGS,
    "enable.idempotence": True,
    # Right after a commit the coordinator is still writing that transaction's markers and
    # answers the next AddOffsetsToTxn/AddPartitionsToTxn with CONCURRENT_TRANSACTIONS;
    # librdkafka retries after retry.backoff.ms, 100 ms by default. That wait was most of every
    # transaction here: send_offsets_to_transaction p50 112 ms -> 22 ms with 10 ms (one
    # producer, local broker, 60 back-to-back transactions). The Java client retries these
    # after 20 ms for the same reason (KAFKA-5477).
    "retry.backoff.ms": 10,
}


#: ``fetch.wait.max.ms`` of every long-lived consumer: how long the broker holds a fetch that
#: finds nothing new. A new record, or a transaction's commit marker for a read_committed
#: reader, answers a held fetch at once (visibility after a commit measured p50 1.5-2 ms with
#: 10, 100 and 500 alike), while each empty answer costs the broker a request: one idle consumer
#: at 10 ms took 0.11 of a core of the local broker on our 2-core machines (~100 fetches/s), at
#: 100 nothing measurable. Not longer: a seek (a rewind) can wait for the held fetch (1 seek in
#: 10 did, measured). Readers that stop at the end of each partition live for one read and keep
#: their short wait.
LONG_POLL_MS = 100

#: ``fetch.min.bytes`` of a consumer that fetches in windows: the broker answers a window early
#: once this much waits. ~7 inputs that submit a run (1.1-1.2 KB each): at 1,000 of them a second
#: a window ends after ~7 ms instead of 20 (ten interleaved processor-bench pairs: latency p99
#: lower in 4 of the 5 the host left undisturbed), while a consumer at a trickle, or idle, still
#: fetches once per window. A backlog is answered at once.
FETCH_WINDOW_BYTES = 8 << 10


def fetch_settings(window_ms: int) -> dict[str, int]:
    """A long-lived consumer's fetch settings: records in windows of ``window_ms`` (the broker
    answers when the window ends or FETCH_WINDOW_BYTES wait), or with 0 each as it lands (long
    poll)."""
    if window_ms <= 0:
        return {"fetch.wait.max.ms": LONG_POLL_MS}
    return {"fetch.wait.max.ms": window_ms, "fetch.min.bytes": FETCH_WINDOW_BYTES}


def partition_count(client: Producer | Consumer, topic: str, timeout_s: float = 30.0) -> int:
    """How many partitions ``topic`` has; a clear error if it does not exist."""
    info = client.list_topics(topic, timeout=timeout_s).topics.get(topic)
    if info is None or info.error is not None or not info.partitions:
        raise AgentrunsKafkaError(
            f"topic {topic} does not exist",
            hint="create the topics first: agentruns topics create",
        )
    return len(info.partitions)


def commit_timed(producer: Producer, timeout_s: float = 30.0) -> float:
    """Commit the producer's open transaction within ``timeout_s``; return when its records
    were all acknowledged (``time.monotonic()``), so callers time the two waits apart: the
    produce requests (one per partition, served one at a time on a broker connection) and
    EndTxn. commit_transaction would flush anyway; the flush first takes nothing longer."""
    deadline = time.monotonic() + timeout_s
    producer.flush(timeout_s)
    flushed = time.monotonic()
    # what is left of the one bound (commit_transaction raises if it cannot finish in time)
    producer.commit_transaction(max(deadline - flushed, 0.001))
    return flushed


def release(producer: Producer, timeout_s: float = 5.0) -> int:
    """Stop ``producer`` now: its threads and broker connections end here, not whenever the last
    reference goes (one left alive keeps reconnecting to a stopped broker, a logged error each
    time, until its process exits). Records still unacknowledged after ``timeout_s`` are purged
    and their number returned: ``Producer.close()`` alone would wait for them without bound.
    Callers that must not lose records flush and check first. Releasing twice is harmless, and
    so is releasing a producer in a fatal state: closing aborts its open transaction, which a
    fenced producer cannot do (the broker aborts it anyway), and that error must not replace
    the one the caller is stopping for."""
    try:
        left = producer.flush(timeout_s)
    except RuntimeError:  # "Producer has been closed": released before
        return 0
    except KafkaException as exc:
        log.info("releasing a producer in a failed state: %s", exc)
        left = len(producer)
    if left:
        producer.purge()
        producer.poll(0)  # serve the purged records' delivery reports
    close = getattr(producer, "close", None)  # recent confluent-kafka only; not in its stubs
    if close is not None:
        try:
            # closing aborts an open transaction; one that cannot be (fenced, or an abort
            # still in progress) is only warned about: the broker aborts it anyway
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                close()
        except KafkaException as exc:
            log.info("closing a producer in a failed state: %s", exc)
    return left


def close_consumer(consumer: Consumer, timeout_s: float = 30.0) -> bool:
    """Close ``consumer`` (leave its group, commit what its revoke callback commits) within
    ``timeout_s``; return whether it closed in time.

    librdkafka's close waits for its group handler, which keeps looking for an unreachable
    coordinator without end while a commit is pending (librdkafka#3740): one lost broker must
    not keep a process from stopping. The close runs in a daemon thread; one that does not
    finish in time is logged and left to the process's exit. An error the close raised (a
    revoke callback's, for one) is raised here. Closing twice is harmless."""
    failed: list[BaseException] = []

    def close() -> None:
        try:
            consumer.close()
        except RuntimeError:  # "Consumer closed": closed before
            pass
        except BaseException as exc:  # handed to the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=close, name="consumer-close", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning("a consumer did not close within %.0f s; left to the process's exit", timeout_s)
        return False
    if failed:
        raise failed[0]
    return True


class ProducerPair:
    """Two transactional producers (ids `<base>-a`, `<base>-b`), used in turn by one committer:
    never two transactions at once.

    A transaction begun on the id that has just committed finds the coordinator still writing
    that commit's markers: its AddPartitionsToTxn/AddOffsetsToTxn are refused
    (CONCURRENT_TRANSACTIONS) and retried, and its records sit unsent meanwhile (~20 ms of a
    ~45 ms processor transaction in a librdkafka debug log). The other id's last transaction
    ended a whole turn ago.
    """

    SLOTS = ("a", "b")

    def __init__(self, new: Callable[[str], Producer]) -> None:
        self._new = new  # slot -> an initialized transactional producer
        self._producers = [new(slot) for slot in self.SLOTS]
        self._turn = 0

    @property
    def current(self) -> Producer:
        """The producer of the next (or the open) transaction."""
        return self._producers[self._turn]

    def committed(self) -> None:
        """The current producer's transaction committed: the next one uses the other."""
        self._turn = 1 - self._turn

    def close(self, timeout_s: float = 5.0) -> None:
        """Release both producers (see :func:`release`); the pair is unusable afterwards."""
        for producer in self._producers:
            release(producer, timeout_s)

    def replace_current(self) -> None:
        """After a fatal error (fenced), or an abort that could not finish: a new producer for
        the current slot (its `init_transactions` fences the old one); the old one released."""
        old = self._producers[self._turn]
        release(old, 0)
        self._producers[self._turn] = self._new(self.SLOTS[self._turn])
