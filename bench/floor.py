"""`agentruns bench floor`: the floor the agent loop stands on, Kafka alone.

N tokens bounce between two processes, each a consume -> produce loop on one broker: side A
reads topic ``a`` and writes ``b``, side B reads ``b`` and writes ``a``, every record going back
to the partition it came from; a token is done after H hops (default 40). A hop is one side's
turn: from the moment the token is visible to it to the moment its answer is visible to the
other side (read_committed). Nothing of the agentruns pipeline runs, only confluent-kafka with
the pipeline's client settings (`agentruns.streams.kafka_defaults`) and its way of taking a
batch (`agentruns.streams.polling.poll_batch`).

Two modes, one after the other in one invocation:

- ``transactional``: both sides answer each batch they consume in one transaction that carries
  the consumed offsets, committed as soon as the batch is in (two transactional ids used in
  turn, as the pipeline does: `ProducerPair`);
- ``plain``: side B is an at-least-once loop instead: idempotent producer, the offsets committed
  once the produce is acknowledged.

A step of the agent loop is four such hops (processor -> model executor -> processor -> tool
executor -> processor), so at a concurrency of N the step floor is hops/s / 4 steps/s and
4 x the hop p50 per step. Figures per mode and level (tokens in flight): hops/s, hop p50/p99,
that step floor, hop p50/p99 of each side apart (``by_side``: in plain mode one side's hops
are transactional, the other's not), and the CPU microseconds per hop of each side, the broker
and this driver. One JSON object on the last line; also written to bench/results/floor.json.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import IO, Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from agentruns.bench.broker import broker_settings
from agentruns.bench.latency import percentile
from agentruns.bench.machine import MachineCpu, stack_labels
from agentruns.bench.results_file import report
from agentruns.streams.kafka_defaults import (
    NO_DELAY,
    TRANSACTIONAL_PRODUCER,
    ProducerPair,
    client_settings,
    close_consumer,
    fetch_settings,
    release,
)
from agentruns.streams.polling import poll_batch

MODES = ("transactional", "plain")
#: hops per step of the agent loop: the processor, the model executor, the processor, the tool
#: executor each commit once before the processor's next snapshot
HOPS_PER_STEP = 4
TIMEOUT_S = 30.0
BATCH = 1000

#: (when a hop ended, how long it took), seconds of ``time.monotonic()``: one clock for every
#: process of the machine, so a hop begun in one process is timed in the other
Sample = tuple[float, float]
Json = dict[str, Any]


# --------------------------------------------------------------------------- figures


def step_floor(hops_per_s: float, hop_p50_s: float) -> Json:
    """The agent loop's step at the floor: four hops one after the other."""
    return {
        "steps_per_s": round(hops_per_s / HOPS_PER_STEP, 1),
        "step_latency_ms": round(HOPS_PER_STEP * hop_p50_s * 1000, 1),
    }


def hop_figures(samples: Sequence[Sample]) -> Json:
    """hops/s over the span from the first hop's start to the last one's end, hop p50/p99 and
    the step floor they imply."""
    if not samples:
        nan = float("nan")
        return {
            "hops": 0,
            "seconds": 0.0,
            "hops_per_s": 0.0,
            "hop_p50_ms": nan,
            "hop_p99_ms": nan,
            "step_floor": step_floor(0.0, nan),
        }
    began = min(end - took for end, took in samples)
    ended = max(end for end, _ in samples)
    span = ended - began
    took = [t for _, t in samples]
    rate = len(samples) / span if span > 0 else 0.0
    p50 = percentile(took, 0.5)
    return {
        "hops": len(samples),
        "seconds": round(span, 3),
        "hops_per_s": round(rate, 1),
        "hop_p50_ms": round(p50 * 1000, 2),
        "hop_p99_ms": round(percentile(took, 0.99) * 1000, 2),
        "step_floor": step_floor(rate, p50),
    }


def side_figures(samples: Sequence[Sample]) -> Json:
    """One side's hops: how many, p50 and p99 (in plain mode the sides differ in kind)."""
    took = [t for _, t in samples]
    return {
        "hops": len(took),
        "hop_p50_ms": round(percentile(took, 0.5) * 1000, 2),
        "hop_p99_ms": round(percentile(took, 0.99) * 1000, 2),
    }


def ratio(value: float | None, floor: float | None) -> float | None:
    """``value / floor`` to two places; None when either is missing or the floor is not a
    positive number."""
    if value is None or floor is None or math.isnan(value) or math.isnan(floor) or floor <= 0:
        return None
    return round(value / floor, 2)


