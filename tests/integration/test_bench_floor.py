"""`agentruns bench floor`, small, against the test broker: both modes run and print their
figures as one JSON object on the last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from agentruns.bench.repeat import last_json_line


def test_the_floor_bench_prints_every_figure_of_both_modes(
    kafka_bootstrap: str, database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "floor.json"
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "DATABASE_URL": database_url}
    cmd = [sys.executable, "-m", "agentruns.connectors.cli", "bench", "floor"]
    args = ["--tokens", "1", "--hops", "5", "--out", str(out)]
    done = subprocess.run(
        [*cmd, *args], env=env, stdout=subprocess.PIPE, text=True, timeout=300, check=True
    )
    figures = last_json_line(done.stdout)
    assert figures == json.loads(out.read_text())
    assert figures["bench"] == "floor" and figures["hops_per_token"] == 5
    assert set(figures["modes"]) == {"transactional", "plain"}
    for levels in figures["modes"].values():
        (level,) = levels
        assert level["tokens"] == 1 and level["hops"] == 5
        for name in ("seconds", "hops_per_s", "hop_p50_ms", "hop_p99_ms"):
            assert level[name] > 0, name
        assert level["step_floor"]["steps_per_s"] > 0
        assert level["step_floor"]["step_latency_ms"] > 0
        assert {"side_a", "side_b", "bench"} <= set(level["cpu_us_per_hop"])
        sides = level["by_side"]
        assert sides["side_a"]["hops"] + sides["side_b"]["hops"] == 5
        assert all(side["hop_p50_ms"] > 0 for side in sides.values() if side["hops"])
