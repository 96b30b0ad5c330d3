"""``agentruns bench inflight``: the CPU and memory one streamed model call in flight costs its
client, threads with the blocking client against one asyncio event loop.

The scripted model server (its own process; one per ``--calls-per-server`` calls in flight,
500 by default: past a few hundred connections a threaded Python server's own GIL holds its
streams back) answers every call with the same streamed tool call (``SCENARIO``: a short text
and a ``create_ticket`` call in 31 SSE events), each event held back ``--delay-ms`` by the
``slow`` fault, so a call lasts about 1.5 s as a real model's does and its client spends that
time waiting. Each client variant runs in a fresh child process
that keeps ``N`` calls in flight (a call starts as soon as the previous one of its worker ends)
for ``--warmup`` plus ``--seconds`` seconds:

- ``threads``: N threads, each calling :meth:`ModelHandler.stream` (the model executor's own
  call: ``KeepAliveHTTP.stream``, its kept connection per thread, the SSE folding into
  ``StreamAssembler``);
- ``asyncio``: one event loop, N tasks, each a minimal streaming client
  (:class:`AsyncModelClient`: ``asyncio.open_connection``, an HTTP/1.1 keep-alive request, the
  chunked body and the SSE lines decoded by :class:`ChunkedBody` and :class:`SseLines`) folding
  every ``data:`` line into a ``StreamAssembler`` with the model executor's own ``_fold_line``,
  under the same deadline, read timeout and byte limits.

Over the measured window (after the warmup) this process reads from ``/proc``: the child's CPU
(user + system) and the model server's, the child's peak RSS (``VmHWM``) and its threads; the
child reports its RSS before its first call, every call's start and end, and how late a probe
(a thread, or a task, sleeping 10 ms over and over) woke. Figures per variant and level: calls
completed in the window, the mean number in flight, client CPU per call and per SSE chunk, RSS
per call in flight ((peak RSS - RSS before the calls) / N), the wall latency p50/p99 of a call
over its nominal latency (events x delay: above 1, the calls were delayed, by the client, the
server or a busy machine), the probe's wake lag p50/p99 (how long ready work waits in the
client: for the GIL, or the event loop, and for a core), the model server's CPU per call, and
the cores the rest of the machine used meanwhile (``other_cores``).

Trials are interleaved (for each trial, each level: threads, then asyncio) and every figure is
reported as the median of the trials with min and max; a shared VM's speed moves within the hour,
so only figures of one run compare. ``verdict`` is computed from the medians at ``--reference``
calls in flight. One JSON object on the last line, also written to bench/results/inflight.json.
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
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from agentruns.bench.latency import percentile
from agentruns.bench.machine import MachineCpu, process_cpu_seconds
from agentruns.bench.repeat import combine
from agentruns.connectors.executors.http import (
    MAX_CHUNK_LINE_BYTES,
    MAX_HEAD_LINES,
    BodyTooLargeError,
    HTTPWireError,
    _chunk_size,
)
from agentruns.connectors.executors.model import (
    _JSON,
    AFTER_DONE_S,
    Assembled,
    MalformedChunkError,
    ModelHandler,
    RouteConfig,
    Routes,
    StreamAssembler,
    _fold_line,
    replace_outcome,
)
from agentruns.processors.events import ModelOutcome
from agentruns.streams import tracing

VARIANTS = ("threads", "asyncio")

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


# --------------------------------------------------------------------------- the wire, sans I/O


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """The status and lower-cased headers of an HTTP/1.x response head (its lines, with or
    without the blank line that ends it)."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not (code.isascii() and code.isdigit()):
        raise HTTPWireError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    if len(lines) > MAX_HEAD_LINES + 2:
        raise HTTPWireError("response head has too many lines")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(code), headers


_SIZE = -1  # a chunk-size line is next
_CRLF = -2  # the CRLF after a chunk's data is next
_TRAILERS = -3  # trailer lines up to the empty one