def floor_level(figures: Json, tokens: int, mode: str = "transactional") -> Json | None:
    """The floor's level with ``tokens`` in flight in ``mode``, if it was measured."""
    for level in figures.get("modes", {}).get(mode, []):
        if level.get("tokens") == tokens:
            return dict(level)
    return None


def ratios_to_floor(loop_level: Mapping[str, Any], floor: Mapping[str, Any] | None) -> Json:
    """A loop level against the floor at the same concurrency: throughput (loop steps/s over
    floor steps/s: below 1 is slower) and step p50 (loop over floor: above 1 is slower)."""
    if floor is None:
        return {"steps_per_s": None, "step_p50": None}
    steps = floor["step_floor"]
    return {
        "steps_per_s": ratio(loop_level.get("durable_steps_per_s"), steps.get("steps_per_s")),
        "step_p50": ratio(loop_level.get("step_latency_p50_ms"), steps.get("step_latency_ms")),
    }


def per_item_us(cpu_s: Mapping[str, float] | None, items: int) -> Json:
    """CPU microseconds per item of each process group (None without /proc or items)."""
    if not cpu_s or items <= 0:
        return {}
    return {name: round(seconds * 1e6 / items, 1) for name, seconds in cpu_s.items()}


# --------------------------------------------------------------------------- one side


def _record(token: str, hop: int, last: int, at: float) -> bytes:
    """A token on its ``hop``-th hop of ``last``, begun ``at``."""
    return f"{token} {hop} {last} {at!r}".encode()


def _parse(value: bytes) -> tuple[str, int, int, float]:
    token, hop, last, at = value.decode().split(" ")
    return token, int(hop), int(last), float(at)


class Side:
    """One side's consume -> produce loop: every token read is answered with the next hop (or,
    after the last, a record on the done topic), in one transaction per batch or, plain,
    produced, acknowledged and then its offsets committed."""

    def __init__(
        self,
        bootstrap: str,
        group: str,
        topics: tuple[str, str, str],
        partitions: int,
        transactional: bool,
    ) -> None:
        self.source, self.sink, self.done = topics
        self.samples: list[Sample] = []
        self.lock = threading.Lock()
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                **client_settings(),
                "group.id": group,
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                **fetch_settings(0),
                **NO_DELAY,
                "log_level": 3,
            }
        )
        self.consumer.assign(
            [TopicPartition(self.source, p, OFFSET_BEGINNING) for p in range(partitions)]
        )
        self.pair: ProducerPair | None = None
        self.producer: Producer | None = None
        if transactional:

            def new(slot: str) -> Producer:
                producer = Producer(
                    {
                        "bootstrap.servers": bootstrap,
                        **client_settings(),
                        "transactional.id": f"{group}-{slot}",
                        **TRANSACTIONAL_PRODUCER,
                        "linger.ms": 0,
                        "log_level": 3,
                    }
                )
                producer.init_transactions(TIMEOUT_S)
                return producer

            self.pair = ProducerPair(new)
        else:
            self.producer = Producer(
                {
                    "bootstrap.servers": bootstrap,
                    **client_settings(),
                    "enable.idempotence": True,
                    **NO_DELAY,
                    "linger.ms": 0,
                    "log_level": 3,
                }
            )

    def turn(self, timeout_s: float) -> None:
        """Consume one batch and answer it."""
        messages = poll_batch(self.consumer, BATCH, timeout_s)
        now = time.monotonic()
        offsets: dict[int, int] = {}
        out: list[tuple[str, bytes, int]] = []
        fresh: list[Sample] = []
        for message in messages:
            value = message.value()
            if message.error() is not None or value is None:
                continue
            partition = message.partition() or 0
            offsets[partition] = (message.offset() or 0) + 1
            token, hop, last, at = _parse(value)
            if hop > 0:  # hop 0 is the seed, written by the driver
                fresh.append((now, now - at))
            if hop >= last:
                out.append((self.done, _record(token, hop, last, now), 0))
            else:
                out.append((self.sink, _record(token, hop + 1, last, now), partition))
        if not out:
            return
        positions = [TopicPartition(self.source, p, o) for p, o in offsets.items()]
        if self.pair is not None:
            producer = self.pair.current
            producer.begin_transaction()
            for topic, value, partition in out:
                producer_produce(producer, topic, value, partition)
            producer.send_offsets_to_transaction(
                positions, self.consumer.consumer_group_metadata(), TIMEOUT_S
            )
            producer.commit_transaction(TIMEOUT_S)
            self.pair.committed()
        else:
            assert self.producer is not None
            for topic, value, partition in out:
                producer_produce(self.producer, topic, value, partition)
            if self.producer.flush(TIMEOUT_S):
                raise RuntimeError("records not acknowledged in time")
            self.consumer.commit(offsets=positions, asynchronous=True)
        with self.lock:
            self.samples.extend(fresh)

    def take(self) -> list[Sample]:
        with self.lock:
            taken, self.samples = self.samples, []
        return taken

    def close(self) -> None:
        close_consumer(self.consumer, 10)
        if self.pair is not None:
            self.pair.close()
        if self.producer is not None:
            release(self.producer)


