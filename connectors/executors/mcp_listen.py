"""Standing connections to MCP servers that announce tool list changes (docs/tools.md,
"Refresh").

A streamable-HTTP server whose ``initialize`` answer advertises ``tools.listChanged`` sends
``notifications/tools/list_changed`` on the session's standing ``GET`` event stream. A
:class:`ToolListListener` keeps one session per such server open with the MCP SDK's client
(``ClientSession`` over ``streamable_http_client``, whose transport opens and re-opens that
stream) and calls ``changed(server)`` for each notification; the caller coalesces them (the
catalog's refresher lists every server once for any number of them).

- one connection per server, on one event loop in a thread of its own; a server that does not
  advertise ``tools.listChanged``, or a ``stdio`` server (its process is the tool executor's),
  gets none: the schedule alone refreshes it;
- the session is pinged every ``PING_S``: a ping that fails (the server went away, restarted
  and forgot the session, a dead connection) ends the session, and it is opened again after a
  back-off (``BACKOFF_MIN_S`` doubling to ``BACKOFF_MAX_S``, with jitter); a session opened
  again calls ``changed`` once, since a change may have been announced while nobody listened;
- :meth:`watch` is given the registry's servers after each refresh: a server no longer named,
  or named differently (URL, auth), loses its connection (one whose entry changed gets a new
  one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
from collections.abc import Callable, Mapping
from typing import Any

import httpx2
from mcp.client.session import ClientSession, IncomingMessage
from mcp.client.streamable_http import streamable_http_client
from mcp_types import Implementation, ToolListChangedNotification

from agentruns.connectors.executors.mcp_rules import MCPServerSpec

log = logging.getLogger("agentruns.catalog.listen")

PING_S = 15.0
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 60.0
CONNECT_TIMEOUT_S = 10.0
CLIENT_INFO = Implementation(name="agentruns-catalog", version="1")


def listens(spec: MCPServerSpec) -> bool:
    """Whether a server can be listened to at all (streamable HTTP, not a process)."""
    return spec.stdio is None and bool(spec.url)


class ToolListListener:
    """One standing session per streamable-HTTP MCP server that advertises
    ``tools.listChanged``; ``changed(server)`` on each announcement (called on the listener's
    thread: it must be quick and thread-safe, e.g. set an event)."""

    def __init__(
        self,
        changed: Callable[[str], None],
        *,
        ping_s: float = PING_S,
        backoff_min_s: float = BACKOFF_MIN_S,
        backoff_max_s: float = BACKOFF_MAX_S,
    ) -> None:
        self._changed = changed
        self.ping_s = ping_s
        self.backoff_min_s, self.backoff_max_s = backoff_min_s, backoff_max_s
        self._loop: asyncio.AbstractEventLoop | None = None  # made by start, closed by stop
        self._thread = threading.Thread(target=self._run, daemon=True, name="mcp-listen")
        self._tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}  # loop thread only
        #: servers listening now (their session open and advertising listChanged)
        self.listening: set[str] = set()
        self.connects: dict[str, int] = {}  # sessions opened per server, for logs and tests

    def _run(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def start(self) -> ToolListListener:
        self._loop = asyncio.new_event_loop()
        self._thread.start()
        return self

    def watch(self, servers: Mapping[str, MCPServerSpec]) -> None:
        """Listen to exactly ``servers`` (those that can be listened to), from any thread."""
        wanted = {name: repr(spec) for name, spec in servers.items() if listens(spec)}
        specs = dict(servers)

        loop = self._loop

        def apply() -> None:
            assert loop is not None
            for name, (shape, task) in list(self._tasks.items()):
                if wanted.get(name) != shape:
                    task.cancel()
                    del self._tasks[name]
            for name, shape in wanted.items():
                if name not in self._tasks:
                    task = loop.create_task(self._listen(specs[name]), name=f"listen-{name}")
                    self._tasks[name] = (shape, task)

        if loop is not None and self._thread.is_alive():
            loop.call_soon_threadsafe(apply)

    def stop(self, timeout_s: float = 10.0) -> None:
        loop = self._loop
        if loop is None or not self._thread.is_alive():
            return

        async def end() -> None:
            tasks = [task for _, task in self._tasks.values()]
            self._tasks.clear()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(end(), loop).result(timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout_s)

    async def _listen(self, spec: MCPServerSpec) -> None:
        """Keep a session to ``spec`` open until cancelled (or the server does not announce
        changes), re-opened after a back-off whenever it is lost."""
        delay = self.backoff_min_s
        opened_before = False
        while True:
            try:
                outcome = await self._session(spec, opened_before)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # whatever the SDK raised: the session is lost
                outcome = "lost"
                log.info("MCP server %s: tool list listening ended: %s", spec.name, _why(exc))
            finally:
                self.listening.discard(spec.name)
            if outcome == "unsupported":
                log.info(
                    "MCP server %s does not announce tool list changes: its tools are listed on"
                    " the schedule only",
                    spec.name,
                )
                return
            if outcome == "listened":
                opened_before = True
                delay = self.backoff_min_s
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, self.backoff_max_s)

    async def _session(self, spec: MCPServerSpec, opened_before: bool) -> str:
        """One session: ``unsupported`` (no ``tools.listChanged``), else it runs until a ping
        fails (``listened``, raised as the ping's error otherwise handled by the caller)."""

        async def on_message(message: IncomingMessage) -> None:
            if isinstance(message, ToolListChangedNotification):
                log.info("MCP server %s: tool list changed", spec.name)
                self._changed(spec.name)

        headers: dict[str, str] = {}
        if spec.conn.auth_header is not None:
            name, secret = spec.conn.auth_header
            headers[name] = secret.reveal()
        client = httpx2.AsyncClient(
            headers=headers,
            # no read timeout: the event stream is quiet until something changes; a dead
            # connection is found by the ping
            timeout=httpx2.Timeout(CONNECT_TIMEOUT_S, read=None),
            verify=_verify(spec),
            proxy=spec.conn.proxy or None,
            trust_env=spec.conn.proxy is None,
        )
        async with (
            client,
            streamable_http_client(spec.url, http_client=client) as (read, write),
            ClientSession(
                read,
                write,
                read_timeout_seconds=CONNECT_TIMEOUT_S,
                message_handler=on_message,
                client_info=CLIENT_INFO,
            ) as session,
        ):
            result = await session.initialize()
            tools = result.capabilities.tools
            if tools is None or not tools.list_changed:
                return "unsupported"
            self.listening.add(spec.name)
            self.connects[spec.name] = self.connects.get(spec.name, 0) + 1
            log.info("MCP server %s: listening for tool list changes", spec.name)
            if opened_before:  # a change may have been announced while nobody listened
                self._changed(spec.name)
            while True:
                await asyncio.sleep(self.ping_s)
                try:
                    await session.send_ping()
                except Exception as exc:
                    why = _why(exc)
                    log.info("MCP server %s: ping failed (%s): listening again", spec.name, why)
                    return "listened"


def _verify(spec: MCPServerSpec) -> Any:
    """httpx2's ``verify`` for the server's TLS settings (a client certificate included)."""
    import ssl

    conn = spec.conn
    if not conn.verify:
        return False
    if conn.ca_file is None and conn.cert_file is None:
        return True
    context = ssl.create_default_context(cafile=conn.ca_file)
    if conn.cert_file is not None:
        context.load_cert_chain(conn.cert_file, conn.key_file)
    return context


def _why(exc: BaseException) -> str:
    """A short reason, from an exception group's first leaf when the SDK raised one."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:200]


__all__ = ["ToolListListener", "listens"]