class ChunkedBody:
    """Decodes a chunked HTTP/1.1 body from the bytes as they arrive: :meth:`feed` returns the
    body's pieces those bytes complete; ``done`` once the last chunk and the trailers were read.
    The same limits as ``KeepAliveHTTP``: ``limit`` body bytes (``BodyTooLargeError``), a
    chunk-size line of ``MAX_CHUNK_LINE_BYTES``, ``MAX_HEAD_LINES`` trailers; a byte after the
    end is an error (nothing was asked for it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self.done = False
        self._buffer = bytearray()
        self._state = _SIZE  # or, >= 0, the bytes left of the current chunk's data
        self._trailers = 0

    def feed(self, data: bytes) -> list[bytes]:
        if self.done:
            if data:
                raise HTTPWireError("bytes after the end of the body")
            return []
        buffer = self._buffer
        buffer += data
        pieces: list[bytes] = []
        at = 0
        while not self.done:
            if self._state >= 0:
                if at == len(buffer):
                    break
                take = min(self._state, len(buffer) - at)
                pieces.append(bytes(buffer[at : at + take]))
                at += take
                self._state -= take
                if self._state == 0:
                    self._state = _CRLF
                continue
            end = buffer.find(b"\r\n", at)
            if end < 0:
                if len(buffer) - at > MAX_CHUNK_LINE_BYTES:
                    raise HTTPWireError(f"a line of the body over {MAX_CHUNK_LINE_BYTES} bytes")
                break
            line = bytes(buffer[at:end])
            at = end + 2
            if self._state == _CRLF:
                if line:
                    raise HTTPWireError("a chunk longer than its size")
                self._state = _SIZE
            elif self._state == _SIZE:
                size = _chunk_size(line)
                self.total += size
                if self.total > self.limit:
                    raise BodyTooLargeError(200, self.total, self.limit)
                self._state = size if size else _TRAILERS
            elif not line:
                self.done = True
            else:
                self._trailers += 1
                if self._trailers > MAX_HEAD_LINES:
                    raise HTTPWireError("response trailers have too many lines")
        del buffer[:at]
        if self.done and buffer:
            raise HTTPWireError("bytes after the end of the body")
        return pieces


class SseLines:
    """Splits a server-sent event stream into its lines (``\\r`` stripped) as its pieces
    arrive, as the model executor's ``_read_stream`` does; a line over ``max_line`` bytes is a
    ``MalformedChunkError``. :meth:`rest` is what is left at the end of the body."""

    def __init__(self, max_line: int) -> None:
        self.max_line = max_line
        self._buffer = bytearray()

    def feed(self, piece: bytes) -> list[bytes]:
        self._buffer += piece
        lines: list[bytes] = []
        if b"\n" in piece:
            *whole, rest = bytes(self._buffer).split(b"\n")
            self._buffer = bytearray(rest)
            lines = [line.rstrip(b"\r") for line in whole]
        if len(self._buffer) > self.max_line:
            raise MalformedChunkError(f"an SSE line over {self.max_line} bytes")
        return lines

    def rest(self) -> bytes:
        return bytes(self._buffer).rstrip(b"\r")


def request_head(url: str, headers: Mapping[str, str], length: int) -> bytes:
    """The head of a POST to ``url`` as ``KeepAliveHTTP`` writes it (direct, no proxy)."""
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [f"POST {target} HTTP/1.1", f"Host: {parts.netloc}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def call_headers(route: RouteConfig) -> dict[str, str]:
    """The headers of a model call, as ``ModelHandler.stream`` sends them."""
    headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream",
        **route.headers,
        **tracing.outgoing_headers(),
    }
    if route.api_key:
        headers["Authorization"] = f"Bearer {route.api_key}"
    return headers


# --------------------------------------------------------------------------- the asyncio client


class AsyncModelClient:
    """One streamed chat completion at a time over one kept connection (one per task): what
    an asyncio model executor would do per call in flight, with the bounds of the blocking one
    (the call's deadline, a wait of at most ``read_timeout_s`` per read, ``max_stream_bytes``,
    ``max_line_bytes``; after ``[DONE]`` the body's end is read for at most ``AFTER_DONE_S``, or
    the connection closed). Plain http only: the bench's server is on loopback."""

    def __init__(self, route: RouteConfig) -> None:
        self.route = route
        self.url = route.chat_url()
        parts = urlsplit(self.url)
        self.host, self.port = parts.hostname or "", parts.port or 80
        self.headers = call_headers(route)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def stream(self, payload: Mapping[str, Any]) -> Assembled:
        route, assembler = self.route, StreamAssembler()
        body = _JSON.encode(payload)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + route.total_timeout_s
        state = {"done": False}  # [DONE] was read
        try:
            async with asyncio.timeout_at(deadline) as scope:
                reader, writer = await self._connection(scope, deadline)
                writer.write(request_head(self.url, self.headers, len(body)) + body)
                await writer.drain()
                scope.reschedule(min(deadline, loop.time() + route.read_timeout_s))
                status, headers = parse_head(await reader.readuntil(b"\r\n\r\n"))
                chunked = "chunked" in headers.get("transfer-encoding", "").lower()
                if status != 200 or not chunked:
                    self.close()
                    return replace_outcome(
                        assembler.result(interrupted=f"HTTP {status}"),
                        ModelOutcome.TRANSPORT_ERROR,
                    )
                await self._read_events(reader, scope, deadline, assembler, state)
            if headers.get("connection", "").lower() == "close":
                self.close()
            return assembler.result()
        except MalformedChunkError as exc:
            self.close()
            return assembler.result(untrusted=f"malformed stream: {exc}")
        except BodyTooLargeError:
            self.close()
            return assembler.result(untrusted=f"answer over {route.max_stream_bytes} bytes")
        except (
            OSError,
            HTTPWireError,
            ValueError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
        ) as exc:
            self.close()
            if state["done"]:  # the body's end did not come in time: the answer stands
                return assembler.result()
            if assembler.chunks == 0:
                return replace_outcome(
                    assembler.result(interrupted=f"{type(exc).__name__}: {exc}"),
                    ModelOutcome.TRANSPORT_ERROR,
                )
            return assembler.result(interrupted=f"connection lost: {type(exc).__name__}: {exc}")

    async def _connection(
        self, scope: asyncio.Timeout, deadline: float
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = self._reader, self._writer
        if reader is not None and writer is not None and not reader.at_eof():
            return reader, writer
        self.close()
        loop = asyncio.get_running_loop()
        scope.reschedule(min(deadline, loop.time() + self.route.connect_timeout_s))
        reader, writer = await asyncio.open_connection(self.host, self.port)
        self._reader, self._writer = reader, writer
        scope.reschedule(deadline)
        return reader, writer

    async def _read_events(
        self,
        reader: asyncio.StreamReader,
        scope: asyncio.Timeout,
        deadline: float,
        assembler: StreamAssembler,
        state: dict[str, bool],
    ) -> None:
        """Fold the body's ``data:`` lines until its end (after ``[DONE]``, for at most
        ``AFTER_DONE_S`` more)."""
        route, loop = self.route, asyncio.get_running_loop()
        body, lines = ChunkedBody(route.max_stream_bytes), SseLines(route.max_line_bytes)
        while not body.done:
            wait = AFTER_DONE_S if state["done"] else route.read_timeout_s
            scope.reschedule(min(deadline, loop.time() + wait))
            data = await reader.read(65536)
            if not data:
                raise ConnectionResetError("connection closed by the server")
            for piece in body.feed(data):
                for line in lines.feed(piece):
                    if not state["done"] and _fold_line(line, assembler, route.max_line_bytes):
                        state["done"] = True
        rest = lines.rest()
        if rest and not state["done"]:
            _fold_line(rest, assembler, route.max_line_bytes)


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
    """The probe's lateness in ``[t0, t1]``, p50/p99 in ms: how long a thread (or task) that
    is ready to run waits for the GIL (or for the event loop) and for a core."""
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


def run_threads(
    routes: Sequence[RouteConfig], n: int, first: float, stagger_s: float, stop: float
) -> tuple[list[Call], list[Lag]]:
    """N threads calling ``ModelHandler.stream`` (no database: ``stream`` touches none) until
    ``stop``; worker i calls ``routes[i % len(routes)]`` and starts its first call ``i / N``
    of ``stagger_s`` after ``first``. A probe thread sleeps ``PROBE_S`` over and over and
    notes how late it wakes."""
    handler = ModelHandler("postgresql://unused.invalid/none", Routes({}, routes[0]))
    calls: list[Call] = []
    lags: list[Lag] = []

    def probe() -> None:
        time.sleep(max(0.0, first - time.monotonic()))
        while (at := time.monotonic()) < stop:
            time.sleep(PROBE_S)
            lags.append((at, time.monotonic() - at - PROBE_S))

    def worker(i: int) -> None:
        time.sleep(max(0.0, first + stagger_s * i / n - time.monotonic()))
        route, payload = routes[i % len(routes)], _payload(i)
        while (start := time.monotonic()) < stop:
            assembled = handler.stream(route, payload)
            calls.append((start, time.monotonic(), assembled.outcome is ModelOutcome.FINISHED))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    threads.append(threading.Thread(target=probe, daemon=True))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    handler.close()
    return calls, lags


def run_asyncio(
    routes: Sequence[RouteConfig], n: int, first: float, stagger_s: float, stop: float
) -> tuple[list[Call], list[Lag]]:
    """One event loop, N tasks each with an :class:`AsyncModelClient`, until ``stop``; a
    probe task as in :func:`run_threads`."""
    calls: list[Call] = []
    lags: list[Lag] = []

    async def probe() -> None:
        await asyncio.sleep(max(0.0, first - time.monotonic()))
        while (at := time.monotonic()) < stop:
            await asyncio.sleep(PROBE_S)
            lags.append((at, time.monotonic() - at - PROBE_S))

    async def worker(i: int) -> None:
        await asyncio.sleep(max(0.0, first + stagger_s * i / n - time.monotonic()))
        client, payload = AsyncModelClient(routes[i % len(routes)]), _payload(i)
        try:
            while (start := time.monotonic()) < stop:
                assembled = await client.stream(payload)
                calls.append((start, time.monotonic(), assembled.outcome is ModelOutcome.FINISHED))
        finally:
            client.close()

    async def main() -> None:
        await asyncio.gather(probe(), *(worker(i) for i in range(n)))

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
    run = run_threads if args.client == "threads" else run_asyncio
    calls, lags = run(routes, args.in_flight, first, args.nominal_s, t1)
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
    from agentruns.connectors.testing.model_server import Answer, Scenario

    scenario = Scenario.model_validate(SCENARIO)
    answer = Answer(scenario, scenario.turn(0), "inflight-0", 0, "")
    return 1 + len(answer.deltas()) + 3


@contextlib.contextmanager
def model_server(scenarios: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A model server process with the bench's scenario: (its process, its URL)."""
    command = [
        sys.executable,
        "-m",
        "agentruns.connectors.testing.model_server",
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
) -> Json:
    """One child's figures over the measured window, from its report and ``/proc``."""
    calls = child["calls"]

    def per_call(seconds: float) -> float:
        return seconds / calls if calls else float("nan")

    return {
        **{k: child[k] for k in ("calls", "failed", "mean_in_flight")},
        "calls_per_s": round(calls / window_s, 1),
        "cpu_ms_per_call": round(per_call(client_cpu_s) * 1e3, 4),
        "cpu_us_per_chunk": round(per_call(client_cpu_s) / chunks_per_call * 1e6, 2),
        "client_cores": round(client_cpu_s / window_s, 3),
        "rss_before_mib": round(rss_before_kib / 1024, 1),
        "peak_rss_mib": round(peak_rss_kib / 1024, 1),
        "rss_kib_per_call": round((peak_rss_kib - rss_before_kib) / in_flight, 1),
        "threads": threads,
        **{k: child[k] for k in child if k.startswith(("latency_", "wake_lag_"))},
        "server_cpu_ms_per_call": round(per_call(server_cpu_s) * 1e3, 4),
        "server_cores": round(server_cpu_s / window_s, 3),
    }


def measure(
    variant: str, in_flight: int, args: argparse.Namespace, scenarios: Path, nominal_s: float
) -> Json:
    """One child of ``variant`` against fresh model servers (one per ``--calls-per-server``
    calls in flight, the calls spread evenly): its figures."""
    chunks_per_call = scenario_events() - 1  # [DONE] is no chunk
    count = -(-in_flight // args.calls_per_server)
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(model_server(scenarios)) for _ in range(count)]
        servers = [proc.pid for proc, _ in started]
        command = [
            sys.executable,
            "-m",
            "agentruns.bench.inflight",
            "--client",
            variant,
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
                raise RuntimeError(f"the {variant} client failed (exit {child.returncode})")
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


def summarize(runs: Sequence[Json], variants: Sequence[str], levels: Sequence[int]) -> Json:
    """``median``, ``min`` and ``max`` of every figure by variant and level (each run:
    ``variant``, ``in_flight`` and its ``figures``)."""
    out: Json = {"median": {}, "min": {}, "max": {}}
    for variant in variants:
        for level in levels:
            trials = [
                r["figures"] for r in runs if r["variant"] == variant and r["in_flight"] == level
            ]
            if not trials:
                continue
            for name, pick in (("median", statistics.median), ("min", min), ("max", max)):
                out[name].setdefault(variant, {})[str(level)] = combine(trials, pick)
    return out


def _ratio(high: float, low: float) -> float | None:
    return round(high / low, 2) if low > 0 else None


def verdict(median: Mapping[str, Mapping[str, Json]], reference: int, nominal_s: float) -> Json:
    """The choice the medians make at ``reference`` calls in flight (threads against
    asyncio): which costs less CPU per call and by what ratio, the memory per call in flight
    of each and by what ratio, how many calls of ``nominal_s`` one core keeps in flight at
    that CPU per call, and the p99 latency over nominal of each at every level."""
    at = str(reference)
    threads, loop = median["threads"][at], median["asyncio"][at]
    t_cpu, a_cpu = threads["cpu_ms_per_call"], loop["cpu_ms_per_call"]
    t_rss, a_rss = threads["rss_kib_per_call"], loop["rss_kib_per_call"]
    cheaper = "asyncio" if a_cpu < t_cpu else "threads"
    smaller = "asyncio" if a_rss < t_rss else "threads"
    cpu_ratio = _ratio(max(t_cpu, a_cpu), min(t_cpu, a_cpu))
    rss_ratio = _ratio(max(t_rss, a_rss), min(t_rss, a_rss))
    # a core's CPU seconds per second over CPU seconds per call: calls per second, times the
    # call's duration: calls in flight
    per_core = {
        name: round(nominal_s / figures["cpu_ms_per_call"] * 1e3)
        if figures["cpu_ms_per_call"] > 0
        else None
        for name, figures in (("threads", threads), ("asyncio", loop))
    }
    latency = {
        name: {level: f.get("latency_p99_ratio") for level, f in median[name].items()}
        for name in ("threads", "asyncio")
    }
    ratios = {
        name: "/".join(f"{r:g}" if r is not None else "-" for r in latency[name].values())
        for name in latency
    }
    text = (
        f"at {reference} calls in flight {cheaper} costs {cpu_ratio}x less client CPU per call "
        f"(threads {t_cpu:g} ms, asyncio {a_cpu:g} ms; one core carries ~{per_core['threads']}"
        f" against ~{per_core['asyncio']} calls in flight); memory per call in flight: threads "
        f"{t_rss:g} KiB, asyncio {a_rss:g} KiB ({smaller} {rss_ratio}x less); p99 latency over "
        f"nominal at {'/'.join(latency['threads'])} in flight: threads {ratios['threads']}, "
        f"asyncio {ratios['asyncio']}"
    )
    return {
        "in_flight": reference,
        "lower_cpu_per_call": cheaper,
        "cpu_per_call_ratio": cpu_ratio,
        "cpu_ms_per_call": {"threads": t_cpu, "asyncio": a_cpu},
        "lower_rss_per_call": smaller,
        "rss_per_call_ratio": rss_ratio,
        "rss_kib_per_call": {"threads": t_rss, "asyncio": a_rss},
        "in_flight_per_core": per_core,
        "latency_p99_ratio": latency,
        "text": text,
    }


def _levels(text: str) -> list[int]:
    levels = [int(v) for v in text.split(",") if v.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("levels are positive integers, e.g. 100,500,1000")
    return levels


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns bench inflight", description=__doc__)
    parser.add_argument("--levels", type=_levels, default=[100, 500, 1000], help="calls in flight")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="threads,asyncio")
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
    parser.add_argument(
        "--reference", type=int, default=None, help="level of the verdict (default 500)"
    )
    parser.add_argument("--out", default="bench/results/inflight.json")
    # a child (started by this bench): one variant at one level
    parser.add_argument("--client", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--in-flight", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--nominal-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.client:
        return client_main(args)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        parser.error(f"--variants: a list of {', '.join(VARIANTS)}")
    reference = args.reference or (
        500 if 500 in args.levels else args.levels[len(args.levels) // 2]
    )
    if reference not in args.levels:
        parser.error("--reference must be one of --levels")

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
                for variant in variants:
                    print(f"trial {trial}: {variant} x {level}", file=sys.stderr, flush=True)
                    figures = measure(variant, level, args, scenarios, nominal_s)
                    run = {
                        "trial": trial,
                        "variant": variant,
                        "in_flight": level,
                        "figures": figures,
                    }
                    print(json.dumps(run), file=sys.stderr, flush=True)
                    runs.append(run)
    summary = summarize(runs, variants, args.levels)
    result: Json = {
        "bench": "inflight",
        "levels": args.levels,
        "variants": variants,
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
        **summary,
        "verdict": verdict(summary["median"], reference, nominal_s)
        if set(VARIANTS) <= set(variants)
        else None,
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