def producer_produce(producer: Producer, topic: str, value: bytes, partition: int) -> None:
    """Produce, serving delivery reports when the local queue is full."""
    while True:
        try:
            producer.produce(topic, value, partition=partition)
            return
        except BufferError:
            producer.poll(0.01)


def run_side(args: argparse.Namespace) -> int:
    """A side process: ``ready`` on stdout once its clients are up; then each ``report`` line
    on stdin is answered with the samples taken since the last one (a JSON list); end of
    stdin stops it."""
    topics = (args.source, args.sink, args.done)
    side = Side(args.bootstrap, args.group, topics, args.partitions, args.transactional)
    side.turn(0.5)
    print("ready", flush=True)
    stop = threading.Event()

    def serve() -> None:
        for line in sys.stdin:
            if line.strip() == "report":
                print(json.dumps(side.take()), flush=True)
        stop.set()

    threading.Thread(target=serve, daemon=True).start()
    try:
        while not stop.is_set():
            side.turn(0.1)
    finally:
        side.close()
    return 0


# --------------------------------------------------------------------------- the driver


class SideProcess:
    """A side running in a process of its own, as every pipeline component does."""

    def __init__(self, argv: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agentruns.bench.floor", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self._stdout.readline()
        if line.strip() != "ready":
            self.stop()
            raise RuntimeError(f"a floor side did not start (it said {line!r})")

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def _stdout(self) -> IO[str]:
        assert self.process.stdout is not None
        return self.process.stdout

    def report(self) -> list[Sample]:
        assert self.process.stdin is not None
        self.process.stdin.write("report\n")
        self.process.stdin.flush()
        return [(float(end), float(took)) for end, took in json.loads(self._stdout.readline())]

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _create_topics(bootstrap: str, names: Mapping[str, int]) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap, **client_settings(), "log_level": 3})
    futures = admin.create_topics(
        [NewTopic(name, partitions) for name, partitions in names.items()],
        operation_timeout=TIMEOUT_S,
    )
    for future in futures.values():
        future.result(timeout=TIMEOUT_S)


class Mode:
    """Two sides on their own topics, and what the driver needs to run levels through them."""

    def __init__(self, bootstrap: str, mode: str, partitions: int) -> None:
        tag = f"floor-{mode}-{uuid.uuid4().hex[:8]}"
        self.a, self.b, self.done = f"{tag}.a", f"{tag}.b", f"{tag}.done"
        self.partitions = partitions
        _create_topics(bootstrap, {self.a: partitions, self.b: partitions, self.done: 1})
        common = ["--side", "--bootstrap", bootstrap, "--partitions", str(partitions)]
        common += ["--done", self.done]
        self.sides: dict[str, SideProcess] = {}
        try:
            for name, source, sink, transactional in (
                ("side_a", self.a, self.b, True),
                ("side_b", self.b, self.a, mode == "transactional"),
            ):
                argv = [*common, "--source", source, "--sink", sink, "--group", f"{tag}-{name}"]
                self.sides[name] = SideProcess(
                    argv + (["--transactional"] if transactional else [])
                )
        except BaseException:
            self.stop()
            raise
        self.seeder = Producer(
            {"bootstrap.servers": bootstrap, **client_settings(), "linger.ms": 0, "log_level": 3}
        )
        self.watcher = Consumer(
            {
                "bootstrap.servers": bootstrap,
                **client_settings(),
                "group.id": f"{tag}-driver",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                **fetch_settings(0),
                **NO_DELAY,
                "log_level": 3,
            }
        )
        self.watcher.assign([TopicPartition(self.done, 0, OFFSET_BEGINNING)])

    def level(self, tokens: int, hops: int, timeout_s: float) -> dict[str, list[Sample]]:
        """Bounce ``tokens`` tokens ``hops`` times each; every hop's sample, by the side whose
        hop it was (a side times the hops of the other: it sees them end)."""
        run = uuid.uuid4().hex[:6]
        now = time.monotonic()
        for i in range(tokens):
            seed = _record(f"{run}-{i}", 0, hops, now)
            producer_produce(self.seeder, self.a, seed, i % self.partitions)
        self.seeder.flush(TIMEOUT_S)
        deadline = time.monotonic() + timeout_s
        done = 0
        while done < tokens and time.monotonic() < deadline:
            for message in poll_batch(self.watcher, BATCH, 0.1):
                value = message.value()
                if message.error() is None and value is not None and value.startswith(run.encode()):
                    done += 1
        if done < tokens:
            raise RuntimeError(f"{tokens - done} of {tokens} tokens not done in {timeout_s} s")
        by_side: dict[str, list[Sample]] = {"side_a": [], "side_b": []}
        timed_by = {"side_a": "side_b", "side_b": "side_a"}
        # a side takes a batch's samples once its commit returned, which may be just after
        # the done record became visible
        while sum(map(len, by_side.values())) < tokens * hops and time.monotonic() < deadline:
            for name in by_side:
                by_side[name].extend(self.sides[timed_by[name]].report())
            if sum(map(len, by_side.values())) < tokens * hops:
                time.sleep(0.02)
        return by_side

    def stop(self) -> None:
        for side in self.sides.values():
            side.stop()
        if hasattr(self, "watcher"):
            self.watcher.close()
            release(self.seeder)


