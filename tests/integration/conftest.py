"""Fixtures of the integration tests (the broker and Postgres come from tests/conftest.py)."""

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentruns.connectors.dev.stack.local_postgres import LocalPostgres
from agentruns.connectors.dev.stack.procs import free_port_block
from agentruns.connectors.postgres.migrate import migrate
from agentruns.streams.admin import ensure_topics
from tests.support.api import Stack, pipeline


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration" in str(item.path):
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def prefix(kafka_bootstrap: str, unique_name: str, request: pytest.FixtureRequest) -> str:
    """A topic prefix of the test's own, its topics created with the module's PARTITIONS."""
    partitions = int(getattr(request.module, "PARTITIONS", 3))
    ensure_topics(kafka_bootstrap, prefix=unique_name, partitions=partitions)
    return unique_name


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, database_url: str) -> Iterator[Stack]:
    """The API's test stack, one per test module."""
    with pipeline(kafka_bootstrap, database_url) as s:
        yield s


@pytest.fixture
def own_postgres() -> Iterator[LocalPostgres]:
    """A Postgres of this test's own, so it can be stopped and started."""
    directory = Path(tempfile.mkdtemp(prefix="agentruns-own-pg-"))
    directory.chmod(0o755)
    server = LocalPostgres(directory, port=free_port_block(1, start=25432), durable=False)
    server.start()
    try:
        migrate(server.url)
        yield server
    finally:
        server.wipe()
