"""Tracing's cost from phases that alternate tracing off and on (`bench loop --tracing both`)."""

from __future__ import annotations

from typing import Any

from agentruns.bench.loop import _tracing_overhead


def _level(
    pipeline: float, steps_per_s: float = 100.0, control: float = 5000.0
) -> list[dict[str, Any]]:
    return [
        {
            "concurrency": 16,
            "durable_steps_per_s": steps_per_s,
            "cpu_us_per_step": {
                # not the pipeline's: left out of its ratio, the control of the machine's speed
                "broker": control * 0.8,
                "postgres": control * 0.1,
                "bench": control * 0.1,
                "processor": pipeline / 2,
                "model-executor": pipeline / 4,
                "tool-executor": pipeline / 4,
                "tool-server": 400.0,
            },
        }
    ]


def test_a_machine_slowing_steadily_weighs_on_both_sides_alike() -> None:
    # off 1000, on 1265, off 1200, on 1495, off 1400: each on phase 15% over the mean of the
    # off phases on either side, though the machine slowed by 40% over the run (against the
    # first off phase alone the first on phase would read 1.265)
    off = [_level(1000, 120), _level(1200, 100), _level(1400, 80)]
    on = [_level(1265, 110), _level(1495, 90)]
    figures = _tracing_overhead(off, on)["16"]
    assert figures["pipeline_on_over_off_by_phase"] == [1.15, 1.15]
    assert figures["pipeline_off_cpu_us_per_step"] == 1200.0
    assert figures["pipeline_on_cpu_us_per_step"] == 1380.0
    assert figures["pipeline_on_over_off"] == 1.15
    assert figures["off_cpu_us_per_step"] == {
        "processor": 600.0,
        "model-executor": 300.0,
        "tool-executor": 300.0,
    }
    assert figures["off_durable_steps_per_s"] == 100.0
    assert figures["on_durable_steps_per_s"] == 100.0


def test_one_on_phase_between_two_off_phases() -> None:
    figures = _tracing_overhead([_level(100), _level(100)], [_level(110)])["16"]
    assert figures["pipeline_on_over_off"] == 1.1
    assert figures["pipeline_on_over_off_by_phase"] == [1.1]


def test_a_phase_the_machine_slowed_alone_shows_in_the_control() -> None:
    # tracing adds 10%; in the on phase the machine also ran everything 20% slower
    off = [_level(1000), _level(1000)]
    on = [_level(1000 * 1.1 * 1.2, control=5000 * 1.2)]
    figures = _tracing_overhead(off, on)["16"]
    assert figures["pipeline_on_over_off_by_phase"] == [1.32]
    assert figures["control_on_over_off_by_phase"] == [1.2]
    assert figures["control_on_over_off"] == 1.2
