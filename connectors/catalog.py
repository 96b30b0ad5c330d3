"""The operator's tool catalog, made from the tool registry (docs/tools.md, "Tool catalog").

The processor, the API and `agentruns run` hold every task to the catalog of the registry they
are given (``--registry``, else the ``tool_registry`` setting, ``AGENTRUNS_TOOL_REGISTRY``); with
none, tasks declare their own tools. The catalog is made from a loaded `ToolRegistry`: its HTTP
tools and the tools its MCP servers list when the catalog is made. A `CatalogRefresher` makes
it again every ``catalog_refresh_s`` and when an MCP server announces that its tools changed
(``notifications/tools/list_changed``, heard on a standing session:
:mod:`agentruns.connectors.executors.mcp_listen`): the registry file and the routes file read
again (a registry made in memory is its own source), every MCP server listed again, a new
version handed to its component. A refresh that cannot read a file keeps the catalog it has,
and an MCP server that does not answer keeps the tools it last listed (both logged and
counted): a catalog is never emptied by an outage.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path

import msgspec
from prometheus_client import Counter

from agentruns.connectors.executors.base import ExecutorError
from agentruns.connectors.executors.mcp_listen import ToolListListener
from agentruns.connectors.executors.mcp_rules import SEPARATOR
from agentruns.connectors.executors.tool import (
    ToolEntry,
    ToolRegistry,
    registry_from_args,
    tools_of,
)
from agentruns.connectors.executors.tool_mcp import discover
from agentruns.connectors.settings import current
from agentruns.processors.catalog import Catalog, CatalogTool

log = logging.getLogger("agentruns.catalog")

REFRESHES = Counter(
    "agentruns_catalog_refreshes_total",
    "Tool catalog refreshes, by component and outcome: changed (a new version taken),"
    " unchanged, failed (the registry or routes file could not be read: the last catalog"
    " stays), unanswered (an MCP server did not list its tools: the tools it last listed stay)",
    ["component", "outcome"],
)

#: Refreshes made for announcements (``notifications/tools/list_changed``) are at least this
#: far apart.
ANNOUNCED_GAP_S = 1.0

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
            kind="run" if entry.kind == "run" else msgspec.UNSET,
        )
        for name, entry in entries.items()
    }
    return Catalog.of(registry.version, tools, routes)


def _route_names(routes: Path | str | None) -> tuple[str, ...] | None:
    """The routes of the model routes file ``routes`` (None: no file, any route)."""
    if routes is None or str(routes) == "":
        return None
    from agentruns.connectors.executors.model import Routes

    return tuple(Routes.from_env(str(routes)).routes)


def configured_catalog(
    path: Path | str | None, *, component: str, routes: Path | str | None = None
) -> Catalog | None:
    """The catalog of the registry at ``path`` and of the model routes file ``routes`` (the
    model executor's: the routes a task may name; none: any), or None without a registry
    (ExecutorError when either cannot be read); either way logged once, at start."""
    if path is None or str(path) == "":
        log.info("%s: %s", component, NO_CATALOG)
        return None
    names = _route_names(routes)
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


def with_unanswered(
    previous: Catalog, tools: Mapping[str, CatalogTool], unanswered: Collection[str]
) -> dict[str, CatalogTool]:
    """``tools`` (a refresh's) plus the tools ``previous`` had of the MCP servers in
    ``unanswered`` (still named by the registry, but they did not list their tools): a server
    that is down keeps what it last listed rather than vanish from the catalog."""
    kept = {
        name: tool
        for name, tool in previous.tools.items()
        if SEPARATOR in name and name.partition(SEPARATOR)[0] in unanswered
    }
    return {**kept, **tools}


def changes(before: Catalog, after: Catalog) -> str:
    """What a refresh changed, for its log line: the tools added, removed and changed."""
    added = sorted(set(after.tools) - set(before.tools))
    removed = sorted(set(before.tools) - set(after.tools))
    changed = sorted(
        n for n in set(before.tools) & set(after.tools) if before.tools[n] != after.tools[n]
    )
    parts = [
        f"{what} {', '.join(names[:20])}{' ...' if len(names) > 20 else ''}"
        for what, names in (("added", added), ("removed", removed), ("changed", changed))
        if names
    ]
    if before.routes != after.routes:
        parts.append("model routes changed")
    return "; ".join(parts) or "no tool changed"


class CatalogRefresher:
    """Makes a long-running component's catalog again every ``interval_s``, and soon after an
    MCP server announces a change (``listen``: one standing session per server that can,
    announcements coalesced), from the registry ``source`` (its file, read again each time, or
    a registry made in memory) and the model routes file ``routes`` and the MCP servers it
    names, and hands each new version to ``apply`` (the processor's `set_catalog`, the API's
    config, the monolith's).

    - the registry or routes file cannot be read or is not valid: the catalog stays
      (``failed``, logged);
    - an MCP server the registry names does not list its tools: the tools it last listed stay
      (``unanswered``, logged); one the registry no longer names loses its tools;
    - anything else: the catalog of what was read, under a new version when its content
      changed. The API and the processor check each task against the catalog they hold when
      it arrives, and a run keeps the version it was checked against (its stamp)."""

    def __init__(
        self,
        source: Path | str | ToolRegistry,
        catalog: Catalog,
        apply: Callable[[Catalog], None],
        *,
        component: str,
        interval_s: float,
        routes: Path | str | None = None,
        listen: bool = True,
    ) -> None:
        # a registry made in memory (`agentruns run --dev-servers`: no file) is its own
        # source; one read from a file is read again from it
        self._registry: ToolRegistry | None = None
        if isinstance(source, ToolRegistry) and not source.path:
            self.path, self._registry = "", source
        else:
            self.path = source.path if isinstance(source, ToolRegistry) else str(source)
        self.routes = routes
        self.catalog = catalog
        self._apply = apply
        self.component = component
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()  # a server announced a change: refresh now
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.listener = ToolListListener(self.changed) if listen else None
        self.announced = 0  # refreshes made for an announcement, for logs and tests

    def changed(self, server: str) -> None:
        """An MCP server announced that its tools changed: refresh soon (any number of
        announcements before that refresh make one)."""
        self._wake.set()

    def _load(self) -> ToolRegistry:
        return self._registry if self._registry is not None else ToolRegistry.load(self.path)

    def refresh(self) -> str:
        """One refresh now: its outcome (changed, unchanged, failed, unanswered)."""
        with self._lock:
            outcome = self._refresh()
        REFRESHES.labels(self.component, outcome).inc()
        return outcome

    def _refresh(self) -> str:
        try:
            registry = self._load()
            names = _route_names(self.routes)
        except ExecutorError as exc:
            log.warning(
                "%s: tool catalog not refreshed, %s stays: %s",
                self.component, self.catalog.version, exc.args[0] if exc.args else exc,
            )  # fmt: skip
            return "failed"
        if self.listener is not None:
            self.listener.watch(registry.mcp_servers)
        listed, answered = discover(registry.mcp_servers, registry.tools.__contains__, ToolEntry)
        unanswered = set(registry.mcp_servers) - answered
        fresh = catalog_of(registry, {**listed, **registry.tools}, names)
        catalog = fresh
        if unanswered:
            tools = with_unanswered(self.catalog, fresh.tools, unanswered)
            catalog = Catalog.of(registry.version, tools, names)
            log.warning(
                "%s: MCP servers %s did not list their tools: the tools they last listed stay",
                self.component, ", ".join(sorted(unanswered)),
            )  # fmt: skip
        if catalog.version == self.catalog.version:
            return "unanswered" if unanswered else "unchanged"
        log.info(
            "%s: tool catalog %s -> %s (%s)",
            self.component, self.catalog.version, catalog.version, changes(self.catalog, catalog),
        )  # fmt: skip
        self.catalog = catalog
        self._apply(catalog)
        return "unanswered" if unanswered else "changed"

    def _loop(self) -> None:
        due = time.monotonic() + self.interval_s
        while not self._stop.is_set():
            self._wake.wait(max(due - time.monotonic(), 0.0))
            if self._stop.is_set():
                return
            announced = self._wake.is_set()
            if not announced and time.monotonic() < due:
                continue
            self._wake.clear()  # announcements from here on make the next refresh
            if announced:
                self.announced += 1
            try:
                self.refresh()
            except Exception:  # a refresh never stops the component it serves
                REFRESHES.labels(self.component, "failed").inc()
                log.exception("%s: tool catalog refresh failed", self.component)
            due = time.monotonic() + self.interval_s
            # a server announcing changes without pause costs one listing per gap at most
            self._stop.wait(ANNOUNCED_GAP_S)

    def start(self) -> CatalogRefresher:
        if self.listener is not None:
            self.listener.start()
            with contextlib.suppress(ExecutorError):  # the first refresh says why, logged
                self.listener.watch(self._load().mcp_servers)
        self._thread = threading.Thread(
            target=self._loop, daemon=True, name=f"catalog-{self.component}"
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30)
        if self.listener is not None:
            self.listener.stop()


def _backend(entry: ToolEntry | None) -> str:
    if entry is None:
        return ""
    if entry.kind == "run":
        route = entry.run.model_route if entry.run is not None else None
        return f"run {route or '(the caller route)'}"
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


@contextlib.contextmanager
def refreshing(
    path: Path | str | ToolRegistry | None,
    catalog: Catalog | None,
    apply: Callable[[Catalog], None],
    *,
    component: str,
    routes: Path | str | None = None,
) -> Iterator[CatalogRefresher | None]:
    """A `CatalogRefresher` of a long-running component's catalog while the block runs, every
    ``catalog_refresh_s`` of the settings and when an MCP server announces a change (none
    without a catalog: tasks declare their own). ``path``: the registry file, or a registry
    made in memory (read again from its file when it has one)."""
    if catalog is None or path is None or (not isinstance(path, ToolRegistry) and not path):
        yield None
        return
    refresher = CatalogRefresher(
        path,
        catalog,
        apply,
        component=component,
        interval_s=current().catalog_refresh_s,
        routes=routes,
    ).start()
    try:
        yield refresher
    finally:
        refresher.stop()
