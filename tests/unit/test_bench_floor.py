"""`agentruns.bench.floor`'s figures, without a broker: hop rate and percentiles from samples,
the step floor they imply, the loop's ratios to it and the shape of a level."""

from __future__ import annotations

import json
import math

import pytest

from agentruns.bench import floor
from agentruns.bench.floor import (
    HOPS_PER_STEP,
    floor_level,
    hop_figures,
    per_item_us,
    ratio,
    ratios_to_floor,
    side_figures,
    step_floor,
)


def test_hops_per_second_span_from_the_first_start_to_the_last_end() -> None:
    # four hops of 10 ms one after the other, from t=100.0 to t=100.04
    samples = [(100.0 + 0.01 * (i + 1), 0.01) for i in range(4)]
    figures = hop_figures(samples)
    assert figures["hops"] == 4
    assert figures["seconds"] == pytest.approx(0.04)
    assert figures["hops_per_s"] == pytest.approx(100.0)
    assert figures["hop_p50_ms"] == pytest.approx(10.0)
    assert figures["step_floor"] == {"steps_per_s": 25.0, "step_latency_ms": 40.0}


def test_overlapping_hops_count_once_each_over_the_common_span() -> None:
    # two tokens in flight: hops overlap, so the rate is twice one token's
    samples = [(1.0 + 0.1 * (i // 2 + 1), 0.1) for i in range(20)]
    figures = hop_figures(samples)
    assert figures["hops_per_s"] == pytest.approx(20.0)
    assert figures["hop_p99_ms"] == pytest.approx(100.0)


def test_percentiles_of_uneven_hops() -> None:
    samples = [(float(i), took) for i, took in enumerate([0.001] * 98 + [0.5, 0.9])]
    figures = hop_figures(samples)
    assert figures["hop_p50_ms"] == pytest.approx(1.0)
    assert figures["hop_p99_ms"] == pytest.approx(500.0)  # nearest rank: the 99th of 100
    assert figures["step_floor"]["step_latency_ms"] == pytest.approx(HOPS_PER_STEP * 1.0)


def test_no_samples_no_rate() -> None:
    figures = hop_figures([])
    assert figures["hops"] == 0 and figures["hops_per_s"] == 0.0
    assert math.isnan(figures["hop_p50_ms"])


def test_the_step_floor_is_four_hops() -> None:
    assert step_floor(1000.0, 0.02) == {"steps_per_s": 250.0, "step_latency_ms": 80.0}


def test_ratio_needs_a_positive_floor() -> None:
    assert ratio(50.0, 200.0) == 0.25
    assert ratio(300.0, 100.0) == 3.0
    assert ratio(None, 100.0) is None
    assert ratio(50.0, None) is None
    assert ratio(50.0, 0.0) is None
    assert ratio(float("nan"), 100.0) is None
    assert ratio(50.0, float("nan")) is None


FLOOR = {
    "bench": "floor",
    "modes": {
        "transactional": [
            {"tokens": 1, "step_floor": {"steps_per_s": 12.5, "step_latency_ms": 80.0}},
            {"tokens": 64, "step_floor": {"steps_per_s": 500.0, "step_latency_ms": 100.0}},
        ],
        "plain": [{"tokens": 64, "step_floor": {"steps_per_s": 800.0, "step_latency_ms": 60.0}}],
    },
}


def test_a_loop_level_against_the_floor_at_its_concurrency() -> None:
    loop_level = {"concurrency": 64, "durable_steps_per_s": 250.0, "step_latency_p50_ms": 250.0}
    found = floor_level(FLOOR, 64)
    assert found is not None and found["step_floor"]["steps_per_s"] == 500.0
    assert ratios_to_floor(loop_level, found) == {"steps_per_s": 0.5, "step_p50": 2.5}
    plain = floor_level(FLOOR, 64, "plain")
    assert ratios_to_floor(loop_level, plain) == {"steps_per_s": 0.31, "step_p50": 4.17}


def test_a_concurrency_the_floor_did_not_measure_has_no_ratio() -> None:
    assert floor_level(FLOOR, 16) is None
    assert floor_level({}, 1) is None
    level = {"durable_steps_per_s": 100.0, "step_latency_p50_ms": 100.0}
    assert ratios_to_floor(level, None) == {"steps_per_s": None, "step_p50": None}


def test_cpu_per_item_in_microseconds() -> None:
    assert per_item_us({"broker": 0.5, "side_a": 0.02}, 1000) == {"broker": 500.0, "side_a": 20.0}
    assert per_item_us(None, 1000) == {}
    assert per_item_us({"broker": 0.5}, 0) == {}


def test_a_level_is_json_with_every_figure() -> None:
    level = {"tokens": 2, **hop_figures([(2.0, 0.5), (2.5, 0.5), (3.0, 0.5)])}
    assert set(level) == {
        "tokens",
        "hops",
        "seconds",
        "hops_per_s",
        "hop_p50_ms",
        "hop_p99_ms",
        "step_floor",
    }
    assert json.loads(json.dumps(level)) == level


def test_a_token_record_round_trips() -> None:
    value = floor._record("ab12-3", 7, 40, 12345.678901234)
    assert floor._parse(value) == ("ab12-3", 7, 40, 12345.678901234)


def test_one_sides_hops() -> None:
    assert side_figures([(1.0, 0.002), (2.0, 0.004), (3.0, 0.02)]) == {
        "hops": 3,
        "hop_p50_ms": 4.0,
        "hop_p99_ms": 20.0,
    }
    assert side_figures([])["hops"] == 0
