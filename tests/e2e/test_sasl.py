"""Kafka with SASL: a broker whose clients authenticate with SCRAM-SHA-256, the demo scenarios
run through it with a client properties file (every producer, consumer and admin client of
every process gets it), and a service with a wrong password ends with one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentruns.connectors.dev.servers.tool_server import DEFAULT_REGISTRY
from agentruns.connectors.dev.stack.local_kafka import LocalKafka, ScramUser
from agentruns.connectors.dev.stack.procs import free_port_block

AGENTRUNS = str(Path(sys.executable).parent / "agentruns")
USER = ScramUser("agentruns-svc", "s3cret-for-the-test")


@pytest.fixture(scope="module")
def sasl_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    port = free_port_block(3)  # PLAINTEXT, controller, SASL_PLAINTEXT
    kafka = LocalKafka(
        tmp_path_factory.mktemp("sasl-kafka"), port=port, scram_user=USER, sasl_port=port + 2
    )
    kafka.start(timeout=120)
    try:
        yield kafka
    finally:
        kafka.wipe()


def client_file(directory: Path, password: str) -> Path:
    """A client properties file as an operator writes one for the Java tools."""
    path = directory / "client.properties"
    path.write_text(
        "# SCRAM over SASL_PLAINTEXT\n"
        "security.protocol=SASL_PLAINTEXT\n"
        "sasl.mechanism=SCRAM-SHA-256\n"
        "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required \\\n"
        f'    username="{USER.name}" password="{password}";\n'
    )
    return path


def env_for(kafka: LocalKafka, database_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTRUNS_")}
    env.update(KAFKA_BOOTSTRAP_SERVERS=kafka.sasl_bootstrap_servers, DATABASE_URL=database_url)
    return env


def test_demo_scenarios_run_through_sasl(
    sasl_kafka: LocalKafka, database_url: str, tmp_path: Path
) -> None:
    config = client_file(tmp_path, USER.password)
    env = {**env_for(sasl_kafka, database_url), "AGENTRUNS_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.run(
        [AGENTRUNS, "--kafka-config", str(config), "demo", "--timeout", "240"],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"kafka    {sasl_kafka.sasl_bootstrap_servers}  (env)" in proc.stdout
    assert "EXPECTED" not in proc.stdout


def test_wrong_password_is_one_line_and_exit_2(
    sasl_kafka: LocalKafka, database_url: str, tmp_path: Path
) -> None:
    config = client_file(tmp_path, "not-the-password")
    env = {**env_for(sasl_kafka, database_url), "AGENTRUNS_KAFKA_CONFIG": str(config)}
    services = (
        ["processor", "--prefix", "sasl-wrong"],
        ["topics", "create"],
        [
            "executor",
            "tool",
            "--bootstrap",
            sasl_kafka.sasl_bootstrap_servers,
            "--database-url",
            database_url,
            "--registry",
            str(DEFAULT_REGISTRY),
        ],
    )
    for command in services:
        proc = subprocess.run(
            [AGENTRUNS, *command], env=env, capture_output=True, text=True, timeout=120
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr
        assert len(lines) == 1, proc.stderr
        assert "Kafka refused the client's credentials" in lines[0]
        assert "SCRAM-SHA-256" in lines[0]


def test_plaintext_client_is_refused_by_the_sasl_listener(
    sasl_kafka: LocalKafka, database_url: str
) -> None:
    """Without the properties file nothing gets through: what passed above passed by SASL."""
    proc = subprocess.run(
        [AGENTRUNS, "topics", "list"],
        env=env_for(sasl_kafka, database_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
