"""The split of a run's time into hops, from its records' timestamps (`bench.hops`)."""

from __future__ import annotations

from agentruns.bench.hops import median_overhead, median_split


def test_each_gap_counts_for_the_hop_its_first_record_opens() -> None:
    # submitted at 0; model effect at 5, its answer at 25; tool effect at 30, answer at 38;
    # the next model effect at 41 and the last answer at 60
    run = [
        (0, "processor"),
        (5, "model"),
        (25, "processor"),
        (30, "tool"),
        (38, "processor"),
        (41, "model"),
        (60, "processor"),
    ]
    assert median_split([run]) == {"processor": 5 + 5 + 3, "model": 20 + 19, "tool": 8}


def test_the_median_is_over_runs() -> None:
    runs = [[(0, "processor"), (ms, "model"), (ms + 10, "processor")] for ms in (1, 2, 30)]
    assert median_split(runs) == {"processor": 2.0, "model": 10.0, "tool": 0.0}


def test_no_runs_no_figures() -> None:
    assert median_split([]) == {}
    assert median_split([[(7, "processor")]]) == {"processor": 0.0, "model": 0.0, "tool": 0.0}


def test_an_overhead_is_the_hop_less_its_own_backends_time() -> None:
    # a model call planned at 15 ms in a 20 ms hop, a tool call at 6 in 8
    run = [(0, "processor"), (5, "model"), (25, "processor"), (30, "tool"), (38, "processor")]
    backends = {"model": {"r": 15.0}, "tool": {"r": 6.0}}
    assert median_overhead({"r": run}, backends) == {"processor": 10.0, "model": 5.0, "tool": 2.0}


def test_a_run_without_an_account_of_each_backend_is_left_out() -> None:
    run = [(0, "processor"), (5, "model"), (25, "processor")]
    assert median_overhead({"r": run}, {"model": {"r": 15.0}, "tool": {}}) == {}
    assert median_overhead({"r": run}, {"model": {"r": 15.0}, "tool": {"r": 0.0}}) == {
        "processor": 5.0,
        "model": 5.0,
        "tool": 0.0,
    }
