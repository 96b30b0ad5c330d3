"""`agentruns bench inflight`: the asyncio client's wire decoding, the window's figures and the
verdict drawn from the medians."""

from __future__ import annotations

import asyncio
import http.client
import json
import math
from dataclasses import replace

import pytest
from agentruns.bench import inflight
from agentruns.bench.inflight import ChunkedBody, SseLines, parse_head
from agentruns.connectors.executors.http import BodyTooLargeError, HTTPWireError
from agentruns.connectors.executors.model import (
    Assembled,
    MalformedChunkError,
    ModelHandler,
    Routes,
)
from agentruns.connectors.testing import model_server


def chunked(*pieces: bytes, trailers: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n" + trailers + b"\r\n"


def test_parse_head_reads_the_status_and_lower_cased_headers() -> None:
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    status, headers = parse_head(head)
    assert status == 200
    assert headers == {"content-type": "text/event-stream", "transfer-encoding": "chunked"}
    with pytest.raises(HTTPWireError, match="status line"):
        parse_head(b"SMTP ready\r\n\r\n")


def test_chunked_body_gives_the_same_pieces_whichever_way_the_bytes_arrive() -> None:
    wire = chunked(b"data: one\n\n", b"data: two\n", b"\n", trailers=b"X-Trailer: 1\r\n")
    at_once = ChunkedBody(1 << 20)
    assert b"".join(at_once.feed(wire)) == b"data: one\n\ndata: two\n\n"
    assert at_once.done and at_once.total == 22
    one_by_one = ChunkedBody(1 << 20)
    pieces = [p for i in range(len(wire)) for p in one_by_one.feed(wire[i : i + 1])]
    assert b"".join(pieces) == b"data: one\n\ndata: two\n\n"
    assert one_by_one.done
    # the end of the body only once the trailers are read
    partial = ChunkedBody(1 << 20)
    partial.feed(wire[:-2])
    assert not partial.done
    assert partial.feed(wire[-2:]) == [] and partial.done


def test_chunked_body_keeps_the_blocking_clients_limits() -> None:
    with pytest.raises(BodyTooLargeError):
        ChunkedBody(10).feed(chunked(b"x" * 11))
    with pytest.raises(HTTPWireError, match="longer than its size"):
        ChunkedBody(100).feed(b"2\r\nabc\r\n")
    with pytest.raises(HTTPWireError, match="chunk size"):
        ChunkedBody(100).feed(b"zz\r\n")
    with pytest.raises(HTTPWireError, match="over"):
        ChunkedBody(100).feed(b"1" * 2000)
    with pytest.raises(HTTPWireError, match="after the end"):
        ChunkedBody(100).feed(chunked(b"a") + b"HTTP/1.1")
    ended = ChunkedBody(100)
    ended.feed(chunked(b"a"))
    with pytest.raises(HTTPWireError, match="after the end"):
        ended.feed(b"x")
    extension = ChunkedBody(100)
    assert extension.feed(b"3;name=value\r\nabc\r\n0\r\n\r\n") == [b"abc"] and extension.done


def test_sse_lines_split_across_pieces() -> None:
    lines = SseLines(64)
    assert lines.feed(b"data: {") == []
    assert lines.feed(b'"a":1}\r\n\r\ndata: [DO') == [b'data: {"a":1}', b""]
    assert lines.feed(b"NE]") == []
    assert lines.rest() == b"data: [DONE]"
    with pytest.raises(MalformedChunkError, match="over 64 bytes"):
        SseLines(64).feed(b"x" * 65)


def test_request_head_is_the_blocking_clients() -> None:
    head = inflight.request_head("http://127.0.0.1:8700/v1/chat/completions", {"A": "b"}, 12)
    assert head == (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8700\r\nA: b\r\n"
        b"Content-Length: 12\r\n\r\n"
    )


def test_the_asyncio_client_assembles_what_the_model_executor_does() -> None:
    scenario = model_server.Scenario.model_validate(inflight.SCENARIO)
    with model_server.serve(port=0, scenarios=[scenario]) as server:
        route = inflight._route(server.url, 0)
        payload = inflight._payload(0)
        handler = ModelHandler("postgresql://unused.invalid/none", Routes({}, route))
        try:
            expected = handler.stream(route, payload)
        finally:
            handler.close()

        async def two_calls() -> list[Assembled]:
            client = inflight.AsyncModelClient(route)
            try:
                return [await client.stream(payload), await client.stream(payload)]
            finally:
                client.close()

        got = asyncio.run(two_calls())
        accepted = server._server.accepted
        # the events the bench counts per call are those the server sends
        connection = http.client.HTTPConnection(server.host, server.port)
        connection.request("POST", "/v1/chat/completions", json.dumps(payload), route.headers)
        body = connection.getresponse().read()
        connection.close()
    assert expected.outcome.value == "finished" and expected.tool_calls
    # the same generation but for the completion id, which the server numbers per attempt
    assert [replace(a, completion_id=None) for a in got] == 2 * [
        replace(expected, completion_id=None)
    ]
    assert all(a.completion_id for a in got)
    assert accepted == 2  # one connection each: the asyncio client kept its own
    assert body.count(b"data: ") == inflight.scenario_events()
    assert body.endswith(b"data: [DONE]\n\n")


def test_window_figures_count_the_calls_that_ended_in_it() -> None:
    calls = [
        (0.0, 1.0, True),  # ended before the window
        (0.5, 2.0, True),
        (1.0, 2.5, False),
        (2.0, 3.5, True),
        (2.9, 4.5, True),  # ended after it
    ]
    figures = inflight.window_figures(calls, 1.5, 3.5, nominal_s=1.5)
    assert figures["calls"] == 2 and figures["failed"] == 1
    # in flight over [1.5, 3.5]: 0.5 + 1.0 + 1.5 + 0.6 seconds in 2 s
    assert figures["mean_in_flight"] == 1.8
    assert figures["latency_p50_s"] == 1.5 and figures["latency_p99_s"] == 1.5
    assert figures["latency_p99_ratio"] == 1.0
    empty = inflight.window_figures([], 0.0, 1.0, 1.0)
    assert empty["calls"] == 0 and empty["latency_p50_s"] is None


def test_run_figures_divide_by_calls_chunks_and_calls_in_flight() -> None:
    child = {
        "calls": 1000,
        "failed": 0,
        "mean_in_flight": 100.0,
        "latency_p50_s": 1.6,
        "latency_p50_ratio": 1.03,
    }
    figures = inflight.run_figures(
        child,
        in_flight=100,
        window_s=10.0,
        client_cpu_s=2.0,
        server_cpu_s=3.0,
        peak_rss_kib=70 * 1024,
        rss_before_kib=60 * 1024,
        threads=101,
        chunks_per_call=20,
    )
    assert figures["calls_per_s"] == 100.0
    assert figures["cpu_ms_per_call"] == 2.0 and figures["cpu_us_per_chunk"] == 100.0
    assert figures["client_cores"] == 0.2 and figures["server_cpu_ms_per_call"] == 3.0
    assert figures["rss_kib_per_call"] == 102.4
    assert figures["latency_p50_ratio"] == 1.03 and figures["threads"] == 101
    none = inflight.run_figures(
        {**child, "calls": 0},
        in_flight=100,
        window_s=10.0,
        client_cpu_s=2.0,
        server_cpu_s=3.0,
        peak_rss_kib=1,
        rss_before_kib=1,
        threads=1,
        chunks_per_call=20,
    )
    assert math.isnan(none["cpu_ms_per_call"])


def _figures(cpu_ms: float, rss_kib: float, p99_ratio: float) -> dict[str, float]:
    return {
        "cpu_ms_per_call": cpu_ms,
        "rss_kib_per_call": rss_kib,
        "latency_p50_s": 1.6,
        "latency_p99_ratio": p99_ratio,
    }


def test_summarize_and_verdict_come_from_the_trials() -> None:
    runs = [
        {"variant": v, "in_flight": n, "trial": t, "figures": _figures(cpu, rss, 1.0 + t / 10)}
        for t in (1, 2, 3)
        for n, scale in ((100, 1.0), (500, 2.0))
        for v, cpu, rss in (("threads", 3.0 * scale + t, 80.0), ("asyncio", 1.0 * scale + t, 10.0))
    ]
    summary = inflight.summarize(runs, ["threads", "asyncio"], [100, 500])
    assert summary["median"]["threads"]["500"]["cpu_ms_per_call"] == 8.0
    assert summary["min"]["asyncio"]["500"]["cpu_ms_per_call"] == 3.0
    assert summary["max"]["asyncio"]["100"]["latency_p99_ratio"] == 1.3
    verdict = inflight.verdict(summary["median"], 500, nominal_s=1.6)
    assert verdict["lower_cpu_per_call"] == "asyncio"
    assert verdict["cpu_per_call_ratio"] == 2.0  # 8 ms against 4 ms
    assert verdict["lower_rss_per_call"] == "asyncio" and verdict["rss_per_call_ratio"] == 8.0
    assert verdict["in_flight_per_core"] == {"threads": 200, "asyncio": 400}
    assert verdict["latency_p99_ratio"]["threads"] == {"100": 1.2, "500": 1.2}
    assert "asyncio costs 2.0x less" in verdict["text"]
    assert "at 100/500 in flight: threads 1.2/1.2, asyncio 1.2/1.2" in verdict["text"]
    # the other way round when the numbers say so
    flipped = {"threads": summary["median"]["asyncio"], "asyncio": summary["median"]["threads"]}
    assert inflight.verdict(flipped, 500, 1.6)["lower_cpu_per_call"] == "threads"


def test_lag_figures_take_the_probes_wakes_in_the_window() -> None:
    lags = [(0.5, 0.9), (1.0, 0.001), (1.5, 0.002), (2.0, 0.004), (3.5, 0.5)]
    assert inflight.lag_figures(lags, 1.0, 2.0) == {"wake_lag_ms_p50": 2.0, "wake_lag_ms_p99": 4.0}
    assert inflight.lag_figures([], 1.0, 2.0)["wake_lag_ms_p50"] is None
