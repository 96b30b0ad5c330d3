"""The tool executor (`agentruns executor tool`): HTTP tools with idempotency and reconciliation.

Consumes ``agentruns.effects.tool`` (CallTool, Reconcile, PollTool, CancelTool) and answers each
with one core event on the inbox (see :mod:`agentruns.connectors.executors.base` for the loop, the
records
and the transaction). The protocol with a tool backend (R11-R14, R22, R25):

- Every exchange ends by the tool's ``timeout_ms`` counted from the request (a backend that
  drips its answer byte by byte cannot hold it longer: a timeout as any other), and a body
  over ``max_body_bytes`` (8 MiB) is not read: the call fails ``UNKNOWN``
  ``invalid_output:too_large``; a JSON body nested deeper than ``MAX_JSON_DEPTH`` fails
  ``invalid_output:too_deep`` (look-ups: cannot tell). ``Retry-After`` is clamped to
  ``MAX_RETRY_AFTER_MS`` or ignored when it is not a number or a date, or is over a day.
- ``CallTool``: ``<method> base_url + endpoint`` with the canonical JSON arguments and the
  header ``Idempotency-Key: <operation key>`` (the same key on every resend), ``If-Match`` with
  the expected resource version when the operation has one, ``X-Callback-URL`` when configured.
  2xx -> ToolCallSucceeded (raw output kept as an artifact, deterministic summary when large);
  202 -> ToolCallAccepted; a timeout or a connection lost after the request was sent ->
  ToolCallTimedOut (the operation is UNKNOWN, never failed); a connection that could not be
  opened -> ToolCallFailed TRANSIENT (nothing was sent); a TLS handshake or certificate that
  failed -> ToolCallFailed UNKNOWN ``tls_failed`` (nothing was sent); status codes ->
  :func:`error_for_status`. The registry as it is at call time is the catalog (the file is
  read again every ``catalog_refresh_s`` when it changed; docs/tools.md): a tool it no longer
  has -> ToolCallFailed ``unknown_tool``; one it marks ``approval_required`` whose call no
  person approved (the operation's ``policy_decision``) -> ToolCallFailed PERMISSION_DENIED
  ``not_approved``; one it now ranks stricter than the permission the run declared ->
  PERMISSION_DENIED ``permission_stricter`` (:func:`agentruns.processors.catalog.
  call_refusal`; nothing is sent). Each tool's auth, proxy and
  TLS come from the registry (read by :mod:`agentruns.connectors.executors.tool_http`, carried by
  :mod:`agentruns.connectors.executors.http`).
- ``Reconcile``: ``GET status_url`` -> 200 succeeded = found_succeeded (with the result), 404 =
  not_executed (safe to resend with the same key), anything else = undeterminable.
- ``PollTool``: ``GET status_url`` -> running/accepted = ToolStatusReported; succeeded /
  failed = ToolCallSucceeded / ToolCallFailed; 404 = ToolCallFailed TRANSIENT ``not_found``
  (never executed: a resend with the same key is safe); cannot tell = ToolStatusReported
  running (poll again later).
- ``CancelTool``: ``POST cancel_url`` -> 200 cancelled or 404 never executed = CancelConfirmed;
  409 (already finished), 5xx, transport errors or no cancel URL = CancelUnconfirmed.
- An effect whose handler raised (the executor's guard) is answered with :meth:`ToolHandler.
  failure`: ToolCallFailed ``UNKNOWN`` (not retried by the core), ReconcileCompleted
  undeterminable, CancelUnconfirmed.
- A ``CallTool`` whose executed-action record is ``started`` without a result (the executor
  crashed between the call and the commit) is first looked up by key: found -> its outcome,
  404 -> called now with the same key, cannot tell -> ToolCallTimedOut (the core reconciles).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from agentruns.connectors.executors.base import (
    NOTHING_AHEAD,
    ActionRecord,
    Ahead,
    ExecutorError,
    Outcome,
    decode_json,
    event_identity,
)
from agentruns.connectors.executors.children import ChildRuns, template_of
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.executors.http import (
    DEFAULT_MAX_BODY_BYTES,
    DIRECT,
    Answer,
    Connectivity,
    KeepAliveHTTP,
)
from agentruns.connectors.executors.limits import NO_LIMITS, RouteLimits
from agentruns.connectors.executors.loop import Executor
from agentruns.connectors.executors.mcp_client import Reply, validate_call_result
from agentruns.connectors.executors.mcp_rules import (
    KEY_META,
    RUN_META,
    SEPARATOR,
    MCPServerSpec,
    output_of,
    parse_mcp_servers,
    rpc_error_class,
    status_class,
    text_of,
)
from agentruns.connectors.executors.mcp_tasks import (
    TASK_TTL_MS,
    MemoryTaskStore,
    PostgresTaskStore,
    TaskRef,
    TaskStore,
    created_task,
    supports_tasks,
    task_status,
)
from agentruns.connectors.executors.process import add_common_arguments, serve_executor
from agentruns.connectors.executors.tool_http import parse_connectivity, scrub_answer
from agentruns.connectors.executors.tool_mcp import MCPTools, discover
from agentruns.connectors.keys import (
    CALLBACK_KEY_ENV,
    CALLBACK_SIGNATURE_HEADER,
    DEFAULT_CALLBACK_TTL_MS,
    executor_callback_key,
    sign_callback,
)
from agentruns.connectors.postgres.artifacts import StoredArtifact
from agentruns.connectors.settings import current
from agentruns.processors import tool_results
from agentruns.processors.catalog import call_refusal
from agentruns.processors.children import CHILD_PARAMETERS, ChildTemplate, child_run_id
from agentruns.processors.effects import (
    CallTool,
    CancelTool,
    Effect,
    NotifyParent,
    PollTool,
    Reconcile,
)
from agentruns.processors.events import (
    CancelConfirmed,
    CancelUnconfirmed,
    Event,
    ReconcileCompleted,
    ReconcileOutcome,
    ToolCallAccepted,
    ToolCallFailed,
    ToolCallTimedOut,
    ToolStatusReported,
)
from agentruns.processors.ids import canonical_json
from agentruns.processors.limits import LARGE_OUTPUT_BYTES, MAX_JSON_DEPTH
from agentruns.processors.state import ErrorClass
from agentruns.streams import tracing
from agentruns.streams.clock import now_ms

log = logging.getLogger("agentruns.executor.tool")

#: Where the tool registry is named when --registry is not given.
REGISTRY_ENV = "AGENTRUNS_TOOL_REGISTRY"
DEFAULT_SUMMARY_BYTES = LARGE_OUTPUT_BYTES
RESULT_MEDIA_TYPE = "application/vnd.agentruns.tool-result+json"
# The longest back-off a backend may ask for (Retry-After); a longer one is cut to this.
MAX_RETRY_AFTER_MS = 10 * 60 * 1000
# A tool that answers 429 or 529 without Retry-After: its calls wait this long.
DEFAULT_THROTTLE_S = 1.0
#: The header that tells a tool backend which run a call is for.
RUN_HEADER = "X-Agentruns-Run-Id"
#: How often a running executor reads its registry file again (the catalog_refresh_s setting).
DEFAULT_CATALOG_REFRESH_S = 30.0
# A Retry-After beyond this is no schedule a backend means (`1e300`): ignored like garbage,
# so our own back-off applies instead of the longest one.
ABSURD_RETRY_AFTER_S = 24 * 3600


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ToolEntry:
    name: str
    description: str
    parameters: Mapping[str, Any]
    endpoint: str
    method: str
    timeout_ms: int
    permission: str
    idempotent: bool
    status_url_template: str | None
    is_async: bool
    cancel_url_template: str | None
    # auth, proxy and TLS of this tool (the registry's defaults where the tool has none)
    conn: Connectivity = DIRECT
    # what the backend allows: calls at once, requests per minute (RouteLimits)
    limits: RouteLimits = NO_LIMITS
    # a person approves every call of this tool, whatever the task's policy says
    approval_required: bool = False
    # "http" (this module's convention) or "mcp" (a tool an MCP server listed: docs/tools.md)
    backend: str = "http"
    mcp_server: str | None = None  # the registry's name of the MCP server
    mcp_tool: str | None = None  # the tool's name at that server
    # "run": a call starts a child run (connectors/executors/children.py), with `run` its
    # template; "tool": an HTTP or MCP tool
    kind: str = "tool"
    run: ChildTemplate | None = None


@dataclass(frozen=True)
class ToolRegistry:
    """The tool registry file (JSON): ``version``, ``base_url``, ``tools``, ``mcp_servers``
    (MCP servers whose tools the tool executor lists: docs/tools.md)."""

    version: str
    base_url: str
    tools: Mapping[str, ToolEntry]
    path: str = ""
    mcp_servers: Mapping[str, MCPServerSpec] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path | str) -> ToolRegistry:
        """The registry at ``path``, its secrets read (a missing one fails here, once, at
        start: the error names the tool and the variable or file, never a value)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ExecutorError(f"cannot read the tool registry {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise ExecutorError(f"invalid tool registry {path}: not a JSON object")
        try:
            defaults = parse_connectivity(data, f"tool registry {path}")
            tools = {
                t["name"]: ToolEntry(
                    name=t["name"],
                    description=t.get("description", ""),
                    parameters=t.get(
                        "parameters", CHILD_PARAMETERS if _kind(t) == "run" else {"type": "object"}
                    ),
                    endpoint=t.get("endpoint", f"/tools/{t['name']}"),
                    method=t.get("method", "POST").upper(),
                    timeout_ms=int(t.get("timeout_ms", 5000)),
                    permission=t.get("permission", "read"),
                    idempotent=bool(t.get("idempotent", True)),
                    status_url_template=t.get("status_url_template"),
                    is_async=bool(t.get("async", False)),
                    cancel_url_template=t.get("cancel_url_template"),
                    conn=parse_connectivity(t, f"tool {t['name']!r} in {path}", defaults),
                    limits=_limits(t),
                    approval_required=_flag(t, "approval_required", False),
                    kind=_kind(t),
                    run=template_of(t, f"tool {t['name']!r} in {path}")
                    if _kind(t) == "run"
                    else None,
                )
                for t in data.get("tools", [])
            }
            servers = parse_mcp_servers(data, f"tool registry {path}", defaults)
            clash = sorted(t for t in tools if t.partition(SEPARATOR)[0] in servers)
            if clash:
                raise ExecutorError(
                    f"invalid tool registry {path}: HTTP tools {clash} are named like the tools"
                    " of an MCP server (<server>__<tool>)"
                )
            return cls(
                str(data.get("version", "unversioned")),
                data.get("base_url", ""),
                tools,
                path=str(path),
                mcp_servers=servers,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ExecutorError(f"invalid tool registry {path}: {exc!r}") from exc

    def openai_tools(self, names: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The registry's tools as OpenAI ``tools`` definitions (all, or ``names`` in order)."""
        chosen = list(self.tools) if names is None else [n for n in names if n in self.tools]
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": dict(t.parameters),
                },
            }
            for t in (self.tools[n] for n in chosen)
        ]


