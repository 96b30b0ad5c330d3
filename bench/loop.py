"""`agentruns bench loop`: the headline benchmark, the whole pipeline end to end.

N concurrent runs (default levels 1, 16, 64) of a 10-step agent loop: each step is a streamed
model call to the scripted model server (zero latency) that asks for one tool call to the
example tool server (zero latency), whose result starts the next step; the 11th model call
answers. Every component is its own process (model server, tool server, processor, model
executor, tool executor), as in production; ``--processors N --executors N`` runs N processors
and N executors of each kind (each its own process and instance id, sharing the partitions of
``--partitions``), reported per process (``processor-0``, ...). Figures: durable steps/s (a
step counts when the snapshot that starts the next step is committed), per-step latency
p50/p99, run latency p50/p99, the CPU microseconds per step of every process (the broker,
Postgres, each component, the bench driver; ``other`` is the rest of the machine) and the peak
RSS of each process, and the effects each executor kept running (its
``agentruns_executor_in_flight`` gauge, sampled every 0.5 s: p50 and max).

Backends that take time: ``--model-latency MEDIAN_MS[:SIGMA]`` makes every model call of the
runs take a log-normal time (streamed a chunk every ``--chunk-ms``, as a model streams its
tokens), ``--tool-latency MIN_MS:MAX_MS`` every tool call a log-uniform time (the scripted
servers' ``latency`` fault, drawn per call and accounted per run: `agentruns.bench.overhead`).
Each level then also reports each run's latency over the sum of its own backends' latencies
(``run_over_backend_p50/p99``: 1.0 is no overhead) and its throughput against the ideal for those
latencies (``throughput_vs_ideal``: the time the same closed loop would take if every run took
exactly its backends' time, over the time it took). The Kafka floor is not measured then.
``--mixed SLOW:INSTANT`` ends with INSTANT runs (the same scenario under another name, its model
and tool calls instant) one after the other alone, then beside SLOW runs whose model calls take
``--model-latency`` (2000:0.5 by default): ``instant_beside_over_alone`` is 1.0 when the slow
runs hold the instant ones back not at all; ``instant_hops_ms_p50`` splits their time into the
processor's, the model executor's and the tool executor's hops (`agentruns.bench.hops`).

``--tool-path mcp`` makes every tool call of the runs a call of the example MCP server's
``set_order_note`` (through the tool executor's MCP client) instead of the example HTTP tool
server's ``create_ticket``; ``--tool-path both`` runs the levels once on each path, HTTP first,
in the same run, and reports ``tool_paths``: the tool executor's and the tool server's CPU
microseconds per step on each path, and the MCP path's over the HTTP path's.

``--tracing on`` runs the pipeline's processes with tracing on, exporting over OTLP/HTTP to a
receiver in the bench that keeps nothing (`agentruns.bench.otlp_sink`; every span sampled: the
SDK's default sampler); ``--tracing both`` runs the levels in phases that alternate tracing off
and on, off first and last (``--tracing-rounds`` on phases; the processor and the executors
restarted at each switch; each phase an equal share of the runs), and reports ``tracing``: per
level, each process's CPU microseconds per step with tracing on and off, the pipeline's
(processors and executors) on over off, and that ratio for each on phase against the off
phases on either side of it (and the same for the broker, Postgres and the bench driver, which
tracing does not touch). A machine that speeds up or slows down steadily over the run weighs on
both sides alike: two halves of a run with tracing off, one after the other, read 0.97-1.11 of
each other.

Without latencies, first, on the same broker, the Kafka floor at the same concurrencies
(`agentruns.bench.floor`: two bare transactional consume -> produce loops, four of whose hops
make a step); each level
reports ``ratio_to_floor``: its steps/s over the floor's (below 1: slower than the floor) and
its step p50 over the floor's step latency (above 1: slower). A shared machine's noise moves
both alike, so the ratios say more than either figure alone. One JSON object on the last line;
also written to bench/results/loop.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition

from agentruns.bench.executors import executor_stats
from agentruns.bench.floor import floor_level, measure, per_item_us, ratios_to_floor
from agentruns.bench.hops import hop_overheads, hop_splits
from agentruns.bench.latency import percentile
from agentruns.bench.machine import MachineCpu, stack_labels
from agentruns.bench.otlp_sink import OtlpSink
from agentruns.bench.overhead import (
    InFlightSampler,
    backend_ms,
    backend_ms_by_kind,
    get_json,
    model_latency_rule,
    overhead_figures,
    planned_call_ms_mean,
    post_json,
    served_over_planned,
    tool_latency_rule,
)
from agentruns.bench.results_file import report
from agentruns.bench.targets import Target, evaluate
from agentruns.connectors.dev.demo.run import registry_tools
from agentruns.connectors.dev.servers import mcp_server, tool_server
from agentruns.connectors.dev.servers.model_server import BUILTIN_SCENARIOS
from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.connectors.dev.stack.services import ServiceStack
from agentruns.connectors.dev.stack.supervisor import Supervisor
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.executors.tool import ToolRegistry, tools_of
from agentruns.connectors.postgres.migrate import migrate
from agentruns.processors.events import Message, RunSubmitted
from agentruns.processors.state import Budgets, ToolSpec
from agentruns.streams.admin import ensure_topics
from agentruns.streams.clock import now_ms
from agentruns.streams.codec import decode, encode
from agentruns.streams.kafka_defaults import LONG_POLL_MS, client_settings, close_consumer
from agentruns.streams.partitioning import partition_for
from agentruns.streams.polling import poll_batch
from agentruns.streams.processor import ProcessorConfig
from agentruns.streams.records import input_record
from agentruns.streams.topics import INBOX, RESULTS, STATE, topic_name

STEPS = 10
#: The runs' scenario: ten tool calls, then the answer. SCENARIO_ALONE is the same scenario under
#: another name, which a latency rule for SCENARIO does not touch (the instant runs of --mixed).
SCENARIO = "bench_10"
SCENARIO_ALONE = "bench_10_alone"
#: The same ten steps, each a call of the example MCP server's idempotent ``set_order_note``.
SCENARIO_MCP = "bench_10_mcp"
#: The name the example MCP server has in the bench's registry (its tools: ``shop__<tool>``).
MCP_SERVER = "shop"


def _numbered(name: str, i: int, count: int) -> str:
    """A component's name: ``name`` alone when it runs once, else ``name-<i>``."""
    return name if count == 1 else f"{name}-{i}"


