"""The model executor (`agentruns executor model`): streamed chat completions into candidates.

Consumes ``agentruns.effects.model`` (CallModel) and answers each effect with one
ModelCallCompleted on the inbox (loop, records and transaction:
:mod:`agentruns.connectors.executors.base`).

For one effect (R7, R9):

1. the frozen context artifact chain is loaded (``previous_context`` links back to the first
   context) and the conversation rebuilt: the initial messages, then per earlier step the
   assistant message of its candidate artifact and one ``tool`` message per tool call (matched
   to the tool result artifacts in the next context's ``inputs``) and the ``messages`` a later
   context adds (a fork's); a repair note becomes a final user message;
2. ``POST {base_url}/chat/completions`` with ``stream: true`` (OpenAI protocol), the run's
   tools (from its registry artifact, descriptions from the registry file), ``user`` = run id;
3. the SSE stream is assembled by :class:`StreamAssembler` (pure) and classified:
   ``stop``/``tool_calls`` = finished; ``length`` = truncated; ``content_filter`` = blocked;
   ended without a finish, connection lost, or deadline passed = incomplete; 429 or 529 =
   rate_limited (Retry-After, clamped); 5xx, other statuses and transport errors before the
   response = transport_error. A stream that cannot be trusted is incomplete too: a chunk of
   an unexpected shape, not JSON, nested deeper than ``MAX_JSON_DEPTH`` or not UTF-8, a line
   over ``max_line_bytes``, more than ``max_stream_bytes`` in all, or still going at
   ``total_timeout_s`` after the request (keep-alive comments and a byte-by-byte drip count
   against it like any other bytes). Tool calls are passed on only from a finished stream: a
   tool never starts on half-streamed arguments;
4. the candidate artifact (the assistant message in OpenAI form plus finish_reason, outcome,
   usage: :func:`candidate_artifact`) is written, then the input (by the loop).

A redelivered effect whose record is completed is answered from the record: no second call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec

from agentruns.connectors.executors import spans
from agentruns.connectors.executors.base import (
    NOTHING_AHEAD,
    ActionRecord,
    Ahead,
    ExecutorError,
    Outcome,
    decode_json,
    event_identity,
)
from agentruns.connectors.executors.config import ExecutorConfig
from agentruns.connectors.executors.conversation import (
    Conversations,
    Loader,
    build_conversation,
    prefetch_conversations,
)
from agentruns.connectors.executors.http import (
    BodyTooLargeError,
    Connectivity,
    DeadlineError,
    HTTPWireError,
    KeepAliveHTTP,
    Secret,
    StreamedAnswer,
)
from agentruns.connectors.executors.limits import DEFAULT_TOKENS_PER_CALL, RouteLimits
from agentruns.connectors.executors.loop import Executor
from agentruns.connectors.executors.metrics import MODEL_COST, MODEL_TOKENS, route_label
from agentruns.connectors.executors.process import add_common_arguments, serve_executor
from agentruns.connectors.executors.tool import (
    REGISTRY_ENV,
    ToolEntry,
    ToolRegistry,
    registry_from_args,
    retry_after_ms,
    tools_of,
)
from agentruns.connectors.postgres.artifacts import PostgresArtifactStore, StoredArtifact
from agentruns.connectors.settings import current
from agentruns.processors.effects import CallModel, Effect
from agentruns.processors.events import (
    Candidate,
    ModelCallCompleted,
    ModelOutcome,
    ModelUsage,
    ToolCallRequest,
)
from agentruns.processors.ids import canonical_json
from agentruns.processors.limits import MAX_AMOUNT, MAX_ID_CHARS, MAX_ITEMS
from agentruns.streams import tracing
from agentruns.streams.clock import now_ms

log = logging.getLogger("agentruns.executor.model")

CANDIDATE_MEDIA_TYPE = "application/vnd.agentruns.candidate+json"
DEFAULT_BASE_URL = "http://127.0.0.1:8700/v1"
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# Bounds on one model answer (per route, RouteConfig): the SSE bytes of a whole stream (or a
# JSON body), one SSE line (real chunks carry a few tokens), and an error body kept for the
# record (only its start is used).
DEFAULT_MAX_STREAM_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_LINE_BYTES = 256 * 1024
ERROR_BODY_BYTES = 64 * 1024
# after ``[DONE]`` only the body's end should be left; reading it lets the connection go
# back to the pool, anything more than this (or later than this) and it is closed instead
AFTER_DONE_BYTES = 1024
AFTER_DONE_S = 0.05

_JSON = msgspec.json.Encoder()
# A provider asking its clients to slow down: 429 (rate limited), 529 (overloaded). The call is
# RATE_LIMITED (the core backs off, R22) and its route sends nothing more for the Retry-After,
# or DEFAULT_THROTTLE_S without one.
THROTTLE_STATUSES = frozenset({429, 529})
DEFAULT_THROTTLE_S = 1.0


# --------------------------------------------------------------------------- routes


PROVIDERS = frozenset({"openai", "anthropic"})
DEFAULT_ANTHROPIC_BASE_URL = "https://api.anthropic.com"
ANTHROPIC_VERSION = "2023-06-01"
# Anthropic requires max_tokens on every request; a route that names none gets this.
DEFAULT_ANTHROPIC_MAX_TOKENS = 4096
# The model sent for the ``*`` entry or the default route when the configuration names none:
# never the task's route name (a task cannot pick the model its run is billed for).
DEFAULT_MODEL_NAME = "default"
# The task's route name goes to the endpoint as ``X-Agentruns-Route`` (a gateway, the scripted
# model server's scenarios) only when it is a plain token: nothing a header could be bent by.
ROUTE_HEADER = "X-Agentruns-Route"
_ROUTE_TOKEN = re.compile(r"[A-Za-z0-9._:/@+-]{1,200}")


@dataclass(frozen=True)
class RouteConfig:
    """How one model route is called: ``provider`` ``openai`` (``POST {base_url}/chat/
    completions``) or ``anthropic`` (``POST {base_url}/v1/messages``). ``model`` defaults to
    the name of the routes file's entry (``default`` for ``*`` and the default route)."""

    base_url: str = DEFAULT_BASE_URL
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None
    provider: str = "openai"
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout_s: float = 30.0  # between two chunks
    # The whole call, from the request: whatever arrives (keep-alive comments, a drip), the
    # stream is cut at this point (no read waits past it).
    total_timeout_s: float = 120.0
    max_stream_bytes: int = DEFAULT_MAX_STREAM_BYTES
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    max_tokens: int | None = None
    temperature: float | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    input_cost_micros_per_1k: int = 0
    output_cost_micros_per_1k: int = 0
    # The provider's limits for this route (RouteLimits): calls at once, requests and tokens
    # per minute; None: no such limit. Calls over them wait in the executor, holding nothing.
    max_in_flight: int | None = None
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise ValueError(f"unknown provider {self.provider!r} (one of {sorted(PROVIDERS)})")
        self.limits()  # a limit that cannot be (0, negative, infinite) is refused at load

    def limits(self) -> RouteLimits:
        return RouteLimits(
            self.max_in_flight,
            self.requests_per_minute,
            self.tokens_per_minute,
            tokens_per_call=self.max_tokens or DEFAULT_TOKENS_PER_CALL,
        )

    def chat_url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def messages_url(self) -> str:
        """Anthropic's Messages endpoint: ``{base}/v1/messages`` (a base given with its
        ``/v1`` is taken as it is)."""
        base = self.base_url.rstrip("/")
        return base + ("/messages" if base.endswith("/v1") else "/v1/messages")

    def redact(self, text: str) -> str:
        """``text`` without this route's key or header values (an error body that echoed
        them), scrubbed as the tool path scrubs its secrets."""
        values = [self.api_key, *self.headers.values()]
        secrets = tuple(Secret(v, "route") for v in values if v and len(v) >= 8)
        return Connectivity(secrets=secrets).redact(text) if secrets else text


