"""The client commands' failures, run as a user runs them (the console script): each ends with
exit code 2 and exactly one line on stderr, `agentruns: <what is wrong> — <what to do>`, never a
trace, and within a bounded time when the broker does not answer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.connectors.dev.stack.services import ServiceStack
from agentruns.connectors.postgres.migrate import migrate
from agentruns.streams.admin import ensure_topics

AGENTRUNS = str(Path(sys.executable).parent / "agentruns")


def run(
    args: list[str], env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [AGENTRUNS, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed command printed on stderr (asserting that is all it printed)."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentruns: "), result.stderr
    return lines[0]


@pytest.fixture
def bare_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Nothing configured: no Kafka or Postgres in the environment, none running in an empty
    state directory (under /tmp: the postgres user must be able to enter it), no Docker."""
    state = Path("/tmp") / f"agentruns-clierr-{tmp_path.name}"
    env = {**os.environ, "AGENTRUNS_STATE_DIR": str(state), "AGENTRUNS_NO_DOCKER": "1"}
    for name in ("KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL", "AGENTRUNS_API_URL"):
        env.pop(name, None)
    yield env
    shutil.rmtree(state, ignore_errors=True)


def test_a_task_file_that_does_not_exist(bare_env: dict[str, str]) -> None:
    line = one_line(run(["submit", "--key", "k", "--task", "/nonexistent.json"], bare_env))
    assert "/nonexistent.json" in line and "No such file" in line


def test_a_task_file_that_is_not_json(bare_env: dict[str, str], tmp_path: Path) -> None:
    task = tmp_path / "task.json"
    task.write_text('{"goal": ')
    line = one_line(run(["submit", "--key", "k", "--task", str(task)], bare_env))
    assert str(task) in line and "not valid JSON" in line


def test_a_task_that_is_not_an_object(bare_env: dict[str, str], tmp_path: Path) -> None:
    task = tmp_path / "task.json"
    task.write_text('["goal"]')
    assert "not a JSON object" in one_line(
        run(["submit", "--key", "k", "--task", str(task)], bare_env)
    )


def test_a_reply_that_is_not_json(bare_env: dict[str, str]) -> None:
    line = one_line(run(["reply", "run-x", "--response", "{bad"], bare_env))
    assert "--response is not valid JSON" in line


@pytest.mark.parametrize(
    "args",
    [
        ["submit", "--key", "k", "--goal", "g"],
        ["results"],
        ["cancel", "run-x"],
        ["replay", "run-x"],
        ["audit"],
        ["revalidate", "--validator-version", "1"],
    ],
    ids=lambda a: a[0],
)
def test_no_cluster_configured_starts_nothing(bare_env: dict[str, str], args: list[str]) -> None:
    line = one_line(run(args, bare_env))
    assert "no Kafka cluster configured" in line
    assert "agentruns dev up" in line and "KAFKA_BOOTSTRAP_SERVERS" in line
    assert not (Path(bare_env["AGENTRUNS_STATE_DIR"]) / "kafka").exists()  # nothing started


@pytest.mark.parametrize(
    "args",
    [["processor"], ["timer"], ["scan"], ["api"], ["executor", "model"], ["db", "migrate"]],
    ids=lambda a: "-".join(a),
)
def test_a_service_with_nothing_configured_refuses_to_start(
    bare_env: dict[str, str], args: list[str]
) -> None:
    """A production command takes Kafka and Postgres from the settings; it starts neither."""
    began = time.monotonic()
    line = one_line(run(args, bare_env))
    assert time.monotonic() - began < 30
    assert "no Kafka cluster configured" in line or "no Postgres configured" in line, line
    assert "KAFKA_BOOTSTRAP_SERVERS is not set" in line or "DATABASE_URL is not set" in line
    assert not (Path(bare_env["AGENTRUNS_STATE_DIR"]) / "kafka").exists()  # nothing started


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args", [["results"], ["submit", "--key", "k", "--goal", "g"]], ids=lambda a: a[0]
)
def test_a_broker_that_does_not_answer_is_one_line_in_bounded_time(
    bare_env: dict[str, str], args: list[str]
) -> None:
    dead = f"127.0.0.1:{free_port_block(1, start=29500)}"
    began = time.monotonic()
    line = one_line(run(args, {**bare_env, "KAFKA_BOOTSTRAP_SERVERS": dead}))
    assert time.monotonic() - began < 30
    assert f"Kafka at {dead} does not answer" in line


