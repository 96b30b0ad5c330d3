"""MCP tool servers as tool backends: the registry's ``mcp_servers`` and the pure mapping of
MCP onto the run's rules (docs/tools.md).

- :func:`parse_mcp_servers`: the registry entries (name, url, auth/TLS/proxy as for HTTP
  tools, or a command the executor starts, ``timeout_ms``, per-tool overrides);
- :func:`rules_for`: a tool's annotations and the operator's override -> permission,
  idempotency, approval, timeout;
- :func:`output_of`: a ``tools/call`` result (content blocks, ``structuredContent``) -> the
  tool output (a JSON value) or the text of an ``isError`` result;
- :func:`rpc_error_class`: a JSON-RPC error -> (ErrorClass, code).

Nothing here does I/O: :mod:`agentruns.connectors.executors.mcp_client` speaks the protocol.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentruns.connectors.executors.base import ExecutorError
from agentruns.connectors.executors.http import DIRECT, Connectivity, Secret
from agentruns.connectors.executors.limits import NO_LIMITS, RouteLimits
from agentruns.connectors.executors.tool_http import parse_connectivity, read_secret
from agentruns.processors.state import ErrorClass

#: Between a server's name and its tool's in the name the agent sees. Not a dot: model APIs
#: allow only ``[A-Za-z0-9_-]`` in a function name (OpenAI, Anthropic).
SEPARATOR = "__"
SERVER_NAME = re.compile(r"[A-Za-z0-9](?:-?[A-Za-z0-9])*")
MAX_SERVER_NAME = 32
#: A name the agent may see: what the model APIs accept, at most 64 characters.
AGENT_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_SERVERS = 64
MAX_TOOLS_PER_SERVER = 512
DEFAULT_MCP_TIMEOUT_MS = 30_000
DEFAULT_REFRESH_S = 60.0
# stdio servers: the longest line (one JSON-RPC message) read from one, the time it has from
# its start to answer ``initialize``, the variables it inherits from the executor
DEFAULT_MAX_LINE_BYTES = 8 * 1024 * 1024
MAX_LINE_BYTES = 64 * 1024 * 1024
DEFAULT_START_TIMEOUT_MS = 10_000
INHERITED_ENV = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER", "LANG", "TMPDIR")
MAX_ARGS, MAX_ARG_CHARS, MAX_ENV = 64, 4096, 64
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
#: The request ``_meta`` keys a server may dedupe on.
KEY_META = "agentruns/idempotency_key"
RUN_META = "agentruns/run_id"
PERMISSIONS = frozenset({"read", "write"})

# JSON-RPC error codes (https://www.jsonrpc.org/specification#error_object)
PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND = -32700, -32600, -32601
INVALID_PARAMS, INTERNAL_ERROR = -32602, -32603


@dataclass(frozen=True)
class ToolOverride:
    """What the operator says of one MCP tool; None: the annotations decide."""

    permission: str | None = None
    approval_required: bool | None = None
    idempotent: bool | None = None
    timeout_ms: int | None = None
    limits: RouteLimits = NO_LIMITS


@dataclass(frozen=True)
class StdioCommand:
    """A server the tool executor starts and speaks to over its stdin and stdout: the
    program, its arguments, the variables set for it (beside :data:`INHERITED_ENV`), and the
    limits of what it may send and how long it may take to start."""

    command: str
    args: tuple[str, ...] = ()
    env: Mapping[str, Secret] = field(default_factory=dict, repr=False)
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    start_timeout_ms: int = DEFAULT_START_TIMEOUT_MS


@dataclass(frozen=True)
class MCPServerSpec:
    """One entry of the registry's ``mcp_servers``: ``url`` (streamable HTTP) or ``stdio``
    (a process of the executor's)."""

    name: str
    url: str = ""
    timeout_ms: int = DEFAULT_MCP_TIMEOUT_MS
    conn: Connectivity = DIRECT
    tools: Mapping[str, ToolOverride] = field(default_factory=dict)
    refresh_s: float = DEFAULT_REFRESH_S
    stdio: StdioCommand | None = None

    def agent_name(self, tool: str) -> str:
        return f"{self.name}{SEPARATOR}{tool}"

    @property
    def endpoint(self) -> str:
        """Where the server is, for logs and the catalog: its URL, or ``stdio:<command>``."""
        return self.url if self.stdio is None else f"stdio:{self.stdio.command}"


@dataclass(frozen=True)
class Rules:
    permission: str
    idempotent: bool
    approval_required: bool
    timeout_ms: int


def _bool(value: Any, what: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"{what} is not true or false: {value!r}")


def _positive_ms(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 3_600_000:
        raise ValueError(f"{what} is not a number of milliseconds in (0, 3600000]: {value!r}")
    return value


def _override(spec: Any, where: str) -> ToolOverride:
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where} must be an object")
    unknown = set(spec) - {
        "permission",
        "approval_required",
        "idempotent",
        "timeout_ms",
        "max_in_flight",
        "requests_per_minute",
    }
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
    permission = spec.get("permission")
    if permission is not None and permission not in PERMISSIONS:
        raise ValueError(f"{where}: permission must be read or write, not {permission!r}")
    in_flight, rate = spec.get("max_in_flight"), spec.get("requests_per_minute")
    if in_flight is not None and (isinstance(in_flight, bool) or not isinstance(in_flight, int)):
        raise ValueError(f"{where}: max_in_flight is not an integer: {in_flight!r}")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float)):
        raise ValueError(f"{where}: requests_per_minute is not a number: {rate!r}")
    return ToolOverride(
        permission=permission,
        approval_required=_bool(spec.get("approval_required"), f"{where}: approval_required"),
        idempotent=_bool(spec.get("idempotent"), f"{where}: idempotent"),
        timeout_ms=_positive_ms(spec.get("timeout_ms"), f"{where}: timeout_ms"),
        limits=RouteLimits(max_in_flight=in_flight, requests_per_minute=rate),
    )