@dataclass(frozen=True)
class Routes:
    """Per-route configs (a JSON file ``{"route": {...}}``; ``"*"`` = every other route)."""

    routes: Mapping[str, RouteConfig]
    fallback: RouteConfig

    @classmethod
    def from_env(cls, path: str | None = None, base_url: str | None = None) -> Routes:
        """The routes file at ``path`` (none: the default route alone serves every task
        route). Where an entry names no ``base_url`` or key: an ``openai`` route takes
        ``--base-url``, ``$AGENTRUNS_MODEL_BASE_URL``, ``$OPENAI_BASE_URL``, and
        ``$AGENTRUNS_MODEL_API_KEY``, ``$OPENAI_API_KEY``; an ``anthropic`` route takes
        ``https://api.anthropic.com`` and ``$ANTHROPIC_API_KEY`` (never the OpenAI key)."""
        settings = current()
        env_base = (
            base_url or settings.model_base_url or os.environ.get("OPENAI_BASE_URL") or ""
        ) or DEFAULT_BASE_URL
        if not env_base.rstrip("/").endswith("/v1"):
            env_base = env_base.rstrip("/") + "/v1"
        env_key = settings.model_api_key or os.environ.get("OPENAI_API_KEY") or None
        fallback = RouteConfig(base_url=env_base, api_key=env_key)
        routes: dict[str, RouteConfig] = {}
        if path:
            try:
                data = json.loads(Path(path).read_text())
                for name, raw in data.items():
                    if raw.get("provider", "openai") == "anthropic":
                        key = os.environ.get("ANTHROPIC_API_KEY") or None
                        defaults = {"base_url": DEFAULT_ANTHROPIC_BASE_URL, "api_key": key}
                    else:
                        defaults = {"base_url": env_base, "api_key": env_key}
                    values = {**defaults, **raw}
                    if "api_key_env" in values:
                        values["api_key"] = os.environ.get(values.pop("api_key_env"))
                    routes[name] = RouteConfig(**values)
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                raise ExecutorError(f"invalid model routes file {path}: {exc}") from exc
        return cls(routes, fallback)

    def get(self, route: str) -> RouteConfig:
        return self.routes.get(route) or self.routes.get("*") or self.fallback

    def known(self, route: str) -> bool:
        """Whether a task's route may be called: it has its own entry, the file has a ``*``
        entry, or there is no routes file (the default route serves every task route). A
        task's route only picks among configured routes; the model, endpoint and key are
        the configuration's."""
        return not self.routes or route in self.routes or "*" in self.routes

    def name_of(self, route: str) -> str:
        """The configured route a task's route is called through: the name of its own entry,
        ``*``, or the empty name of the default route. Limits are kept per configured route."""
        if route in self.routes:
            return route
        return "*" if "*" in self.routes else ""

    def model_of(self, route: str) -> str:
        """The model a task's route calls: its configured ``model``, else the name of its
        entry; ``default`` for the ``*`` entry and the default route. Never the task's name
        for a route it has no entry for."""
        configured = self.get(route).model
        if configured:
            return configured
        name = self.name_of(route)
        return name if name not in ("", "*") else DEFAULT_MODEL_NAME


def route_header(route: str) -> dict[str, str]:
    """``X-Agentruns-Route`` for a task's route name that is a plain token, else nothing."""
    return {ROUTE_HEADER: route} if _ROUTE_TOKEN.fullmatch(route) else {}


# --------------------------------------------------------------------------- the stream


@dataclass(frozen=True)
class Assembled:
    """A classified generation: what the stream said, and whether it can be trusted."""

    outcome: ModelOutcome
    finish_reason: str | None
    content: str
    tool_calls: tuple[dict[str, Any], ...]  # OpenAI form; empty unless finished
    usage: Mapping[str, int]
    completion_id: str | None
    model: str | None
    detail: str = ""
    retry_after_ms: int | None = None
    # Anthropic's thinking blocks of a finished answer, verbatim with their signatures: the
    # API wants them back, unchanged, before the tool results they led to
    thinking: tuple[dict[str, Any], ...] = ()


FINISHED = frozenset({"stop", "tool_calls", "function_call"})


class MalformedChunkError(ValueError):
    """A chunk is valid JSON of a shape the protocol does not have."""


