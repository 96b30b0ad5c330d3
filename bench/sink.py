"""``agentruns bench sink``: how fast the Postgres projection keeps up with the run log.

Run logs are produced the way the processor produces them: realistic runs (the simulated world
of ``agentruns.connectors.dev.servers.workload``) are folded with the real core and written as
Event, Snapshot and Result records in Kafka transactions
(``agentruns.connectors.dev.servers.log_writer.LogWriter``).

Three phases; the first two with one sink (``agentruns.connectors.projection.sink.Sink``, in a
thread):

* throughput: a backlog of ``--events`` events is written first; the sink projects it from
  scratch; events/s = events / time to the last commit;
* lag: the writer paces ``--rate`` events/s for ``--seconds`` in 50 ms transactions (as the
  processor commits); lag = time the sink's Postgres commit made the row visible minus the time
  the Kafka transaction holding the event committed (both ``time.time()`` on this machine, taken
  when each commit call returned). An event the sink never made visible counts with the lag it
  had when the bench gave up waiting, so a stalled sink cannot improve the percentiles;
* scale-out (``--sinks N``, default 2; 1 skips it): N ``agentruns sink`` processes in one
  group project another backlog of the same size (see :func:`scale_out`): the way to use more
  than the one core a sink's interpreter can.

The CPU split: the sink's process CPU per event in the backlog phase, and the core fold alone
(``parse_event_body`` + ``transition`` over the same events, timed in this process afterwards);
the difference is what the sink adds (consume, decode, rows, COPY; not Postgres' own CPU).

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
from confluent_kafka import ConsumerGroupState, KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from agentruns.bench.broker import broker_settings
from agentruns.bench.core import host_speed
from agentruns.bench.latency import percentile
from agentruns.bench.machine import MachineCpu, process_cpu_seconds, scrape
from agentruns.bench.targets import Target, evaluate
from agentruns.connectors.dev.servers.log_writer import LogWriter, Record
from agentruns.connectors.dev.servers.workload import interleave, simulate
from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.connectors.lifecycle import progress
from agentruns.processors.events import Event
from agentruns.processors.state import RunState
from agentruns.processors.transition import transition
from agentruns.streams.admin import ensure_topics
from agentruns.streams.interpreter import tune_gc
from agentruns.streams.kafka_defaults import client_settings
from agentruns.streams.records import (
    event_body,
    parse_event_body,
)
from agentruns.streams.topics import EVENTS, topic_name


def make_runs(count_events: int, tag: str, seed: int = 7) -> list[list[Event]]:
    """Realistic run logs totalling at least ``count_events`` events; run ids start with tag."""
    rng = random.Random(seed)
    runs: list[list[Event]] = []
    total = 0
    i = 0
    while total < count_events:
        steps = rng.randint(2, 12)
        log = simulate(rng, f"{tag}-{i:05d}", steps=steps)
        runs.append(log)
        total += len(log)
        i += 1
    return runs


def paced_writer(
    bootstrap: str, prefix: str, partitions: int, tag: str, rate: int, seconds: float
) -> tuple[list[tuple[str, int, float]], float]:
    """Write `rate` events/s for `seconds` in 50 ms transactions (new runs named tag-*);
    returns every (run_id, seq, commit time) and the wall time it took."""
    writer = LogWriter(bootstrap, prefix, partitions)
    runs = make_runs(int(rate * seconds), tag, seed=13)
    paced = interleave(runs, random.Random(17))[: int(rate * seconds)]
    interval = 0.05
    per_txn = max(1, int(rate * interval))
    planned: list[tuple[list[Record], list[tuple[str, int]]]] = []
    for first in range(0, len(paced), per_txn):
        records = writer.plan(paced[first : first + per_txn])
        planned.append((records, writer.planned))
    committed: list[tuple[str, int, float]] = []
    start = time.monotonic()
    for n, (records, keys) in enumerate(planned):
        pause = start + n * interval - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        at = writer.send(records)
        committed.extend((run_id, seq, at) for run_id, seq in keys)
    wall = time.monotonic() - start
    writer.close()
    return committed, wall


def core_fold_seconds(events: Sequence[Event]) -> float:
    """CPU seconds the core alone needs to fold `events` as the sink does (parse each body,
    then transition), best of three."""
    bodies = [(e.run_id, event_body(e)) for e in events]
    best = float("inf")
    for _ in range(3):
        states: dict[str, RunState | None] = {}
        began = time.process_time()
        for run_id, body in bodies:
            result = transition(states.get(run_id), parse_event_body(body))
            if result.state is not None:
                states[run_id] = result.state
        best = min(best, time.process_time() - began)
    return best


_COORDINATOR = (
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
)


def _assigned(admin: AdminClient, group: str) -> int:
    """How many partitions the members of `group` hold now (0 while it rebalances, while the
    group's coordinator is still being found or loaded, or while the broker does not answer)."""
    try:
        described = admin.describe_consumer_groups([group])[group].result(timeout=10)
    except concurrent.futures.TimeoutError:
        return 0  # a broker that has just started may not answer within 10 s
    except KafkaException as exc:
        error = exc.args[0] if exc.args else None
        if isinstance(error, KafkaError) and (error.retriable() or error.code() in _COORDINATOR):
            return 0
        raise
    if str(described.state) != str(ConsumerGroupState.STABLE):
        return 0
    return sum(len(m.assignment.topic_partitions) for m in described.members)


def scale_out(
    bootstrap: str, database_url: str, *, sinks: int, events: int, partitions: int
) -> dict[str, Any]:
    """`sinks` `agentruns sink` processes in one group project a backlog of `events`.

    The sinks start on empty topics and join the group first; the backlog is then written in
    ONE Kafka transaction (planned as `LogWriter.write` would, 500 events per snapshot round),
    so read_committed consumers see all of it at the instant it commits: the clock starts
    there, with no process start-up or group join inside it, and stops when the sinks' stored
    positions in the events topic (`sink_offsets`, committed with the rows) sum to the number
    of events, read every 50 ms: the topics are new and hold one transaction, so its events
    sit at offsets 0..n-1 of each partition. Reading Postgres costs the sinks nothing; a
    metrics scrape cost ~2 ms of a sink's interpreter, ~4% of a core at 20 per second."""
    tag = f"bx{uuid.uuid4().hex[:6]}"
    prefix = f"bench-sink-{tag}"
    group = f"{prefix}-sink"
    ensure_topics(bootstrap, prefix=prefix, partitions=partitions)
    base = free_port_block(sinks)
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap, "DATABASE_URL": database_url}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentruns.connectors.projection.sink",
                *("--prefix", prefix, "--group", group, "--instance-id", f"bench-{i}"),
                *("--metrics-port", str(base + i), "--log-level", "WARNING"),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        for i in range(sinks)
    ]
    try:
        deadline = time.monotonic() + 120
        admin = AdminClient({"bootstrap.servers": bootstrap, **client_settings(), "log_level": 0})
        while _assigned(admin, group) < 3 * partitions or any(
            scrape(base + i, "agentruns_sink_events_total") is None for i in range(sinks)
        ):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{sinks} sink processes did not join group {group}")
            time.sleep(0.1)
        backlog = interleave(make_runs(events, f"{tag}-a"), random.Random(23))
        writer = LogWriter(bootstrap, prefix, partitions)
        records = [
            r for i in range(0, len(backlog), 500) for r in writer.plan(backlog[i : i + 500])
        ]
        events_topic = topic_name(EVENTS, prefix)
        expected = sum(1 for r in records if r[0] == events_topic)
        with psycopg.connect(database_url, autocommit=True) as conn:
            began = writer.send(records)
            # from the commit on: the sinks only polled an empty read_committed view before it
            cpu_before = [process_cpu_seconds(p.pid) for p in procs]
            machine = MachineCpu.start({p.pid: "sink" for p in procs})
            projected = 0
            while projected < expected:
                if time.monotonic() > deadline + 600 or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"the sinks projected {projected} of {expected}")
                time.sleep(0.05)
                row = conn.execute(
                    "SELECT coalesce(sum(next_offset), 0) FROM sink_offsets"
                    " WHERE consumer = %s AND topic = %s",
                    (group, events_topic),
                ).fetchone()
                projected = int(row[0]) if row else 0
            seconds = time.time() - began
        load = machine.stop()
        cpu_after = [process_cpu_seconds(p.pid) for p in procs]
        writer.close()
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=60)
    spent = [
        None if a is None or b is None else a - b
        for a, b in zip(cpu_after, cpu_before, strict=True)
    ]
    cpu = None if None in spent else sum(x for x in spent if x is not None)
    return {
        "sinks": sinks,
        "run_ids": f"{tag}-a-*",
        "events": len(backlog),
        "events_per_second": round(len(backlog) / seconds),
        "sinks_cpu_us_per_event": None if cpu is None else round(cpu / len(backlog) * 1e6, 1),
        "machine": load,
    }


