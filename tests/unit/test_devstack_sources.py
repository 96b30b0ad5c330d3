"""Where Kafka and Postgres come from (agentruns.connectors.dev.stack.services), with the Docker
check faked: no engine runs here. The containers and docker-compose.kafka.yml must configure
the broker as the local one does."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from agentruns.connectors.dev.stack import services
from agentruns.connectors.dev.stack.local_kafka import (
    KafkaNode,
    broker_settings,
    container_env,
    server_properties,
)
from agentruns.connectors.dev.stack.services import (
    CONTAINER,
    ENV,
    LOCAL,
    Plan,
    ServiceStack,
    kafka_container_env,
    plan_sources,
)
from agentruns.connectors.errors import MissingToolError

ROOT = Path(__file__).resolve().parents[2]
KAFKA = "127.0.0.1:9092"
DB = "postgresql://u@127.0.0.1/db"


def never() -> bool:
    raise AssertionError("Docker is asked although both services are configured")


@pytest.mark.parametrize(
    ("kafka", "database", "docker", "plan"),
    [
        (KAFKA, DB, never, Plan(ENV, ENV)),
        (None, None, lambda: True, Plan(CONTAINER, CONTAINER)),
        (None, None, lambda: False, Plan(LOCAL, LOCAL)),
        (KAFKA, None, lambda: True, Plan(ENV, CONTAINER)),
        (None, DB, lambda: False, Plan(LOCAL, ENV)),
    ],
)
def test_a_configured_service_is_used_a_missing_one_comes_from_docker_else_locally(
    kafka: str | None, database: str | None, docker: Any, plan: Plan
) -> None:
    assert plan_sources(kafka, database, docker=docker) == plan


class FakeContainer:
    """What ServiceStack calls on testcontainers' containers; it records instead of running."""

    started: list[FakeContainer] = []

    def __init__(self, image: str, **_: Any) -> None:
        self.image = image
        self.env: dict[str, str] = {"KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS": "1"}
        self.running = False

    def with_kraft(self) -> FakeContainer:
        return self

    def with_env(self, name: str, value: str) -> FakeContainer:
        self.env[name] = value
        return self

    def start(self) -> FakeContainer:
        self.running = True
        FakeContainer.started.append(self)
        return self

    def stop(self) -> None:
        self.running = False

    def get_bootstrap_server(self) -> str:
        return "127.0.0.1:29092"

    def get_connection_url(self) -> str:
        return "postgresql://test@127.0.0.1:25432/test"


@pytest.fixture
def no_services_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("AGENTRUNS_KAFKA_TXN_VERIFICATION", raising=False)
    monkeypatch.setattr(services, "docker_available", lambda: True)


def test_with_docker_both_services_come_from_containers_configured_as_the_local_broker(
    no_services_configured: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, attr in (("kafka", "KafkaContainer"), ("postgres", "PostgresContainer")):
        module = types.ModuleType(f"testcontainers.community.{name}")
        setattr(module, attr, FakeContainer)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    FakeContainer.started = []
    stack = ServiceStack(ephemeral=True)
    endpoints = stack.start()
    assert (endpoints.kafka_source, endpoints.postgres_source) == ("testcontainers",) * 2
    assert endpoints.kafka_bootstrap == "127.0.0.1:29092"
    kafka, postgres = FakeContainer.started
    assert kafka.image == services.KAFKA_IMAGE and postgres.image == services.POSTGRES_IMAGE
    assert kafka.env == kafka_container_env()  # the image's own defaults overridden
    stack.close()
    assert not kafka.running and not postgres.running


def test_docker_without_the_docker_extra_is_a_one_line_error_naming_it(
    no_services_configured: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("testcontainers", "testcontainers.community", "testcontainers.community.kafka"):
        monkeypatch.setitem(sys.modules, name, None)  # as when the package is not installed
    with pytest.raises(MissingToolError) as raised:
        ServiceStack(ephemeral=True).start()
    line = raised.value.one_line()
    assert "\n" not in line
    assert "testcontainers is not installed" in line and "agentruns[docker]" in line


def local_broker_settings() -> dict[str, str]:
    node = KafkaNode(node_id=1, port=19092, controller_port=19093, directory=Path("/x"))
    text = server_properties(node, "1@127.0.0.1:19093", replicas=1)
    return dict(line.split("=", 1) for line in text.splitlines())


def test_the_container_broker_is_configured_as_the_local_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AGENTRUNS_KAFKA_TXN_VERIFICATION", raising=False)
    local = local_broker_settings()
    env = kafka_container_env()
    for name in broker_settings(1):
        assert env["KAFKA_" + name.upper().replace(".", "_")] == local[name], name
    # the settings the pipeline's transactions and consumer groups depend on
    assert env["KAFKA_TRANSACTION_PARTITION_VERIFICATION_ENABLE"] == "false"
    assert env["KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS"] == "8"
    assert env["KAFKA_TRANSACTION_STATE_LOG_NUM_PARTITIONS"] == "8"
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "1"
    assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "1"


def compose_kafka_env() -> dict[str, str]:
    text = (ROOT / "docker-compose.kafka.yml").read_text()
    kafka = text.split("\n  kafka:\n", 1)[1].split("\n  postgres:\n", 1)[0]
    pairs = re.findall(r'^\s+(KAFKA_[A-Z_]+):\s*"?([^"\n]*?)"?\s*$', kafka, re.MULTILINE)
    return dict(pairs)


def test_docker_compose_configures_the_broker_as_the_local_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AGENTRUNS_KAFKA_TXN_VERIFICATION", raising=False)
    compose = compose_kafka_env()
    wanted = container_env(broker_settings(1))
    assert {name: compose.get(name) for name in wanted} == wanted
