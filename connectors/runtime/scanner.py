"""`agentruns scan`: the fallback scanner (R26) for runs without progress.

Results wake a run at once; this scanner is the safety net. It looks for non-terminal runs whose
last event is older than a threshold (from the Postgres projection), works out what each one is
waiting for, and checks whether anyone is working on it: the consumer group lag of the executor
that owns the run's pending effect, and due timers not yet fired. Each stuck run gets a diagnosis
line (and a Prometheus counter in `--every` mode). A person's pending answer is not "stuck": it is
user wait (R16), reported separately.

Re-driving: effects are durable in Kafka and executors resume from their committed offsets, so
work is never lost while a component is down; what the scanner re-drives is time. A stuck run
whose due timer has not fired (timer service down) gets that timer fired again by producing the
same deterministic TimerFired input the timer service would (`--redrive`); the processor drops it
if the timer already fired.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import psycopg
from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client import Counter

from agentruns.connectors import health
from agentruns.connectors.projection.stuck import stuck_condition
from agentruns.connectors.runtime.timers import fired_input
from agentruns.connectors.service import run_service
from agentruns.streams import clock
from agentruns.streams.access import executor_group
from agentruns.streams.codec import encode
from agentruns.streams.kafka_defaults import client_settings, close_consumer
from agentruns.streams.partitioning import partition_for
from agentruns.streams.topics import INBOX, default_prefix, effect_suffix, topic_name

STUCK = Counter("agentruns_stuck_runs_total", "Runs found without progress by the scanner")
WAITING_ON = {
    "MODEL_RUNNING": "model",
    "READY": "model",
    "TOOL_RUNNING": "tool",
    "WAITING_TOOL": "tool",
}


@dataclass
class Diagnosis:
    run_id: str
    status: str
    idle_s: float
    waiting_on: str
    detail: str
    redriven: int = 0


def group_lag(bootstrap: str, group: str, topic: str) -> int | None:
    """Messages of `topic` not yet committed by `group`; None when the group never committed."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            **client_settings(),
            "group.id": group,
            "enable.auto.commit": False,
            "log_level": 3,
        }
    )
    try:
        meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if meta is None:
            return None
        parts = [TopicPartition(topic, p) for p in meta.partitions]
        committed = consumer.committed(parts, timeout=10)
        if all(tp.offset < 0 for tp in committed):
            return None
        lag = 0
        for tp in committed:
            high = consumer.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=10)[
                1
            ]
            lag += high - max(tp.offset, 0)
        return lag
    finally:
        close_consumer(consumer)


def scan(
    bootstrap: str,
    database_url: str,
    *,
    prefix: str = "agentruns",
    stale_after_s: float = 60.0,
    redrive: bool = False,
    now_ms: int | None = None,
) -> list[Diagnosis]:
    now = clock.now_ms() if now_ms is None else now_ms
    condition, params = stuck_condition(now, stale_after_s)
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT run_id, status, extract(epoch FROM last_event_at) * 1000, state"
            f" FROM runs WHERE {condition} ORDER BY last_event_at",
            params,
        ).fetchall()
    lags: dict[str, int | None] = {}
    found: list[Diagnosis] = []
    producer: Producer | None = None
    for run_id, status, last_ms, state_text in rows:
        state = json.loads(state_text)  # runs.state is text (migration 0006)
        idle = (now - float(last_ms)) / 1000
        # The run's own pending timers (from its projected state): a due one that has not
        # fired means the timer service is down or behind; the timers table may not even
        # have it yet.
        overdue = [
            (t["timer_id"], (t["due_at"], state["trace_id"]))
            for t in state.get("timers", [])
            if t["due_at"] <= now
        ]
        kind = WAITING_ON.get(status)
        if overdue:
            waiting, detail = "timer", f"{len(overdue)} due timer(s) not fired: timer service down?"
        elif kind is not None:
            topic = topic_name(effect_suffix(kind), prefix)
            if kind not in lags:
                lags[kind] = group_lag(bootstrap, executor_group(prefix, kind), topic)
            lag = lags[kind]
            waiting = f"{kind} executor"
            if lag is None:
                detail = f"no {kind} executor has ever consumed {topic}"
            elif lag > 0:
                detail = f"{lag} effects waiting in {topic}: {kind} executor down or slow"
            else:
                detail = f"{topic} fully consumed but no result: look at the {kind} executor log"
        else:
            waiting, detail = status.lower(), "no progress (paused or waiting on input)"
        diagnosis = Diagnosis(run_id, status, round(idle, 1), waiting, detail)
        if redrive and overdue:
            producer = producer or Producer({"bootstrap.servers": bootstrap, **client_settings()})
            inbox = producer.list_topics(timeout=10).topics[topic_name(INBOX, prefix)]
            partitions = len(inbox.partitions)
            for timer_id, (due_at, trace_id) in overdue:
                record = fired_input((run_id, timer_id, due_at, trace_id))
                producer.produce(
                    topic_name(INBOX, prefix),
                    key=run_id.encode(),
                    value=encode("Input", record),
                    partition=partition_for(run_id, partitions),
                )
                diagnosis.redriven += 1
        found.append(diagnosis)
        STUCK.inc()
    if producer is not None:
        producer.flush(30)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns scan", description=__doc__)
    parser.add_argument("--prefix", default=default_prefix())
    parser.add_argument("--stale-after", type=float, default=60.0, help="seconds without progress")
    parser.add_argument("--redrive", action="store_true", help="fire overdue timers again")
    parser.add_argument("--every", type=float, help="scan every SECONDS until stopped")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--log-level", default=os.environ.get("AGENTRUNS_LOG_LEVEL", "INFO"))
    health.add_arguments(parser)  # with --every
    args = parser.parse_args(list(argv) if argv is not None else None)
    service = run_service(
        args, "scanner", serve_health=args.every is not None, consumer=False, migrations=False
    )
    with service as running:
        ep, stop = running.endpoints, running.stop
        running.serving_loop()
        while True:
            found = scan(
                ep.kafka_bootstrap,
                ep.database_url,
                prefix=args.prefix,
                stale_after_s=args.stale_after,
                redrive=args.redrive,
            )
            for d in found:
                if args.json:
                    print(json.dumps(asdict(d)), flush=True)
                else:
                    print(
                        f"{d.run_id}  {d.status}  idle {d.idle_s:.0f}s  waiting on "
                        f"{d.waiting_on}: {d.detail}"
                        + (f" (re-drove {d.redriven} timers)" if d.redriven else ""),
                        flush=True,
                    )
            if args.every is None or stop.wait(args.every):
                break
    if args.every is None and not found:
        print("no run without progress", flush=True)
    return 0


__all__ = ["Diagnosis", "group_lag", "main", "scan"]


if __name__ == "__main__":
    from agentruns.connectors.lifecycle import run_command

    raise SystemExit(run_command(main))
