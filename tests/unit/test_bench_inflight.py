"""`agentruns bench inflight`: the window's figures, the probe's lags, the medians over the
trials, the levels it takes, and its calls against an in-process model server."""

from __future__ import annotations

import argparse
import http.client
import json
import math
import time

import pytest

from agentruns.bench import inflight
from agentruns.connectors.dev.servers import model_server


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
        nominal_s=1.5,
    )
    assert figures["calls_per_s"] == 100.0
    assert figures["cpu_ms_per_call"] == 2.0 and figures["cpu_us_per_chunk"] == 100.0
    assert figures["client_cores"] == 0.2 and figures["server_cpu_ms_per_call"] == 3.0
    assert figures["rss_kib_per_call"] == 102.4
    assert figures["latency_p50_ratio"] == 1.03 and figures["threads"] == 101
    # 2 ms a call: one core carries 500 calls a second, 750 calls of 1.5 s in flight
    assert figures["in_flight_per_core"] == 750
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
        nominal_s=1.5,
    )
    assert math.isnan(none["cpu_ms_per_call"]) and none["in_flight_per_core"] is None


def test_summarize_takes_median_min_and_max_by_level() -> None:
    runs = [
        {
            "trial": t,
            "in_flight": n,
            "figures": {
                "cpu_ms_per_call": scale + t,
                "rss_kib_per_call": 10.0 * scale,
                "latency_p99_ratio": 1.0 + t / 10,
                "wake_lag_ms_p99": None if t == 2 else 1.0,  # no wake in one trial's window
            },
        }
        for t in (1, 2, 3)
        for n, scale in ((100, 1.0), (500, 2.0))
    ]
    summary = inflight.summarize(runs, [100, 500, 1000])
    assert summary["median"]["500"]["cpu_ms_per_call"] == 4.0
    assert summary["min"]["500"]["cpu_ms_per_call"] == 3.0
    assert summary["max"]["100"]["latency_p99_ratio"] == 1.3
    assert summary["median"]["100"]["rss_kib_per_call"] == 10.0
    # a figure some trial lacks is no median; a level no run measured is left out
    assert "wake_lag_ms_p99" not in summary["median"]["100"]
    assert set(summary["median"]) == set(summary["max"]) == {"100", "500"}


def test_lag_figures_take_the_probes_wakes_in_the_window() -> None:
    lags = [(0.5, 0.9), (1.0, 0.001), (1.5, 0.002), (2.0, 0.004), (3.5, 0.5)]
    assert inflight.lag_figures(lags, 1.0, 2.0) == {"wake_lag_ms_p50": 2.0, "wake_lag_ms_p99": 4.0}
    assert inflight.lag_figures([], 1.0, 2.0)["wake_lag_ms_p50"] is None


def test_levels_are_positive_integers() -> None:
    assert inflight._levels("100,500,1000") == [100, 500, 1000]
    assert inflight._levels(" 50 ,") == [50]
    for text in ("", "0,100", "-5", "ten"):
        with pytest.raises(argparse.ArgumentTypeError):
            inflight._levels(text)


def test_the_calls_in_flight_finish_and_send_the_events_counted() -> None:
    scenario = model_server.Scenario.model_validate(inflight.SCENARIO)
    with model_server.serve(port=0, scenarios=[scenario]) as server:
        route = inflight._route(server.url, 0)
        first = time.monotonic()
        calls, _ = inflight.run_calls([route, route], 3, first, 0.01, first + 1.0)
        # the events the bench counts per call are those the server sends
        connection = http.client.HTTPConnection(server.host, server.port)
        connection.request(
            "POST", "/v1/chat/completions", json.dumps(inflight._payload(0)), route.headers
        )
        body = connection.getresponse().read()
        connection.close()
    assert calls and all(ok and start <= end for start, end, ok in calls)
    assert body.count(b"data: ") == inflight.scenario_events()
    assert body.endswith(b"data: [DONE]\n\n")
