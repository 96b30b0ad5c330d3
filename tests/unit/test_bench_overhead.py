"""The loop bench's figures for backends that take time (`agentruns.bench.overhead`)."""

from __future__ import annotations

import pytest

from agentruns.bench.overhead import (
    backend_ms,
    backend_ms_by_kind,
    calls_of,
    ideal_elapsed_s,
    in_flight_of,
    model_latency_rule,
    overhead_figures,
    planned_call_ms_mean,
    served_over_planned,
    tool_latency_rule,
)
from agentruns.connectors.dev.servers.model_server import FaultRule
from agentruns.connectors.dev.servers.tool_server import FaultRule as ToolFaultRule


def test_the_ideal_closed_loop_starts_each_run_as_a_slot_frees() -> None:
    assert ideal_elapsed_s([2.0, 2.0, 2.0, 2.0], 2) == 4.0
    assert ideal_elapsed_s([3.0, 1.0, 1.0, 1.0], 2) == 3.0  # three short ones beside a long one
    assert ideal_elapsed_s([1.0] * 10, 100) == 1.0
    assert ideal_elapsed_s([], 4) == 0.0


def test_each_run_is_measured_against_its_own_backends() -> None:
    backends = backend_ms(
        {"conversations": {"a": {"calls": 2, "ms": 1500.0}, "b": {"calls": 1, "ms": 1000.0}}},
        {"runs": {"a": {"calls": 1, "ms": 500.0}, "b": {"calls": 1, "ms": 1000.0}}},
    )
    assert backends == {"a": 2000.0, "b": 2000.0}
    assert backend_ms_by_kind(
        {"conversations": {"a": {"calls": 2, "ms": 1500.0}}}, {"runs": {"a": {"ms": 500.0}}}
    ) == {"model": {"a": 1500.0}, "tool": {"a": 500.0}}
    figures = overhead_figures(["a", "b"], {"a": 2.2, "b": 2.0}, backends, 2, 2.2)
    assert figures["run_over_backend_p50"] in (1.0, 1.1)
    assert figures["run_over_backend_p99"] == 1.1
    assert figures["run_backend_ms_p50"] == 2000.0
    assert figures["throughput_vs_ideal"] == pytest.approx(2.0 / 2.2, abs=0.001)


def test_the_planned_time_of_a_call_is_a_mean_over_the_runs_given() -> None:
    model = {"conversations": {"a": {"calls": 2, "ms": 3000.0}, "b": {"calls": 1, "ms": 90.0}}}
    assert planned_call_ms_mean(model, ["a"]) == 1500.0
    assert planned_call_ms_mean(model, ["a", "b"]) == 1030.0
    assert planned_call_ms_mean({"runs": {"a": {"calls": 4, "ms": 100.0}}}, ["a"]) == 25.0
    assert planned_call_ms_mean(model, ["nobody"]) is None


def test_a_server_falling_behind_its_own_schedule_shows() -> None:
    model = {"conversations": {"a": {"ms": 1000.0, "served_ms": 1100.0}, "b": {"ms": 1000.0}}}
    assert served_over_planned(model, ["a"]) == 1.1
    assert served_over_planned(model, ["a", "b"]) == 0.55
    assert served_over_planned(model, ["nobody"]) is None


def test_a_run_without_accounted_backends_is_left_out_of_the_ratios() -> None:
    figures = overhead_figures(["a", "b"], {"a": 1.0, "b": 9.0}, {"a": 1000.0}, 2, 9.0)
    assert figures["runs_measured"] == 1 and figures["run_over_backend_p99"] == 1.0
    assert figures["throughput_vs_ideal"] is None  # not every run's backends are known


def test_the_running_effects_are_read_from_an_executors_metrics() -> None:
    text = (
        "# HELP agentruns_executor_in_flight Effects held\n"
        "# TYPE agentruns_executor_in_flight gauge\n"
        'agentruns_executor_in_flight{kind="model",state="running"} 412.0\n'
        'agentruns_executor_in_flight{kind="model",state="waiting"} 3.0\n'
        "# TYPE other_metric counter\n"
        "other_metric_total 7.0\n"
    )
    assert in_flight_of(text) == {"model": 412.0}
    calls = (
        "# TYPE agentruns_executor_call_seconds histogram\n"
        'agentruns_executor_call_seconds_bucket{kind="model",outcome="ok",le="+Inf"} 4.0\n'
        'agentruns_executor_call_seconds_count{kind="model",outcome="ok"} 4.0\n'
        'agentruns_executor_call_seconds_sum{kind="model",outcome="ok"} 9.0\n'
        'agentruns_executor_call_seconds_count{kind="model",outcome="error"} 1.0\n'
        'agentruns_executor_call_seconds_sum{kind="model",outcome="error"} 1.0\n'
    )
    assert calls_of(calls) == (10.0, 5.0)


def test_the_latency_options_are_rules_the_servers_take() -> None:
    model = model_latency_rule("2000:0.7", 50, "bench_10")
    assert FaultRule.model_validate(model).scenario == "bench_10"
    assert (model["median_ms"], model["sigma"]) == (2000.0, 0.7)
    assert model_latency_rule("1500", 0, None)["sigma"] == 0.5
    tool = tool_latency_rule("50:2000")
    assert ToolFaultRule.model_validate(tool).max_ms == 2000.0
    assert tool_latency_rule("300")["max_ms"] == 300.0
    with pytest.raises(ValueError):
        model_latency_rule("fast", 50, None)
