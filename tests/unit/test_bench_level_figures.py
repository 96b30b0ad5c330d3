"""A loop bench level counts its own runs only (`agentruns.bench.loop.level_figures`)."""

from __future__ import annotations

from agentruns.bench.loop import level_figures


def test_slow_runs_ending_during_a_level_are_not_counted_as_its_runs() -> None:
    instant = [f"instant-{i}" for i in range(3)]
    slow = [f"slow-{i}" for i in range(5)]
    latency_of = {**{r: 0.4 for r in instant}, **{r: 22.0 for r in slow}}
    steps = [(r, 0.04) for r in instant] + [(r, 2.0) for r in slow]
    done = {r: "SUCCEEDED" for r in instant + slow}
    figures = level_figures(instant, steps, latency_of, done, elapsed=2.0)
    assert figures["run_latency_p50_ms"] == 400.0
    assert figures["run_latency_p99_ms"] == 400.0
    assert figures["step_latency_p99_ms"] == 40.0
    assert figures["durable_steps_per_s"] == 1.5
    assert (figures["completed"], figures["succeeded"]) == (3, 3)


def test_a_run_that_has_not_ended_is_unfinished_and_has_no_latency() -> None:
    figures = level_figures(["a", "b"], [("a", 0.1)], {"a": 1.0}, {"a": "FAILED"}, elapsed=0.0)
    assert (figures["completed"], figures["succeeded"]) == (1, 0)
    assert figures["run_latency_p50_ms"] == 1000.0
    assert figures["durable_steps_per_s"] == 0.0