def _peak_rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return float("nan")


class Driver:
    """Keeps `concurrency` runs in flight and measures them from the committed topics."""

    def __init__(self, bootstrap: str, prefix: str, partitions: int) -> None:
        self.bootstrap = bootstrap
        self.prefix = prefix
        self.partitions = partitions
        self.producer = Producer(
            {"bootstrap.servers": bootstrap, **client_settings(), "linger.ms": 1}
        )
        self.inbox = topic_name(INBOX, prefix)
        self.tools = registry_tools()
        self.tools_of: dict[str, tuple[ToolSpec, ...]] = {}  # other scenarios' tools
        self.submitted: dict[str, float] = {}
        self.step_seen: dict[str, tuple[int, float]] = {}
        # (run id, one step's latency): a level counts its own runs' steps only
        self.step_latencies: list[tuple[str, float]] = []
        self.latency_of: dict[str, float] = {}  # run id -> its latency (seconds)
        self.done: dict[str, str] = {}
        self._lock = threading.Lock()
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                **client_settings(),
                "group.id": f"bench-loop-{uuid.uuid4().hex[:8]}",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": LONG_POLL_MS,
                "log_level": 3,
            }
        )
        self._consumer.assign(
            [
                TopicPartition(topic_name(t, prefix), p, 0)
                for t in (STATE, RESULTS)
                for p in range(partitions)
            ]
        )
        self.last_runs: list[str] = []
        self.stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def submit(self, level: int | str, i: int, scenario: str = SCENARIO) -> str:
        run_id = f"loop-{level}-{i}-{uuid.uuid4().hex[:6]}"
        event = RunSubmitted(
            run_id=run_id,
            event_id=f"{run_id}:submit",
            at=now_ms(),
            trace_id=uuid.uuid4().hex,
            goal="ten tickets",
            messages=(Message(role="user", content=f"scenario:{scenario} run {run_id}"),),
            tools=self.tools_of.get(scenario, self.tools),
            model_route=f"scenario:{scenario}",
            budgets=Budgets(max_steps=STEPS + 5),
        )
        record = input_record(event)
        with self._lock:
            self.submitted[run_id] = time.monotonic()
        self.producer.produce(
            self.inbox,
            key=run_id.encode(),
            value=encode("Input", record),
            partition=partition_for(run_id, self.partitions),
        )
        self.producer.poll(0)
        return run_id

    def _watch(self) -> None:
        while not self.stop.is_set():
            # woken by the first record: `consume(n, timeout)` would hold each for the whole
            # timeout, and every step would be timed in multiples of it
            for msg in poll_batch(self._consumer, 500, 0.05):
                value = msg.value()
                if msg.error() is not None or value is None:
                    continue
                now = time.monotonic()
                topic = msg.topic() or ""
                if topic.endswith(".state"):
                    snap = decode(value, "Snapshot").record
                    state = json.loads(snap["state"]) if snap["state"] else None
                    if state is None:
                        continue
                    run_id, step = snap["run_id"], int(state["step"])
                    with self._lock:
                        seen = self.step_seen.get(run_id)
                        if seen is None:
                            began = self.submitted.get(run_id, now)
                            self.step_seen[run_id] = (step, began)
                        elif step > seen[0]:
                            latency = (now - seen[1]) / (step - seen[0])
                            self.step_latencies.append((run_id, latency))
                            self.step_seen[run_id] = (step, now)
                else:
                    result = decode(value, "Result").record
                    with self._lock:
                        submitted = self.submitted.get(result["run_id"])
                        if submitted is not None and result["run_id"] not in self.done:
                            self.done[result["run_id"]] = result["status"]
                            self.latency_of[result["run_id"]] = now - submitted

    def level(
        self, concurrency: int, runs: int, timeout: float, scenario: str = SCENARIO
    ) -> dict[str, Any]:
        self.producer.flush(10)
        with self._lock:
            base_steps = len(self.step_latencies)
        started = time.monotonic()
        mine: list[str] = []
        next_index = 0
        deadline = started + timeout
        while time.monotonic() < deadline:
            with self._lock:
                in_flight = sum(1 for r in mine if r not in self.done)
                finished = sum(1 for r in mine if r in self.done)
            if finished >= runs:
                break
            while in_flight < concurrency and next_index < runs:
                mine.append(self.submit(concurrency, next_index, scenario))
                next_index += 1
                in_flight += 1
            self.producer.flush(5)
            time.sleep(0.005)
        elapsed = time.monotonic() - started
        with self._lock:
            figures = level_figures(
                mine, self.step_latencies[base_steps:], self.latency_of, self.done, elapsed
            )
        self.last_runs = mine
        return {"concurrency": concurrency, "runs": runs, **figures}

    def close(self) -> None:
        self.stop.set()
        self._watcher.join(timeout=10)
        close_consumer(self._consumer, 10)