def _optional_str(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise MalformedChunkError(f"{what} is a {type(value).__name__}, not a string")


def _list(value: Any, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise MalformedChunkError(f"{what} is a {type(value).__name__}, not a list")
    return value


def _object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise MalformedChunkError(f"{what} is a {type(value).__name__}, not an object")
    return value


class StreamAssembler:
    """Folds ``chat.completion.chunk`` objects into one generation (pure: no I/O).

    Tool-call deltas are merged by ``index``; arguments pieces are concatenated. Only
    :meth:`result` decides whether the tool calls are complete (a trusted finish). A chunk of
    a shape the protocol does not have raises :class:`MalformedChunkError` (the caller ends
    the call: an untrusted stream is incomplete)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, int] = {}
        self.completion_id: str | None = None
        self.model: str | None = None
        self.done = False
        self.chunks = 0

    def feed(self, chunk: Any) -> None:
        chunk = _object(chunk, "a chunk")
        self.chunks += 1
        completion_id = _optional_str(chunk.get("id"), "id")
        self.completion_id = self.completion_id or (completion_id or "")[:MAX_ID_CHARS] or None
        model = _optional_str(chunk.get("model"), "model")
        self.model = self.model or (model or "")[:MAX_ID_CHARS] or None
        usage = chunk.get("usage")
        if isinstance(usage, Mapping):
            self.usage = {
                str(k)[:64]: min(max(v, 0), MAX_AMOUNT)
                for k, v in usage.items()
                if isinstance(v, int) and not isinstance(v, bool)
            }
        for choice in _list(chunk.get("choices"), "choices"):
            choice = _object(choice, "a choice")
            if choice.get("index", 0) != 0:
                continue
            streamed = "delta" in choice
            delta = choice.get("delta") if streamed else choice.get("message")
            delta = _object(delta or {}, "delta" if streamed else "message")
            content = _optional_str(delta.get("content"), "content")
            if content:
                self.content.append(content)
            for position, call in enumerate(_list(delta.get("tool_calls"), "tool_calls")):
                self._feed_call(_object(call, "a tool call"), None if streamed else position)
            finish = _optional_str(choice.get("finish_reason"), "finish_reason")
            if finish:
                self.finish_reason = finish[:100]

    def _feed_call(self, call: Mapping[str, Any], position: int | None) -> None:
        """One tool-call delta (``position``: its place in a non-streamed message, where the
        calls carry no ``index``)."""
        index = call.get("index", position)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_ITEMS:
            raise MalformedChunkError(f"a tool call delta has no valid index ({index!r:.40})")
        slot = self.calls.setdefault(index, {"id": None, "name": "", "arguments": []})
        slot["id"] = _optional_str(call.get("id"), "a tool call id") or slot["id"]
        function = _object(call.get("function") or {}, "a tool call function")
        name = _optional_str(function.get("name"), "a tool name")
        if name:
            slot["name"] = name
        arguments = _optional_str(function.get("arguments"), "tool call arguments")
        if arguments is not None:
            slot["arguments"].append(arguments)

    def result(self, *, interrupted: str | None = None, untrusted: str | None = None) -> Assembled:
        """Classify. ``interrupted``: why the stream stopped early (connection lost, deadline);
        ``untrusted``: why nothing it said can be used (incomplete, even after a finish)."""
        reason = self.finish_reason
        if untrusted is not None:
            outcome, detail = ModelOutcome.INCOMPLETE, untrusted
        elif interrupted is not None and reason is None:
            outcome, detail = ModelOutcome.INCOMPLETE, interrupted
        elif reason is None:
            outcome, detail = ModelOutcome.INCOMPLETE, "stream ended without a finish_reason"
        elif reason in FINISHED:
            outcome, detail = ModelOutcome.FINISHED, ""
        elif reason == "length":
            outcome, detail = ModelOutcome.TRUNCATED, "finish_reason=length"
        elif reason == "content_filter":
            outcome, detail = ModelOutcome.BLOCKED, "finish_reason=content_filter"
        else:
            outcome, detail = ModelOutcome.INCOMPLETE, f"unknown finish_reason {reason!r}"
        calls: tuple[dict[str, Any], ...] = ()
        if outcome is ModelOutcome.FINISHED:
            calls = tuple(
                {
                    "id": slot["id"] or f"call_{self.completion_id or 'x'}_{index}",
                    "type": "function",
                    "function": {"name": slot["name"], "arguments": "".join(slot["arguments"])},
                }
                for index, slot in sorted(self.calls.items())
            )
        return Assembled(
            outcome=outcome,
            finish_reason=reason,
            content="".join(self.content),
            tool_calls=calls,
            usage=dict(self.usage),
            completion_id=self.completion_id,
            model=self.model,
            detail=detail,
        )


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream (one per event)."""
    for line in lines:
        if line.startswith("data:"):
            yield line[5:].strip()


# --------------------------------------------------------------------------- Anthropic


class Folds(Protocol):
    """What the stream readers fold events into: :class:`StreamAssembler` (OpenAI) or
    :class:`AnthropicAssembler`."""

    chunks: int
    done: bool

    def feed(self, chunk: Any) -> None: ...

    def result(
        self, *, interrupted: str | None = None, untrusted: str | None = None
    ) -> Assembled: ...


# stop_reason -> (outcome, the finish_reason the candidate records in OpenAI's words)
ANTHROPIC_STOPS: Mapping[str, tuple[ModelOutcome, str]] = {
    "end_turn": (ModelOutcome.FINISHED, "stop"),
    "stop_sequence": (ModelOutcome.FINISHED, "stop"),
    "tool_use": (ModelOutcome.FINISHED, "tool_calls"),
    "max_tokens": (ModelOutcome.TRUNCATED, "length"),
    "refusal": (ModelOutcome.BLOCKED, "content_filter"),
}
# `error` events that ask the client to slow down, like HTTP 429 / 529
ANTHROPIC_THROTTLES = frozenset({"overloaded_error", "rate_limit_error"})
# content block type -> the delta types it takes (and the field each carries)
_BLOCK_DELTAS: Mapping[str, Mapping[str, str]] = {
    "text": {"text_delta": "text"},
    "tool_use": {"input_json_delta": "partial_json"},
    "thinking": {"thinking_delta": "thinking", "signature_delta": "signature"},
    "redacted_thinking": {},
}


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return min(max(value, 0), MAX_AMOUNT)
    return None


class AnthropicAssembler:
    """Folds Anthropic Messages stream events into one generation (pure: no I/O).

    Content blocks are kept by ``index`` from ``content_block_start`` to
    ``content_block_stop``; text, tool input JSON, thinking and signature deltas go to the
    block of their type only. An event of a shape the protocol does not have, a delta for a
    block that is not open, or a block type this reader does not know raises
    :class:`MalformedChunkError` (the call ends incomplete: a block it cannot send back would
    make the next request of the run wrong). ``message_stop`` or an ``error`` event ends the
    stream (``done``)."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, Any]] = {}
        self.stop_reason: str | None = None
        self.usage: dict[str, int] = {}
        self.completion_id: str | None = None
        self.model: str | None = None
        self.error: tuple[str, str] | None = None
        self.done = False
        self.chunks = 0

    def feed(self, chunk: Any) -> None:
        event = _object(chunk, "an event")
        self.chunks += 1
        kind = event.get("type")
        match kind:
            case "message_start":
                self._message(_object(event.get("message"), "message"))
            case "message":  # a whole (non-streamed) answer
                self._message(event)
                for index, block in enumerate(_list(event.get("content"), "content")):
                    self._whole_block(index, _object(block, "a content block"))
                stop = _optional_str(event.get("stop_reason"), "stop_reason")
                self.stop_reason = stop[:100] if stop else None
                self.done = True
            case "content_block_start":
                index = self._index(event)
                if index in self.blocks:
                    raise MalformedChunkError(f"content block {index} started twice")
                self._start(index, _object(event.get("content_block"), "content_block"))
            case "content_block_delta":
                self._delta(self._open(event), _object(event.get("delta"), "delta"))
            case "content_block_stop":
                self._open(event)["closed"] = True
            case "message_delta":
                delta = _object(event.get("delta") or {}, "delta")
                stop = _optional_str(delta.get("stop_reason"), "stop_reason")
                if stop:
                    self.stop_reason = stop[:100]
                self._usage(event.get("usage"))
            case "message_stop":
                self.done = True
            case "ping":
                pass
            case "error":
                error = _object(event.get("error") or {}, "error")
                error_type = _optional_str(error.get("type"), "error type") or "error"
                message = _optional_str(error.get("message"), "error message") or ""
                self.error = (error_type[:100], message[:300])
                self.done = True
            case _:
                raise MalformedChunkError(f"unknown event type {str(kind)[:40]!r}")

    def _message(self, message: Mapping[str, Any]) -> None:
        self.completion_id = (_optional_str(message.get("id"), "id") or "")[:MAX_ID_CHARS] or None
        self.model = (_optional_str(message.get("model"), "model") or "")[:MAX_ID_CHARS] or None
        self._usage(message.get("usage"))

    def _usage(self, usage: Any) -> None:
        """Anthropic's counts (``message_delta`` carries the cumulative ones), and the prompt
        and completion totals the budgets and route limits count, in OpenAI's names."""
        if not isinstance(usage, Mapping):
            return
        for key, value in usage.items():
            count = _count(value)
            if count is not None:
                self.usage[str(key)[:64]] = count
        prompt = sum(
            self.usage.get(k, 0)
            for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
        )
        self.usage["prompt_tokens"] = min(prompt, MAX_AMOUNT)
        self.usage["completion_tokens"] = self.usage.get("output_tokens", 0)

    @staticmethod
    def _index(event: Mapping[str, Any]) -> int:
        index = event.get("index")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_ITEMS:
            raise MalformedChunkError(f"a content block has no valid index ({index!r:.40})")
        return index

    def _open(self, event: Mapping[str, Any]) -> dict[str, Any]:
        index = self._index(event)
        block = self.blocks.get(index)
        if block is None or block["closed"]:
            raise MalformedChunkError(f"content block {index} is not open")
        return block

    def _start(self, index: int, block: Mapping[str, Any]) -> dict[str, Any]:
        kind = block.get("type")
        if kind not in _BLOCK_DELTAS:
            raise MalformedChunkError(f"unknown content block type {str(kind)[:40]!r}")
        slot: dict[str, Any] = {"type": kind, "closed": False, "parts": {}}
        if kind == "tool_use":
            slot["id"] = _optional_str(block.get("id"), "a tool_use id")
            slot["name"] = _optional_str(block.get("name"), "a tool name") or ""
            slot["input"] = _object(block.get("input") or {}, "a tool_use input")
        elif kind == "redacted_thinking":
            slot["data"] = _optional_str(block.get("data"), "redacted thinking data") or ""
        for field_name in _BLOCK_DELTAS[str(kind)].values():
            initial = _optional_str(block.get(field_name), field_name)
            slot["parts"][field_name] = [initial] if initial else []
        self.blocks[index] = slot
        return slot

    def _whole_block(self, index: int, block: Mapping[str, Any]) -> None:
        slot = self._start(index, block)
        if slot["type"] == "tool_use":
            slot["parts"]["partial_json"] = [canonical_json(slot["input"])]
        slot["closed"] = True

    @staticmethod
    def _delta(block: dict[str, Any], delta: Mapping[str, Any]) -> None:
        kind = delta.get("type")
        field_name = _BLOCK_DELTAS[block["type"]].get(str(kind))
        if field_name is None:
            raise MalformedChunkError(f"a {str(kind)[:40]!r} delta in a {block['type']} block")
        piece = _optional_str(delta.get(field_name), field_name)
        if piece:
            block["parts"][field_name].append(piece)

    def result(self, *, interrupted: str | None = None, untrusted: str | None = None) -> Assembled:
        """Classify (as :meth:`StreamAssembler.result`). A finish also needs every content
        block closed: no tool starts on arguments whose block never ended."""
        stop = self.stop_reason
        open_blocks = sorted(i for i, b in self.blocks.items() if not b["closed"])
        finish: str | None = None
        if untrusted is not None:
            outcome, detail = ModelOutcome.INCOMPLETE, untrusted
        elif self.error is not None:
            error_type, message = self.error
            throttled = error_type in ANTHROPIC_THROTTLES
            outcome = ModelOutcome.RATE_LIMITED if throttled else ModelOutcome.INCOMPLETE
            detail = f"error event {error_type}: {message}"
        elif stop is None:
            outcome = ModelOutcome.INCOMPLETE
            detail = interrupted or "stream ended without a stop_reason"
        elif stop not in ANTHROPIC_STOPS:
            outcome, detail = ModelOutcome.INCOMPLETE, f"unknown stop_reason {stop!r}"
        else:
            outcome, finish = ANTHROPIC_STOPS[stop]
            detail = "" if outcome is ModelOutcome.FINISHED else f"stop_reason={stop}"
            if outcome is ModelOutcome.FINISHED and open_blocks:
                outcome = ModelOutcome.INCOMPLETE
                detail = f"content block {open_blocks[0]} never closed"
        calls: tuple[dict[str, Any], ...] = ()
        thinking: tuple[dict[str, Any], ...] = ()
        blocks = [b for _, b in sorted(self.blocks.items())]
        if outcome is ModelOutcome.FINISHED:
            calls = tuple(
                {
                    "id": b["id"] or f"toolu_{self.completion_id or 'x'}_{n}",
                    "type": "function",
                    "function": {
                        "name": b["name"],
                        "arguments": "".join(b["parts"]["partial_json"])
                        or canonical_json(b["input"]),
                    },
                }
                for n, b in enumerate(blocks)
                if b["type"] == "tool_use"
            )
            thinking = tuple(_thinking_block(b) for b in blocks if "thinking" in b["type"])
        return Assembled(
            outcome=outcome,
            finish_reason=finish or stop,
            content="".join(t for b in blocks if b["type"] == "text" for t in b["parts"]["text"]),
            tool_calls=calls,
            usage=dict(self.usage),
            completion_id=self.completion_id,
            model=self.model,
            detail=detail,
            thinking=thinking,
        )


def _thinking_block(block: Mapping[str, Any]) -> dict[str, Any]:
    if block["type"] == "redacted_thinking":
        return {"type": "redacted_thinking", "data": block["data"]}
    parts = block["parts"]
    return {
        "type": "thinking",
        "thinking": "".join(parts["thinking"]),
        "signature": "".join(parts["signature"]),
    }


def _tool_input(arguments: Any) -> dict[str, Any]:
    """A recorded call's arguments as Anthropic's ``input`` object (arguments that are not a
    JSON object, which validation refused, go back as ``{}``: the repair note says why)."""
    if isinstance(arguments, str):
        value, problem = decode_json(arguments.encode("utf-8", "surrogatepass"))
        if problem is None and isinstance(value, dict):
            return value
    return {}


def anthropic_messages(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[str, list[dict[str, Any]]]:
    """(system, messages) of a conversation in OpenAI form, in Anthropic's: system and
    developer messages become the system prompt; an assistant message its thinking blocks
    (verbatim), its text and one ``tool_use`` block per call; ``tool`` messages
    ``tool_result`` blocks of a user message. Consecutive messages of one role are merged
    into one (the API wants user and assistant in turn)."""
    system: list[str] = []
    out: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})

    for message in messages:
        role, content = message.get("role"), message.get("content")
        text = content if isinstance(content, str) else ""
        if role in ("system", "developer"):
            if text:
                system.append(text)
        elif role == "assistant":
            blocks = [dict(b) for b in message.get("thinking") or () if isinstance(b, Mapping)]
            if text:
                blocks.append({"type": "text", "text": text})
            for call in message.get("tool_calls") or ():
                function = call.get("function") or {}
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call.get("id"),
                        "name": function.get("name"),
                        "input": _tool_input(function.get("arguments")),
                    }
                )
            add("assistant", blocks)
        elif role == "tool":
            result = {"type": "tool_result", "tool_use_id": message.get("tool_call_id")}
            add("user", [{**result, "content": text}])
        elif text:
            add("user", [{"type": "text", "text": text}])
    return "\n\n".join(system), out