def tools_of(registry: ToolRegistry) -> dict[str, ToolEntry]:
    """Every tool of ``registry``: its HTTP tools and what its MCP servers list now (a server
    that does not answer is logged and has none)."""
    listed, _ = discover(registry.mcp_servers, registry.tools.__contains__, ToolEntry)
    return {**listed, **registry.tools}


def _kind(tool: Mapping[str, Any]) -> str:
    """A registry entry's kind: ``tool`` (the default) or ``run`` (ValueError: another)."""
    kind = tool.get("kind", "tool")
    if kind not in ("tool", "run"):
        raise ValueError(f"kind of {tool['name']!r} is not tool or run: {kind!r}")
    return str(kind)


def _flag(tool: Mapping[str, Any], name: str, default: bool) -> bool:
    """A registry entry's boolean field (ValueError: present and not a boolean)."""
    value = tool.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name} of {tool['name']!r} is not true or false: {value!r}")
    return value


def _limits(tool: Mapping[str, Any]) -> RouteLimits:
    """A registry entry's ``max_in_flight`` and ``requests_per_minute`` (ValueError: not a
    limit that can be)."""
    in_flight, rate = tool.get("max_in_flight"), tool.get("requests_per_minute")
    if in_flight is not None and (isinstance(in_flight, bool) or not isinstance(in_flight, int)):
        raise ValueError(f"max_in_flight of {tool['name']!r} is not an integer: {in_flight!r}")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float)):
        raise ValueError(f"requests_per_minute of {tool['name']!r} is not a number: {rate!r}")
    return RouteLimits(max_in_flight=in_flight, requests_per_minute=rate)


# --------------------------------------------------------------------------- pure mapping


def retry_after_ms(value: str | None, limit: int = MAX_RETRY_AFTER_MS) -> int | None:
    """``Retry-After`` (seconds, possibly fractional, or an HTTP date) in ms, within
    [0, ``limit``]; None when it is neither (``NaN``, ``inf``, garbage) or over a day
    (``1e300``). Never raises."""
    if not value or len(value) > 100:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
        try:
            when = parsedate_to_datetime(value)
            seconds = (when.timestamp() * 1000 - now_ms()) / 1000
        except (TypeError, ValueError, OverflowError, IndexError, OSError):
            return None
    if not math.isfinite(seconds) or seconds > ABSURD_RETRY_AFTER_S:
        return None
    return int(min(max(seconds * 1000, 0), limit))


