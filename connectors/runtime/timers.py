"""`agentruns timer`: the only way time enters the core (R1).

Consumes `effects.timer` (ScheduleTimer, CancelTimer; AskUser records are the API's business
and are skipped here) into the Postgres `timers` table, committing the consumed offsets only
after the rows are committed (at-least-once in, idempotent upserts). A firing loop produces one
`TimerFired` input per due timer to the run's inbox partition, then marks it fired.

Exactly once as the processor sees it: the input of a timer is a pure function of the timer
(input_id `<timer_id>:fired`, `at` = its due time), so a re-fire after a crash between the
produce and the mark is byte-identical and the processor drops it as an exact duplicate; a timer
for a run that moved on is recorded by the core as LATE and changes nothing. Several timer
processes may run: the consumer group splits the effect partitions, and firing claims rows with
`FOR UPDATE SKIP LOCKED`.

Hostile input: an effect the service cannot ingest (undecodable, a due time outside
`agentruns.processors.limits.MAX_TIME_MS`, a row Postgres refuses) becomes a dead-letter record on
`<prefix>.dlq` with its reason, and the next effects are ingested. Each effect is written in its
own savepoint, so one bad row never takes the batch with it. A database or broker that is away
is waited for with capped exponential backoff, on the same consumed batch.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import psycopg
from confluent_kafka import Consumer, KafkaException, Message, Producer
from prometheus_client import Counter, Histogram

from agentruns.connectors import dead_letters, health
from agentruns.connectors.service import run_service
from agentruns.connectors.settings import current
from agentruns.processors.effects import CancelTimer, ScheduleTimer
from agentruns.processors.events import TimerFired
from agentruns.processors.limits import MAX_TIME_MS
from agentruns.streams import dlq
from agentruns.streams.access import timer_group
from agentruns.streams.admin import ensure_topics
from agentruns.streams.clock import now_ms
from agentruns.streams.codec import CodecError, decode, encode
from agentruns.streams.kafka_defaults import (
    KEYED_PARTITIONER,
    LONG_POLL_MS,
    NO_DELAY,
    client_settings,
    close_consumer,
    group_consumer,
    partition_count,
    release,
)
from agentruns.streams.membership import Membership
from agentruns.streams.partitioning import partition_for
from agentruns.streams.polling import check_fatal
from agentruns.streams.records import input_record, parse_effect_body
from agentruns.streams.topics import DLQ, INBOX, default_prefix, effect_suffix, topic_name

log = logging.getLogger("agentruns.timer")
Conn = psycopg.Connection[tuple[Any, ...]]

#: Backoff of the retry loop while Postgres or the broker is away: first wait, and its cap.
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 5.0
DUE_AT_OUT_OF_RANGE = "invalid_input:due_at_out_of_range"

TIMER_RECORDS = Counter("agentruns_timer_records_total", "Timer effect records consumed")
TIMER_EFFECTS = Counter(
    "agentruns_timer_effects_total",
    "Timer effects ingested, by outcome (scheduled, cancelled, ignored, dead_letter)",
    ["outcome"],
)
TIMERS_FIRED = Counter("agentruns_timers_fired_total", "Due timers fired into the inbox")
TIMER_FIRE_DELAY = Histogram(
    "agentruns_timer_fire_delay_seconds",
    "From a timer's due time to the commit of its firing",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
TIMER_FIRE_SECONDS = Histogram(
    "agentruns_timer_fire_seconds",
    "Time to fire one round of due timers (produce, flush, mark fired)",
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
TIMER_RETRIES = Counter(
    "agentruns_timer_retries_total", "Batches retried while Postgres or the broker was away"
)


class Refused(Exception):
    """An effect the timer service cannot ingest; `reason` and `error_class` go to its dead
    letter."""

    def __init__(self, reason: str, error_class: str = dlq.INVALID_EVENT) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error_class = error_class


def refusal(exc: Exception) -> Refused:
    """Why an effect could not be ingested, as a dead letter states it."""
    if isinstance(exc, Refused):
        return exc
    if isinstance(exc, CodecError):
        return Refused(str(exc), exc.error_class)
    if isinstance(exc, msgspec.MsgspecError):
        return Refused(f"invalid_input:effect_body: {exc}")
    if isinstance(exc, psycopg.Error):
        return Refused(f"invalid_input:unstorable: {dead_letters.first_line(exc)}")
    return Refused(f"invalid_input:effect: {dead_letters.first_line(exc)}")


def fired_input(row: tuple[Any, ...]) -> dict[str, Any]:
    """The inbox input of a due timer: deterministic, so a re-fire is an exact duplicate."""
    run_id, timer_id, due_at, trace_id = row[:4]
    event = TimerFired(
        run_id=run_id, event_id=f"{timer_id}:fired", at=due_at, trace_id=trace_id, timer_id=timer_id
    )
    return input_record(event)


class TimerService:
    def __init__(
        self,
        bootstrap: str,
        database_url: str,
        *,
        prefix: str = "agentruns",
        group_id: str = "",
        instance_id: str = "0",
        tick_ms: int = 50,
    ) -> None:
        self.bootstrap = bootstrap
        self.database_url = database_url
        self.prefix = prefix
        self.tick = tick_ms / 1000
        self.inbox = topic_name(INBOX, prefix)
        self.dlq = topic_name(DLQ, prefix)
        group_id = group_id or timer_group(prefix)  # one group per deployment prefix
        self.group_id = group_id
        self.membership = Membership()  # what /healthz reports
        self.fired = 0
        self.scheduled = 0
        self.dead_letters = 0
        self.retries = 0
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                **client_settings(),
                "group.id": group_id,
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "fetch.wait.max.ms": LONG_POLL_MS,
                "session.timeout.ms": 6000,
                "heartbeat.interval.ms": 1000,
                # Static membership: a restarted timer service resumes its partitions at once.
                "group.instance.id": f"{group_id}-{instance_id}",
                **NO_DELAY,
                **group_consumer(group_id),
            }
        )
        self._producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                **client_settings(),
                "enable.idempotence": True,
                "linger.ms": 2,
                **NO_DELAY,
                **KEYED_PARTITIONER,
            }
        )
        self.partitions = partition_count(self._producer, self.inbox)
        self._conn: Conn | None = None

    def _db(self) -> Conn:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.database_url)
        return self._conn

    def run(self, stop: threading.Event) -> None:
        self._consumer.subscribe(
            [topic_name(effect_suffix("timer"), self.prefix)],
            on_assign=lambda _c, partitions: self.membership.assigned(partitions),
            on_revoke=lambda _c, _partitions: self.membership.revoked(),
        )
        backoff = RETRY_FIRST_S
        pending: list[Message] | None = None  # consumed, not yet ingested: kept across retries
        try:
            while not stop.is_set():
                try:
                    if pending is None:
                        pending = check_fatal(self._consumer.consume(500, self.tick), self.group_id)
                    self._ingest(pending)
                    pending = None
                    self._fire_due()
                    backoff = RETRY_FIRST_S
                except (psycopg.OperationalError, KafkaException) as exc:
                    # Postgres restarting or the broker away: the same batch is ingested again.
                    log.warning("%s; retrying in %.1fs", dead_letters.first_line(exc), backoff)
                    self.retries += 1
                    TIMER_RETRIES.inc()
                    self._drop_db()
                    stop.wait(backoff)
                    backoff = min(backoff * 2, RETRY_MAX_S)
        finally:
            self.close()

    def _drop_db(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
        self._conn = None

    def _ingest(self, messages: list[Message]) -> None:
        """Write the batch's timer effects in one transaction, each in its own savepoint; an
        effect that cannot be ingested is dead-lettered (flushed before the rows and offsets
        commit) and the rest go on."""
        if not messages:
            return
        dead: list[dict[str, Any]] = []
        outcomes: dict[str, int] = {}
        conn = self._db()
        with conn.transaction():
            for msg in messages:
                if msg.error() is not None or msg.value() is None:
                    continue
                try:
                    with conn.transaction():
                        outcome = self._apply(conn, msg)
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
                except Exception as exc:  # the one guard: this effect, and only it, is refused
                    if isinstance(exc, psycopg.OperationalError) and (conn.broken or conn.closed):
                        raise  # Postgres away, not the effect: the whole batch again, later
                    refused = refusal(exc)
                    log.error("timer effect at offset %s refused: %s", msg.offset(), refused.reason)
                    dead.append(
                        dead_letters.of_message(
                            msg, refused.reason, refused.error_class, record="Effect"
                        )
                    )
            dead_letters.send(self._producer, self.dlq, dead, component="timer")
        self.dead_letters += len(dead)
        # counted once the batch is in: a batch retried after an outage counts once
        TIMER_RECORDS.inc(len(messages))
        if dead:
            outcomes["dead_letter"] = len(dead)
        for outcome, n in outcomes.items():
            TIMER_EFFECTS.labels(outcome).inc(n)
        try:
            self._consumer.commit(asynchronous=False)
        except KafkaException as exc:
            log.warning("offset commit failed (rows are idempotent, will re-read): %s", exc)

    def _apply(self, conn: Conn, msg: Message) -> str:
        """Ingest one effect; returns its outcome (`agentruns_timer_effects_total`)."""
        effect = parse_effect_body(decode(msg.value() or b"", "Effect").record["body"])
        if isinstance(effect, ScheduleTimer):
            if not 0 <= effect.due_at <= MAX_TIME_MS:
                raise Refused(DUE_AT_OUT_OF_RANGE)
            conn.execute(
                "INSERT INTO timers"
                " (run_id, timer_id, purpose, due_at, trace_id, step, attempt, prefix)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (prefix, run_id, timer_id)"
                " DO NOTHING",
                (
                    effect.run_id,
                    effect.timer_id,
                    str(effect.purpose),
                    effect.due_at,
                    effect.trace_id,
                    effect.step,
                    effect.attempt,
                    self.prefix,
                ),
            )
            self.scheduled += 1
            return "scheduled"
        if isinstance(effect, CancelTimer):
            conn.execute(
                "UPDATE timers SET cancelled = true WHERE prefix IN (%s, '')"
                " AND run_id = %s AND timer_id = %s AND fired_at IS NULL",
                (self.prefix, effect.run_id, effect.timer_id),
            )
            return "cancelled"
        return "ignored"

    def _fire_due(self) -> None:
        began = time.monotonic()
        conn = self._db()
        with conn.transaction():
            rows = conn.execute(
                "SELECT run_id, timer_id, due_at, trace_id, prefix FROM timers"
                " WHERE prefix IN (%s, '') AND fired_at IS NULL AND NOT cancelled"
                " AND due_at <= %s ORDER BY due_at LIMIT 500 FOR UPDATE SKIP LOCKED",
                (self.prefix, now_ms()),
            ).fetchall()
            if not rows:
                return
            for row in rows:
                record = fired_input(row)
                self._producer.produce(
                    self.inbox,
                    key=record["run_id"].encode(),
                    value=encode("Input", record),
                    partition=partition_for(record["run_id"], self.partitions),
                )
            if self._producer.flush(30) != 0:
                raise KafkaException("timer inputs not delivered within 30 s")
            conn.cursor().executemany(
                "UPDATE timers SET fired_at = %s"
                " WHERE prefix = %s AND run_id = %s AND timer_id = %s",
                [(now_ms(), r[4], r[0], r[1]) for r in rows],
            )
        self.fired += len(rows)
        TIMERS_FIRED.inc(len(rows))
        TIMER_FIRE_SECONDS.observe(time.monotonic() - began)
        fired_at = now_ms()
        for row in rows:
            TIMER_FIRE_DELAY.observe(max(0, fired_at - row[2]) / 1000)
        log.info("fired %d timers", len(rows))

    def close(self) -> None:
        close_consumer(self._consumer)
        release(self._producer, 10)
        if self._conn is not None:
            self._conn.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns timer", description=__doc__)
    parser.add_argument("--prefix", default=default_prefix())
    parser.add_argument("--group", default="", help="consumer group (default <prefix>-timer)")
    parser.add_argument("--instance-id", default=current().instance_id)
    parser.add_argument("--tick-ms", type=int, default=50)
    parser.add_argument("--log-level", default=current().log_level)
    health.add_arguments(parser)
    args = parser.parse_args(list(argv) if argv is not None else None)
    with run_service(args, "timer") as running:
        ep, status = running.endpoints, running.health
        assert status is not None
        ensure_topics(ep.kafka_bootstrap, prefix=args.prefix)
        service = TimerService(
            ep.kafka_bootstrap,
            ep.database_url,
            prefix=args.prefix,
            group_id=args.group,
            instance_id=args.instance_id,
            tick_ms=args.tick_ms,
        )
        status.watch_consumer(service.membership, service.group_id)
        running.serving_loop()
        service.run(running.stop)
    return 0


if __name__ == "__main__":
    from agentruns.connectors.lifecycle import run_command

    raise SystemExit(run_command(main))