def anthropic_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The run's tools (OpenAI's function form) as Anthropic tools."""
    out = []
    for tool in tools:
        function = tool.get("function") or {}
        spec: dict[str, Any] = {
            "name": function.get("name"),
            "input_schema": function.get("parameters") or {"type": "object"},
        }
        if function.get("description"):
            spec["description"] = function["description"]
        out.append(spec)
    return out


def anthropic_request(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    route: RouteConfig,
    model: str,
    run_id: str,
) -> dict[str, Any]:
    """The streamed ``POST /v1/messages`` body of one call."""
    system, mapped = anthropic_messages(messages)
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": route.max_tokens or DEFAULT_ANTHROPIC_MAX_TOKENS,
        "messages": mapped,
        "stream": True,
        "metadata": {"user_id": run_id},
    }
    if system:
        payload["system"] = system
    if tools:
        payload["tools"] = anthropic_tools(tools)
    if route.temperature is not None:
        payload["temperature"] = route.temperature
    return payload


# --------------------------------------------------------------------------- artifacts


def candidate_artifact(
    assembled: Assembled, effect: CallModel, route: str
) -> tuple[StoredArtifact, dict[str, Any]]:
    """The candidate artifact: the assistant message in OpenAI form + finish/outcome/usage."""
    message: dict[str, Any] = {"role": "assistant", "content": assembled.content}
    if assembled.tool_calls:
        message["tool_calls"] = list(assembled.tool_calls)
    if assembled.thinking:
        message["thinking"] = list(assembled.thinking)
    body = {
        "type": "candidate",
        "run_id": effect.run_id,
        "step": effect.step,
        "attempt": effect.attempt,
        "context_ref": effect.context_ref,
        "model_route": route,
        "model": assembled.model,
        "completion_id": assembled.completion_id,
        "message": message,
        "finish_reason": assembled.finish_reason,
        "outcome": assembled.outcome.value,
        "usage": dict(assembled.usage),
    }
    return StoredArtifact.of(canonical_json(body), CANDIDATE_MEDIA_TYPE), message


# --------------------------------------------------------------------------- handler


def _deadline_of(context: Mapping[str, Any]) -> int | None:
    """The run's deadline (epoch ms) as its frozen context holds it (R7), if it has one."""
    remaining = context.get("remaining")
    deadline = remaining.get("deadline_at") if isinstance(remaining, Mapping) else None
    return deadline if isinstance(deadline, int) and not isinstance(deadline, bool) else None


