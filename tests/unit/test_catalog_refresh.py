"""A catalog that changes while the components run: the executor's check of a call against
the catalog as it is now (`call_refusal`), the tool executor reading its registry again, and
`CatalogRefresher` (a new version when the content changed; an unreadable file or an MCP server
that does not answer never empties the catalog)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agentruns.connectors.catalog import (
    CatalogRefresher,
    catalog_of,
    changes,
    configured_catalog,
    refreshing,
    with_unanswered,
)
from agentruns.connectors.dev.servers import tool_server
from agentruns.connectors.executors.base import NOTHING_AHEAD
from agentruns.connectors.executors.tool import ToolHandler, ToolRegistry
from agentruns.processors.catalog import Catalog, CatalogTool, call_refusal
from agentruns.processors.effects import CallTool, OperationSpec
from agentruns.processors.events import ToolCallFailed
from agentruns.processors.state import ErrorClass

# --------------------------------------------------------------------------- call_refusal


def refusal(declared: str | None, decision: str = "allow", **now: Any) -> str | None:
    allowed = {"permission": "write", "approval_required": False, **now}
    found = call_refusal("t", declared, decision, version="v1+abc", **allowed)
    return None if found is None else found[0]


@pytest.mark.parametrize(
    ("declared", "now", "expected"),
    [
        ("write", "write", None),
        ("admin", "write", None),  # the run is narrower than the catalog: allowed
        ("read", "write", "permission_stricter"),
        ("write", "admin", "permission_stricter"),
        ("custom", "write", "permission_stricter"),  # outside the ranking: only the same one
        ("custom", "custom", None),
        (None, "admin", None),  # an effect that does not carry it: not checked
    ],
)
def test_a_permission_the_catalog_now_ranks_stricter_is_refused(
    declared: str | None, now: str, expected: str | None
) -> None:
    assert refusal(declared, permission=now) == expected


def test_a_tool_now_under_approval_needs_an_approved_call() -> None:
    assert refusal("write", "allow", approval_required=True) == "not_approved"
    assert refusal("write", "approved", approval_required=True) is None
    # approval does not excuse a permission made stricter since
    assert refusal("read", "approved", approval_required=True) == "permission_stricter"
    _, message = call_refusal(
        "t", "read", "allow", permission="write", approval_required=False, version="v1+abc"
    ) or ("", "")
    assert "v1+abc" in message and "read" in message and "write" in message


# --------------------------------------------------------------------------- the executor


def _registry(path: Path, **changes: dict[str, Any]) -> Path:
    data = json.loads(tool_server.DEFAULT_REGISTRY.read_text())
    for tool in data["tools"]:
        tool.update(changes.get(tool["name"], {}))
    path.write_text(json.dumps(data))
    return path


def _call(handler: ToolHandler, tool: str, permission: str | None, decision: str = "allow") -> Any:
    effect = CallTool(
        idempotency_key="k",
        run_id="r1",
        step=1,
        attempt=1,
        trace_id="t",
        operation=OperationSpec(
            key="op-1",
            tool=tool,
            arguments_json='{"to": "a@b", "subject": "s", "body": "b"}',
            expected_version=None,
            policy_decision=decision,
            dispatch=1,
            permission=permission,
        ),
    )
    return asyncio.run(handler.execute(effect, None, NOTHING_AHEAD)).event


def test_the_executor_reads_its_registry_again_and_holds_calls_to_it(tmp_path: Path) -> None:
    path = _registry(tmp_path / "tools.json")
    # nothing listens there: an allowed call fails connect_failed, a refused one never tries
    handler = ToolHandler(
        ToolRegistry.load(path), base_url="http://127.0.0.1:9", catalog_refresh_s=30
    )
    try:
        assert _call(handler, "send_email", "write").error_code == "connect_failed"
        _registry(path, send_email={"permission": "admin"})
        assert not handler.reload_if_due()  # not due yet: the registry it has
        assert _call(handler, "send_email", "write").error_code == "connect_failed"
        assert handler.reload_if_due(now=handler._reload_at)
        refused = _call(handler, "send_email", "write")
        assert isinstance(refused, ToolCallFailed)
        assert (refused.error_class, refused.error_code) == (
            ErrorClass.PERMISSION_DENIED,
            "permission_stricter",
        )
        assert _call(handler, "send_email", "admin").error_code == "connect_failed"
        # a file that is no registry keeps the last one
        path.write_text("{not json")
        assert not handler.reload_if_due(now=handler._reload_at)
        assert handler.reload_failures == 1
        assert handler.registry.tools["send_email"].permission == "admin"
        # a tool taken out of the file is unknown from the next reload
        data = json.loads(tool_server.DEFAULT_REGISTRY.read_text())
        data["tools"] = [t for t in data["tools"] if t["name"] != "send_email"]
        path.write_text(json.dumps(data))
        assert handler.reload_if_due(now=handler._reload_at)
        assert _call(handler, "send_email", "admin").error_code == "unknown_tool"
    finally:
        handler.close()


# --------------------------------------------------------------------------- the refresher


def test_unanswered_servers_keep_their_last_tools_and_changes_are_named() -> None:
    before = Catalog.of(
        "v",
        {
            "shop__a": CatalogTool(),
            "docs__b": CatalogTool(),
            "plain": CatalogTool(),
        },
    )
    fresh = {"plain": CatalogTool(permission="write"), "new": CatalogTool()}
    kept = with_unanswered(before, fresh, {"shop"})
    assert sorted(kept) == ["new", "plain", "shop__a"]  # docs answered: its tool is gone
    assert kept["plain"].permission == "write"
    after = Catalog.of("v", kept)
    assert changes(before, after) == "added new; removed docs__b; changed plain"
    assert changes(after, after) == "no tool changed"


def _dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/mcp"


def test_the_refresher_takes_a_new_version_and_never_empties_the_catalog(tmp_path: Path) -> None:
    path = _registry(tmp_path / "tools.json")
    first = configured_catalog(path, component="test")
    assert first is not None
    taken: list[Catalog] = []
    refresher = CatalogRefresher(path, first, taken.append, component="test", interval_s=60)
    assert refresher.refresh() == "unchanged" and taken == []
    _registry(path, send_email={"approval_required": True})
    assert refresher.refresh() == "changed"
    assert [c.version for c in taken] == [refresher.catalog.version] != [first.version]
    assert refresher.catalog.tools["send_email"].approval_required
    path.write_text("[]")
    assert refresher.refresh() == "failed" and len(taken) == 1
    assert refresher.catalog is taken[0]
    # an MCP server that does not answer keeps what it last listed; a removed one loses it
    data = json.loads(tool_server.DEFAULT_REGISTRY.read_text())
    data["mcp_servers"] = [{"name": "shop", "url": _dead_url(), "timeout_ms": 500}]
    path.write_text(json.dumps(data))
    listed = dict(taken[0].tools, shop__lookup_order=CatalogTool())
    refresher.catalog = Catalog.of("listed", listed)
    assert refresher.refresh() == "unanswered"
    assert "shop__lookup_order" in refresher.catalog.tools
    assert "shop__lookup_order" in taken[-1].tools
    data.pop("mcp_servers")
    path.write_text(json.dumps(data))
    assert refresher.refresh() == "changed"
    assert "shop__lookup_order" not in refresher.catalog.tools
    assert refresher.catalog == catalog_of(ToolRegistry.load(path))


def test_announcements_are_coalesced_into_few_refreshes(tmp_path: Path) -> None:
    path = _registry(tmp_path / "tools.json")
    first = configured_catalog(path, component="test")
    assert first is not None
    refresher = CatalogRefresher(path, first, print, component="test", interval_s=3600)
    refresher.start()
    try:
        for _ in range(200):  # a server announcing changes without pause
            refresher.changed("shop")
        _registry(path, send_email={"approval_required": True})
        refresher.changed("shop")
        deadline = time.monotonic() + 10
        while not refresher.catalog.tools["send_email"].approval_required:
            assert time.monotonic() < deadline, "the announcement made no refresh"
            time.sleep(0.02)
        time.sleep(1.5)
    finally:
        refresher.stop()
    # not one refresh per announcement: the first, and one for what came during it
    assert 1 <= refresher.announced <= 2


def test_a_registry_made_in_memory_is_refreshed_from_itself(tmp_path: Path) -> None:
    registry = ToolRegistry.load(_registry(tmp_path / "tools.json"))
    made = replace(registry, path="")  # as `agentruns run --dev-servers` makes its registry
    (tmp_path / "tools.json").unlink()  # nothing to read: the registry is its own source
    catalog = catalog_of(made)
    refresher = CatalogRefresher(made, catalog, print, component="test", interval_s=60)
    assert refresher.refresh() == "unchanged"
    assert refresher.catalog is catalog
    with refreshing(made, catalog, print, component="test") as running:
        assert running is not None and running.path == ""
    with refreshing(None, catalog, print, component="test") as running:
        assert running is None