def parse_mcp_servers(
    data: Mapping[str, Any], where: str, defaults: Connectivity | None = None
) -> dict[str, MCPServerSpec]:
    """The registry's ``mcp_servers`` (ExecutorError naming the entry when one is not valid;
    secrets are read here, once, as for HTTP tools)."""
    entries = data.get("mcp_servers", [])
    if not isinstance(entries, list) or len(entries) > MAX_SERVERS:
        raise ExecutorError(f"{where}: mcp_servers must be a list of at most {MAX_SERVERS}")
    servers: dict[str, MCPServerSpec] = {}
    for entry in entries:
        if not isinstance(entry, Mapping):
            raise ExecutorError(f"{where}: an mcp_servers entry is not an object")
        name = entry.get("name")
        if (
            not isinstance(name, str)
            or len(name) > MAX_SERVER_NAME
            or SERVER_NAME.fullmatch(name) is None
        ):
            raise ExecutorError(
                f"{where}: MCP server name {name!r} must be letters, digits and single hyphens"
                f" (at most {MAX_SERVER_NAME})"
            )
        if name in servers:
            raise ExecutorError(f"{where}: MCP server {name!r} is named twice")
        here = f"MCP server {name!r} in {where}"
        url, stdio = entry.get("url"), None
        if (url is None) == ("command" not in entry):
            raise ExecutorError(f"{here}: give exactly one of url and command")
        if url is None:
            stdio = _stdio(entry, here)
        elif not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ExecutorError(f"{here}: url must be an http:// or https:// URL")
        try:
            timeout = _positive_ms(entry.get("timeout_ms"), "timeout_ms")
            refresh = entry.get("refresh_s", DEFAULT_REFRESH_S)
            if isinstance(refresh, bool) or not isinstance(refresh, int | float):
                raise ValueError(f"refresh_s is not a number: {refresh!r}")
            if not 1 <= refresh <= 86_400:
                raise ValueError(f"refresh_s must be within [1, 86400]: {refresh!r}")
            tools = entry.get("tools", {})
            if not isinstance(tools, Mapping):
                raise ValueError("tools must be an object: tool name -> override")
            overrides = {str(t): _override(o, f"tools[{t!r}]") for t, o in tools.items()}
        except ValueError as exc:
            raise ExecutorError(f"{here}: {exc}") from None
        if stdio is None:
            conn = parse_connectivity(entry, here, defaults)
        else:  # no HTTP: no auth, TLS or proxy; the secrets of its variables are scrubbed
            conn = Connectivity(secrets=tuple(stdio.env.values()))
        servers[name] = MCPServerSpec(
            name=name,
            url=url or "",
            timeout_ms=timeout or DEFAULT_MCP_TIMEOUT_MS,
            conn=conn,
            tools=overrides,
            refresh_s=float(refresh),
            stdio=stdio,
        )
    return servers