def level_figures(
    mine: Sequence[str],
    steps_seen: Sequence[tuple[str, float]],
    latency_of: Mapping[str, float],
    done: Mapping[str, str],
    elapsed: float,
) -> dict[str, Any]:
    """A level's figures from its own runs only: runs of an earlier level that end during it
    (the slow runs `_mixed` starts before its instant ones) are not this level's."""
    own = set(mine)
    steps = sorted(x for r, x in steps_seen if r in own)
    run_lat = sorted(latency_of[r] for r in mine if r in latency_of)
    statuses = [done.get(r, "UNFINISHED") for r in mine]
    return {
        "completed": sum(1 for s in statuses if s != "UNFINISHED"),
        "succeeded": statuses.count("SUCCEEDED"),
        "seconds": round(elapsed, 2),
        "durable_steps_per_s": round(len(steps) / elapsed, 1) if elapsed else 0.0,
        "step_latency_p50_ms": round(percentile(steps, 0.5) * 1000, 1),
        "step_latency_p99_ms": round(percentile(steps, 0.99) * 1000, 1),
        "run_latency_p50_ms": round(percentile(run_lat, 0.5) * 1000, 1),
        "run_latency_p99_ms": round(percentile(run_lat, 0.99) * 1000, 1),
    }


def _wait_for(url: str, timeout: float) -> None:
    """Until ``url`` answers (a server the supervisor started is listening)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _scenarios_dir(root: Path) -> Path:
    """A scenario directory with ``SCENARIO_ALONE``: ``SCENARIO`` under another name, and
    ``SCENARIO_MCP``: its steps as calls of the MCP server's ``set_order_note``."""
    root.mkdir(exist_ok=True)
    scenario = json.loads((BUILTIN_SCENARIOS / f"{SCENARIO}.json").read_text())
    scenario["name"] = SCENARIO_ALONE
    (root / f"{SCENARIO_ALONE}.json").write_text(json.dumps(scenario))
    turns = []
    for i, turn in enumerate(scenario["turns"], start=1):
        if turn.get("tool_calls"):
            arguments = {"order_id": f"O-{i}", "note": f"bench step {i}"}
            call = {"name": f"{MCP_SERVER}__set_order_note", "arguments": arguments}
            turn = {**turn, "tool_calls": [call]}
        turns.append(turn)
    mcp = {**scenario, "name": SCENARIO_MCP, "turns": turns}
    (root / f"{SCENARIO_MCP}.json").write_text(json.dumps(mcp))
    return root


def _registry_with_mcp(root: Path, mcp_url: str) -> Path:
    """The example registry plus the example MCP server at ``mcp_url``."""
    registry = json.loads(tool_server.DEFAULT_REGISTRY.read_text())
    registry["mcp_servers"] = [mcp_server.dev_registry_entry(mcp_url, MCP_SERVER)]
    path = root / "tools.json"  # beside the scenario directory: the model server reads it all
    path.write_text(json.dumps(registry))
    return path


