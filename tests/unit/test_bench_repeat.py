"""`agentruns bench repeat`: trials of one bench, combined figure by figure."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from bench import repeat


def test_combine_takes_numbers_at_every_depth_and_leaves_the_rest() -> None:
    trials = [
        {"rate": 10, "name": "a", "ok": True, "by_s": [1, 2], "phase": {"p99": 5.0, "n": 1}},
        {"rate": 30, "name": "b", "ok": False, "by_s": [3], "phase": {"p99": 1.0, "n": 2}},
        {"rate": 20, "name": "c", "ok": True, "by_s": [], "phase": {"p99": 9.0, "n": None}},
    ]
    assert repeat.combine(trials, statistics.median) == {"rate": 20.0, "phase": {"p99": 5.0}}
    assert repeat.combine(trials, min) == {"rate": 10.0, "phase": {"p99": 1.0}}
    assert repeat.combine(trials, max) == {"rate": 30.0, "phase": {"p99": 9.0}}
    # a figure one trial lacks is not combined from the others
    assert repeat.combine([{"x": 1, "y": 2}, {"x": 3}], max) == {"x": 3.0}


def test_last_json_line_is_the_figures() -> None:
    assert repeat.last_json_line('progress\n{"a": 1}\n\n') == {"a": 1}
    with pytest.raises(ValueError, match="printed nothing"):
        repeat.last_json_line("\n")
    with pytest.raises(ValueError, match="not a JSON object"):
        repeat.last_json_line("[1, 2]")


def test_repeat_runs_the_bench_as_often_as_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "core-trials.json"
    args = ["--events", "600", "--repeat", "1"]
    assert repeat.main(["--trials", "2", "--out", str(out), "core", *args]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    assert printed["of"] == "core" and printed["args"] == args
    assert len(printed["trials"]) == printed["trials_run"] == 2
    rates = [t["transitions_per_second"] for t in printed["trials"]]
    assert all(r > 0 for r in rates)
    assert printed["median"]["transitions_per_second"] == round(statistics.median(rates), 3)
    assert printed["min"]["transitions_per_second"] == min(rates)
    assert printed["median"]["events"] == 600


def test_repeat_refuses_a_single_trial() -> None:
    with pytest.raises(SystemExit):
        repeat.main(["--trials", "1", "core"])