def _stdio(entry: Mapping[str, Any], here: str) -> StdioCommand:
    """The ``command``, ``args``, ``env``, ``max_line_bytes`` and ``start_timeout_ms`` of a
    stdio server's entry."""
    for http_only in ("auth", "tls", "proxy"):
        if http_only in entry:
            raise ExecutorError(f"{here}: {http_only} is for an HTTP server, not a command")
    command, args, env = entry.get("command"), entry.get("args", []), entry.get("env", {})
    if not isinstance(command, str) or not command or len(command) > MAX_ARG_CHARS:
        raise ExecutorError(f"{here}: command must be a program's name or path")
    if (
        not isinstance(args, list)
        or len(args) > MAX_ARGS
        or not all(isinstance(a, str) and len(a) <= MAX_ARG_CHARS for a in args)
    ):
        raise ExecutorError(
            f"{here}: args must be a list of at most {MAX_ARGS} strings"
            f" of at most {MAX_ARG_CHARS} characters"
        )
    if not isinstance(env, Mapping) or len(env) > MAX_ENV:
        raise ExecutorError(f"{here}: env must be an object of at most {MAX_ENV} variables")
    variables: dict[str, Secret] = {}
    for key, value in env.items():
        if not isinstance(key, str) or ENV_NAME.fullmatch(key) is None:
            raise ExecutorError(f"{here}: env: {str(key)[:40]!r} is not a variable name")
        if isinstance(value, str) and "\x00" not in value and len(value) <= MAX_ARG_CHARS:
            variables[key] = Secret(value, f"env {key}")
        elif isinstance(value, Mapping):  # {"value_env": NAME} or {"value_file": PATH}
            variables[key] = read_secret(value, "value", f"{here} env {key}")
        else:
            raise ExecutorError(f"{here}: env {key} must be a string, value_env or value_file")
    line = entry.get("max_line_bytes", DEFAULT_MAX_LINE_BYTES)
    if isinstance(line, bool) or not isinstance(line, int) or not 1024 <= line <= MAX_LINE_BYTES:
        raise ExecutorError(f"{here}: max_line_bytes must be within [1024, {MAX_LINE_BYTES}]")
    try:
        start = _positive_ms(entry.get("start_timeout_ms"), "start_timeout_ms")
    except ValueError as exc:
        raise ExecutorError(f"{here}: {exc}") from None
    return StdioCommand(
        command=command,
        args=tuple(args),
        env=variables,
        max_line_bytes=line,
        start_timeout_ms=start or DEFAULT_START_TIMEOUT_MS,
    )


# --------------------------------------------------------------------------- annotations


def rules_for(
    annotations: Mapping[str, Any] | None, override: ToolOverride | None, timeout_ms: int
) -> Rules:
    """A tool's rules from its MCP annotations (wire names: ``readOnlyHint``,
    ``destructiveHint``, ``idempotentHint``), the operator's override winning field by field.

    read-only -> read, idempotent, no approval; otherwise write, idempotent only if
    ``idempotentHint`` is true, and a person approves every call unless ``destructiveHint`` is
    false (no hints at all: the MCP defaults, destructive and not idempotent)."""
    hints = annotations or {}
    read_only = hints.get("readOnlyHint") is True
    destructive = hints.get("destructiveHint") is not False  # MCP's default: true
    if read_only:
        rules = Rules("read", True, False, timeout_ms)
    else:
        rules = Rules("write", hints.get("idempotentHint") is True, destructive, timeout_ms)
    if override is None:
        return rules
    return Rules(
        permission=override.permission or rules.permission,
        idempotent=rules.idempotent if override.idempotent is None else override.idempotent,
        approval_required=(
            rules.approval_required
            if override.approval_required is None
            else override.approval_required
        ),
        timeout_ms=override.timeout_ms or rules.timeout_ms,
    )