def error_for_status(status: int) -> tuple[ErrorClass, str] | None:
    """The error class and code of a non-2xx tool answer; None when it is not a failure
    (2xx) or not one (504: the request may have executed -> timed out, see ``call``)."""
    if 200 <= status < 300 or status == 504:
        return None
    match status:
        case 300:
            return ErrorClass.OBJECT_AMBIGUOUS, "ambiguous"
        case 401 | 403:
            return ErrorClass.PERMISSION_DENIED, "permission_denied"
        case 409 | 412:
            return ErrorClass.STATE_CONFLICT, "stale_version" if status == 409 else "precondition"
        case 429:
            return ErrorClass.RATE_LIMIT, "rate_limited"
        case 529:  # overloaded: nothing was done, and the backend asks to slow down
            return ErrorClass.RATE_LIMIT, "overloaded"
        case 408 | 500 | 502 | 503:
            return ErrorClass.TRANSIENT, f"http_{status}"
        case 400 | 422:
            return ErrorClass.UNKNOWN, "invalid_arguments"
        case 404:
            return ErrorClass.UNKNOWN, "not_found"
        case _:
            return ErrorClass.UNKNOWN, f"http_{status}"


def _json(body: bytes) -> tuple[Any, str | None]:
    """(payload, problem): None for an empty or non-JSON body; ``too_deep`` when it nests
    deeper than MAX_JSON_DEPTH (the only problem that makes an answer unusable)."""
    if not body:
        return None, None
    payload, problem = decode_json(body)
    return payload, "too_deep" if problem == "too_deep" else None


def _error_code(payload: Any, default: str) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), str):
        return str(payload["error"])[:200]
    return default


# --------------------------------------------------------------------------- handler


def registry_from_args(path: str | None) -> ToolRegistry:
    """The tool registry a command was given (``--registry`` or $AGENTRUNS_TOOL_REGISTRY); a
    production executor has no default, so none given is an error, as is an unreadable file."""
    if not path:
        raise ExecutorError(
            "no tool registry given",
            hint=f"pass --registry PATH or set {REGISTRY_ENV} (a JSON file, see docs/executors.md)",
        )
    return ToolRegistry.load(path)