def run_bench(
    bootstrap: str,
    database_url: str,
    *,
    events: int,
    rate: int,
    seconds: float,
    partitions: int,
    batch_size: int,
    sinks: int,
) -> dict[str, Any]:
    from agentruns.connectors.postgres.migrate import migrate
    from agentruns.connectors.projection.sink import CommitReport, Sink, SinkConfig

    migrate(database_url)
    tune_gc()  # the GC setting `agentruns sink` runs with: the in-process sink is measured
    load_before = os.getloadavg()[0]
    tag = f"bs{uuid.uuid4().hex[:6]}"
    prefix = f"bench-sink-{tag}"
    ensure_topics(bootstrap, prefix=prefix, partitions=partitions)
    writer = LogWriter(bootstrap, prefix, partitions)
    rng = random.Random(11)

    say = progress("bench sink")
    # phase 1: a backlog, projected from scratch
    say(f"a backlog of {events} events, projected from scratch")
    backlog = interleave(make_runs(events, f"{tag}-a"), rng)
    writer.write(backlog)
    visible: dict[tuple[str, int], float] = {}
    lock = threading.Lock()

    def on_commit(report: CommitReport) -> None:
        with lock:
            for key in report.events:
                visible[key] = report.committed_at

    sink = Sink(
        SinkConfig(
            bootstrap=bootstrap,
            database_url=database_url,
            prefix=prefix,
            group_id=f"{prefix}-sink",
            assign="all",
            batch_size=batch_size,
        ),
        on_commit=on_commit,
    )
    stop = threading.Event()
    thread = threading.Thread(target=sink.run, args=(stop,), name="sink", daemon=True)
    began = time.time()
    cpu_began = time.process_time()
    machine = MachineCpu.start()
    thread.start()
    deadline = time.monotonic() + 600
    while sink.stats.events < len(backlog):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"sink projected {sink.stats.events} of {len(backlog)} events")
        time.sleep(0.01)
    with lock:
        last = max(visible.values())
    throughput = len(backlog) / (last - began)
    cpu = time.process_time() - cpu_began  # this process only: the sink (writer is idle)
    backlog_machine = machine.stop()
    fold_s, write_s = sink.stats.fold_s, sink.stats.write_s
    backlog_batches = sink.stats.batches

    say(f"paced writes: {rate} events/s for {seconds:g} s")
    # phase 2: paced writes, lag from Kafka commit to visible row. The writer runs in its own
    # process (the sink thread would otherwise share its interpreter lock) and plans (folds,
    # encodes) every transaction before its clock starts, so it only produces while pacing.
    writer.close()
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        committed_list, wall = pool.apply(
            paced_writer, (bootstrap, prefix, partitions, f"{tag}-b", rate, seconds)
        )
    committed = {(run_id, seq): at for run_id, seq, at in committed_list}
    deadline = time.monotonic() + 120
    while True:
        with lock:
            done = all(k in visible for k in committed)
        if done or time.monotonic() > deadline or not thread.is_alive():
            break
        time.sleep(0.02)
    gave_up = time.time()
    stop.set()
    thread.join(30)
    with lock:
        lags = [visible.get(k, gave_up) - t for k, t in committed.items()]
    missing = sum(1 for k in committed if k not in visible)
    core_s = core_fold_seconds(backlog)
    say(f"the backlog again, projected by {sinks} sink processes")
    # phase 3: the same kind of backlog, projected by `sinks` processes sharing the partitions
    scaled = (
        scale_out(
            database_url=database_url,
            bootstrap=bootstrap,
            sinks=sinks,
            events=events,
            partitions=partitions,
        )
        if sinks > 1
        else None
    )
    figures: dict[str, Any] = {
        "bench": "sink",
        "events_projected": len(backlog),
        "runs": len({e.run_id for e in backlog}),
        "events_per_second": round(throughput),
        "backlog_batches": backlog_batches,
        "backlog_cpu_seconds": round(cpu, 2),
        "events_per_cpu_second": round(len(backlog) / cpu),
        "backlog_fold_seconds": round(fold_s, 2),
        "backlog_write_seconds": round(write_s, 2),
        "cpu_us_per_event": round(cpu / len(backlog) * 1e6, 1),
        "core_fold_us_per_event": round(core_s / len(backlog) * 1e6, 1),
        "rest_us_per_event": round((cpu - core_s) / len(backlog) * 1e6, 1),
        # the whole machine in the backlog phase (sink, Postgres, broker): cores busy, the
        # hypervisor's steal, and CPU per event of everything but the sink process
        "backlog_machine": {
            **backlog_machine,
            "others_cpu_us_per_event": None
            if backlog_machine["busy_s"] is None
            else round((backlog_machine["busy_s"] - cpu) / len(backlog) * 1e6, 1),
        },
        "load_average_1m_before": round(load_before, 2),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "broker": broker_settings(bootstrap),
        "paced_rate": rate,
        "paced_events": len(committed),
        "paced_achieved_rate": round(len(committed) / wall),
        "lag_p50_ms": round(percentile(lags, 0.50) * 1000, 1),
        "lag_p99_ms": round(percentile(lags, 0.99) * 1000, 1),
        "lag_max_ms": round(max(lags, default=0.0) * 1000, 1),
        "lag_missing": missing,
        "partitions": partitions,
        "batch_size": batch_size,
        "sink_retries": sink.stats.retries,
        "scale_out": scaled,
    }
    # the rate target is checked on the sinks of the scale-out phase when there is one: how
    # agentruns reaches a rate one interpreter cannot (one sink's rate is reported beside it)
    rate_figure = "scale_out.events_per_second" if scaled is not None else "events_per_second"
    targets = (Target(rate_figure, 10_000), Target("lag_p99_ms", 1_000, at_most=True))
    return {**figures, **evaluate(figures, targets)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns bench sink")
    parser.add_argument("--events", type=int, default=50_000, help="backlog size (throughput)")
    parser.add_argument("--rate", type=int, default=2_000, help="paced events/s (lag)")
    parser.add_argument("--seconds", type=float, default=10.0, help="paced duration")
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=5_000)
    parser.add_argument(
        "--sinks", type=int, default=2, help="sink processes of the scale-out phase (1: none)"
    )
    args = parser.parse_args(argv)
    from agentruns.connectors.dev.stack.services import ServiceStack

    speed = host_speed()  # before the services start: the host, not our load
    with ServiceStack(ephemeral=True) as stack:
        assert stack.endpoints is not None
        report = run_bench(
            stack.endpoints.kafka_bootstrap,
            stack.endpoints.database_url,
            events=args.events,
            rate=args.rate,
            seconds=args.seconds,
            partitions=args.partitions,
            batch_size=args.batch_size,
            sinks=args.sinks,
        )
    report["host_speed"] = speed
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
