"""The MCP servers of a tool registry as the tool executor sees them: their sessions and the
tools they list, as registry entries (docs/tools.md).

Each server's tools are listed (``tools/list``) when the executor starts and again every
``refresh_s`` (60 s; in the background, a call never waits for it), when an answer carries
``notifications/tools/list_changed``, and when a call names a tool of the server that the last
listing did not have (at most every ``UNKNOWN_REFRESH_S``). When the registry is read again
(:meth:`MCPTools.reconfigure`), a server it no longer names loses its tools. A tool is named
``<server>__<tool>`` for the agent; a listed tool whose name cannot be one (not
``[A-Za-z0-9_-]``, over 64 characters) or that an HTTP tool of the registry already has is
left out with a warning.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from agentruns.connectors.executors.http import KeepAliveHTTP
from agentruns.connectors.executors.limits import NO_LIMITS
from agentruns.connectors.executors.mcp_client import HTTPWire, MCPSession, Wire
from agentruns.connectors.executors.mcp_rules import (
    AGENT_TOOL_NAME,
    MAX_TOOLS_PER_SERVER,
    SEPARATOR,
    MCPServerSpec,
    rules_for,
)
from agentruns.connectors.executors.mcp_stdio import StdioWire
from agentruns.connectors.executors.mcp_tasks import task_support

if TYPE_CHECKING:
    from agentruns.connectors.executors.tool import ToolEntry

log = logging.getLogger("agentruns.executor.tool.mcp")

#: A call naming an unlisted tool of a server lists its tools again at most this often.
UNKNOWN_REFRESH_S = 5.0
START_LISTING_S = 10.0


def entries_of(
    spec: MCPServerSpec,
    tools: list[dict[str, Any]],
    taken: Callable[[str], bool],
    make: Callable[..., ToolEntry],
) -> dict[str, ToolEntry]:
    """A server's listed tools as registry entries (the rules from annotations and the
    operator's overrides); ``taken``: the names HTTP tools already have."""
    entries: dict[str, ToolEntry] = {}
    for tool in tools[:MAX_TOOLS_PER_SERVER]:
        name = tool.get("name")
        agent_name = spec.agent_name(str(name))
        if not isinstance(name, str) or AGENT_TOOL_NAME.fullmatch(agent_name) is None:
            log.warning("MCP server %s: tool %.80r left out (not a tool name)", spec.name, name)
            continue
        if taken(agent_name):
            log.warning("MCP server %s: %s is an HTTP tool's name: left out", spec.name, name)
            continue
        override = spec.tools.get(name)
        annotations = tool.get("annotations")
        rules = rules_for(
            annotations if isinstance(annotations, Mapping) else None, override, spec.timeout_ms
        )
        schema = tool.get("inputSchema")
        entries[agent_name] = make(
            name=agent_name,
            description=str(tool.get("description") or "")[:4000],
            parameters=schema if isinstance(schema, Mapping) else {"type": "object"},
            endpoint=spec.endpoint,
            method="POST",
            timeout_ms=rules.timeout_ms,
            permission=rules.permission,
            idempotent=rules.idempotent,
            status_url_template=None,
            is_async=task_support(tool),
            cancel_url_template=None,
            conn=spec.conn,
            limits=override.limits if override is not None else NO_LIMITS,
            approval_required=rules.approval_required,
            backend="mcp",
            mcp_server=spec.name,
            mcp_tool=name,
        )
    return entries


