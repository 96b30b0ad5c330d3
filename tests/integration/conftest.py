"""Fixtures of the integration tests (the broker and Postgres come from tests/conftest.py)."""

from collections.abc import Iterator

import pytest
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
