"""The operator's tool catalog, made from the tool registry (docs/tools.md, "Tool catalog").

The processor, the API and `agentruns run` hold every task to the catalog of the registry they
are given (``--registry``, else the ``tool_registry`` setting, ``AGENTRUNS_TOOL_REGISTRY``); with
none, tasks declare their own tools. The catalog is made from a loaded `ToolRegistry`: its HTTP
tools and the tools its MCP servers list when the catalog is made (a server that does not
answer then has no tools in it until the process starts again: docs/tools.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from agentruns.connectors.executors.tool import (
    ToolEntry,
    ToolRegistry,
    registry_from_args,
    tools_of,
)
from agentruns.processors.catalog import Catalog, CatalogTool

log = logging.getLogger("agentruns.catalog")

#: What a process without a catalog logs when it starts.
NO_CATALOG = "no tool catalog: tasks declare their own tools"


def catalog_of(
    registry: ToolRegistry,
    entries: Mapping[str, ToolEntry] | None = None,
    routes: tuple[str, ...] | None = None,
) -> Catalog:
    """The catalog of ``registry`` (of ``entries``, its tools, when the caller has listed
    them already) and of the model ``routes`` tasks may name (None: any): its tools as the
    operator declares them, under the registry's version plus a hash of that content."""
    if entries is None:
        entries = tools_of(registry)
    tools = {
        name: CatalogTool(
            parameters=dict(entry.parameters),
            permission=entry.permission,
            approval_required=entry.approval_required,
            idempotent=entry.idempotent,
            is_async=entry.is_async,
        )
        for name, entry in entries.items()
    }
    return Catalog.of(registry.version, tools, routes)


def configured_catalog(
    path: Path | str | None, *, component: str, routes: Path | str | None = None
) -> Catalog | None:
    """The catalog of the registry at ``path`` and of the model routes file ``routes`` (the
    model executor's: the routes a task may name; none: any), or None without a registry
    (ExecutorError when either cannot be read); either way logged once, at start."""
    if path is None or str(path) == "":
        log.info("%s: %s", component, NO_CATALOG)
        return None
    names = None
    if routes is not None and str(routes) != "":
        from agentruns.connectors.executors.model import Routes

        names = tuple(Routes.from_env(str(routes)).routes)
    catalog = catalog_of(registry_from_args(str(path)), routes=names)
    log.info(
        "%s: tool catalog %s (%d tools, %s) from %s",
        component,
        catalog.version,
        len(catalog.tools),
        "any model route" if names is None else f"model routes {', '.join(names)}",
        path,
    )
    return catalog


def _backend(entry: ToolEntry | None) -> str:
    if entry is None:
        return ""
    if entry.backend == "mcp":
        return f"mcp {entry.mcp_server} {entry.mcp_tool}"
    return f"{entry.method} {entry.endpoint}"


def catalog_rows(entries: Mapping[str, ToolEntry], catalog: Catalog) -> list[dict[str, object]]:
    """The catalog's tools as `agentruns tools list` and the console show them, by name."""
    rows: list[dict[str, object]] = []
    for name in sorted(catalog.tools):
        tool, entry = catalog.tools[name], entries.get(name)
        rows.append(
            {
                "name": name,
                "permission": tool.permission,
                "approval_required": tool.approval_required,
                "idempotent": tool.idempotent,
                "is_async": tool.is_async,
                "backend": _backend(entry),
                "parameters": tool.parameters,
            }
        )
    return rows


def format_listing(version: str, rows: list[dict[str, object]]) -> str:
    """The text of `agentruns tools list`: the catalog version, then one line per tool."""
    head = ("name", "permission", "approval", "idempotent", "async", "backend")
    table = [head] + [
        (
            str(r["name"]),
            str(r["permission"]),
            "required" if r["approval_required"] else "-",
            "yes" if r["idempotent"] else "no",
            "yes" if r["is_async"] else "no",
            str(r["backend"]),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in table
    ]
    return "\n".join([f"tool catalog {version} ({len(rows)} tools)", *lines])
