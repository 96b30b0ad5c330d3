"""Fixtures shared by the whole test run: one real Kafka broker and one real Postgres.

Resolved by the development harness (agentruns.connectors.dev.stack.services):
KAFKA_BOOTSTRAP_SERVERS / DATABASE_URL if set, testcontainers when Docker answers, else local
processes started in a temporary directory on free ports
and stopped at the end. Fixtures are lazy: unit tests never start anything.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from agentruns.connectors.dev.stack.services import ServiceStack
from agentruns.connectors.endpoints import Endpoints

#: Tests that start brokers of their own, cut the network or kill processes at random: with
#: `pytest -n 2` (`make test`) they run one after another on one worker, so that no two of them
#: share the machine's two cores while the other tests, mostly waiting on the broker, run beside.
HEAVY = {
    "tests/e2e/test_chaos.py",
    "tests/e2e/test_chaos_cluster.py",
    "tests/e2e/test_executor_kills.py",
    "tests/e2e/test_hostile.py",
    "tests/integration/test_cluster_faults.py",
    "tests/integration/test_full_disk.py",
    "tests/integration/test_network_partition.py",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.split("::", 1)[0] in HEAVY:
            item.add_marker(pytest.mark.xdist_group("heavy"))


@pytest.fixture(scope="session", autouse=True)
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The processors the tests start keep their stores of ended runs here, not in the user's
    state directory (the processes they start inherit it)."""
    path = tmp_path_factory.mktemp("state")
    os.environ["AGENTRUNS_STORE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def services() -> Iterator[Endpoints]:
    with ServiceStack(ephemeral=True) as stack:
        assert stack.endpoints is not None
        yield stack.endpoints


@pytest.fixture(scope="session")
def kafka_bootstrap(services: Endpoints) -> str:
    return services.kafka_bootstrap


@pytest.fixture(scope="session")
def database_url(services: Endpoints) -> str:
    from agentruns.connectors.postgres.migrate import migrate

    migrate(services.database_url)
    return services.database_url


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A topic/group/prefix name no other test uses (tests share one broker)."""
    base = request.node.name.replace("[", "-").replace("]", "").replace("_", "-")[:40]
    return f"t-{base}-{uuid.uuid4().hex[:8]}"