def measure(
    bootstrap: str,
    levels: Sequence[int],
    hops: int,
    partitions: int,
    *,
    modes: Sequence[str] = MODES,
    labels: Mapping[int, str] | None = None,
    timeout_s: float = 300.0,
) -> Json:
    """The floor at each level (tokens in flight) in each mode, on the broker at ``bootstrap``.
    ``labels``: pid -> group of the processes whose CPU to count apart (the broker)."""
    figures: Json = {
        "bench": "floor",
        "hops_per_token": hops,
        "hops_per_step": HOPS_PER_STEP,
        "partitions": partitions,
        "broker": broker_settings(bootstrap),
        "modes": {},
    }
    for mode in modes:
        print(f"floor {mode}", file=sys.stderr, flush=True)
        pair = Mode(bootstrap, mode, partitions)
        try:
            # every partition's first transaction and fetch, not counted
            pair.level(partitions, 2, timeout_s)
            results = []
            for tokens in levels:
                sides = {side.pid: name for name, side in pair.sides.items()}
                machine = MachineCpu.start({**(labels or {}), **sides})
                by_side = pair.level(tokens, hops, timeout_s)
                cpu = machine.stop()
                samples = [s for side in by_side.values() for s in side]
                level = {"tokens": tokens, **hop_figures(samples)}
                level["by_side"] = {name: side_figures(s) for name, s in by_side.items()}
                level["cpu_us_per_hop"] = per_item_us(cpu.get("cpu_s_by_process"), len(samples))
                level["busy_cores"] = cpu.get("busy_cores")
                level["steal_pct"] = cpu.get("steal_pct")
                print(json.dumps(level), file=sys.stderr, flush=True)
                results.append(level)
        finally:
            pair.stop()
        figures["modes"][mode] = results
    return figures


def _levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("levels are counts of 1 or more, comma-separated")
    return levels


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns bench floor", description=__doc__)
    parser.add_argument("--tokens", type=_levels, default=[1, 64], help="tokens in flight")
    parser.add_argument("--hops", type=int, default=40, help="hops per token")
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--modes", default=",".join(MODES), help="transactional, plain or both")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per level")
    parser.add_argument("--out", default="bench/results/floor.json")
    # one side of a pair (the driver starts them)
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--group", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--sink", help=argparse.SUPPRESS)
    parser.add_argument("--done", help=argparse.SUPPRESS)
    parser.add_argument("--transactional", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.side:
        return run_side(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: one or more of {', '.join(MODES)}")
    if args.hops < 1:
        parser.error("--hops must be 1 or more")
    from agentruns.connectors.dev.stack.services import ServiceStack

    with ServiceStack(ephemeral=True) as stack:
        assert stack.endpoints is not None
        figures = measure(
            stack.endpoints.kafka_bootstrap,
            args.tokens,
            args.hops,
            args.partitions,
            modes=modes,
            labels=stack_labels(stack),
            timeout_s=args.timeout,
        )
    report(figures, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