class _NotInMemory(Exception):
    """An artifact a call needs is neither read ahead nor cached."""


class _ArtifactCache:
    """Artifacts are immutable: parsed JSON cached by ref (bounded). Reads that miss go through
    a few connections shared by every thread (``connections``), not one per thread: an executor
    runs hundreds of calls at once, and each of them reads what it misses."""

    def __init__(self, database_url: str, size: int = 4096, connections: int = 4) -> None:
        self._url = database_url
        self._size = size
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._idle: list[PostgresArtifactStore] = []
        self._stores: list[PostgresArtifactStore] = []
        self._free = threading.Semaphore(connections)

    @contextlib.contextmanager
    def _store(self) -> Iterator[PostgresArtifactStore]:
        with self._free:
            with self._lock:
                store = self._idle.pop() if self._idle else None
            if store is None:
                store = PostgresArtifactStore(self._url)
                with self._lock:
                    self._stores.append(store)
            try:
                yield store
            finally:
                with self._lock:
                    self._idle.append(store)

    def cached(self, refs: Sequence[str]) -> dict[str, Any]:
        """What the cache holds of ``refs`` (no database read)."""
        with self._lock:
            found = {ref: self._items[ref] for ref in refs if ref in self._items}
            for ref in found:
                self._items.move_to_end(ref)
        return found

    def load(self, refs: Sequence[str]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        missing = []
        with self._lock:
            for ref in refs:
                if ref in self._items:
                    self._items.move_to_end(ref)
                    found[ref] = self._items[ref]
                else:
                    missing.append(ref)
        if missing:
            with self._store() as store:
                texts = store.get_many(missing)
            for ref, text in texts.items():
                try:
                    found[ref] = json.loads(text)
                except ValueError:
                    found[ref] = text
            with self._lock:
                for ref in missing:
                    if ref in found:
                        self._items[ref] = found[ref]
                while len(self._items) > self._size:
                    self._items.popitem(last=False)
        return found

    def close(self) -> None:
        with self._lock:
            for store in self._stores:
                store.close()
            self._stores.clear()
            self._idle.clear()


class ModelHandler:
    """Calls the model route of each CallModel effect and classifies the stream."""

    effect_types = frozenset({"CallModel"})

    def __init__(
        self,
        database_url: str,
        routes: Routes,
        registry: ToolRegistry | None = None,
        described: Mapping[str, ToolEntry] | None = None,
    ) -> None:
        self.routes = routes
        self.registry = registry
        # the tools' descriptions the model is offered: the registry's HTTP tools and what its
        # MCP servers list at start (``described``, when the caller has listed them already)
        if described is None:
            described = {} if registry is None else tools_of(registry)
        self.described: Mapping[str, ToolEntry] = described
        self._cache = _ArtifactCache(database_url)
        self._conversations = Conversations()
        # One keep-alive connection per worker thread and origin. Connect timeouts and byte
        # limits are the route's, per call.
        self._http = KeepAliveHTTP(connect_timeout_s=DEFAULT_CONNECT_TIMEOUT_S)

    def close(self) -> None:
        self._http.close()
        self._cache.close()

    def route_of(self, effect: Effect) -> str:
        assert isinstance(effect, CallModel)
        return self.routes.name_of(effect.model_route)

    def limits(self, route: str) -> RouteLimits:
        return self.routes.get(route).limits()

    def exclusive_s(self, effect: Effect) -> float:
        """A model call changes nothing outside: of two calls of one key, the first answer
        recorded is the one sent (`ActionRecords.complete`)."""
        return 0.0

    def prepare(self, effects: Sequence[Effect]) -> Ahead:
        """The conversations of a group of calls, read in a few statements (each call of the
        group reads its own from this map, however many the cache keeps)."""
        calls = [e for e in effects if isinstance(e, CallModel)]
        if not calls:
            return NOTHING_AHEAD
        return prefetch_conversations(calls, self._cache.load, self._conversations)

    async def execute(self, effect: Effect, previous: ActionRecord | None, ahead: Ahead) -> Outcome:
        if not isinstance(effect, CallModel):
            raise ExecutorError(f"not a model effect: {effect.type}")
        if previous is not None:
            # Started, never completed: the executor died mid-call. Nothing of that generation
            # was recorded or referenced, so calling again cannot merge two generations.
            log.info("re-calling %s after an interrupted attempt", effect.idempotency_key)
        if not self.routes.known(effect.model_route):
            # refused before anything is read or sent: BLOCKED is never retried, and the run
            # fails at once (`model:blocked`); the record's detail names the route
            detail = f"unknown model route {effect.model_route[:200]!r}: not in the routes file"
            assembled = StreamAssembler().result(interrupted=detail)
            return self._outcome(effect, replace_outcome(assembled, ModelOutcome.BLOCKED))
        route = self.routes.get(effect.model_route)

        def in_memory(refs: Sequence[str]) -> dict[str, Any]:
            found = {ref: ahead[ref] for ref in refs if ref in ahead}
            if len(found) < len(refs):
                found.update(self._cache.cached([ref for ref in refs if ref not in found]))
            if len(found) < len(refs):
                raise _NotInMemory
            return found

        def from_database(refs: Sequence[str]) -> dict[str, Any]:
            found = {ref: ahead[ref] for ref in refs if ref in ahead}
            if len(found) < len(refs):
                found.update(self._cache.load([ref for ref in refs if ref not in found]))
            return found

        try:
            try:
                messages, context, tools = self._conversation(effect, in_memory)
            except _NotInMemory:  # neither read ahead nor cached: the database, off the loop
                messages, context, tools = await asyncio.to_thread(
                    self._conversation, effect, from_database
                )
        except ExecutorError as exc:
            assembled = StreamAssembler().result(interrupted=str(exc))
            return self._outcome(effect, replace_outcome(assembled, ModelOutcome.TRANSPORT_ERROR))
        deadline = _deadline_of(context)
        if deadline is not None and now_ms() >= deadline:
            # it waited for its route past its run's deadline: the run expires (its timer), and
            # the provider is not asked for an answer nobody will use
            interrupted = f"the run's deadline passed before the call ({deadline})"
            assembled = StreamAssembler().result(interrupted=interrupted)
            return self._outcome(effect, replace_outcome(assembled, ModelOutcome.TRANSPORT_ERROR))
        model = self.routes.model_of(effect.model_route)
        if route.provider == "anthropic":
            payload = anthropic_request(messages, tools, route, model, effect.run_id)
            return self._outcome(effect, await self._chat(effect, route, model, payload))
        if any("thinking" in m for m in messages):  # an answer of an Anthropic route before
            messages = [{k: v for k, v in m.items() if k != "thinking"} for m in messages]
        payload = {
            "model": model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": effect.run_id,
        }
        if tools:
            payload["tools"] = tools
        if route.max_tokens is not None:
            payload["max_tokens"] = route.max_tokens
        if route.temperature is not None:
            payload["temperature"] = route.temperature
        assembled = await self._chat(effect, route, model, payload)
        return self._outcome(effect, assembled)

    async def _chat(
        self, effect: CallModel, route: RouteConfig, model: str, payload: Mapping[str, Any]
    ) -> Assembled:
        """`stream`, described on the effect's `chat` span when tracing is on."""
        assembled = await self.stream(route, payload, effect.model_route)
        span = tracing.current()
        if span is not None:
            usage = assembled.usage
            spans.describe_chat(
                span,
                provider=route.provider,
                model=model,
                payload=payload,
                outcome=assembled.outcome.value,
                finish_reason=assembled.finish_reason,
                response_model=assembled.model,
                response_id=assembled.completion_id,
                input_tokens=int(usage.get("prompt_tokens", 0)),
                output_tokens=int(usage.get("completion_tokens", 0)),
                content=assembled.content,
                tool_calls=assembled.tool_calls,
            )
        return assembled

    def _conversation(
        self, effect: CallModel, load: Loader
    ) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
        """The messages, the current context and the tools of a call (R7)."""
        messages, context = build_conversation(effect, load, self._conversations)
        return messages, context, self._tools(context.get("tool_registry"), load)

    def _tools(self, registry_ref: Any, load: Loader) -> list[dict[str, Any]]:
        specs = None
        if isinstance(registry_ref, str):
            specs = load([registry_ref]).get(registry_ref)
        if isinstance(specs, list):
            described = self.described
            return [
                {
                    "type": "function",
                    "function": {
                        "name": s["name"],
                        "description": described[s["name"]].description
                        if s["name"] in described
                        else "",
                        "parameters": s.get("parameters", {"type": "object"}),
                    },
                }
                for s in specs
                if isinstance(s, Mapping) and "name" in s
            ]
        return self.registry.openai_tools() if self.registry is not None else []

    async def stream(
        self, route: RouteConfig, payload: Mapping[str, Any], task_route: str = ""
    ) -> Assembled:
        """The one method that talks to the model endpoint; every failure is classified, and
        what it says of the answer holds none of the route's secrets."""
        assembled = await self._stream(route, payload, task_route)
        if assembled.outcome is not ModelOutcome.FINISHED and assembled.detail:
            return Assembled(**{**assembled.__dict__, "detail": route.redact(assembled.detail)})
        return assembled

    async def _stream(
        self, route: RouteConfig, payload: Mapping[str, Any], task_route: str
    ) -> Assembled:
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            **route_header(task_route),
            **route.headers,
            **tracing.outgoing_headers(),
        }
        assembler: Folds
        if route.provider == "anthropic":
            headers["anthropic-version"] = ANTHROPIC_VERSION
            if route.api_key:
                headers["x-api-key"] = route.api_key
            assembler, url = AnthropicAssembler(), route.messages_url()
        else:
            if route.api_key:
                headers["Authorization"] = f"Bearer {route.api_key}"
            assembler, url = StreamAssembler(), route.chat_url()
        async with self._http.stream(
            "POST",
            url,
            timeout_s=route.total_timeout_s,
            read_timeout_s=route.read_timeout_s,
            connect_timeout_s=route.connect_timeout_s,
            headers=headers,
            body=_JSON.encode(payload),
        ) as answer:
            if answer.failure is not None:  # not connected, or no answer's head
                return replace_outcome(
                    assembler.result(interrupted=answer.detail), ModelOutcome.TRANSPORT_ERROR
                )
            try:
                if answer.status != 200:
                    body = await _read_capped(answer, ERROR_BODY_BYTES)
                    return self._http_error(answer, body)
                if "json" in (answer.header("content-type") or ""):
                    return await _whole_answer(answer, route, assembler)
                return await _read_stream(answer, route, assembler)
            except (OSError, HTTPWireError, ValueError) as exc:
                if assembler.chunks == 0:
                    return replace_outcome(
                        assembler.result(interrupted=f"{type(exc).__name__}: {exc}"),
                        ModelOutcome.TRANSPORT_ERROR,
                    )
                return assembler.result(interrupted=f"connection lost: {type(exc).__name__}: {exc}")

    @staticmethod
    def _http_error(answer: StreamedAnswer, body: bytes) -> Assembled:
        status = answer.status
        text = body[:300].decode("utf-8", "replace")
        detail = f"HTTP {status}: {text}"
        if status in THROTTLE_STATUSES:
            assembled = replace_outcome(
                StreamAssembler().result(interrupted=detail), ModelOutcome.RATE_LIMITED
            )
            after = retry_after_ms(answer.header("retry-after"))
            return Assembled(**{**assembled.__dict__, "retry_after_ms": after})
        return replace_outcome(
            StreamAssembler().result(interrupted=detail), ModelOutcome.TRANSPORT_ERROR
        )

    def failure(self, effect: Effect, code: str, message: str) -> Outcome:
        """The answer to an effect this handler could not carry out (the executor's guard): a
        transport error, which the core retries as a new attempt within its own bound."""
        assert isinstance(effect, CallModel)
        event = ModelCallCompleted(
            **event_identity(effect),
            step=effect.step,
            attempt=effect.attempt,
            outcome=ModelOutcome.TRANSPORT_ERROR,
        )
        return Outcome(event, detail=f"{ModelOutcome.TRANSPORT_ERROR.value}: {code}: {message}")

    def _outcome(self, effect: CallModel, assembled: Assembled) -> Outcome:
        artifacts: tuple[StoredArtifact, ...] = ()
        candidate_ref = None
        if assembled.outcome not in (ModelOutcome.TRANSPORT_ERROR, ModelOutcome.RATE_LIMITED):
            artifact, _ = candidate_artifact(assembled, effect, effect.model_route)
            artifacts, candidate_ref = (artifact,), artifact.ref
        calls = tuple(
            ToolCallRequest(
                id=str(c["id"]),
                name=c["function"]["name"],
                arguments_json=c["function"]["arguments"],
            )
            for c in assembled.tool_calls
        )
        route = self.routes.get(effect.model_route)
        input_tokens = int(assembled.usage.get("prompt_tokens", 0))  # Anthropic's: the same names
        output_tokens = int(assembled.usage.get("completion_tokens", 0))
        cost = min(
            (
                input_tokens * route.input_cost_micros_per_1k
                + output_tokens * route.output_cost_micros_per_1k
            )
            // 1000,
            MAX_AMOUNT,
        )
        event = ModelCallCompleted(
            **event_identity(effect),
            step=effect.step,
            attempt=effect.attempt,
            outcome=assembled.outcome,
            candidate_ref=candidate_ref,
            candidate=Candidate(content=assembled.content, tool_calls=calls),
            usage=ModelUsage(
                input_tokens=input_tokens, output_tokens=output_tokens, cost_micros=cost
            ),
            retry_after_ms=assembled.retry_after_ms,
        )
        detail = f"{assembled.outcome.value}: {assembled.detail}".strip(": ")
        throttle = None
        if assembled.outcome is ModelOutcome.RATE_LIMITED:  # the route slows down, alone
            after = assembled.retry_after_ms
            throttle = DEFAULT_THROTTLE_S if after is None else after / 1000
        used = input_tokens + output_tokens if assembled.usage else None
        if assembled.usage:
            name = route_label(self.routes.name_of(effect.model_route))
            MODEL_TOKENS.labels(name, "input").inc(input_tokens)
            MODEL_TOKENS.labels(name, "output").inc(output_tokens)
            MODEL_COST.labels(name).inc(cost / 1_000_000)
        return Outcome(event, artifacts, detail[:1000], tokens=used, throttle_s=throttle)


