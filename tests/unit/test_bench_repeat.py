"""`agentruns bench repeat`: trials of one bench, combined figure by figure."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest

from agentruns.bench import machine, repeat, targets


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


def test_neighbours_burn_cpu_while_the_block_runs_and_are_gone_after_it() -> None:
    with machine.neighbours(2) as pids:
        assert len(pids) == 2
        began = [machine.process_cpu_seconds(p) for p in pids]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # each is busy as soon as it gets a core
            now = [machine.process_cpu_seconds(p) for p in pids]
            used = [n - b for b, n in zip(began, now, strict=True) if b is not None and n]
            if len(used) == 2 and min(used) >= 0.1:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the neighbours did not use CPU: {began} -> {now}")
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()
    with pytest.raises(RuntimeError), machine.neighbours(1) as pids:
        raise RuntimeError("a trial failed")
    assert not Path(f"/proc/{pids[0]}").exists()


def test_repeat_records_the_neighbours_it_ran_beside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "core-trials.json"
    args = ["--events", "300", "--repeat", "1"]
    assert repeat.main(["--trials", "2", "--contend", "1", "--out", str(out), "core", *args]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["contend"] == 1 and printed["trials_run"] == 2
    assert "1 busy neighbour(s)" in repeat.summary(printed)[0]
    with pytest.raises(SystemExit):
        repeat.main(["--contend", "-1", "core"])


def test_repeat_refuses_a_single_trial() -> None:
    with pytest.raises(SystemExit):
        repeat.main(["--trials", "1", "core"])


def test_targets_check_a_figure_by_its_path() -> None:
    figures = {"rate": 12.0, "lat": {"p99": 80}, "flag": True, "name": "x"}
    assert targets.figure(figures, "lat.p99") == 80.0
    assert targets.figure(figures, "lat.p50") is None
    assert targets.figure(figures, "flag") is None  # a boolean is not a figure
    assert targets.figure(figures, "name.deeper") is None
    judged = targets.evaluate(
        figures,
        (
            targets.Target("rate", 10),
            targets.Target("lat.p99", 50, at_most=True),
            targets.Target("missing", 1),
        ),
    )
    assert [c["met"] for c in judged["checks"]] == [True, False, None]
    assert judged["targets"] == {"rate": 10, "lat.p99": 50, "missing": 1}
    assert judged["meets_targets"] is False
    ok = targets.evaluate(figures, (targets.Target("lat.p99", 80, at_most=True),))
    assert ok["meets_targets"] is True
    # what a bench printed can be judged again on other figures of the same shape
    again = targets.targets_of(judged["checks"])
    assert again[1] == targets.Target("lat.p99", 50.0, at_most=True)
    assert targets.evaluate({"lat": {"p99": 40}}, again[1:2])["meets_targets"] is True


def test_repeat_judges_the_targets_on_the_median(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "core.json"
    assert repeat.main(["--trials", "2", "--out", str(out), "core", "--events", "600"]) == 0
    printed = json.loads(out.read_text())
    snapshot = next(c for c in printed["median_checks"] if c["figure"] == "snapshot_bytes_step_50")
    assert snapshot["at_most"] is True and snapshot["bound"] == 8192
    assert snapshot["value"] == printed["median"]["snapshot_bytes_step_50"]
    assert snapshot["met"] is (snapshot["value"] <= 8192)
    rate = next(c for c in printed["median_checks"] if c["figure"] == "transitions_per_second")
    assert rate["value"] == printed["median"]["transitions_per_second"]
    assert printed["median_meets_targets"] is all(c["met"] for c in printed["median_checks"])
    met = sum(1 for t in printed["trials"] if t["meets_targets"])
    assert printed["trials_meeting_targets"] == met
    told = capsys.readouterr().err
    assert "core: 2 trials" in told
    assert f"snapshot_bytes_step_50 <= 8192: median {snapshot['value']}" in told
    assert f"trials meeting every target: {met}" in told


def test_each_trial_says_how_the_host_was() -> None:
    trial = {
        "meets_targets": False,
        "host_speed": {"core_fold_us_per_event": 56.5},
        "throughput_machine": {"steal_pct": 0.7},
        "latency": {"machine": {"steal_pct": 9.4}},
    }
    assert repeat.host_line(trial) == "steal up to 9.4%, host_speed 56.5 µs/event, missed a target"
    assert repeat.host_line({"meets_targets": True}) == "met every target"
    assert repeat.host_line({}) == "no targets"


def test_a_trial_writes_its_figures_to_a_file_of_its_own(tmp_path: Path) -> None:
    """A trial is not the bench's latest result: it never writes over bench/results/."""
    args = ["--levels", "16"]
    assert repeat.trial_args("loop", args, str(tmp_path)) == [
        *args, "--out", str(tmp_path / "loop.json"),
    ]  # fmt: skip
    named = ["--out", "/tmp/mine.json", "--levels", "16"]
    assert repeat.trial_args("loop", named, str(tmp_path)) == named
    assert repeat.trial_args("floor", ["--out=/tmp/f.json"], str(tmp_path)) == ["--out=/tmp/f.json"]
    assert repeat.trial_args("core", args, str(tmp_path)) == args  # prints only


def test_the_benches_that_write_a_result_file_are_the_ones_given_a_file_of_their_own() -> None:
    root = Path(repeat.__file__).parent
    writing = {b for b in repeat.BENCHES if '"--out"' in (root / f"{b}.py").read_text()}
    assert writing == set(repeat.WRITES_OUT)
