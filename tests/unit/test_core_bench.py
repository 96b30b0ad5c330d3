"""The core benchmark runs and prints one JSON object on its last line."""

from __future__ import annotations

import json

import pytest

from bench import core


def test_bench_core_prints_json_last_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert core.main(["--events", "1500", "--repeat", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads(last)
    assert report["events"] == 1500 and report["transitions_per_second"] > 0
    assert report["snapshot_bytes_step_50"] is not None
    assert report["snapshot_bytes_step_50"] <= 8 * 1024