def replace_outcome(assembled: Assembled, outcome: ModelOutcome) -> Assembled:
    return Assembled(**{**assembled.__dict__, "outcome": outcome, "tool_calls": ()})


class _Overrun(Exception):
    """The answer went past one of the call's bounds (size or deadline)."""


async def _pieces(answer: StreamedAnswer, limit: int) -> AsyncGenerator[bytes, None]:
    """The body's bytes as they arrive, ended by ``_Overrun`` past ``limit`` bytes or the
    call's deadline: every piece counts, a keep-alive comment as much as a token."""
    try:
        async with contextlib.aclosing(answer.pieces(limit)) as pieces:
            async for piece in pieces:
                yield piece
    except BodyTooLargeError:
        raise _Overrun(f"answer over {limit} bytes") from None
    except DeadlineError:
        raise _Overrun("total timeout exceeded") from None


async def _read_capped(answer: StreamedAnswer, limit: int) -> bytes:
    """Up to ``limit`` bytes of an (error) body; the rest is not read."""
    body = bytearray()
    with contextlib.suppress(_Overrun, OSError, HTTPWireError, ValueError):
        async with contextlib.aclosing(_pieces(answer, 1 << 62)) as pieces:
            async for piece in pieces:
                body += piece
                if len(body) >= limit:
                    break
    return bytes(body[:limit])


