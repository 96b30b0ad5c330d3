"""The catalog refreshed when an MCP server announces a change, against the example MCP server
as a process: its "changed tool list" fault sends ``notifications/tools/list_changed`` on the
standing stream the catalog's refresher listens to, and the catalog has the new tool long
before its schedule (an hour) would; the listener opens its session again after the server is
killed and restarted; and `agentruns run`'s monolith, on a registry made in memory, refreshes
its catalog (the processor's and the API's) the same way."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from agentruns.connectors.catalog import CatalogRefresher, catalog_of, configured_catalog
from agentruns.connectors.executors.mcp_rules import parse_mcp_servers
from agentruns.connectors.executors.tool import ToolRegistry
from agentruns.connectors.monolith import Monolith
from agentruns.processors.catalog import Catalog
from agentruns.streams.admin import ensure_topics
from tests.integration.test_mcp_tools import ServerProcess
from tests.support.waiting import wait_for

ARCHIVE = "shop__archive_order"
HOUR_S = 3600.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp_path)
    process.start()
    try:
        yield process
    finally:
        process.stop()
        process.http.close()


def _entry(server: ServerProcess) -> dict[str, object]:
    return {"name": "shop", "url": f"{server.url}/mcp", "timeout_ms": 2000}


def _change_tools(server: ServerProcess) -> None:
    """A call of a client of its own that makes the server add ``archive_order``."""
    server.fault(target="lookup_order", kind="tools_changed")

    async def call() -> None:
        async with (
            streamable_http_client(f"{server.url}/mcp") as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            result = await session.call_tool("lookup_order", {"order_id": "o-1"})
            assert not result.is_error

    asyncio.run(call())


def _listening(refresher: CatalogRefresher, connects: int = 1) -> None:
    listener = refresher.listener
    assert listener is not None
    wait_for(
        lambda: "shop" in listener.listening and listener.connects.get("shop", 0) >= connects,
        30,
        "the refresher listening to the MCP server",
    )


def test_an_announced_change_refreshes_the_catalog_before_its_schedule(
    server: ServerProcess, tmp_path: Path
) -> None:
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"version": "listen-1", "mcp_servers": [_entry(server)]}))
    catalog = configured_catalog(registry, component="test")
    assert catalog is not None and ARCHIVE not in catalog.tools
    taken: list[Catalog] = []
    refresher = CatalogRefresher(
        registry, catalog, taken.append, component="test", interval_s=HOUR_S
    ).start()
    try:
        _listening(refresher)
        _change_tools(server)
        wait_for(lambda: ARCHIVE in refresher.catalog.tools, 10, "the announced tool")
        assert taken and ARCHIVE in taken[-1].tools
        assert refresher.announced >= 1
        assert refresher.catalog.tools[ARCHIVE].approval_required  # destructive: approval
    finally:
        refresher.stop()


def test_the_listener_opens_its_session_again_after_the_server_restarts(
    server: ServerProcess, tmp_path: Path
) -> None:
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"version": "listen-2", "mcp_servers": [_entry(server)]}))
    catalog = configured_catalog(registry, component="test")
    assert catalog is not None
    refresher = CatalogRefresher(registry, catalog, print, component="test", interval_s=HOUR_S)
    assert refresher.listener is not None
    refresher.listener.ping_s = 0.5  # a lost session is found within a second
    refresher.start()
    try:
        _listening(refresher)
        assert server.process is not None
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(10)
        wait_for(lambda: "shop" not in refresher.listener.listening, 10, "the session lost")
        server.start()  # the same port, a new process that knows no session
        _listening(refresher, connects=2)
        _change_tools(server)
        wait_for(lambda: ARCHIVE in refresher.catalog.tools, 10, "the announced tool")
    finally:
        refresher.stop()
    assert refresher.listener.connects["shop"] >= 2


def test_the_monolith_refreshes_the_catalog_of_a_registry_made_in_memory(
    server: ServerProcess, kafka_bootstrap: str, database_url: str, unique_name: str
) -> None:
    from agentruns.connectors.dev.servers import tool_server

    registry = ToolRegistry.load(tool_server.DEFAULT_REGISTRY)
    servers = parse_mcp_servers({"mcp_servers": [_entry(server)]}, "the test registry")
    made = replace(registry, mcp_servers=servers, path="")  # as `agentruns run --dev-servers`
    ensure_topics(kafka_bootstrap, prefix=unique_name, partitions=1)
    monolith = Monolith(kafka_bootstrap, database_url, prefix=unique_name, registry=made)
    api_catalogs: list[Catalog] = []
    monolith.take_catalog(api_catalogs.append)
    assert ARCHIVE not in monolith.catalog.tools
    assert monolith.catalog == catalog_of(made)
    monolith.start()
    try:
        assert monolith.refresher is not None
        _listening(monolith.refresher)
        _change_tools(server)
        wait_for(lambda: ARCHIVE in monolith.catalog.tools, 10, "the announced tool")
        assert monolith.processor._path.settings.catalog is monolith.catalog
        assert api_catalogs[-1] is monolith.catalog
        assert "search_docs" in monolith.catalog.tools  # the registry's HTTP tools stay
    finally:
        monolith.stop()
    assert monolith.failed is None
