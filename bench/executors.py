"""``agentruns bench executors``: tool-call effects through the real broker to the tool server.

One tool executor process (``python -m agentruns.connectors.executors.tool``) and the example tool
server
(its own process, zero tool latency) against a real Kafka and Postgres (``ServiceStack``:
``KAFKA_BOOTSTRAP_SERVERS``/``DATABASE_URL`` when set, else an ephemeral local stack started
and stopped here). This process plays the processor: it produces ``CallTool`` effect records
and reads the committed ``ToolCallSucceeded`` inputs back from the inbox (read_committed).

Two phases:

- throughput: ``--calls`` effects produced at once; calls/s = calls / (first produce -> last
  answer visible);
- latency: ``--rate`` effects per second, ``--warmup`` seconds unmeasured, then ``--seconds``
  measured; the added latency of a call is "effect produced" -> "answer visible in the inbox"
  (the tool itself takes no time), p50/p99.

Also reported: executor CPU per call in both phases (``/proc``, robust to a busy machine, unlike
the wall-clock figures) and ``executor_stats``, the line the executor logs when it stops: batches,
transactions, mean ms per stage, transaction-time percentiles, effect age when polled and when
committed (from the records' timestamps).

Prints one JSON object on its last line. Targets: >= 1,000 calls/s per executor process,
p99 added latency <= 50 ms at 200 calls/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentruns.bench.broker import broker_settings
from agentruns.bench.core import host_speed
from agentruns.bench.latency import p99_by_second, percentile
from agentruns.bench.machine import MachineCpu, process_cpu_seconds
from agentruns.bench.targets import Target, evaluate
from agentruns.connectors.dev.servers import tool_server
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.lifecycle import progress
from agentruns.streams.clock import now_ms
from agentruns.streams.kafka_defaults import LONG_POLL_MS, client_settings, close_consumer

#: per executor process; p99 added latency at 200 calls/s
TARGETS = (Target("calls_per_s", 1_000), Target("added_latency_ms.p99", 50, at_most=True))


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


@contextlib.contextmanager
def _process(
    command: list[str], banner: bool = False, stderr: Any = None
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE if banner else subprocess.DEVNULL,
        stderr=stderr,
        text=True,
    )
    first = ""
    try:
        if banner:
            assert proc.stdout is not None
            first = proc.stdout.readline()
        yield proc, first
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


class Collector:
    """Reads the inbox in a thread; remembers when each input id became visible."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        from confluent_kafka import Consumer, TopicPartition

        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                **client_settings(),
                "group.id": f"bench-{uuid.uuid4().hex[:8]}",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": LONG_POLL_MS,
                "log_level": 3,
            }
        )
        self.consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        self.seen: dict[str, float] = {}
        self.kinds: dict[str, int] = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from agentruns.streams.codec import decode
        from agentruns.streams.polling import poll_batch

        while not self.stop.is_set():
            # consume(n, timeout) would hold what arrived until n records or the timeout and
            # add that wait to every latency measured
            for message in poll_batch(self.consumer, 1000, 0.1):
                now = time.monotonic()
                value = message.value()
                if message.error() is not None or value is None:
                    continue
                record = decode(value, expected_name="Input").record
                with self.lock:
                    self.seen.setdefault(record["input_id"], now)
                    self.kinds[record["kind"]] = self.kinds.get(record["kind"], 0) + 1

    def wait(self, ids: list[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if all(i in self.seen for i in ids):
                    return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        close_consumer(self.consumer, 10)


def _effects(prefix: str, count: int, start: int) -> list[tuple[str, bytes, str]]:
    """(input id of the answer, encoded Effect record, run_id) for ``count`` CallTools."""
    from agentruns.processors.effects import CallTool, OperationSpec
    from agentruns.processors.ids import canonical_json
    from agentruns.streams.codec import encode
    from agentruns.streams.records import effect_record

    out = []
    now = now_ms()
    for i in range(start, start + count):
        run_id = f"bench-{prefix}-{i % 97}"
        key = f"{prefix}:call:{i}"
        effect = CallTool(
            idempotency_key=key,
            run_id=run_id,
            step=1,
            attempt=1,
            trace_id=f"trace-{i}",
            operation=OperationSpec(
                key=f"op-{prefix}-{i}",
                tool="create_ticket",
                arguments_json=canonical_json({"title": f"bench ticket {i}"}),
                expected_version=None,
                policy_decision="allow",
                dispatch=1,
            ),
        )
        value = encode("Effect", effect_record(effect, seq=i + 1, at=now))
        out.append((f"{key}:result", value, run_id))
    return out


def run(args: argparse.Namespace, bootstrap: str, database_url: str) -> dict[str, Any]:
    from confluent_kafka import Producer

    from agentruns.connectors.postgres.migrate import migrate
    from agentruns.streams.admin import ensure_topics
    from agentruns.streams.topics import INBOX, effect_suffix, topic_name

    migrate(database_url)
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    ensure_topics(bootstrap, prefix=prefix, partitions=args.partitions)
    effects_topic = topic_name(effect_suffix("tool"), prefix)
    server_cmd = [
        sys.executable,
        "-m",
        "agentruns.connectors.dev.servers.tool_server",
        "--port",
        "0",
    ]
    with (
        tempfile.TemporaryDirectory() as tmp,
        _process(server_cmd, banner=True) as (server, banner),
    ):
        url = banner.split("listening on ", 1)[1].split()[0]
        registry = json.loads(tool_server.DEFAULT_REGISTRY.read_text())
        registry["base_url"] = url
        registry_path = Path(tmp) / "tools.json"
        registry_path.write_text(json.dumps(registry))
        executor_cmd = [
            sys.executable, "-m", "agentruns.connectors.executors.tool",
            "--bootstrap", bootstrap, "--database-url", database_url, "--prefix", prefix,
            "--registry", str(registry_path), "--max-in-flight", str(args.max_in_flight),
            "--max-batch", str(args.max_batch), "--log-level", "INFO",
            "--gather-ms", str(args.gather_ms),
        ]  # fmt: skip
        executor_log = Path(tmp) / "executor.log"
        collector = Collector(bootstrap, topic_name(INBOX, prefix), args.partitions)
        producer = Producer(
            {"bootstrap.servers": bootstrap, **client_settings(), "linger.ms": 0, "log_level": 3}
        )
        try:
            with (
                open(executor_log, "w") as log_file,
                _process(executor_cmd, stderr=log_file) as (executor, _),
            ):
                say = progress("bench executors")
                say("warm-up: 50 calls")  # the executor joins its group, connections open
                warm = _effects(prefix, 50, 0)
                for _, value, run_id in warm:
                    producer.produce(effects_topic, key=run_id.encode(), value=value)
                producer.flush(30)
                if not collector.wait([i for i, _, _ in warm], 120):
                    raise RuntimeError("the executor did not answer the warm-up calls")
                cpu0 = process_cpu_seconds(executor.pid)
                say(f"throughput: a backlog of {args.calls} calls")
                throughput = _throughput(args, producer, collector, effects_topic, prefix)
                cpu1 = process_cpu_seconds(executor.pid)
                machine = MachineCpu.start({executor.pid: "executor", server.pid: "tool server"})
                say(f"latency: {args.rate} calls/s for {args.seconds:g} s")
                latency = _latency(args, producer, collector, effects_topic, prefix)
                latency["machine"] = machine.stop()  # was the host busy or stolen from?
                cpu2 = process_cpu_seconds(executor.pid)
                if cpu1 is not None and cpu2 is not None:
                    latency["executor_cpu_ms_per_call"] = round(
                        (cpu2 - cpu1) * 1000 / latency["sent"], 3
                    )
                if cpu0 is not None and cpu1 is not None and cpu1 > cpu0:
                    per_call = (cpu1 - cpu0) / throughput["calls"]
                    throughput["executor_cpu_ms_per_call"] = round(per_call * 1000, 3)
                    throughput["cpu_bound_calls_per_s"] = round(1 / per_call, 1)
        finally:
            producer.flush(10)
            collector.close()
        stats = executor_stats(executor_log)
    figures: dict[str, Any] = {
        "bench": "executors",
        "calls_per_s": throughput["calls_per_s"],
        "added_latency_ms": {"p50": latency["p50_ms"], "p99": latency["p99_ms"]},
        "throughput": throughput,
        "latency": latency,
        "executor_stats": stats,
        "max_in_flight": args.max_in_flight,
        "max_batch": args.max_batch,
        "gather_ms": args.gather_ms,
        "partitions": args.partitions,
        "cpus": os.cpu_count(),
        "load_average_1m": _load_average(),
        "broker": broker_settings(bootstrap),
    }
    return {**figures, **evaluate(figures, TARGETS)}


def executor_stats(path: Path) -> dict[str, Any] | None:
    """The stats line the executor logs when it stops (batches, mean ms per stage): its log is
    JSON lines, and the stats are the JSON text after the marker in one line's message."""
    marker = "executor stats "
    for line in reversed(path.read_text().splitlines()):
        try:
            message = json.loads(line).get("msg", "")
        except ValueError:
            continue  # not a log line of ours (a warning printed by a library)
        if isinstance(message, str) and message.startswith(marker):
            stats: dict[str, Any] = json.loads(message.removeprefix(marker))
            return stats
    return None


def _throughput(
    args: argparse.Namespace, producer: Any, collector: Collector, topic: str, prefix: str
) -> dict[str, Any]:
    batch = _effects(prefix, args.calls, 1_000_000)
    began = time.monotonic()
    sent: dict[str, float] = {}
    for input_id, value, run_id in batch:
        producer.produce(topic, key=run_id.encode(), value=value)
        sent[input_id] = time.monotonic()
        producer.poll(0)
    producer.flush(30)
    if not collector.wait(list(sent), args.timeout):
        with collector.lock:
            missing = sum(1 for i in sent if i not in collector.seen)
        raise RuntimeError(f"{missing} of {len(sent)} calls unanswered after {args.timeout}s")
    with collector.lock:
        ended = max(collector.seen[i] for i in sent)
        lat = [(collector.seen[i] - t) * 1000 for i, t in sent.items()]
    elapsed = ended - began
    return {
        "calls": len(sent),
        "seconds": round(elapsed, 3),
        "calls_per_s": round(len(sent) / elapsed, 1),
        "p50_ms_under_load": round(percentile(lat, 0.5), 2),
    }


def _latency(
    args: argparse.Namespace, producer: Any, collector: Collector, topic: str, prefix: str
) -> dict[str, Any]:
    """Paced calls: `warmup` seconds unmeasured (the throughput phase's burst settles), then
    `seconds` measured, as the processor bench does."""
    count = int(args.rate * (args.warmup + args.seconds))
    batch = _effects(prefix, count, 2_000_000)
    interval = 1.0 / args.rate
    sent: dict[str, float] = {}
    began = time.monotonic()
    for n, (input_id, value, run_id) in enumerate(batch):
        due = began + n * interval
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        producer.produce(topic, key=run_id.encode(), value=value)
        producer.poll(0)
        sent[input_id] = time.monotonic()
    producer.flush(30)
    if not collector.wait(list(sent), args.timeout):
        raise RuntimeError("latency phase: calls unanswered")
    measured = began + args.warmup
    with collector.lock:
        timed = [
            (t - measured, (collector.seen[i] - t) * 1000) for i, t in sent.items() if t >= measured
        ]
    lat = [ms for _, ms in timed]
    return {
        "rate_per_s": args.rate,
        "warmup_s": args.warmup,
        "sent": count,
        "calls": len(lat),
        "p50_ms": round(percentile(lat, 0.5), 2),
        "p90_ms": round(percentile(lat, 0.9), 2),
        "p99_ms": round(percentile(lat, 0.99), 2),
        "max_ms": round(max(lat), 2),
        "p99_ms_by_second": p99_by_second(timed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns bench executors", description=__doc__)
    parser.add_argument("--calls", type=int, default=5000, help="throughput phase calls")
    parser.add_argument("--rate", type=float, default=200.0, help="latency phase calls/s")
    parser.add_argument("--seconds", type=float, default=10.0, help="latency phase duration")
    parser.add_argument(
        "--warmup", type=float, default=2.0, help="seconds of paced calls before measuring"
    )
    parser.add_argument(
        "--max-in-flight",
        "--workers",
        dest="max_in_flight",
        type=int,
        default=ExecutorConfig.max_in_flight,
    )
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument(
        "--gather-ms", type=int, default=ExecutorConfig.gather_ms, help="the executor's --gather-ms"
    )
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    from agentruns.connectors.dev.stack.services import ServiceStack

    speed = host_speed()  # before the services start: the host, not our load
    with ServiceStack(ephemeral=True) as stack:
        assert stack.endpoints is not None
        result = run(args, stack.endpoints.kafka_bootstrap, stack.endpoints.database_url)
    result["host_speed"] = speed
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