async def _whole_answer(answer: StreamedAnswer, route: RouteConfig, assembler: Folds) -> Assembled:
    """A non-streamed ``chat.completion`` (a server that ignored ``stream: true``)."""
    body = bytearray()
    try:
        async with contextlib.aclosing(_pieces(answer, route.max_stream_bytes)) as pieces:
            async for piece in pieces:
                body += piece
    except _Overrun as exc:
        return assembler.result(untrusted=str(exc))
    value, problem = decode_json(bytes(body))
    if problem is not None:
        return assembler.result(untrusted=f"answer is {problem.replace('_', ' ')}")
    try:
        assembler.feed(value)
    except MalformedChunkError as exc:
        return assembler.result(untrusted=f"malformed answer: {exc}")
    return assembler.result()


async def _read_stream(answer: StreamedAnswer, route: RouteConfig, assembler: Folds) -> Assembled:
    """Fold the SSE ``data:`` events into ``assembler`` until ``[DONE]``, the end of the
    body or a bound; comments (``: ping``) and other fields are skipped, but not free."""
    buffer = bytearray()
    try:
        async with contextlib.aclosing(_pieces(answer, route.max_stream_bytes)) as pieces:
            async for piece in pieces:
                buffer += piece
                if b"\n" in piece:
                    *lines, rest = bytes(buffer).split(b"\n")
                    buffer = bytearray(rest)
                    for line in lines:
                        if _fold_line(line.rstrip(b"\r"), assembler, route.max_line_bytes):
                            await _finish_body(answer, pieces)
                            return assembler.result()
                if len(buffer) > route.max_line_bytes:
                    raise MalformedChunkError(f"an SSE line over {route.max_line_bytes} bytes")
        if buffer and _fold_line(bytes(buffer).rstrip(b"\r"), assembler, route.max_line_bytes):
            return assembler.result()
    except _Overrun as exc:
        if str(exc) == "total timeout exceeded":
            return assembler.result(interrupted=str(exc))
        return assembler.result(untrusted=str(exc))
    except MalformedChunkError as exc:
        return assembler.result(untrusted=f"malformed stream: {exc}")
    return assembler.result()