class ToolHandler:
    """Executes tool effects over HTTP; one pooled keep-alive client shared by the pool."""

    effect_types = frozenset({"CallTool", "Reconcile", "PollTool", "CancelTool", "NotifyParent"})

    def __init__(
        self,
        registry: ToolRegistry,
        *,
        base_url: str | None = None,
        callback_url: str | None = None,
        callback_key: bytes | None = None,
        callback_ttl_ms: int = DEFAULT_CALLBACK_TTL_MS,
        summary_bytes: int = DEFAULT_SUMMARY_BYTES,
        connect_timeout_s: float = 2.0,
        lookup_timeout_s: float = 5.0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        catalog_refresh_s: float = DEFAULT_CATALOG_REFRESH_S,
        tasks: TaskStore | None = None,
        children: ChildRuns | None = None,
    ) -> None:
        self.registry = registry
        # the MCP tasks calls started, by operation key (Postgres in an executor process)
        self.tasks: TaskStore = tasks if tasks is not None else MemoryTaskStore()
        # child runs (tools of kind run): None where no executor's Kafka is at hand
        self.children = children
        # the registry file is read again this often (when it has a path), so a call is held
        # to the catalog as it is now; a file that cannot be read keeps the last registry
        self.catalog_refresh_s = catalog_refresh_s
        self._registry_text = _file_text(registry.path)
        self._reload_at = time.monotonic() + catalog_refresh_s
        self.reload_failures = 0
        self._base_url_given = bool(base_url)
        self.base_url = (base_url or registry.base_url).rstrip("/")
        if not self.base_url and _http_tools(registry):
            raise ExecutorError(
                "no tool base URL", hint="set base_url in the registry or --base-url"
            )
        self.callback_url = callback_url
        # The callback key only (`agentruns.connectors.keys`): never the API's secret.
        self.callback_key = callback_key
        self.callback_ttl_ms = callback_ttl_ms
        self.summary_bytes = summary_bytes
        self.connect_timeout_s = connect_timeout_s
        self.lookup_timeout_s = lookup_timeout_s
        self._http = KeepAliveHTTP(connect_timeout_s, max_body_bytes)
        self.mcp = MCPTools(registry.mcp_servers, self._http, self._is_http_tool, ToolEntry)
        if registry.mcp_servers:  # listed now, so the first calls find their tools
            self.mcp.seed(*discover(registry.mcp_servers, registry.tools.__contains__, ToolEntry))

    def tools(self) -> dict[str, ToolEntry]:
        """Every tool this executor runs now: the registry's HTTP tools and the tools its MCP
        servers listed."""
        return {**self.mcp.entries, **self.registry.tools}

    def _is_http_tool(self, name: str) -> bool:
        return name in self.registry.tools

    def reload_if_due(self, now: float | None = None) -> bool:
        """Read the registry file again if ``catalog_refresh_s`` has passed; True when it
        changed and was taken. A file that cannot be read or is not valid keeps the registry
        the executor has (logged, counted in ``reload_failures``): never an empty one."""
        now = time.monotonic() if now is None else now
        if not self.registry.path or now < self._reload_at:
            return False
        self._reload_at = now + self.catalog_refresh_s
        text = _file_text(self.registry.path)
        if text == self._registry_text:
            return False
        from agentruns.connectors.catalog import REFRESHES  # it imports this module

        try:
            registry = ToolRegistry.load(self.registry.path)
            if _http_tools(registry) and not (self._base_url_given or registry.base_url):
                raise ExecutorError(f"{registry.path}: HTTP tools and no base_url")
        except ExecutorError as exc:
            self.reload_failures += 1
            REFRESHES.labels("tool-executor", "failed").inc()
            log.warning("tool registry not taken, the last one stays: %s", exc)
            return False
        REFRESHES.labels("tool-executor", "changed").inc()
        log.info(
            "tool registry %s: version %s -> %s (%d HTTP tools, MCP servers %s)",
            registry.path, self.registry.version, registry.version, len(registry.tools),
            ", ".join(sorted(registry.mcp_servers)) or "none",
        )  # fmt: skip
        self._registry_text = text
        self.registry = registry
        if not self._base_url_given:
            self.base_url = registry.base_url.rstrip("/")
        self.mcp.reconfigure(registry.mcp_servers)
        return True

    async def aclose(self) -> None:
        """End the MCP sessions (on the executor's event loop, before :meth:`close`)."""
        await self.mcp.close()

    def close(self) -> None:
        self._http.close()
        self.tasks.close()
        if self.children is not None:
            self.children.close()

    def route_of(self, effect: Effect) -> str:
        """A tool effect's route is its tool (its calls and look-ups reach the same backend),
        if the registry has it; every other name shares the empty route (its calls fail at
        once): the routes are bounded by the registry, whatever the effects name."""
        match effect:
            case CallTool():
                tool = effect.operation.tool
            case Reconcile() | PollTool() | CancelTool():
                tool = effect.tool
            case _:
                tool = ""
        if tool in self.registry.tools or tool in self.mcp.entries:
            return tool
        server = self.mcp.server_of(tool)  # a tool its server has not listed (yet)
        return "" if server is None else f"mcp:{server.name}"

    def limits(self, route: str) -> RouteLimits:
        entry = self._entry(route)
        return NO_LIMITS if entry is None else entry.limits

    def exclusive_s(self, effect: Effect) -> float:
        """A call or a cancellation acts on its tool for up to its timeout (a resumed call
        looks it up first); look-ups change nothing, and a child run's submission is the same
        bytes on every resend (taken once)."""
        if not isinstance(effect, CallTool | CancelTool):
            return 0.0
        entry = self._entry(_tool_of(effect))
        if entry is None or entry.kind == "run":
            return 0.0
        return entry.timeout_ms / 1000 + self.lookup_timeout_s

    def prepare(self, effects: Sequence[Effect]) -> Ahead:
        """Nothing to read ahead: a tool call's effect carries all it needs."""
        return NOTHING_AHEAD

    def failure(self, effect: Effect, code: str, message: str) -> Outcome:
        """The answer to an effect this handler could not carry out (the executor's guard):
        the core does not retry UNKNOWN; a reconcile that cannot finish is undeterminable
        (a person decides); a cancel is unconfirmed."""
        op_key, dispatch = _op_of(effect)
        ids = self._ids(effect, op_key, dispatch)
        event: Event
        match effect:
            case Reconcile():
                event = ReconcileCompleted(**ids, outcome=ReconcileOutcome.UNDETERMINABLE)
            case CancelTool():
                event = CancelUnconfirmed(**ids)
            case _:
                event = ToolCallFailed(
                    **ids, error_class=ErrorClass.UNKNOWN, error_code=code, message=message
                )
        return Outcome(event, detail=f"{code}: {message}")

    # ------------------------------------------------------------------ the one network method

    def request_headers(
        self, entry: ToolEntry, headers: Mapping[str, str] | None
    ) -> dict[str, str]:
        """Every header of a request to a tool: the call's own and the tool's auth. The one
        place a request is built, so a header every tool call carries is added here."""
        out = {**(headers or {}), **tracing.outgoing_headers()}  # the effect's trace
        if entry.conn.auth_header is not None:
            name, secret = entry.conn.auth_header
            out[name] = secret.reveal()
        return out

    async def _send(
        self,
        entry: ToolEntry,
        method: str,
        url: str,
        *,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
    ) -> Answer:
        """The only method that touches the network (see :class:`KeepAliveHTTP`). The answer
        holds none of the tool's secrets, whatever the backend echoed: its body becomes
        artifacts and messages, its detail action records and logs."""
        answer = await self._http.send(
            method,
            url,
            timeout_s=timeout_s,
            headers=self.request_headers(entry, headers),
            body=body,
            conn=entry.conn,
        )
        return scrub_answer(answer, entry.conn)

    # ------------------------------------------------------------------ dispatch

    async def execute(self, effect: Effect, previous: ActionRecord | None, ahead: Ahead) -> Outcome:
        self.reload_if_due()
        tool = _tool_of(effect)
        entry = self.registry.tools.get(tool)
        if isinstance(effect, NotifyParent) or (entry is not None and entry.kind == "run"):
            return await self._execute_child(effect, entry)
        if self.mcp.server_of(tool) is not None and tool not in self.registry.tools:
            return await self._execute_mcp(effect, previous)
        match effect:
            case CallTool():
                if previous is not None and previous.status == "started":
                    return await self._resume(effect)
                return await self._call(effect)
            case Reconcile():
                return await self._reconcile(effect)
            case PollTool():
                return await self._poll(effect)
            case CancelTool():
                return await self._cancel(effect)
            case _:
                raise ExecutorError(f"not a tool effect: {effect.type}")

    async def _execute_child(self, effect: Effect, entry: ToolEntry | None) -> Outcome:
        """An effect of a child run (connectors/executors/children.py)."""
        children = self.children
        if children is None:
            return self.failure(
                effect, "child_runs_unavailable", "this tool executor cannot start child runs"
            )
        match effect:
            case NotifyParent():
                return await children.notify(effect)
            case CallTool():
                assert entry is not None and entry.run is not None
                op = effect.operation
                refused = self._refused(effect, entry, self._ids(effect, op.key, op.dispatch))
                if refused is not None:
                    return refused
                return await children.call(effect, entry.run)
            case PollTool():
                return await children.poll(effect)
            case CancelTool():
                return await children.cancel(effect, child_run_id(effect.operation_key))
            case _:  # Reconcile: never asked (a child's start is never answered timed out)
                return self.failure(effect, "child_run", "a child run's call is not looked up")

    def callback_headers(self, key: str, dispatch: int, now: int | None = None) -> dict[str, str]:
        """The callback headers of one dispatch of an operation: ``X-Callback-URL``, the
        template with ``{key}`` replaced by the percent-encoded key, and with a callback key
        ``X-Callback-Signature`` (`keys.sign_callback`: this operation, this dispatch, until
        ``callback_ttl_ms`` from now), which the backend sends back as a header. A signature
        never travels in the URL, which access logs record."""
        if not self.callback_url:
            return {}
        headers = {"X-Callback-URL": self.callback_url.replace("{key}", quote(key, safe=""))}
        if self.callback_key:
            expires = (now_ms() if now is None else now) + self.callback_ttl_ms
            signature = sign_callback(self.callback_key, key, dispatch, expires)
            headers[CALLBACK_SIGNATURE_HEADER] = signature
        return headers

    def _refused(self, effect: CallTool, entry: ToolEntry, ids: dict[str, Any]) -> Outcome | None:
        """The refusal of a call the catalog as it is now does not allow (it may have changed
        since the run was submitted), made before anything is sent; None: allowed."""
        op = effect.operation
        refusal = call_refusal(
            op.tool,
            op.permission,
            op.policy_decision,
            permission=entry.permission,
            approval_required=entry.approval_required,
            version=self.registry.version,
        )
        if refusal is None:
            return None
        code, message = refusal
        event = ToolCallFailed(
            **ids, error_class=ErrorClass.PERMISSION_DENIED, error_code=code, message=message
        )
        return Outcome(event, detail=code)

    def _entry(self, tool: str) -> ToolEntry | None:
        return self.registry.tools.get(tool) or self.mcp.entries.get(tool)

    def _url(self, template: str, key: str) -> str:
        path = template.replace("{key}", quote(key, safe=""))
        return path if path.startswith(("http://", "https://")) else self.base_url + path

    def _ids(self, effect: Effect, op_key: str, dispatch: int) -> dict[str, Any]:
        return {
            **event_identity(effect),
            "step": effect.step,
            "operation_key": op_key,
            "dispatch": dispatch,
        }

    # ------------------------------------------------------------------ CallTool

    async def _call(self, effect: CallTool) -> Outcome:
        op = effect.operation
        ids = self._ids(effect, op.key, op.dispatch)
        entry = self._entry(op.tool)
        if entry is None:
            event: Event = ToolCallFailed(
                **ids,
                error_class=ErrorClass.UNKNOWN,
                error_code="unknown_tool",
                message=f"{op.tool} is not in tool registry {self.registry.version}",
            )
            return Outcome(event, detail="unknown tool")
        refused = self._refused(effect, entry, ids)
        if refused is not None:
            return refused
        try:
            arguments = json.loads(op.arguments_json)
        except ValueError:
            event = ToolCallFailed(
                **ids, error_class=ErrorClass.UNKNOWN, error_code="invalid_arguments_json"
            )
            return Outcome(event, detail="arguments are not JSON")
        headers = {
            "Idempotency-Key": op.key,
            "Content-Type": "application/json",
            # for the backend's own records: which run asked (percent-encoded: a run id is
            # free text, a header value may not be)
            RUN_HEADER: quote(effect.run_id, safe=":"),
        }
        if op.expected_version is not None:
            headers["If-Match"] = op.expected_version
        headers.update(self.callback_headers(op.key, op.dispatch))
        answer = await self._send(
            entry,
            entry.method,
            self._url(entry.endpoint, op.key),
            timeout_s=entry.timeout_ms / 1000,
            headers=headers,
            body=canonical_json(arguments).encode(),
        )
        if answer.failure == "invalid_request":  # nothing sent; the same call would fail again
            return self.failure(effect, "invalid_request", answer.detail)
        if answer.failure == "not_sent":
            event = ToolCallFailed(
                **ids,
                error_class=ErrorClass.TRANSIENT,
                error_code="connect_failed",
                message=answer.detail[:500],
            )
            return Outcome(event, detail=answer.detail)
        if answer.failure == "tls":  # nothing was sent; a retry would meet the same certificate
            event = ToolCallFailed(
                **ids,
                error_class=ErrorClass.UNKNOWN,
                error_code="tls_failed",
                message=answer.detail[:500],
            )
            return Outcome(event, detail=answer.detail)
        if answer.failure == "too_large":
            return self.failure(effect, "invalid_output:too_large", answer.detail)
        if answer.failure is not None or answer.status == 504:
            return Outcome(ToolCallTimedOut(**ids), detail=answer.detail or "HTTP 504")
        payload, problem = _json(answer.body)
        if problem is not None and 200 <= answer.status < 300:
            message = f"HTTP {answer.status} body nested deeper than {MAX_JSON_DEPTH}"
            return self.failure(effect, f"invalid_output:{problem}", message)
        if answer.status == 202:
            event = ToolCallAccepted(
                **ids, poll_after_ms=retry_after_ms(answer.header("retry-after"))
            )
            return Outcome(event, detail="HTTP 202")
        if 200 <= answer.status < 300:
            output = payload.get("result", payload) if isinstance(payload, dict) else payload
            if payload is None and answer.body:
                output = answer.body.decode("utf-8", "replace")
            return self._succeeded(effect, ids, op.tool, arguments, output, answer.status)
        error = error_for_status(answer.status)
        assert error is not None
        error_class, default_code = error
        event = ToolCallFailed(
            **ids,
            error_class=error_class,
            error_code=_error_code(payload, default_code),
            message=answer.body[:500].decode("utf-8", "replace"),
            retry_after_ms=retry_after_ms(answer.header("retry-after")),
        )
        throttle = None
        if error_class is ErrorClass.RATE_LIMIT:  # this tool's calls slow down, alone
            after = event.retry_after_ms
            throttle = DEFAULT_THROTTLE_S if after is None else after / 1000
        return Outcome(event, detail=f"HTTP {answer.status}", throttle_s=throttle)

    def _result_artifact(
        self, op_key: str, tool: str, arguments: Any, output: Any, http_status: int
    ) -> StoredArtifact:
        content = canonical_json(
            {
                "type": "tool_result",
                "operation_key": op_key,
                "tool": tool,
                "arguments": arguments,
                "status": "succeeded",
                "http_status": http_status,
                "registry_version": self.registry.version,
                "output": output,
            }
        )
        return StoredArtifact.of(content, RESULT_MEDIA_TYPE)

    def _succeeded(
        self,
        effect: Effect,
        ids: dict[str, Any],
        tool: str,
        arguments: Any,
        output: Any,
        http_status: int,
    ) -> Outcome:
        artifact = self._result_artifact(ids["operation_key"], tool, arguments, output, http_status)
        event = tool_results.succeeded(ids, output, artifact.ref, self.summary_bytes)
        return Outcome(event, (artifact,), detail=f"HTTP {http_status}")

    # ------------------------------------------------------------------ look-ups

    async def _lookup(self, tool: str, key: str) -> tuple[str, Any, Answer]:
        """Status of an operation by key: (found|running|failed|cancelled|not_found|unknown)."""
        entry = self._entry(tool)
        template = entry.status_url_template if entry is not None else None
        if entry is None or template is None:
            return "unknown", None, Answer(detail="no status URL for this tool")
        answer = await self._send(
            entry, "GET", self._url(template, key), timeout_s=self.lookup_timeout_s
        )
        if answer.failure is not None:
            return "unknown", None, answer
        payload, problem = _json(answer.body)
        if problem is not None:
            return "unknown", None, answer
        if answer.status == 404:
            return "not_found", payload, answer
        if answer.status != 200 or not isinstance(payload, dict):
            return "unknown", payload, answer
        status = payload.get("status")
        match status:
            case "succeeded":
                return "found", payload, answer
            case "running" | "accepted" | "failed" | "cancelled":
                return str(status), payload, answer
            case _:
                return "unknown", payload, answer

    async def _resume(self, effect: CallTool) -> Outcome:
        """A started CallTool without a result: look it up before anything else (R12)."""
        op = effect.operation
        ids = self._ids(effect, op.key, op.dispatch)
        state, payload, answer = await self._lookup(op.tool, op.key)
        detail = f"resumed after a crash: look-up {state}"
        match state:
            case "not_found":
                return await self._call(effect)
            case "found":
                arguments = json.loads(op.arguments_json)
                outcome = self._succeeded(
                    effect, ids, op.tool, arguments, payload.get("result"), answer.status
                )
                return Outcome(outcome.event, outcome.artifacts, detail)
            case "running" | "accepted":
                return Outcome(ToolCallAccepted(**ids), detail=detail)
            case "failed" | "cancelled":
                event: Event = ToolCallFailed(
                    **ids, error_class=ErrorClass.UNKNOWN, error_code=f"tool_{state}"
                )
                return Outcome(event, detail=detail)
            case _:
                return Outcome(ToolCallTimedOut(**ids), detail=detail)

    async def _reconcile(self, effect: Reconcile) -> Outcome:
        ids = self._ids(effect, effect.operation_key, effect.dispatch)
        state, payload, answer = await self._lookup(effect.tool, effect.operation_key)
        detail = f"look-up {state} (HTTP {answer.status or answer.failure})"
        if state == "found":
            output = payload.get("result")
            artifact = self._result_artifact(
                effect.operation_key, effect.tool, payload.get("arguments"), output, answer.status
            )
            event = ReconcileCompleted(
                **ids, outcome=ReconcileOutcome.FOUND_SUCCEEDED, result_ref=artifact.ref
            )
            return Outcome(event, (artifact,), detail)
        if state == "not_found":
            return Outcome(
                ReconcileCompleted(**ids, outcome=ReconcileOutcome.NOT_EXECUTED), (), detail
            )
        # running / failed / cancelled / cannot tell: the core has no finer outcome; a person
        # decides (the detail in the executed-action record says what the backend reported).
        event = ReconcileCompleted(**ids, outcome=ReconcileOutcome.UNDETERMINABLE)
        return Outcome(event, (), detail)

    async def _poll(self, effect: PollTool) -> Outcome:
        ids = self._ids(effect, effect.operation_key, effect.dispatch)
        state, payload, answer = await self._lookup(effect.tool, effect.operation_key)
        detail = f"poll {effect.poll}: {state}"
        match state:
            case "found":
                return self._succeeded(
                    effect, ids, effect.tool, None, payload.get("result"), answer.status
                )
            case "failed" | "cancelled":
                event: Event = ToolCallFailed(
                    **ids,
                    error_class=ErrorClass.UNKNOWN,
                    error_code=f"tool_{state}",
                    message=canonical_json(payload)[:500],
                )
            case "not_found":
                event = ToolCallFailed(
                    **ids, error_class=ErrorClass.TRANSIENT, error_code="not_found"
                )
            case "accepted":
                event = ToolStatusReported(**ids, status="accepted", poll=effect.poll)
            case _:
                event = ToolStatusReported(**ids, status="running", poll=effect.poll)
        return Outcome(event, (), detail)

    async def _cancel(self, effect: CancelTool) -> Outcome:
        ids = self._ids(effect, effect.operation_key, effect.dispatch)
        entry = self._entry(effect.tool)
        template = entry.cancel_url_template if entry is not None else None
        if entry is None or template is None:
            return Outcome(CancelUnconfirmed(**ids), detail="no cancel URL for this tool")
        answer = await self._send(
            entry,
            "POST",
            self._url(template, effect.operation_key),
            timeout_s=self.lookup_timeout_s,
            headers={"Idempotency-Key": effect.operation_key},
        )
        detail = f"cancel: HTTP {answer.status or answer.failure}"
        if answer.status in (200, 404):
            return Outcome(CancelConfirmed(**ids), detail=detail)
        return Outcome(CancelUnconfirmed(**ids), detail=detail)

    # ------------------------------------------------------------------ MCP tools

    async def _execute_mcp(self, effect: Effect, previous: ActionRecord | None) -> Outcome:
        """A tool effect of an MCP server's tool (docs/tools.md)."""
        match effect:
            case CallTool():
                entry, problem = await self.mcp.entry(effect.operation.tool)
                if previous is not None and previous.status == "started":
                    return await self._resume_mcp(effect, entry, problem)
                return await self._call_mcp(effect, entry, problem)
            case Reconcile():
                return await self._reconcile_mcp(effect)
            case PollTool():
                ref = await self.tasks.get(effect.operation_key)
                if ref is not None:
                    return await self._poll_task(effect, ref)
                ids = self._ids(effect, effect.operation_key, effect.dispatch)
                event: Event = ToolCallFailed(
                    **ids,
                    error_class=ErrorClass.UNKNOWN,
                    error_code="not_pollable",
                    message="this MCP tool's call started no task: it has no status",
                )
                return Outcome(event, detail="poll of an MCP tool without a task")
            case CancelTool():
                return await self._cancel_mcp(effect)
            case _:
                raise ExecutorError(f"not a tool effect: {effect.type}")

    async def _resume_mcp(self, effect: CallTool, entry: ToolEntry | None, problem: str) -> Outcome:
        """A started MCP call without a result (a crash between the call and its answer): an
        MCP server has no look-up by key, so only an idempotent tool is called again; any other
        is answered timed out (the core reconciles: undeterminable, a person decides)."""
        op = effect.operation
        ref = await self.tasks.get(op.key)
        if ref is not None:  # the call started a task before the crash: wait for it
            event = ToolCallAccepted(**self._ids(effect, op.key, op.dispatch))
            return Outcome(event, detail=f"resumed after a crash: MCP task {ref.task_id}")
        if entry is not None and entry.idempotent:
            outcome = await self._call_mcp(effect, entry, problem)
            return replace(outcome, detail=f"resumed (idempotent): {outcome.detail}")
        ids = self._ids(effect, op.key, op.dispatch)
        return Outcome(ToolCallTimedOut(**ids), detail="resumed after a crash: no MCP look-up")

    async def _call_mcp(self, effect: CallTool, entry: ToolEntry | None, problem: str) -> Outcome:
        op = effect.operation
        ids = self._ids(effect, op.key, op.dispatch)
        if entry is None or entry.mcp_server is None or entry.mcp_tool is None:
            server = self.mcp.server_of(op.tool)
            if server is not None and problem:  # its server could not be asked: nothing sent
                event: Event = ToolCallFailed(
                    **ids,
                    error_class=ErrorClass.TRANSIENT,
                    error_code="connect_failed",
                    message=f"MCP server {server.name}: {problem}"[:500],
                )
                return Outcome(event, detail=problem)
            event = ToolCallFailed(
                **ids,
                error_class=ErrorClass.UNKNOWN,
                error_code="unknown_tool",
                message=f"{op.tool} is not a tool its MCP server lists",
            )
            return Outcome(event, detail="unknown MCP tool")
        refused = self._refused(effect, entry, ids)
        if refused is not None:
            return refused
        try:
            arguments = json.loads(op.arguments_json)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):  # MCP arguments are an object
            event = ToolCallFailed(
                **ids, error_class=ErrorClass.UNKNOWN, error_code="invalid_arguments_json"
            )
            return Outcome(event, detail="arguments are not a JSON object")
        meta = {KEY_META: op.key, RUN_META: effect.run_id}
        if op.expected_version is not None:
            meta["agentruns/expected_version"] = op.expected_version
        params: dict[str, Any] = {"name": entry.mcp_tool, "arguments": arguments, "_meta": meta}
        session = self.mcp.session(entry.mcp_server)
        tasked = False
        if entry.is_async:  # a task when the server takes task-augmented calls (opened first)
            await session.ensure_open(time.monotonic() + entry.timeout_ms / 1000)
            tasked = supports_tasks(session.capabilities)
            if tasked:
                params["task"] = {"ttl": TASK_TTL_MS}
        reply = await session.request("tools/call", params, entry.timeout_ms / 1000, op.key)
        if reply.list_changed:
            self.mcp.stale(entry.mcp_server)
        if tasked and reply.kind == "result" and "task" in reply.value:
            return await self._task_started(effect, ids, entry, reply.value)
        return self._mcp_outcome(effect, ids, entry, arguments, reply)

    async def _task_started(
        self, effect: CallTool, ids: dict[str, Any], entry: ToolEntry, result: Mapping[str, Any]
    ) -> Outcome:
        """A call answered with a task: kept by operation key, then ToolCallAccepted (the
        core polls it: PollTool)."""
        created = created_task(result)
        if isinstance(created, str):
            return self.failure(effect, "invalid_output:bad_task", created)
        task_id, poll_after_ms = created
        assert entry.mcp_server is not None
        await self.tasks.put(effect.operation.key, TaskRef(entry.mcp_server, task_id))
        event = ToolCallAccepted(**ids, poll_after_ms=poll_after_ms)
        return Outcome(event, detail=f"MCP task {task_id}"[:300])

    async def _poll_task(self, effect: PollTool, ref: TaskRef) -> Outcome:
        """``tasks/get``; once the task ended, ``tasks/result`` as the call's answer. A server
        that cannot be asked now is polled again; one that no longer knows the task fails the
        call UNKNOWN (it may have run: never called again by itself)."""
        ids = self._ids(effect, effect.operation_key, effect.dispatch)
        entry, _ = await self.mcp.entry(effect.tool)
        if ref.server not in self.mcp.servers or entry is None:
            return self.failure(effect, "unknown_tool", f"{effect.tool}: its MCP server is gone")
        session = self.mcp.session(ref.server)
        params = {"taskId": ref.task_id}
        reply = await session.request("tasks/get", params, self.lookup_timeout_s)
        detail = f"poll {effect.poll}: MCP task {ref.task_id[:64]}"
        running = ToolStatusReported(**ids, status="running", poll=effect.poll)
        if reply.kind == "error":
            message = entry.conn.redact(str(reply.value.get("message", "")))[:500]
            event = ToolCallFailed(
                **ids, error_class=ErrorClass.UNKNOWN, error_code="task_lost", message=message
            )
            return Outcome(event, detail=f"{detail}: tasks/get error")
        if reply.kind != "result":  # cannot tell now: poll again later
            return Outcome(running, detail=f"{detail}: {reply.kind} {reply.detail}"[:300])
        status = task_status(reply.value)
        if status is None:
            return self.failure(effect, "invalid_output:bad_task", "not a tasks/get result")
        state, message = status
        match state:
            case "working":
                return Outcome(running, detail=f"{detail}: working")
            case "input_required":  # nobody here can give it input: the call cannot end
                event = ToolCallFailed(
                    **ids, error_class=ErrorClass.UNKNOWN, error_code="task_input_required",
                    message=entry.conn.redact(message)[:500],
                )  # fmt: skip
                return Outcome(event, detail=f"{detail}: input_required")
            case "cancelled":
                event = ToolCallFailed(
                    **ids, error_class=ErrorClass.UNKNOWN, error_code="tool_cancelled",
                    message=entry.conn.redact(message)[:500],
                )  # fmt: skip
                return Outcome(event, detail=f"{detail}: cancelled")
        timeout_s = entry.timeout_ms / 1000
        answer = await session.request("tasks/result", params, timeout_s)
        if answer.kind not in ("result", "error") or (
            answer.kind == "result" and "content" not in answer.value
        ):  # no answer now: poll again
            return Outcome(running, detail=f"{detail}: tasks/result {answer.kind}"[:300])
        outcome = self._mcp_outcome(effect, ids, entry, None, answer)
        return replace(outcome, detail=f"{detail}: {state}, {outcome.detail}"[:500])

    def _mcp_outcome(
        self,
        effect: CallTool | PollTool,
        ids: dict[str, Any],
        entry: ToolEntry,
        arguments: Any,
        reply: Reply,
    ) -> Outcome:
        """The answer to a ``tools/call`` by what came of it (docs/tools.md, "Errors")."""
        detail = f"MCP {reply.kind}" + (f": {reply.detail}" if reply.detail else "")
        detail = entry.conn.redact(detail)[:500]
        event: Event
        if reply.kind == "result":
            problem = validate_call_result(reply.value)
            if problem is not None:
                return self.failure(effect, "invalid_output:bad_result", problem)
            if reply.value.get("isError") is True:
                message = entry.conn.redact(text_of(reply.value.get("content")))[:500]
                event = ToolCallFailed(
                    **ids, error_class=ErrorClass.UNKNOWN, error_code="tool_error", message=message
                )
                return Outcome(event, detail="MCP isError")
            output = output_of(reply.value)
            outcome = self._succeeded(
                effect, ids, _tool_of(effect), arguments, output, reply.status
            )
            return replace(outcome, detail="MCP result")
        if reply.kind == "error":
            error_class, code = rpc_error_class(reply.value.get("code"))
            message = entry.conn.redact(str(reply.value.get("message", "")))[:500]
            event = ToolCallFailed(**ids, error_class=error_class, error_code=code, message=message)
            return Outcome(event, detail=detail)
        if reply.kind == "tls":
            event = ToolCallFailed(
                **ids, error_class=ErrorClass.UNKNOWN, error_code="tls_failed", message=detail
            )
            return Outcome(event, detail=detail)
        if reply.kind == "too_large":
            return self.failure(effect, "invalid_output:too_large", detail)
        if reply.kind == "invalid" and reply.sent:
            what = reply.detail.split(":")[0] or "not_jsonrpc"
            return self.failure(effect, f"invalid_output:{what}", detail)
        if reply.kind == "cancelled":
            event = ToolCallFailed(
                **ids, error_class=ErrorClass.UNKNOWN, error_code="cancelled", message=detail
            )
            return Outcome(event, detail=detail)
        if reply.kind == "status":
            error = status_class(reply.status, entry.idempotent)
            if error is not None:
                error_class, code = error
                if not reply.sent and error_class is ErrorClass.UNKNOWN:
                    error_class, code = ErrorClass.TRANSIENT, f"session_failed:{code}"
                event = ToolCallFailed(
                    **ids, error_class=error_class, error_code=code, message=detail
                )
                throttle = DEFAULT_THROTTLE_S if error_class is ErrorClass.RATE_LIMIT else None
                return Outcome(event, detail=detail, throttle_s=throttle)
            if not reply.sent:
                event = ToolCallFailed(
                    **ids, error_class=ErrorClass.TRANSIENT, error_code="session_failed",
                    message=detail,
                )  # fmt: skip
                return Outcome(event, detail=detail)
            return Outcome(ToolCallTimedOut(**ids), detail=detail)
        if not reply.sent or reply.kind in ("not_sent", "session_lost"):
            # nothing of the call reached the tool: the core resends it with the same key
            code = "connect_failed" if reply.kind == "not_sent" else "session_failed"
            event = ToolCallFailed(
                **ids, error_class=ErrorClass.TRANSIENT, error_code=code, message=detail
            )
            return Outcome(event, detail=detail)
        # "unknown": sent, and no answer by the deadline (or the connection was lost)
        return Outcome(ToolCallTimedOut(**ids), detail=detail)

    async def _reconcile_mcp(self, effect: Reconcile) -> Outcome:
        """No look-up by key at an MCP server: an idempotent tool's call may be sent again
        (``not_executed``: the core resends it); any other's outcome a person decides."""
        ids = self._ids(effect, effect.operation_key, effect.dispatch)
        entry, _ = await self.mcp.entry(effect.tool)
        if entry is not None and entry.idempotent:
            event = ReconcileCompleted(**ids, outcome=ReconcileOutcome.NOT_EXECUTED)
            return Outcome(event, detail="MCP tool is idempotent: safe to resend")
        event = ReconcileCompleted(**ids, outcome=ReconcileOutcome.UNDETERMINABLE)
        return Outcome(event, detail="MCP tool has no look-up and is not idempotent")

    async def _cancel_mcp(self, effect: CancelTool) -> Outcome:
        ids = self._ids(effect, effect.operation_key, effect.dispatch)
        ref = await self.tasks.get(effect.operation_key)
        if ref is not None and ref.server in self.mcp.servers:
            params = {"taskId": ref.task_id}
            reply = await self.mcp.session(ref.server).request(
                "tasks/cancel", params, self.lookup_timeout_s
            )
            status = task_status(reply.value) if reply.kind == "result" else None
            detail = f"cancel: MCP task {ref.task_id[:64]}: {reply.kind}"
            if status is not None and status[0] == "cancelled":
                return Outcome(CancelConfirmed(**ids), detail=detail)
            # an error (the task ended already, or is unknown) or no answer: not confirmed
            return Outcome(CancelUnconfirmed(**ids), detail=detail)
        server = self.mcp.server_of(effect.tool)
        assert server is not None
        state = await self.mcp.session(server.name).cancel(
            effect.operation_key, self.lookup_timeout_s
        )
        if state == "never_sent":
            return Outcome(CancelConfirmed(**ids), detail="cancel: the call was never sent")
        return Outcome(CancelUnconfirmed(**ids), detail=f"cancel: {state}")


