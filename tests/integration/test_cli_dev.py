"""The `agentruns dev` and error paths, run as a user runs them: the console script."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agentruns.connectors.dev.stack.procs import free_port_block, pid_alive
from agentruns.connectors.dev.stack.services import ServiceStack

AGENTRUNS = [sys.executable, "-m", "agentruns.connectors.cli"]


def _run(
    args: list[str], env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        AGENTRUNS + args, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def dev_env(tmp_path: Path) -> dict[str, str]:
    state = Path("/tmp") / f"agentruns-clitest-{tmp_path.name}"
    kafka_port = free_port_block(2, start=28000)
    env = {
        **os.environ,
        "AGENTRUNS_STATE_DIR": str(state),
        "AGENTRUNS_KAFKA_PORT": str(kafka_port),
        "AGENTRUNS_PG_PORT": str(free_port_block(1, start=kafka_port + 2)),
    }
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    env.pop("DATABASE_URL", None)
    yield env
    _run(["dev", "down", "--wipe"], env)
    shutil.rmtree(state, ignore_errors=True)


def test_dev_up_status_down_leaves_nothing_behind(dev_env: dict[str, str]) -> None:
    up = _run(["dev", "up"], dev_env)
    assert up.returncode == 0, up.stderr
    assert "ready in" in up.stdout and "0001_artifacts" in up.stdout

    status = _run(["dev", "status", "--json"], dev_env)
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)
    pids = info["kafka"]["pids"]
    assert pids and info["postgres"]["running"]
    assert info["kafka"]["bootstrap_servers"].endswith(dev_env["AGENTRUNS_KAFKA_PORT"])

    again = _run(["dev", "up"], dev_env)  # idempotent: already running, nothing new
    assert again.returncode == 0, again.stderr
    assert "none new" in again.stdout

    down = _run(["dev", "down"], dev_env)
    assert down.returncode == 0, down.stderr
    assert not any(pid_alive(p) for p in pids)
    after = _run(["dev", "status"], dev_env)
    assert after.returncode == 1 and "stopped" in after.stdout


def test_port_in_use_is_one_clear_line(dev_env: dict[str, str]) -> None:
    with socket.socket() as blocker:
        try:
            blocker.bind(("127.0.0.1", int(dev_env["AGENTRUNS_KAFKA_PORT"])))
            blocker.listen()
        except OSError as exc:  # another process on this machine took it first: in use too
            if exc.errno != errno.EADDRINUSE:
                raise
        result = _run(["dev", "up"], dev_env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "in use" in lines[0] and "Traceback" not in result.stderr


def test_missing_java_is_one_clear_line(dev_env: dict[str, str], tmp_path: Path) -> None:
    env = {**dev_env, "PATH": str(tmp_path), "AGENTRUNS_KAFKA_HOME": str(tmp_path / "nojars")}
    result = _run(["dev", "up"], env)
    assert result.returncode == 2
    assert "java is not installed" in result.stderr and "Traceback" not in result.stderr


def test_unreachable_bootstrap_is_one_clear_line(dev_env: dict[str, str]) -> None:
    env = {**dev_env, "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9"}
    result = _run(["topics", "create"], env, timeout=60)
    assert result.returncode == 2
    assert "does not answer" in result.stderr and "KAFKA_BOOTSTRAP_SERVERS" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [["executor", "tool"], ["run"]], ids=" ".join)
def test_a_missing_tool_registry_is_one_clear_line(
    dev_env: dict[str, str], tmp_path: Path, command: list[str]
) -> None:
    env = {k: v for k, v in dev_env.items() if k != "AGENTRUNS_TOOL_REGISTRY"}
    result = _run(command, env, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no tool registry" in lines[0], result.stderr
    assert "--registry" in lines[0] and "AGENTRUNS_TOOL_REGISTRY" in lines[0]

    absent = tmp_path / "absent.json"
    result = _run([*command, "--registry", str(absent)], env, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot read the tool registry {absent}" in lines[0]


def test_a_command_leaves_running_what_another_command_started(
    dev_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`agentruns run` without `dev up` starts the local stack; `agentruns submit` (here
    `topics list`) in another terminal uses it and must not stop it when it ends."""
    env = {**dev_env, "AGENTRUNS_NO_DOCKER": "1"}
    for name in ("AGENTRUNS_STATE_DIR", "AGENTRUNS_KAFKA_PORT", "AGENTRUNS_PG_PORT"):
        monkeypatch.setenv(name, env[name])
    monkeypatch.setenv("AGENTRUNS_NO_DOCKER", "1")
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with ServiceStack() as first:
        assert first.local is not None
        listed = _run(["topics", "list"], env)
        assert listed.returncode == 0, listed.stderr
        assert first.local.kafka.running() and first.local.postgres.running()
    assert not first.local.kafka.running() and not first.local.postgres.running()
