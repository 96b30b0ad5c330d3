"""``agentruns bench inflight``: the CPU and memory one streamed model call in flight costs the
model executor's client.

The scripted model server (its own process; one per ``--calls-per-server`` calls in flight,
500 by default: past a few hundred connections a threaded Python server's own GIL holds its
streams back) answers every call with the same streamed tool call (``SCENARIO``: a short text
and a ``create_ticket`` call in 31 SSE events), each event held back ``--delay-ms`` by the
``slow`` fault, so a call lasts about 1.5 s as a real model's does and its client spends that
time waiting. For each level N of ``--levels`` a fresh child process runs one event loop with
N tasks, each calling :meth:`ModelHandler.stream` (the model executor's own call: the shared
``KeepAliveHTTP`` and its kept connections, the SSE lines folded into ``StreamAssembler``) over
and over, so N calls stay in flight (a task starts its next call as soon as its last one ends;
the first calls are spread over one call's nominal time) for ``--warmup`` plus ``--seconds``
seconds.

Over the measured window (after the warmup) this process reads from ``/proc``: the child's CPU
(user + system) and the model servers', the child's peak RSS (``VmHWM``) and its threads; the
child reports its RSS before its first call, every call's start and end, and how late a probe
(a task sleeping 10 ms over and over) woke. Figures per level: calls completed in the window,
the mean number in flight, client CPU per call and per SSE chunk, how many calls of the nominal
duration one core carries at that CPU per call, RSS per call in flight ((peak RSS - RSS before
the calls) / N), the wall latency p50/p99 of a call over its nominal latency (events x delay:
above 1, the calls were delayed, by the client, the servers or a busy machine), the probe's
wake lag p50/p99 (how long ready work waits for the event loop and for a core), the model
servers' CPU per call, and the cores the rest of the machine used meanwhile
(``other_cores``).

Every level runs once per trial (``--trials``, the levels in order within each trial) and
every figure is reported as the median of the trials with min and max; a shared VM's speed
moves within the hour, so only figures of one run compare. One JSON object on the last line,
also written to bench/results/inflight.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from agentruns.bench.latency import percentile
from agentruns.bench.machine import MachineCpu, process_cpu_seconds
from agentruns.bench.repeat import combine
from agentruns.bench.results_file import report
from agentruns.connectors.executors.model import ModelHandler, RouteConfig, Routes
from agentruns.processors.events import ModelOutcome

#: the answer of every call: some text, then one tool call (the common shape of an agent step)
SCENARIO: dict[str, Any] = {
    "name": "inflight",
    "description": "agentruns bench inflight: a short text and one tool call, ~30 SSE events",
    "chunk_chars": 12,
    "turns": [
        {
            "content": "The customer asks for a refund of a duplicate charge on the last "
            "invoice. Refunds go through the billing team, so I will open a ticket for them "
            "with the order number and both charge dates from the message.",
            "tool_calls": [
                {
                    "name": "create_ticket",
                    "arguments": {
                        "title": "Refund a duplicate charge on the last invoice",
                        "priority": "normal",
                        "team": "billing",
                    },
                }
            ],
        }
    ],
}

Json = dict[str, Any]
# one call of a child: (start, end) on the monotonic clock (one clock for every process of
# the machine on Linux), and whether it finished
Call = tuple[float, float, bool]
# one wake of the probe: (when it went to sleep, how late it woke)
Lag = tuple[float, float]
#: how long the probe sleeps: its lateness is how long work that is ready waits in the client
PROBE_S = 0.01


# --------------------------------------------------------------------------- one child


def rss_kib(pid: int | str = "self") -> tuple[int, int, int]:
    """(VmRSS, VmHWM in KiB, threads) of a process (Linux ``/proc``; zeros elsewhere)."""
    found = {"VmRSS": 0, "VmHWM": 0, "Threads": 0}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in found:
                found[name] = int(value.split()[0])
    return found["VmRSS"], found["VmHWM"], found["Threads"]


def window_figures(calls: Sequence[Call], t0: float, t1: float, nominal_s: float) -> Json:
    """What a child's calls say about the window ``[t0, t1]``: calls that ended in it (and
    how many of them did not finish), the mean number in flight over it, the wall latency
    p50/p99 of the calls that ended in it and its ratio to the nominal latency."""
    ended = [c for c in calls if t0 <= c[1] <= t1]
    latencies = [end - start for start, end, ok in ended if ok]
    overlap = sum(max(0.0, min(end, t1) - max(start, t0)) for start, end, _ in calls)
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    return {
        "calls": sum(1 for c in ended if c[2]),
        "failed": sum(1 for c in ended if not c[2]),
        "mean_in_flight": round(overlap / (t1 - t0), 1) if t1 > t0 else None,
        "latency_p50_s": round(p50, 3) if latencies else None,
        "latency_p99_s": round(p99, 3) if latencies else None,
        "latency_p50_ratio": round(p50 / nominal_s, 3) if latencies else None,
        "latency_p99_ratio": round(p99 / nominal_s, 3) if latencies else None,
    }


def lag_figures(lags: Sequence[Lag], t0: float, t1: float) -> Json:
    """The probe's lateness in ``[t0, t1]``, p50/p99 in ms: how long a task that is ready to
    run waits for the event loop and for a core."""
    late = [lag for at, lag in lags if t0 <= at <= t1]
    if not late:
        return {"wake_lag_ms_p50": None, "wake_lag_ms_p99": None}
    return {
        "wake_lag_ms_p50": round(percentile(late, 0.5) * 1e3, 2),
        "wake_lag_ms_p99": round(percentile(late, 0.99) * 1e3, 2),
    }


def _payload(worker: int) -> dict[str, Any]:
    """A call's body as ``ModelHandler.execute`` builds it (a short conversation)."""
    return {
        "model": "scenario:inflight",
        "messages": [
            {"role": "system", "content": "You are a support agent. Use the tools."},
            {"role": "user", "content": "I was charged twice for my last invoice."},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": f"inflight-{worker}",
    }


def _route(url: str, delay_ms: float) -> RouteConfig:
    return RouteConfig(
        base_url=url.rstrip("/") + "/v1",
        headers={"X-Fault": f"slow; delay_ms={delay_ms:g}", "X-Scenario": "inflight"},
    )


def run_calls(
    routes: Sequence[RouteConfig], n: int, first: float, stagger_s: float, stop: float
) -> tuple[list[Call], list[Lag]]:
    """One event loop, N tasks calling ``ModelHandler.stream`` (no database: ``stream`` touches
    none) until ``stop``; task i calls ``routes[i % len(routes)]`` and starts its first call
    ``i / N`` of ``stagger_s`` after ``first``. A probe task sleeps ``PROBE_S`` over and over
    and notes how late it wakes."""
    calls: list[Call] = []
    lags: list[Lag] = []

    async def probe() -> None:
        await asyncio.sleep(max(0.0, first - time.monotonic()))
        while (at := time.monotonic()) < stop:
            await asyncio.sleep(PROBE_S)
            lags.append((at, time.monotonic() - at - PROBE_S))

    async def worker(handler: ModelHandler, i: int) -> None:
        await asyncio.sleep(max(0.0, first + stagger_s * i / n - time.monotonic()))
        route, payload = routes[i % len(routes)], _payload(i)
        while (start := time.monotonic()) < stop:
            assembled = await handler.stream(route, payload)
            calls.append((start, time.monotonic(), assembled.outcome is ModelOutcome.FINISHED))

    async def main() -> None:
        handler = ModelHandler("postgresql://unused.invalid/none", Routes({}, routes[0]))
        try:
            await asyncio.gather(probe(), *(worker(handler, i) for i in range(n)))
        finally:
            handler.close()  # in the loop's thread; the closed transports let go of their
            for _ in range(2):  # sockets on the loop's next turns
                await asyncio.sleep(0)

    asyncio.run(main())
    return calls, lags


def client_main(args: argparse.Namespace) -> int:
    """A child: report its RSS and window, keep N calls in flight, report the calls."""
    routes = [_route(url, args.delay_ms) for url in args.url.split(",")]
    rss_before, _, threads_before = rss_kib()
    first = time.monotonic() + 0.2
    t0 = first + args.warmup
    t1 = t0 + args.seconds
    print(
        json.dumps(
            {"rss_before_kib": rss_before, "threads_before": threads_before, "t0": t0, "t1": t1}
        ),
        flush=True,
    )
    calls, lags = run_calls(routes, args.in_flight, first, args.nominal_s, t1)
    figures = {**window_figures(calls, t0, t1, args.nominal_s), **lag_figures(lags, t0, t1)}
    figures["calls_total"] = len(calls)
    figures["ru_maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(figures), flush=True)
    return 0


# --------------------------------------------------------------------------- the parent


def scenario_events() -> int:
    """The SSE events (chunks and ``[DONE]``) of a ``SCENARIO`` answer, as the model server
    sends them to a call that asks for usage: the role delta, the deltas, the finish chunk,
    the usage chunk and ``[DONE]``."""
    from agentruns.connectors.dev.servers.model_server import Answer, Scenario

    scenario = Scenario.model_validate(SCENARIO)
    answer = Answer(scenario, scenario.turn(0), "inflight-0", 0, "")
    return 1 + len(answer.deltas()) + 3


@contextlib.contextmanager
def model_server(scenarios: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A model server process with the bench's scenario: (its process, its URL)."""
    command = [
        sys.executable,
        "-m",
        "agentruns.connectors.dev.servers.model_server",
        "--port",
        "0",
        "--scenarios",
        str(scenarios),
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        if "listening on " not in banner:
            raise RuntimeError(f"the model server did not start: {banner!r}")
        yield proc, banner.split("listening on ", 1)[1].split()[0]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _cpu_seconds(pids: Sequence[int]) -> float | None:
    """User + system CPU seconds of processes together (None without ``/proc``)."""
    seconds = [process_cpu_seconds(pid) for pid in pids]
    return None if None in seconds else sum(s for s in seconds if s is not None)


def run_figures(
    child: Json,
    *,
    in_flight: int,
    window_s: float,
    client_cpu_s: float,
    server_cpu_s: float,
    peak_rss_kib: int,
    rss_before_kib: int,
    threads: int,
    chunks_per_call: int,
    nominal_s: float,
) -> Json:
    """One child's figures over the measured window, from its report and ``/proc``.
    ``in_flight_per_core``: how many calls of ``nominal_s`` one core keeps in flight at this
    CPU per call (a core's CPU seconds per second over CPU seconds per call is calls per
    second; times a call's duration, calls in flight)."""
    calls = child["calls"]

    def per_call(seconds: float) -> float:
        return seconds / calls if calls else float("nan")

    return {
        **{k: child[k] for k in ("calls", "failed", "mean_in_flight")},
        "calls_per_s": round(calls / window_s, 1),
        "cpu_ms_per_call": round(per_call(client_cpu_s) * 1e3, 4),
        "cpu_us_per_chunk": round(per_call(client_cpu_s) / chunks_per_call * 1e6, 2),
        "client_cores": round(client_cpu_s / window_s, 3),
        "in_flight_per_core": round(nominal_s / per_call(client_cpu_s))
        if calls and client_cpu_s > 0
        else None,
        "rss_before_mib": round(rss_before_kib / 1024, 1),
        "peak_rss_mib": round(peak_rss_kib / 1024, 1),
        "rss_kib_per_call": round((peak_rss_kib - rss_before_kib) / in_flight, 1),
        "threads": threads,
        **{k: child[k] for k in child if k.startswith(("latency_", "wake_lag_"))},
        "server_cpu_ms_per_call": round(per_call(server_cpu_s) * 1e3, 4),
        "server_cores": round(server_cpu_s / window_s, 3),
    }


def measure(in_flight: int, args: argparse.Namespace, scenarios: Path, nominal_s: float) -> Json:
    """One child at ``in_flight`` calls against fresh model servers (one per
    ``--calls-per-server`` calls in flight, the calls spread evenly): its figures."""
    chunks_per_call = scenario_events() - 1  # [DONE] is no chunk
    count = -(-in_flight // args.calls_per_server)
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(model_server(scenarios)) for _ in range(count)]
        servers = [proc.pid for proc, _ in started]
        command = [
            sys.executable,
            "-m",
            "agentruns.bench.inflight",
            "--child",
            "--url",
            ",".join(url for _, url in started),
            "--in-flight",
            str(in_flight),
            "--warmup",
            str(args.warmup),
            "--seconds",
            str(args.seconds),
            "--delay-ms",
            str(args.delay_ms),
            "--nominal-s",
            str(nominal_s),
        ]
        child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            start = json.loads(child.stdout.readline())
            time.sleep(max(0.0, start["t0"] - time.monotonic()))
            cpu = MachineCpu.start({child.pid: "client", **dict.fromkeys(servers, "model_server")})
            client0, server0 = process_cpu_seconds(child.pid), _cpu_seconds(servers)
            began = time.monotonic()
            threads = 0
            while (now := time.monotonic()) < start["t1"]:
                threads = max(threads, rss_kib(child.pid)[2])
                time.sleep(min(0.5, start["t1"] - now))
            client1, server1 = process_cpu_seconds(child.pid), _cpu_seconds(servers)
            window_s = time.monotonic() - began
            _, peak, last_threads = rss_kib(child.pid)
            machine = cpu.stop()
            report = json.loads(child.stdout.readline())
            if child.wait(60) != 0:
                raise RuntimeError(f"the client failed (exit {child.returncode})")
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
    if client0 is None or client1 is None or server0 is None or server1 is None:
        raise RuntimeError("no /proc: the bench measures CPU on Linux only")
    figures = run_figures(
        report,
        in_flight=in_flight,
        window_s=window_s,
        client_cpu_s=client1 - client0,
        server_cpu_s=server1 - server0,
        peak_rss_kib=peak or report["ru_maxrss_kib"],
        rss_before_kib=start["rss_before_kib"],
        threads=max(threads, last_threads),
        chunks_per_call=chunks_per_call,
        nominal_s=nominal_s,
    )
    figures["servers"] = count
    figures["steal_pct"] = machine.get("steal_pct")
    figures["busy_cores"] = machine.get("busy_cores")
    # everything else the machine ran meanwhile (this bench's parent included: it sleeps)
    by_process = machine.get("cores_by_process") or {}
    figures["other_cores"] = round(
        sum(v for k, v in by_process.items() if k not in ("client", "model_server")), 2
    )
    return figures


def summarize(runs: Sequence[Json], levels: Sequence[int]) -> Json:
    """``median``, ``min`` and ``max`` of every figure by level (each run: ``in_flight`` and
    its ``figures``); a level no run measured is left out."""
    out: Json = {"median": {}, "min": {}, "max": {}}
    for level in levels:
        trials = [r["figures"] for r in runs if r["in_flight"] == level]
        if not trials:
            continue
        for name, pick in (("median", statistics.median), ("min", min), ("max", max)):
            out[name][str(level)] = combine(trials, pick)
    return out


def _levels(text: str) -> list[int]:
    try:
        levels = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("levels are positive integers, e.g. 100,500,1000")
    return levels


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns bench inflight", description=__doc__)
    parser.add_argument("--levels", type=_levels, default=[100, 500, 1000], help="calls in flight")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="per SSE event")
    parser.add_argument(
        "--calls-per-server",
        type=int,
        default=500,
        help="calls in flight per model server process (a threaded Python server: past a few "
        "hundred connections its own GIL delays the streams)",
    )
    parser.add_argument("--out", default="bench/results/inflight.json")
    # a child (started by this bench): one level
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--in-flight", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--nominal-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.child:
        return client_main(args)
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    if args.calls_per_server < 1:
        parser.error("--calls-per-server must be at least 1")

    from agentruns.bench.core import host_speed

    events = scenario_events()
    nominal_s = events * args.delay_ms / 1000
    speed = host_speed()
    runs: list[Json] = []
    with tempfile.TemporaryDirectory() as tmp:
        scenarios = Path(tmp)
        (scenarios / "inflight.json").write_text(json.dumps(SCENARIO))
        for trial in range(1, args.trials + 1):
            for level in args.levels:
                print(f"trial {trial}: {level} calls in flight", file=sys.stderr, flush=True)
                run = {
                    "trial": trial,
                    "in_flight": level,
                    "figures": measure(level, args, scenarios, nominal_s),
                }
                print(json.dumps(run), file=sys.stderr, flush=True)
                runs.append(run)
    result: Json = {
        "bench": "inflight",
        "levels": args.levels,
        "trials_run": args.trials,
        "delay_ms": args.delay_ms,
        "calls_per_server": args.calls_per_server,
        "events_per_call": events,
        "chunks_per_call": events - 1,
        "nominal_call_s": round(nominal_s, 3),
        "warmup_s": args.warmup,
        "seconds": args.seconds,
        "host_speed": speed,
        "load_average": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        **summarize(runs, args.levels),
        "runs": runs,
    }
    report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