def _http_tools(registry: ToolRegistry) -> bool:
    """Whether ``registry`` has tools a base URL is needed for (not only child runs)."""
    return any(t.kind == "tool" for t in registry.tools.values())


def _tool_of(effect: Effect) -> str:
    if isinstance(effect, CallTool):
        return effect.operation.tool
    return str(getattr(effect, "tool", ""))


def _file_text(path: str) -> bytes | None:
    """The bytes of the registry file (None: no path, or it cannot be read now)."""
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError:
        return None


def _op_of(effect: Effect) -> tuple[str, int]:
    """(operation key, dispatch) of a tool effect."""
    if isinstance(effect, CallTool):
        return effect.operation.key, effect.operation.dispatch
    return str(getattr(effect, "operation_key", "")), int(getattr(effect, "dispatch", 1))


# --------------------------------------------------------------------------- process


class ToolExecutor(Executor):
    """``ToolExecutor(config, registry=..., base_url=...)``: the monolith's in-process form."""

    def __init__(
        self,
        config: ExecutorConfig,
        registry: ToolRegistry | Path | str,
        *,
        base_url: str | None = None,
        callback_url: str | None = None,
        callback_key: bytes | None = None,
        summary_bytes: int = DEFAULT_SUMMARY_BYTES,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        catalog_refresh_s: float = DEFAULT_CATALOG_REFRESH_S,
    ) -> None:
        handler = ToolHandler(
            registry if isinstance(registry, ToolRegistry) else ToolRegistry.load(registry),
            base_url=base_url,
            callback_url=callback_url,
            callback_key=callback_key,
            summary_bytes=summary_bytes,
            max_body_bytes=max_body_bytes,
            catalog_refresh_s=catalog_refresh_s,
            tasks=PostgresTaskStore(config.database_url),
            children=ChildRuns(config),
        )
        try:
            super().__init__(config, handler)
        except BaseException:
            handler.close()
            raise
        self.tool_handler = handler

    def tools(self) -> dict[str, ToolEntry]:
        """Every tool this executor runs now (its registry's and what its MCP servers listed)."""
        return self.tool_handler.tools()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns executor tool", description=__doc__)
    add_common_arguments(parser, "tool")
    parser.add_argument(
        "--registry",
        default=os.environ.get(REGISTRY_ENV),
        help=f"the tool registry, a JSON file (required; default ${REGISTRY_ENV})",
    )
    parser.add_argument(
        "--base-url", default=None, help="tool server base URL (overrides the registry's)"
    )
    parser.add_argument(
        "--callback-url",
        default=os.environ.get("AGENTRUNS_CALLBACK_URL"),
        help="X-Callback-URL template, e.g. http://api:8000/operations/{key}/callback "
        f"(signed with ${CALLBACK_KEY_ENV}, from `agentruns keys callback`)",
    )
    parser.add_argument("--summary-bytes", type=int, default=DEFAULT_SUMMARY_BYTES)
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="a tool answer larger than this fails the call (invalid_output:too_large)",
    )
    args = parser.parse_args(argv)
    registry = registry_from_args(args.registry)

    def make(config: ExecutorConfig) -> ToolExecutor:
        return ToolExecutor(
            config,
            registry,
            base_url=args.base_url,
            callback_url=args.callback_url,
            callback_key=executor_callback_key(),
            summary_bytes=args.summary_bytes,
            max_body_bytes=args.max_body_bytes,
            catalog_refresh_s=current().catalog_refresh_s,
        )

    return serve_executor(args, "tool", make)


__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_RETRY_AFTER_MS",
    "ToolEntry",
    "ToolExecutor",
    "ToolHandler",
    "ToolRegistry",
    "error_for_status",
    "main",
    "retry_after_ms",
]


if __name__ == "__main__":
    from agentruns.connectors.lifecycle import run_command

    raise SystemExit(run_command(main))