async def _finish_body(answer: StreamedAnswer, pieces: AsyncIterator[bytes]) -> None:
    """Read the body's end after ``[DONE]`` so that the connection is kept for the next call;
    a body that goes on past ``AFTER_DONE_BYTES`` or ``AFTER_DONE_S`` (no read waits longer)
    is left unread, and its connection closed. The answer is complete whatever happens here."""
    answer.wait_at_most(AFTER_DONE_S)
    until = time.monotonic() + AFTER_DONE_S
    extra = 0
    with contextlib.suppress(_Overrun, OSError, HTTPWireError, ValueError):
        async for piece in pieces:
            extra += len(piece)
            if extra > AFTER_DONE_BYTES or time.monotonic() > until:
                return


def _fold_line(line: bytes, assembler: Folds, max_line: int) -> bool:
    """One SSE line into the assembler; True at ``data: [DONE]`` or an event that ends the
    stream (Anthropic's ``message_stop`` or ``error``). ``event:`` lines are skipped: each
    Anthropic ``data`` object names its own ``type``."""
    if len(line) > max_line:
        raise MalformedChunkError(f"an SSE line over {max_line} bytes")
    if not line.startswith(b"data:"):
        return False  # a comment, another field or an event separator
    data = line[5:].strip()
    if data == b"[DONE]":
        assembler.done = True
        return True
    chunk, problem = decode_json(data)
    if problem is not None:
        raise MalformedChunkError(f"a chunk is {problem.replace('_', ' ')}: {data[:80]!r}")
    assembler.feed(chunk)
    return assembler.done


# --------------------------------------------------------------------------- process


class ModelExecutor(Executor):
    """``ModelExecutor(config, routes=Routes.from_env(), registry=...)``: in-process form."""

    def __init__(
        self,
        config: ExecutorConfig,
        routes: Routes | None = None,
        registry: ToolRegistry | Path | str | None = None,
        described: Mapping[str, ToolEntry] | None = None,
    ) -> None:
        if registry is not None and not isinstance(registry, ToolRegistry):
            registry = ToolRegistry.load(registry)
        handler = ModelHandler(
            config.database_url,
            routes or Routes.from_env(),
            registry,
            described,
        )
        try:
            super().__init__(config, handler)
        except BaseException:
            handler.close()
            raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentruns executor model", description=__doc__)
    add_common_arguments(parser, "model")
    parser.add_argument(
        "--base-url",
        default=None,
        help="OpenAI-compatible base URL (default $AGENTRUNS_MODEL_BASE_URL, else "
        f"{DEFAULT_BASE_URL})",
    )
    parser.add_argument(
        "--routes",
        default=current().model_routes,
        help='per-route JSON: {"route": {...}} (default $AGENTRUNS_MODEL_ROUTES)',
    )
    parser.add_argument(
        "--registry",
        default=current().tool_registry,
        help=f"the tool registry, a JSON file, for the tools' descriptions (optional; default"
        f" ${REGISTRY_ENV}; without one the model sees the tools without descriptions)",
    )
    args = parser.parse_args(argv)
    registry = registry_from_args(args.registry) if args.registry else None

    def make(config: ExecutorConfig) -> ModelExecutor:
        return ModelExecutor(config, Routes.from_env(args.routes, args.base_url), registry)

    return serve_executor(args, "model", make)


__all__ = [
    "AnthropicAssembler",
    "Assembled",
    "ModelExecutor",
    "ModelHandler",
    "RouteConfig",
    "Routes",
    "StreamAssembler",
    "anthropic_messages",
    "anthropic_request",
    "candidate_artifact",
    "main",
]


if __name__ == "__main__":
    from agentruns.connectors.lifecycle import run_command

    raise SystemExit(run_command(main))