# --------------------------------------------------------------------------- results


def _block(block: Mapping[str, Any]) -> Any:
    """One content block as the tool output keeps it (snake-case keys of our own)."""
    kind = block.get("type")
    match kind:
        case "text":
            return {"type": "text", "text": block.get("text", "")}
        case "image" | "audio":
            return {"type": kind, "mime_type": block.get("mimeType"), "data": block.get("data")}
        case "resource":
            resource = block.get("resource") or {}
            out = {"type": "resource", "uri": resource.get("uri")}
            out["mime_type"] = resource.get("mimeType")
            if "text" in resource:
                out["text"] = resource.get("text")
            else:
                out["blob"] = resource.get("blob")
            return out
        case "resource_link":
            return {"type": "resource_link", "uri": block.get("uri"), "name": block.get("name")}
        case _:
            return {"type": str(kind)}


def text_of(content: Any, limit: int = 2000) -> str:
    """The text blocks of a result, joined (an ``isError`` result's message)."""
    if not isinstance(content, list):
        return ""
    parts = [
        str(b.get("text", ""))
        for b in content
        if isinstance(b, Mapping) and b.get("type") == "text"
    ]
    return "\n".join(parts)[:limit]


def output_of(result: Mapping[str, Any]) -> Any:
    """The tool output of a successful ``tools/call`` result (validated beforehand): its
    ``structuredContent`` when it has one (the machine form; the spec has the text blocks
    repeat it); else a single text block's text; else the blocks as a list."""
    structured = result.get("structuredContent")
    if structured is not None:
        return structured
    content = result.get("content") or []
    if len(content) == 1 and content[0].get("type") == "text":
        return content[0].get("text", "")
    return [_block(b) for b in content]


def rpc_error_class(code: Any) -> tuple[ErrorClass, str]:
    """The class and code of a JSON-RPC error answer to ``tools/call``. The server refused or
    failed the request as a whole: the model is told (UNKNOWN is not retried by the core)."""
    match code:
        case -32602:
            return ErrorClass.UNKNOWN, "invalid_arguments"
        case -32601:
            return ErrorClass.UNKNOWN, "method_not_found"
        case -32600:
            return ErrorClass.UNKNOWN, "invalid_request"
        case -32700:
            return ErrorClass.UNKNOWN, "parse_error"
        case -32603:
            return ErrorClass.UNKNOWN, "internal_error"
        case int():
            return ErrorClass.UNKNOWN, f"mcp_error:{code}"
        case _:
            return ErrorClass.UNKNOWN, "mcp_error"


def status_class(status: int, idempotent: bool) -> tuple[ErrorClass, str] | None:
    """A non-2xx HTTP answer to a ``tools/call`` POST without a JSON-RPC error in it; None:
    the request may have reached the tool and its outcome is unknown (answer timed out)."""
    match status:
        case 401 | 403:
            return ErrorClass.PERMISSION_DENIED, "permission_denied"
        case 429:
            return ErrorClass.RATE_LIMIT, "rate_limited"
        case 503:  # unavailable: the server took nothing in
            return ErrorClass.TRANSIENT, "http_503"
        case 400 | 405 | 406 | 413 | 415:
            return ErrorClass.UNKNOWN, f"http_{status}"
        case 500 | 502 | 504 if not idempotent:
            return None
        case 500 | 502 | 504:
            return ErrorClass.TRANSIENT, f"http_{status}"
        case _:
            return ErrorClass.UNKNOWN, f"http_{status}"


__all__ = [
    "KEY_META",
    "RUN_META",
    "SEPARATOR",
    "MCPServerSpec",
    "Rules",
    "StdioCommand",
    "ToolOverride",
    "output_of",
    "parse_mcp_servers",
    "rpc_error_class",
    "rules_for",
    "status_class",
    "text_of",
]
