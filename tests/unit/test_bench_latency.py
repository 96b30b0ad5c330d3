"""The benches' percentile helpers (bench/latency.py)."""

from __future__ import annotations

import math

from agentruns.bench.latency import by_second, p99_by_second, percentile


def test_percentile_is_the_nearest_rank_of_unsorted_samples() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 100 .. 1, unsorted on purpose
    assert percentile(values, 0.5) == 51.0  # round(0.5 * 99) = 50 -> the 51st smallest
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 1.0) == 100.0
    assert percentile(values, 0.0) == 1.0
    assert math.isnan(percentile([], 0.99))


def test_samples_grouped_by_second_keep_empty_seconds() -> None:
    samples = [(0.1, 1.0), (0.9, 2.0), (2.5, 3.0)]
    assert by_second(samples) == [[1.0, 2.0], [], [3.0]]


def test_p99_by_second_scales_and_skips_empty_seconds() -> None:
    samples = [(0.0, 0.010), (0.5, 0.030), (2.2, 0.005)]
    assert p99_by_second(samples, scale=1000) == [30.0, 5.0]