class MCPTools:
    """The registry's MCP servers: sessions (opened lazily on the executor's event loop) and
    the entries of the tools they list."""

    def __init__(
        self,
        servers: Mapping[str, MCPServerSpec],
        http: KeepAliveHTTP,
        taken: Callable[[str], bool],
        make: Callable[..., ToolEntry],
    ) -> None:
        self.servers = dict(servers)
        self._http = http
        self._taken = taken
        self._make = make
        self._sessions: dict[str, MCPSession] = {}
        # replaced whole (never changed in place): read by other threads (route_of)
        self.entries: Mapping[str, ToolEntry] = {}
        self._listed_at: dict[str, float] = {}
        self._listing: dict[str, asyncio.Task[None]] = {}
        self._ending: set[asyncio.Task[None]] = set()

    def server_of(self, tool: str) -> MCPServerSpec | None:
        """The server a tool name belongs to by its prefix (listed or not)."""
        server, sep, _ = tool.partition(SEPARATOR)
        return self.servers.get(server) if sep else None

    def session(self, server: str) -> MCPSession:
        session = self._sessions.get(server)
        if session is None:
            spec = self.servers[server]
            wire: Wire = HTTPWire(spec, self._http) if spec.stdio is None else StdioWire(spec)
            session = self._sessions[server] = MCPSession(spec, wire)
        return session

    def _install(self, spec: MCPServerSpec, tools: list[dict[str, Any]]) -> None:
        kept = {k: v for k, v in self.entries.items() if v.mcp_server != spec.name}
        self.entries = {**kept, **entries_of(spec, tools, self._taken, self._make)}
        self._listed_at[spec.name] = time.monotonic()

    async def refresh(self, server: str) -> str:
        """List a server's tools now; "" or why it failed (the previous entries stay)."""
        spec = self.servers[server]
        tools, problem = await self.session(server).list_tools(spec.timeout_ms / 1000)
        if tools is None:
            log.warning("MCP server %s: %s", server, problem)
            return problem
        self._install(spec, tools)
        return problem

    def stale(self, server: str) -> None:
        """The server said its tools changed: list them again with the next call."""
        self._listed_at[server] = -1e18

    def refresh_soon(self, server: str) -> None:
        """List a server's tools in the background if the last listing is older than its
        ``refresh_s`` (one listing at a time)."""
        spec = self.servers[server]
        if time.monotonic() - self._listed_at.get(server, -1e18) < spec.refresh_s:
            return
        running = self._listing.get(server)
        if running is not None and not running.done():
            return

        async def listing() -> None:
            await self.refresh(server)

        self._listing[server] = asyncio.get_running_loop().create_task(listing())

    async def entry(self, tool: str) -> tuple[ToolEntry | None, str]:
        """The entry of an MCP tool, listing its server's tools first when they were never
        listed or the tool is not among them (not more often than UNKNOWN_REFRESH_S)."""
        spec = self.server_of(tool)
        if spec is None:
            return None, "not an MCP tool"
        self.refresh_soon(spec.name)
        found = self.entries.get(tool)
        if found is not None:
            return found, ""
        listed = self._listed_at.get(spec.name)
        if listed is None or time.monotonic() - listed >= UNKNOWN_REFRESH_S:
            problem = await self.refresh(spec.name)
            if spec.name not in self._listed_at:
                return None, problem or "never listed"
        return self.entries.get(tool), ""

    def reconfigure(self, servers: Mapping[str, MCPServerSpec]) -> None:
        """The registry was read again: a server it no longer names loses its tools and its
        session; one whose entry changed (URL, auth, overrides) is listed again with its next
        call, before the call is held to its tools; the others keep what they listed."""
        changed = {
            name
            for name, spec in self.servers.items()
            if name not in servers or repr(servers[name]) != repr(spec)
        }
        self.servers = dict(servers)
        if not changed:
            return
        self.entries = {k: v for k, v in self.entries.items() if v.mcp_server not in changed}
        for name in changed:
            self._listed_at.pop(name, None)
            running = self._listing.pop(name, None)
            if running is not None:
                running.cancel()
            session = self._sessions.pop(name, None)
            if session is not None:
                self._end(session)

    def _end(self, session: MCPSession) -> None:
        """End a session no longer used, in the background when a loop runs here."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop in this thread: the server expires the session
        task = loop.create_task(session.terminate())
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    def seed(self, entries: Mapping[str, ToolEntry], listed: set[str]) -> None:
        """What was listed at start (:func:`discover`), as if listed now."""
        self.entries = dict(entries)
        now = time.monotonic()
        for server in listed:
            self._listed_at[server] = now

    async def close(self) -> None:
        for task in self._listing.values():
            task.cancel()
        for session in self._sessions.values():
            await session.terminate()


def discover(
    servers: Mapping[str, MCPServerSpec],
    taken: Callable[[str], bool],
    make: Callable[..., ToolEntry],
    timeout_s: float = START_LISTING_S,
) -> tuple[dict[str, ToolEntry], set[str]]:
    """List every server's tools now (at start, in the caller's thread, on an event loop of
    its own); a server that does not answer is logged and listed later by the executor."""

    async def run() -> tuple[dict[str, ToolEntry], set[str]]:
        http = KeepAliveHTTP(2.0)
        tools = MCPTools(servers, http, taken, make)
        try:
            await asyncio.wait_for(
                asyncio.gather(*(tools.refresh(name) for name in servers)), timeout_s
            )
        except TimeoutError:
            log.warning("MCP servers: not all listed their tools within %.0f s", timeout_s)
        finally:
            await tools.close()
            http.close()
        return dict(tools.entries), set(tools._listed_at)

    return asyncio.run(run()) if servers else ({}, set())


__all__ = ["MCPTools", "discover", "entries_of"]
