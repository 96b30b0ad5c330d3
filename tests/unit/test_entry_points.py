"""Every service module runs as `python -m agentruns...` with its own `main`, and `agentruns X`
reaches the same command: neither imports the module twice (its metrics would be registered
twice and the process would stop before it started)."""

from __future__ import annotations

import subprocess
import sys

import pytest

MODULES = {
    "agentruns.connectors.runtime.processor": "processor",
    "agentruns.connectors.runtime.timers": "timer",
    "agentruns.connectors.runtime.scanner": "scan",
    "agentruns.connectors.monolith": "run",
    "agentruns.connectors.api.serve": "api",
    "agentruns.connectors.projection.sink": "sink",
    "agentruns.connectors.projection.replay": "replay",
    "agentruns.connectors.projection.audit": "audit",
    "agentruns.connectors.projection.revalidate": "revalidate",
    "agentruns.connectors.executors.model": "executor model",
    "agentruns.connectors.executors.tool": "executor tool",
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_service_module_runs_as_a_script(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert f"usage: agentruns {MODULES[module]}" in done.stdout
    assert "Traceback" not in done.stderr


def test_a_command_error_is_one_line_and_exit_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agentruns.connectors.executors.tool", "--bootstrap", "x:1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "AGENTRUNS_TOOL_REGISTRY": ""},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("agentruns: ")
    assert len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stderr
