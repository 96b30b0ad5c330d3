"""The executors bench reads the executor's stats from its JSON log lines."""

from __future__ import annotations

import json
from pathlib import Path

from agentruns.bench.executors import executor_stats


def test_the_stats_come_from_the_last_json_log_line_that_holds_them(tmp_path: Path) -> None:
    log = tmp_path / "executor.log"
    stats = {"batches": 3, "stages_ms": {"execute": 1.5}}
    lines = [
        json.dumps({"level": "info", "msg": "executor stats " + json.dumps({"batches": 1})}),
        json.dumps({"level": "info", "msg": "executor stats " + json.dumps(stats)}),
        "a warning a library printed, not JSON",
        json.dumps({"level": "info", "msg": "stopped"}),
    ]
    log.write_text("\n".join(lines) + "\n")
    assert executor_stats(log) == stats


def test_a_log_without_stats_gives_none(tmp_path: Path) -> None:
    log = tmp_path / "executor.log"
    log.write_text(json.dumps({"msg": "executor started"}) + "\nplain text\n")
    assert executor_stats(log) is None
