"""The test servers' drawn latencies: deterministic, shaped as asked, clamped, bounded."""

from __future__ import annotations

import math
import statistics

import pytest
from pydantic import ValidationError

from agentruns.connectors.dev.servers.latency import (
    MAX_MS,
    LatencyParams,
    lognormal_ms,
    loguniform_ms,
    uniform,
)

N = 20_000


def test_uniform_is_a_pure_function_of_the_key_strictly_inside_0_1() -> None:
    assert uniform(0, "run-1", 2, 0) == uniform(0, "run-1", 2, 0)
    assert uniform(0, "run-1", 2, 0) == uniform("0:run-1:2:0")  # the key is the joined parts
    draws = {uniform(0, "run-1", 2, attempt) for attempt in range(100)}
    assert len(draws) == 100
    assert all(0 < u < 1 for u in draws)
    assert uniform(1, "run-1", 2, 0) != uniform(0, "run-1", 2, 0)  # the seed changes it


def test_uniform_is_spread_evenly() -> None:
    draws = [uniform("k", i) for i in range(N)]
    assert statistics.fmean(draws) == pytest.approx(0.5, abs=0.01)
    below = sum(u < 0.1 for u in draws) / N
    assert below == pytest.approx(0.1, abs=0.01)


def test_the_quantile_extremes_stay_finite() -> None:
    tiny, nearly_one = 0.5 / 2**52, 1 - 0.5 / 2**52
    assert lognormal_ms(tiny, 2000, 0.5, 100, 30000) == 100
    assert lognormal_ms(nearly_one, 2000, 0.5, 100, 30000) == 30000
    assert loguniform_ms(tiny, 50, 2000) == pytest.approx(50, rel=1e-6)
    assert loguniform_ms(nearly_one, 50, 2000) == pytest.approx(2000, rel=1e-6)


def test_lognormal_median_and_spread_are_as_asked() -> None:
    params = LatencyParams(median_ms=2000, sigma=0.5, min_ms=1, max_ms=MAX_MS)
    draws = [params.draw_ms("conv", turn, 0) for turn in range(N)]
    assert statistics.median(draws) == pytest.approx(2000, rel=0.03)
    logs = [math.log(d) for d in draws]
    assert statistics.stdev(logs) == pytest.approx(0.5, rel=0.03)
    assert params.draw_ms("conv", 7, 0) == params.draw_ms("conv", 7, 0)


def test_sigma_zero_is_always_the_median() -> None:
    params = LatencyParams(median_ms=300, sigma=0, min_ms=1, max_ms=1000)
    assert {params.draw_ms("c", i) for i in range(50)} == {300}


def test_draws_are_clamped_to_the_bounds() -> None:
    wide = LatencyParams(median_ms=1000, sigma=3, min_ms=500, max_ms=1500)
    draws = [wide.draw_ms("c", i) for i in range(2000)]
    assert min(draws) == 500 and max(draws) == 1500
    assert all(500 <= d <= 1500 for d in draws)
    outside = LatencyParams(median_ms=10_000, sigma=0, min_ms=50, max_ms=2000)
    assert outside.draw_ms("c", 0) == 2000


def test_loguniform_without_a_median() -> None:
    params = LatencyParams(min_ms=50, max_ms=2000)  # the tool server's defaults
    draws = [params.draw_ms("key", i) for i in range(N)]
    assert all(50 <= d <= 2000 for d in draws)
    # uniform in log space: the median is the geometric mean, each decade as likely as its width
    assert statistics.median(draws) == pytest.approx(math.sqrt(50 * 2000), rel=0.05)
    share_below_500 = sum(d < 500 for d in draws) / N
    assert share_below_500 == pytest.approx(math.log(10) / math.log(40), abs=0.02)


@pytest.mark.parametrize(
    "params",
    [
        {"median_ms": -1},
        {"median_ms": 0},
        {"median_ms": float("nan")},
        {"min_ms": float("inf")},
        {"max_ms": MAX_MS * 10},
        {"sigma": 1e9},
        {"sigma": -0.1},
        {"min_ms": 500, "max_ms": 100},
        {"seed": "not a number"},
        {"unknown": 1},
    ],
)
def test_out_of_bounds_parameters_are_refused(params: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        LatencyParams.model_validate(params)