def test_audit_without_postgres_says_how_to_get_one_or_go_without(
    bare_env: dict[str, str], kafka_bootstrap: str, unique_name: str
) -> None:
    ensure_topics(kafka_bootstrap, prefix=unique_name, partitions=1)
    env = {**bare_env, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    line = one_line(run(["audit", "--prefix", unique_name], env))
    assert "no Postgres configured" in line and "--no-postgres" in line

    without = run(["audit", "--prefix", unique_name, "--no-postgres"], env)
    assert without.returncode == 0, without.stderr
    assert "audited 0 runs" in without.stdout


def test_replay_needs_kafka_only(
    bare_env: dict[str, str], kafka_bootstrap: str, unique_name: str
) -> None:
    ensure_topics(kafka_bootstrap, prefix=unique_name, partitions=1)
    env = {**bare_env, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    result = run(["replay", "run-x", "--prefix", unique_name], env)
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["agentruns: no events for run run-x"]


@pytest.mark.timeout(300)
def test_client_commands_use_the_local_stack_another_command_started(
    bare_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`agentruns run` without `dev up` starts the local stack in the state directory (without
    saving its config); the client commands in another terminal find it there."""
    kafka_port = free_port_block(2, start=28100)
    env = {
        **bare_env,
        "AGENTRUNS_KAFKA_PORT": str(kafka_port),
        "AGENTRUNS_PG_PORT": str(free_port_block(1, start=kafka_port + 2)),
    }
    for name in (
        "AGENTRUNS_STATE_DIR",
        "AGENTRUNS_KAFKA_PORT",
        "AGENTRUNS_PG_PORT",
        "AGENTRUNS_NO_DOCKER",
    ):
        monkeypatch.setenv(name, env[name])
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with ServiceStack() as started:
        assert started.endpoints is not None and started.local is not None
        ensure_topics(started.endpoints.kafka_bootstrap, prefix="local", partitions=1)
        migrate(started.endpoints.database_url)  # as `agentruns run` does
        submitted = run(["submit", "--key", "k", "--goal", "g", "--prefix", "local"], env)
        assert submitted.returncode == 0, submitted.stderr
        assert '"run_id": "run-' in submitted.stdout
        audited = run(["audit", "--prefix", "local"], env)  # its Postgres too
        assert audited.returncode == 0, audited.stderr
        assert "audited 0 runs" in audited.stdout
    assert not started.local.kafka.running()


@pytest.mark.parametrize("source", ["token_env", "token_file"])
def test_a_tool_secret_that_is_not_there_stops_the_tool_executor_at_start(
    bare_env: dict[str, str], tmp_path: Path, source: str
) -> None:
    missing = "AGENTRUNS_TEST_ABSENT_TOKEN" if source == "token_env" else str(tmp_path / "none")
    bare_env.pop("AGENTRUNS_TEST_ABSENT_TOKEN", None)
    registry = tmp_path / "tools.json"
    tool = {"name": "guarded", "endpoint": "/x", "auth": {"type": "bearer", source: missing}}
    registry.write_text(json.dumps({"base_url": "http://127.0.0.1:9", "tools": [tool]}))
    started = time.monotonic()
    line = one_line(run(["executor", "tool", "--registry", str(registry)], bare_env))
    assert "guarded" in line and missing in line
    assert time.monotonic() - started < 30  # before any broker or database is looked for
