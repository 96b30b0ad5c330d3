"""The supervisor tells a component that ended on its own from one it took down itself."""

from __future__ import annotations

import os
import time
from pathlib import Path

from agentruns.connectors.dev.stack.supervisor import Supervisor

SERVER = ("http.server", "0", "--bind", "127.0.0.1")  # runs until signalled


def _wait_exited(sup: Supervisor, name: str, timeout: float = 20.0) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (code := sup.exited(name)) is not None:
            return code
        time.sleep(0.05)
    return None


def test_a_killed_component_is_held_down_not_crashed(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, env={})
    sup.add("server", *SERVER)
    sup.start("server")
    try:
        assert sup.exited("server") is None
        sup.kill("server")
        assert sup.components["server"].kills == 1
        assert sup.exited("server") is None  # down on purpose until started again
        sup.start("server")
        assert sup.components["server"].starts == 2
        assert sup.exited("server") is None
    finally:
        sup.stop_all()
    assert sup.exited("server") is None


def test_a_component_that_exits_by_itself_reports_its_status(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, env={})
    sup.add("broken", "json.tool", str(tmp_path / "missing.json"))
    sup.start("broken")
    try:
        assert _wait_exited(sup, "broken") == 2  # json.tool: no such file
        assert "missing.json" in sup.log_tail("broken")
        sup.start("broken")  # restarted: running or exited again, never held down
        assert sup.components["broken"].starts == 2
    finally:
        sup.stop_all()


def test_a_component_writes_its_thread_stacks_when_asked_and_goes_on(tmp_path: Path) -> None:
    # the component imports the same agentruns as the test (the source tree on PYTHONPATH)
    env = {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "PYTHONSAFEPATH")}
    sup = Supervisor(tmp_path, env=env)
    sup.add("service", "agentruns.connectors.dev.servers.tool_server", "--port", "0")
    sup.start("service")
    try:
        deadline = time.monotonic() + 60
        while not sup.log_tail("service") and time.monotonic() < deadline:
            time.sleep(0.1)  # its banner: past start-up, run_command registered the handler
        assert sup.dump_stacks() == ["service"]
        while "Thread 0x" not in sup.log_tail("service", 200) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "Thread 0x" in sup.log_tail("service", 200)
        assert sup.exited("service") is None
    finally:
        sup.stop_all()
