"""The core benchmark runs and prints one JSON object on its last line."""

from __future__ import annotations

import json

import pytest

from agentruns.bench import core


def test_bench_core_prints_json_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert core.main(["--events", "1500", "--repeat", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads(last)
    assert report["events"] == 1500 and report["transitions_per_second"] > 0
    assert report["snapshot_bytes_step_50"] is not None
    assert report["snapshot_bytes_step_50"] <= 8 * 1024


def test_host_speed_times_a_fixed_fold_and_a_loop() -> None:
    speed = core.host_speed(events=300, repeat=1)
    assert set(speed) == {"sum_range_1000_us", "core_fold_us_per_event"}
    assert all(isinstance(v, float) and v > 0 for v in speed.values())
    # the same workload each time: a second probe is the same fold, so within an order of
    # magnitude on any host (a fixed seed, not the caller's data)
    again = core.host_speed(events=300, repeat=1)
    assert 0.1 < again["core_fold_us_per_event"] / speed["core_fold_us_per_event"] < 10
