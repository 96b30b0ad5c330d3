"""Percentiles of the benches' latency samples, overall and per second of a phase."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def percentile(values: Iterable[float], q: float) -> float:
    """The sample at quantile ``q`` (nearest rank on ``q * (n - 1)``); NaN without samples."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def by_second(samples: Iterable[tuple[float, float]]) -> list[list[float]]:
    """``(seconds into the phase, value)`` samples grouped by whole second (empty seconds
    kept, so an index is a second)."""
    seconds: list[list[float]] = []
    for at, value in samples:
        while len(seconds) <= int(at):
            seconds.append([])
        seconds[int(at)].append(value)
    return seconds


def p99_by_second(samples: Sequence[tuple[float, float]], scale: float = 1.0) -> list[float]:
    """The p99 of each second that has samples, times ``scale``, rounded to 0.1: where in a
    phase the slow ones were (a stall, or all along)."""
    return [round(percentile(s, 0.99) * scale, 1) for s in by_second(samples) if s]
