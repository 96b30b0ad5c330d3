"""The operator's tool catalog at every door, against the real broker and Postgres: the API
answers 422, `RunsProducer` raises, and a task written to Kafka directly ends FAILED with the
reason; a task that names only its tools is filled from the catalog and runs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from agentruns.connectors.api.client import InvalidInputError, RunsProducer
from agentruns.processors.catalog import Catalog, CatalogTool
from agentruns.processors.state import ToolSpec
from agentruns.streams.records import input_record
from tests.support.api import PARTITIONS, Stack, pipeline
from tests.support.console import logged_in
from tests.support.pipeline import SEARCH, Inbox, submitted

DELETE = {"type": "object", "properties": {"record_id": {"type": "string"}}}
CATALOG = Catalog.of(
    "it-1",
    {
        "search_docs": CatalogTool(parameters=SEARCH.parameters, permission="read"),
        "delete_record": CatalogTool(parameters=DELETE, permission="admin", approval_required=True),
    },
)
WIDER = "invalid_input:tool_differs_from_catalog: delete_record: permission read is wider than"


@pytest.fixture(scope="module")
def guarded(kafka_bootstrap: str, database_url: str) -> Iterator[Stack]:
    """The API's test stack whose processor and API hold tasks to CATALOG."""
    with pipeline(kafka_bootstrap, database_url, catalog=CATALOG) as s:
        yield s


def test_the_api_refuses_a_task_that_widens_the_catalog_and_fills_one_that_names_its_tools(
    guarded: Stack,
) -> None:
    cases = {
        "unknown": ({"name": "drop_table"}, "invalid_input:tool_not_in_catalog: drop_table"),
        "wider": ({"name": "delete_record", "permission": "read", "parameters": DELETE}, WIDER),
        "approval": (
            {"name": "delete_record"},
            "invalid_input:tool_differs_from_catalog: delete_record: approval_required:",
        ),
    }
    for name, (tool, reason) in cases.items():
        r = guarded.http.post(
            "/runs",
            json={"goal": "g", "tools": [tool]},
            headers={"Idempotency-Key": f"catalog-{name}-{uuid.uuid4().hex}"},
        )
        assert r.status_code == 422, (name, r.text)
        assert r.json()["reason"].startswith(reason), (name, r.json())
    run_id = guarded.submit(f"catalog-named-{uuid.uuid4().hex}", tools=[{"name": "search_docs"}])
    run = guarded.wait_status(run_id, "SUCCEEDED")
    assert run["catalog_version"] == CATALOG.version


def test_runs_producer_with_the_catalog_raises_before_producing(guarded: Stack) -> None:
    with (
        RunsProducer(
            guarded.bootstrap,
            producer_id="catalog-test",
            prefix=guarded.prefix,
            partitions=PARTITIONS,
            catalog=CATALOG,
        ) as producer,
        pytest.raises(InvalidInputError) as refused,
    ):
        producer.submit(
            {"goal": "g", "tools": [{"name": "delete_record", "permission": "read"}]},
            idempotency_key=f"catalog-client-{uuid.uuid4().hex}",
        )
    assert refused.value.reason.startswith(WIDER)


def test_a_task_written_to_kafka_that_widens_the_catalog_ends_failed_with_the_reason(
    guarded: Stack,
) -> None:
    run_id = f"catalog-raw-{uuid.uuid4().hex}"
    # written with `write`, below the catalog's `admin` (a record's `read` would be taken as
    # omitted, and filled in from the catalog)
    task = submitted(run_id).model_copy(
        update={"tools": (ToolSpec(name="delete_record", parameters=DELETE, permission="write"),)}
    )
    inbox = Inbox(guarded.bootstrap, guarded.prefix, PARTITIONS)
    try:
        inbox.send(input_record(task, producer_id="raw", producer_seq=1))
        inbox.flush()
    finally:
        inbox.close()
    run = guarded.wait_status(run_id, "FAILED")
    wider = WIDER.replace("permission read", "permission write")
    assert run["outcome"].startswith(wider)
    assert run["catalog_version"] == CATALOG.version
    assert run["result"]["summary"].startswith("FAILED: " + wider)


def test_the_console_shows_the_catalog_version_and_its_tools(guarded: Stack) -> None:
    with logged_in(guarded) as client:
        page = client.get("/ui/tools")
    assert page.status_code == 200
    assert f'<code id="catalog-version">{CATALOG.version}</code>' in page.text
    assert "<code>delete_record</code></td><td>admin</td>" in page.text
    assert "required" in page.text