def _mcp_tools(registry: Path) -> tuple[ToolSpec, ...]:
    """The MCP server's tools as its listing declares them."""
    entries = tools_of(ToolRegistry.load(registry)).values()
    return tuple(
        ToolSpec(name=e.name, parameters=dict(e.parameters), permission=e.permission,
                 idempotent=e.idempotent)
        for e in entries
        if e.backend == "mcp"
    )  # fmt: skip


def _tool_paths(
    http: Sequence[Mapping[str, Any]], mcp: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Per level: the tool executor's and the tool server's CPU per step on each path."""
    out: dict[str, Any] = {}
    for h, m in zip(http, mcp, strict=True):
        h_cpu, m_cpu = h.get("cpu_us_per_step") or {}, m.get("cpu_us_per_step") or {}
        http_exec, mcp_exec = h_cpu.get("tool-executor"), m_cpu.get("tool-executor")
        out[str(h["concurrency"])] = {
            "http_tool_executor_cpu_us_per_step": http_exec,
            "mcp_tool_executor_cpu_us_per_step": mcp_exec,
            "mcp_over_http": round(mcp_exec / http_exec, 2) if http_exec and mcp_exec else None,
            "http_tool_server_cpu_us_per_step": h_cpu.get("tool-server"),
            "mcp_server_cpu_us_per_step": m_cpu.get("mcp-server"),
            "http_durable_steps_per_s": h["durable_steps_per_s"],
            "mcp_durable_steps_per_s": m["durable_steps_per_s"],
        }
    return out


#: Processes whose work tracing does not change (the records are the same, a traceparent header
#: aside): how their CPU per step moves between phases shows the machine's drift. Not a control
#: to divide by: their CPU per step also follows the pipeline's pace (0.943-0.953 in one run of
#: three trials where tracing slowed the steps by 6%, 1.08 in another).
TRACING_CONTROL = ("broker", "postgres", "bench")


def _tracing_overhead(
    off: Sequence[Sequence[Mapping[str, Any]]], on: Sequence[Sequence[Mapping[str, Any]]]
) -> dict[str, Any]:
    """Per level, from phases that alternate off, on, off, ... (``off`` one longer than ``on``,
    each phase the levels measured on an equal share of the runs): each process's CPU per step
    with tracing on (the mean over the on phases) and off (over each on phase's two neighbours,
    so that a machine speeding up or slowing down steadily weighs on both sides alike), the
    pipeline's (processors and executors: what makes spans) on over off, and that ratio for
    each on phase against its neighbours. A phase the machine slowed down alone still weighs on
    one side, so the same ratios are given for the processes tracing does not touch
    (`TRACING_CONTROL`): a phase where they moved as much as the pipeline was the machine's."""
    out: dict[str, Any] = {}
    for at, first in enumerate(off[0]):
        ons = [_cpu_of(phase[at]) for phase in on]
        offs = [_cpu_of(phase[at]) for phase in off]
        pipeline = [n for n in offs[0] if n.startswith(("processor", "model-executor", "tool-"))]
        pipeline = [n for n in pipeline if n != "tool-server"]
        off_cpu = _mean_cpu([_mean_cpu(offs[i : i + 2]) for i in range(len(on))])
        on_cpu = _mean_cpu(ons)

        def total(cpu: Mapping[str, float | None], names: Sequence[str]) -> float:
            return sum(cpu.get(n) or 0.0 for n in names)

        pipe_off, pipe_on = [total(c, pipeline) for c in offs], [total(c, pipeline) for c in ons]
        ctl_off = [total(c, TRACING_CONTROL) for c in offs]
        ctl_on = [total(c, TRACING_CONTROL) for c in ons]
        pipeline_ratio, by_phase = _neighbour_ratios(pipe_off, pipe_on)
        control_ratio, control_by_phase = _neighbour_ratios(ctl_off, ctl_on)
        out[str(first["concurrency"])] = {
            "off_cpu_us_per_step": {n: off_cpu.get(n) for n in pipeline},
            "on_cpu_us_per_step": {n: on_cpu.get(n) for n in pipeline},
            "pipeline_off_cpu_us_per_step": round(total(off_cpu, pipeline), 1),
            "pipeline_on_cpu_us_per_step": round(total(on_cpu, pipeline), 1),
            "pipeline_on_over_off": pipeline_ratio,
            "pipeline_on_over_off_by_phase": by_phase,
            "control_on_over_off_by_phase": control_by_phase,
            "control_on_over_off": control_ratio,
            "off_durable_steps_per_s": _mean(p[at].get("durable_steps_per_s") for p in off),
            "on_durable_steps_per_s": _mean(p[at].get("durable_steps_per_s") for p in on),
        }
    return out


def _neighbour_ratios(
    off: Sequence[float], on: Sequence[float]
) -> tuple[float | None, list[float | None]]:
    """A figure measured in phases off, on, off, ... (``off`` one longer): the mean of the on
    phases over the mean of their neighbours' means, and each on phase over its neighbours'."""
    around = [(off[i] + off[i + 1]) / 2 for i in range(len(on))]
    by_phase = [round(o / a, 3) if a else None for o, a in zip(on, around, strict=True)]
    whole = sum(around)
    return (round(sum(on) / whole, 3) if whole else None), by_phase


def _cpu_of(level: Mapping[str, Any]) -> dict[str, float | None]:
    return dict(level.get("cpu_us_per_step") or {})


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(sum(present) / len(present), 1) if present else None


def _mean_cpu(tables: Sequence[Mapping[str, float | None]]) -> dict[str, float]:
    """Each process's CPU microseconds per step, the mean over ``tables`` (process -> figure,
    each over an equal share of the runs)."""
    out: dict[str, float] = {}
    for name in {n for table in tables for n in table}:
        mean = _mean(table.get(name) for table in tables)
        if mean is not None:
            out[name] = mean
    return out


def _mixed(driver: Driver, slow: int, instant: int, timeout: float) -> dict[str, Any]:
    """``instant`` runs one after the other with nothing else running, then the same beside
    ``slow`` runs started together (their model calls slowed): the instant runs' latency
    beside them over alone (1.0: the slow runs hold them back not at all)."""
    alone = driver.level(1, instant, timeout, scenario=SCENARIO_ALONE)
    alone_ids = driver.last_runs
    slow_ids = [driver.submit("mixed-slow", i) for i in range(slow)]
    driver.producer.flush(10)
    time.sleep(1.0)  # the slow runs' first calls are under way
    beside = driver.level(1, instant, timeout, scenario=SCENARIO_ALONE)
    beside_ids = driver.last_runs
    slow_done = [r for r in slow_ids if r in driver.done]
    deadline = time.monotonic() + timeout
    while len(slow_done) < len(slow_ids) and time.monotonic() < deadline:
        time.sleep(0.2)
        slow_done = [r for r in slow_ids if r in driver.done]
    slow_latency = [driver.latency_of[r] for r in slow_done]
    alone_ms, beside_ms = alone["run_latency_p50_ms"], beside["run_latency_p50_ms"]
    return {
        "slow_runs": slow,
        "instant_runs": instant,
        "instant_alone_ms_p50": alone_ms,
        "instant_beside_ms_p50": beside_ms,
        "instant_beside_over_alone": round(beside_ms / alone_ms, 3) if alone_ms else None,
        # where the instant runs' time went, per hop (`agentruns.bench.hops`)
        "instant_hops_ms_p50": hop_splits(
            driver.bootstrap,
            driver.prefix,
            driver.partitions,
            {"alone": alone_ids, "beside": beside_ids},
        ),
        "slow_completed": len(slow_done),
        "slow_run_latency_p50_ms": round(percentile(slow_latency, 0.5) * 1000, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns bench loop", description=__doc__)
    parser.add_argument("--levels", default="1,16,64", help="concurrent runs per level")
    parser.add_argument(
        "--runs", default="20,300,700", help="runs per level (at least 1,000 in all)"
    )
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument(
        "--gather-ms",
        type=int,
        default=ExecutorConfig.gather_ms,
        help="the executors' --gather-ms",
    )
    parser.add_argument(
        "--fetch-window-ms",
        type=int,
        default=ProcessorConfig.fetch_window_ms,
        help="the processors' --fetch-window-ms (0: each input fetched as it lands)",
    )
    parser.add_argument("--processors", type=int, default=1, help="processor processes")
    parser.add_argument(
        "--executors", type=int, default=1, help="executor processes of each kind (model, tool)"
    )
    parser.add_argument(
        "--model-latency",
        default=None,
        metavar="MEDIAN_MS[:SIGMA]",
        help="every model call of the runs takes a log-normal time with this median (sigma"
        " 0.5 unless given), streamed a chunk every --chunk-ms; e.g. 2000:0.5",
    )
    parser.add_argument(
        "--tool-latency",
        default=None,
        metavar="MIN_MS:MAX_MS",
        help="every tool call takes a log-uniform time between these; e.g. 50:2000",
    )
    parser.add_argument("--chunk-ms", type=float, default=50.0, help="see --model-latency")
    parser.add_argument(
        "--mixed",
        default=None,
        metavar="SLOW:INSTANT",
        help="after the levels: INSTANT runs with instant model and tool calls alone, then"
        " beside SLOW runs whose model calls take --model-latency (default 2000:0.5)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="the executors' --max-in-flight (default: 512, or the highest level if higher)",
    )
    parser.add_argument(
        "--tool-path",
        choices=("http", "mcp", "both"),
        default="http",
        help="the runs' tool calls: the example HTTP tool server, the example MCP server, or"
        " the levels once on each (HTTP first)",
    )
    parser.add_argument(
        "--tracing",
        choices=("off", "on", "both"),
        default="off",
        help="the pipeline's tracing: off, on (OTLP to a receiver that keeps nothing), or the"
        " levels in alternating phases, off first and last, to compare their CPU per step",
    )
    parser.add_argument(
        "--tracing-rounds",
        type=int,
        default=2,
        help="with --tracing both: the phases with tracing on, each between two with it off",
    )
    parser.add_argument(
        "--no-floor", action="store_true", help="skip the Kafka floor (skipped with latencies)"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per level")
    parser.add_argument("--floor-hops", type=int, default=40, help="hops per token of the floor")
    parser.add_argument("--out", default="bench/results/loop.json")
    args = parser.parse_args(list(argv) if argv is not None else None)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    runs = [int(x) for x in args.runs.split(",") if x.strip()]
    if len(runs) != len(levels):
        parser.error("--runs needs one count per level")
    if any(n < 1 for n in levels + runs):
        parser.error("--levels and --runs are positive integers")
    mixed = None
    if args.mixed:
        slow_text, _, instant_text = args.mixed.partition(":")
        if not (slow_text.isdigit() and instant_text.isdigit()):
            parser.error("--mixed is SLOW:INSTANT, two counts")
        mixed = (int(slow_text), int(instant_text))
    model_latency = args.model_latency or ("2000:0.5" if mixed else None)
    try:
        model_rule = (
            model_latency_rule(model_latency, args.chunk_ms, SCENARIO) if model_latency else None
        )
        tool_rule = tool_latency_rule(args.tool_latency) if args.tool_latency else None
    except ValueError as exc:
        parser.error(f"a latency is MEDIAN_MS[:SIGMA] or MIN_MS:MAX_MS: {exc}")
    with_latency = model_rule is not None or tool_rule is not None
    if args.tool_path != "http" and (with_latency or mixed):
        parser.error("--tool-path mcp|both measures instant backends: no latencies, no --mixed")
    if args.tracing == "both" and (args.tool_path == "both" or mixed):
        parser.error("--tracing both compares one path: not with --tool-path both nor --mixed")
    if not 1 <= args.tracing_rounds <= 10:
        parser.error("--tracing-rounds is 1 to 10")
    max_in_flight = args.max_in_flight or max(ExecutorConfig.max_in_flight, *levels)
    prefix = f"loop-{uuid.uuid4().hex[:8]}"
    with (
        ServiceStack(ephemeral=True) as stack,
        tempfile.TemporaryDirectory() as tmp,
        OtlpSink() as sink,
    ):
        assert stack.endpoints is not None
        ep = stack.endpoints
        migrate(ep.database_url)
        ensure_topics(ep.kafka_bootstrap, prefix=prefix, partitions=args.partitions)
        services = stack_labels(stack)
        # before the pipeline's processes start: nothing else of ours is on the broker
        floor = (
            None
            if with_latency or args.no_floor
            else measure(
                ep.kafka_bootstrap, levels, args.floor_hops, args.partitions, labels=services
            )
        )
        # one block of free ports: the servers', then each pipeline process's metrics port
        first = free_port_block(3 + 2 * args.executors + args.processors, start=30000)
        model_port, tool_port, mcp_port = first, first + 1, first + 2
        metrics = list(range(first + 3, first + 3 + 2 * args.executors + args.processors))
        mcp_url = f"http://127.0.0.1:{mcp_port}"
        registry = tool_server.DEFAULT_REGISTRY
        if args.tool_path != "http":
            registry = _registry_with_mcp(Path(tmp), mcp_url)
        env = {
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": ep.kafka_bootstrap,
            "DATABASE_URL": ep.database_url,
            "AGENTRUNS_LOG_LEVEL": "WARNING",
        }
        traced_env = {
            **env,
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_SERVICE_NAME": "agentruns-bench",
        }
        if args.tracing == "on":
            env = traced_env
        else:  # no exporter configured anywhere: tracing off
            env = {k: v for k, v in env.items() if not k.startswith("OTEL_")}
        sup = Supervisor(Path(tempfile.gettempdir()) / f"{prefix}-logs", env)
        common = ("--prefix", prefix)
        scenarios = _scenarios_dir(Path(tmp) / "scenarios")
        sup.add(
            "model-server",
            "agentruns.connectors.dev.servers.model_server",
            "--port",
            str(model_port),
            "--scenarios",
            str(scenarios),
        )
        sup.add(
            "tool-server", "agentruns.connectors.dev.servers.tool_server", "--port", str(tool_port)
        )
        if args.tool_path != "http":
            sup.add(
                "mcp-server", "agentruns.connectors.dev.servers.mcp_server", "--port", str(mcp_port)
            )
        watched: dict[str, str] = {}
        for i in range(args.processors):
            name = _numbered("processor", i, args.processors)
            metrics_port = metrics[2 * args.executors + i]
            watched[name] = f"http://127.0.0.1:{metrics_port}/metrics"
            sup.add(
                name,
                "agentruns.connectors.runtime.processor",
                *common,
                "--instance-id",
                str(i),
                "--fetch-window-ms",
                str(args.fetch_window_ms),
                "--log-level",
                "WARNING",
                "--metrics-address",
                f"127.0.0.1:{metrics_port}",
            )
        sampled: dict[str, str] = {}
        for k, (kind, port) in enumerate((("model", model_port), ("tool", tool_port))):
            for i in range(args.executors):
                name = _numbered(f"{kind}-executor", i, args.executors)
                metrics_port = metrics[k * args.executors + i]
                sampled[name] = f"http://127.0.0.1:{metrics_port}/metrics"
                sup.add(
                    name,
                    f"agentruns.connectors.executors.{kind}",
                    *common,
                    "--instance",
                    str(i),
                    "--base-url",
                    f"http://127.0.0.1:{port}",
                    "--registry",
                    str(registry),
                    "--gather-ms",
                    str(args.gather_ms),
                    "--max-in-flight",
                    str(max_in_flight),
                    "--metrics-address",
                    f"127.0.0.1:{metrics_port}",
                    "--log-level",
                    "INFO",  # the stats line each executor logs when it stops
                )
        sup.start_all()
        model_url, tool_url = f"http://127.0.0.1:{model_port}", f"http://127.0.0.1:{tool_port}"
        driver = Driver(ep.kafka_bootstrap, prefix, args.partitions)
        results: list[dict[str, Any]] = []
        mcp_results: list[dict[str, Any]] | None = None
        traced_results: list[dict[str, Any]] | None = None
        off_phases: list[list[dict[str, Any]]] = []
        on_phases: list[list[dict[str, Any]]] = []
        exported: dict[str, int] | None = None
        mixed_figures = None
        try:
            driver.level(1, 1, 120)  # warm-up: every process connected and joined
            if model_rule is not None:
                post_json(model_url + "/faults", model_rule)
            if tool_rule is not None:
                post_json(tool_url + "/faults", tool_rule)

            def measure_levels(scenario: str, share: float = 1.0) -> list[dict[str, Any]]:
                measured: list[dict[str, Any]] = []
                components = {  # again each time: `--tracing both` restarts the pipeline
                    c.process.pid: name
                    for name, c in sup.components.items()
                    if c.process is not None
                }
                for concurrency, whole in zip(levels, runs, strict=True):
                    count = max(1, round(whole * share))
                    print(f"level {concurrency}: {count} runs", file=sys.stderr, flush=True)
                    machine = MachineCpu.start({**services, **components})
                    sampler = InFlightSampler(sampled, watched).start()
                    level = driver.level(concurrency, count, args.timeout, scenario)
                    in_flight = sampler.stop()
                    cpu = machine.stop()
                    # every step a completed run took, the first one's too
                    steps = level["completed"] * STEPS
                    level["cpu_us_per_step"] = per_item_us(cpu.get("cpu_s_by_process"), steps)
                    level["busy_cores"] = cpu.get("busy_cores")
                    level["steal_pct"] = cpu.get("steal_pct")
                    level["in_flight"] = in_flight
                    if floor is not None:
                        floor_at = floor_level(floor, concurrency)
                        level["ratio_to_floor"] = ratios_to_floor(level, floor_at)
                    if with_latency:
                        model_latency = get_json(model_url + "/latency")
                        tool_latency = get_json(tool_url + "/latency")
                        backends = backend_ms(model_latency, tool_latency)
                        level["model_served_over_planned"] = served_over_planned(
                            model_latency, driver.last_runs
                        )
                        level.update(
                            overhead_figures(
                                driver.last_runs,
                                driver.latency_of,
                                backends,
                                concurrency,
                                level["seconds"],
                            )
                        )
                        level["planned_call_ms_mean"] = {
                            "model": planned_call_ms_mean(model_latency, driver.last_runs),
                            "tool": planned_call_ms_mean(tool_latency, driver.last_runs),
                        }
                        # what each stage added to a run beyond its own calls' time
                        level["overhead_ms_p50"] = hop_overheads(
                            driver.bootstrap,
                            driver.prefix,
                            driver.partitions,
                            driver.last_runs,
                            backend_ms_by_kind(model_latency, tool_latency),
                        )
                    measured.append(level)
                    print(json.dumps(measured[-1]), file=sys.stderr, flush=True)
                return measured

            if args.tool_path != "http":
                _wait_for(mcp_url + "/stats", 60)
                driver.tools_of[SCENARIO_MCP] = _mcp_tools(registry)
                driver.level(1, 1, 120, SCENARIO_MCP)  # warm-up: the MCP session is open

            def restart_pipeline(with_env: dict[str, str]) -> None:
                sup.env = with_env
                pipeline = [n for n in sup.components if n in watched or n in sampled]
                for name in pipeline:  # stopped cleanly: their groups hand over at once
                    sup.stop(name)
                for name in pipeline:
                    sup.start(name)
                driver.level(1, 1, 120)  # warm-up again: every process connected and joined

            scenario = SCENARIO_MCP if args.tool_path == "mcp" else SCENARIO
            if args.tracing == "both":
                share = 1 / (2 * args.tracing_rounds + 1)
                results = measure_levels(scenario, share)
                off_phases, on_phases = [results], []
                for i in range(args.tracing_rounds):
                    print(f"phase {2 * i + 2}: tracing on", file=sys.stderr, flush=True)
                    restart_pipeline(traced_env)
                    on_phases.append(measure_levels(scenario, share))
                    print(f"phase {2 * i + 3}: tracing off", file=sys.stderr, flush=True)
                    restart_pipeline(env)
                    off_phases.append(measure_levels(scenario, share))
                traced_results = on_phases[0]
            else:
                results = measure_levels(scenario)
            if args.tool_path == "both":
                print("the same levels through the MCP server", file=sys.stderr, flush=True)
                mcp_results = measure_levels(SCENARIO_MCP)
            if args.tracing != "off":
                exported = sink.counts()
            if mixed is not None:
                print(f"mixed: {mixed[1]} instant beside {mixed[0]} slow", file=sys.stderr)
                # instant: every call of the instant runs, their tools' too
                urllib.request.urlopen(
                    urllib.request.Request(tool_url + "/faults", method="DELETE"), timeout=10
                ).close()
                mixed_figures = _mixed(driver, mixed[0], mixed[1], args.timeout)
                print(json.dumps(mixed_figures), file=sys.stderr, flush=True)
            rss = {
                name: _peak_rss_mib(c.process.pid)
                for name, c in sup.components.items()
                if c.process is not None
            }
        finally:
            driver.close()
            sup.stop_all()
        stats = {name: executor_stats(sup.log_dir / f"{name}.log") for name in sampled}
    by_level = {str(level["concurrency"]): level for level in results}
    figures = {
        "bench": "loop",
        "steps_per_run": STEPS,
        # every phase's runs with --tracing both
        "runs_total": sum(r["runs"] for p in off_phases + on_phases or [results] for r in p),
        "gather_ms": args.gather_ms,
        "fetch_window_ms": args.fetch_window_ms,
        "partitions": args.partitions,
        "max_in_flight": max_in_flight,
        "model_latency": model_rule,
        "tool_latency": tool_rule,
        "processes": {"processor": args.processors, "executors_per_kind": args.executors},
        "levels": results,
        # the levels again by concurrency: `agentruns bench repeat` takes medians of objects,
        # not of lists
        "by_level": by_level,
        "mixed": mixed_figures,
        "peak_rss_mib": rss,
        "executor_stats": stats,
        "floor": floor,
        "tool_path": args.tool_path,
    }
    figures["tracing_mode"] = args.tracing
    figures["otlp_exported"] = exported
    if traced_results is not None:
        figures["traced_levels"] = traced_results
        figures["tracing"] = _tracing_overhead(off_phases, on_phases)
    if mcp_results is not None:
        figures["mcp_levels"] = mcp_results
        figures["tool_paths"] = _tool_paths(results, mcp_results)
    figures.update(evaluate(figures, targets(with_latency, by_level, mixed_figures)))
    report(figures, args.out)
    return 0


#: With backends that take time, at this many concurrent runs (2 s median model calls):
LATENCY_TARGET_LEVEL = "512"
LATENCY_TARGETS = (
    # each run's latency over its own backends' latencies
    Target(f"by_level.{LATENCY_TARGET_LEVEL}.run_over_backend_p50", 1.10, at_most=True),
    Target(f"by_level.{LATENCY_TARGET_LEVEL}.run_over_backend_p99", 1.25, at_most=True),
    # steps/s against the ideal closed loop for those latencies
    Target(f"by_level.{LATENCY_TARGET_LEVEL}.throughput_vs_ideal", 0.9),
)
#: An instant run beside slow ones, against the same run alone.
MIXED_TARGET = Target("mixed.instant_beside_over_alone", 1.2, at_most=True)


def targets(
    with_latency: bool, by_level: Mapping[str, Any], mixed: Mapping[str, Any] | None
) -> list[Target]:
    """The targets the run's figures can be judged on."""
    out = list(LATENCY_TARGETS) if with_latency and LATENCY_TARGET_LEVEL in by_level else []
    if mixed is not None:
        out.append(MIXED_TARGET)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
