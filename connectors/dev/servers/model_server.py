"""Scripted model server: an OpenAI-compatible ``/v1/chat/completions`` and an Anthropic
``/v1/messages`` (the same scenarios and faults in Anthropic's SSE events), driven by scenario
files.

Used by the demo, the tests and the benchmarks in place of a real model. A scenario (JSON file in
``connectors/dev/servers/scenarios/`` or a ``--scenarios`` directory) lists the turns of a
conversation; the
turn is the number of tool-result groups already in the request's messages, so the same
conversation always gets the same answer (deterministic: no clock, no randomness in bodies).

Faults are injected per request by the scenario turn (``faults``, counted per conversation so a
retry can succeed), by the ``X-Fault`` request header, or by rules posted to ``/faults``.
See ``docs/servers.md`` for the protocol, the scenario format and the fault catalogue.

    python -m agentruns.connectors.dev.servers.model_server --port 8700 [--scenarios DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import ssl
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentruns.connectors.dev.servers.httpserver import (
    FaultRequest,
    Frames,
    JSONHandler,
    ServerHandle,
    param_text,
    parse_fault_header,
    run_until_signal,
    start_server,
)
from agentruns.connectors.dev.servers.latency import MAX_MS, LatencyParams

BUILTIN_SCENARIOS = Path(__file__).with_name("scenarios")
DEFAULT_PORT = 8700
SCENARIO_MARKER = re.compile(r"scenario:([A-Za-z0-9_.\-]+)")

FaultKind = Literal[
    "disconnect",
    "incomplete",
    "length",
    "content_filter",
    "slow",
    "429",
    "529",
    "overloaded",
    "api_error",
    "500",
    "503",
    "keepalive",
    "drip",
    "bad_chunk",
    "huge_stream",
    "huge_line",
    "bad_utf8",
    "latency",
]
FAULT_KINDS: frozenset[str] = frozenset(get_args(FaultKind))
# `bad_chunk; shape=...`: a chunk that is valid JSON (or, for `not_json`, not) of a shape the
# protocol does not have, sent after `after_chunks` good chunks; the stream then finishes.
BadShape = Literal[
    "choices_not_list",
    "choice_not_object",
    "delta_string",
    "content_not_string",
    "index_missing",
    "arguments_not_string",
    "not_object",
    "not_json",
    "deep",
    "unknown_block",
]
BAD_SHAPES: frozenset[str] = frozenset(get_args(BadShape))
# Defaults of the new kinds' parameters (bytes, nesting, milliseconds).
HUGE_STREAM_BYTES = 8 * 1024 * 1024
HUGE_LINE_BYTES = 1024 * 1024
BAD_DEPTH = 1000
# `bad_chunk; shape=unknown_block`: a content block (Anthropic) or part (OpenAI) of this type
UNKNOWN_BLOCK_TYPE = "hologram"
KEEPALIVE_MS = 100.0
DRIP_MS = 1000.0
# `latency`: the words of the filler deltas streamed before the scripted answer, a few a chunk.
FILLER_TEXT = (
    "let me think about this request step by step and check what the tools can tell us "
    "before giving a careful answer"
)
FILLER_WORDS_PER_CHUNK = 3
MAX_FILLER_CHUNKS = 10_000  # a long L at a short chunk_ms gets wider spacing, not more chunks


class StreamLatency(LatencyParams):
    """The ``latency`` fault's parameters: the call's total time L is log-normal around
    ``median_ms``; the role delta comes after ``ttft_share`` x L, then one chunk every
    ``chunk_ms`` (0: the scripted deltas alone, spread evenly) until L."""

    median_ms: float = Field(default=2000.0, gt=0, le=MAX_MS)
    min_ms: float = Field(default=100.0, gt=0, le=MAX_MS)
    max_ms: float = Field(default=30000.0, gt=0, le=MAX_MS)
    ttft_share: float = Field(default=0.2, ge=0, le=1)
    chunk_ms: float = Field(default=50.0, ge=0, le=60000)

    @model_validator(mode="after")
    def _whole_chunks(self) -> StreamLatency:
        if 0 < self.chunk_ms < 1:
            raise ValueError("chunk_ms must be 0 (no filler) or at least 1")
        return self


LATENCY_FIELDS = tuple(StreamLatency.model_fields)


@dataclass(frozen=True)
class Pace:
    """When a ``latency`` request's chunks go out: ``total`` seconds (the drawn L) in all."""

    total: float
    spec: StreamLatency

    @property
    def ttft(self) -> float:
        return self.total * self.spec.ttft_share

    def filler(self, scripted: int) -> int:
        """Filler chunks to stream before ``scripted`` deltas so that one comes about every
        ``chunk_ms`` between the first chunk and L (none with ``chunk_ms`` 0)."""
        if self.spec.chunk_ms <= 0:
            return 0
        wanted = round((self.total - self.ttft) * 1000 / self.spec.chunk_ms)
        return max(0, min(wanted, MAX_FILLER_CHUNKS) - scripted)

    def offsets(self, frames: int, deltas: int) -> list[float]:
        """Seconds from the start at which each frame is due: the role delta at the first
        token, the ``deltas`` after it evenly until L, the rest (finish, ``[DONE]``) at L."""
        rest = self.total - self.ttft
        due = [self.ttft, *(self.ttft + rest * k / deltas for k in range(1, deltas))]
        return due + [self.total] * (frames - len(due))


class ToolCallSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    id: str | None = None


class LatencyFields(BaseModel):
    """The ``latency`` parameters of a fault rule or a scenario turn's fault, checked against
    ``StreamLatency`` when the kind is ``latency`` (so a bad rule is refused when posted)."""

    kind: FaultKind
    median_ms: float | None = None
    sigma: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    seed: int | None = None
    ttft_share: float | None = None
    chunk_ms: float | None = None

    @model_validator(mode="after")
    def _latency_in_bounds(self) -> LatencyFields:
        if self.kind == "latency":
            try:
                StreamLatency.model_validate(self.latency_params())
            except ValidationError as exc:
                raise ValueError(f"invalid latency parameters: {exc}") from None
        return self

    def latency_params(self) -> dict[str, str]:
        """The latency parameters given, as fault parameters (exact: ``str``, not ``%g``)."""
        values = {name: getattr(self, name) for name in LATENCY_FIELDS}
        return {name: str(v) for name, v in values.items() if v is not None}


class FaultSpec(LatencyFields):
    """A fault served by a scenario turn or a ``/faults`` rule.

    ``times``: how many requests (per conversation and turn) get it; ``None`` = every request.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: FaultKind
    times: int | None = 1
    after_chunks: int = 2
    delay_ms: float | None = None
    retry_after: float | str = 1.0
    shape: BadShape = "choices_not_list"
    size: int | None = None
    depth: int | None = None


class Turn(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    content: str = ""
    tool_calls: list[ToolCallSpec] = Field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    faults: list[FaultSpec] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _single_fault(cls, data: Any) -> Any:
        if isinstance(data, dict) and "fault" in data:
            data = dict(data)
            fault = data.pop("fault")
            data["faults"] = [*data.get("faults", []), fault]
        return data


class Scenario(BaseModel):
    """Turn ``n`` answers a request carrying ``n`` tool-result groups; past the end the last
    turn repeats (a final answer stays final, a tool call loops forever)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str = ""
    turns: list[Turn] = Field(min_length=1)
    chunk_chars: int = Field(default=12, ge=1)
    delay_ms: int = Field(default=0, ge=0)

    def turn(self, index: int) -> Turn:
        return self.turns[min(index, len(self.turns) - 1)]


class FaultRule(LatencyFields):
    """A fault posted to ``/faults``: matches requests by scenario / turn / conversation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: FaultKind
    scenario: str | None = None
    turn: int | None = None
    conversation: str | None = None
    times: int | None = 1
    per_conversation: bool = False
    after_chunks: int = 2
    delay_ms: float | None = None
    retry_after: float | str = 1.0
    shape: BadShape = "choices_not_list"
    size: int | None = None
    depth: int | None = None


DEFAULT_SCENARIO = Scenario(
    name="default",
    description="Fallback when a conversation names no scenario: one short final answer.",
    turns=[Turn(content="Done.")],
)


def load_scenarios(*dirs: Path | str | None) -> dict[str, Scenario]:
    """Load ``*.json`` scenarios; later directories override earlier ones by name."""
    scenarios: dict[str, Scenario] = {DEFAULT_SCENARIO.name: DEFAULT_SCENARIO}
    for d in dirs:
        if d is None:
            continue
        for path in sorted(Path(d).glob("*.json")):
            try:
                scenario = Scenario.model_validate_json(path.read_bytes())
            except ValidationError as exc:
                raise ValueError(f"invalid scenario file {path}: {exc}") from exc
            scenarios[scenario.name] = scenario
    return scenarios


# --- reading the conversation -----------------------------------------------------------


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def turn_of(messages: Sequence[Mapping[str, Any]]) -> int:
    """Number of groups of consecutive tool-result messages (one group per model turn)."""
    groups = 0
    previous_was_tool = False
    for message in messages:
        is_tool = message.get("role") in ("tool", "function")
        if is_tool and not previous_was_tool:
            groups += 1
        previous_was_tool = is_tool
    return groups


def scenario_name_of(
    body: Mapping[str, Any], header: str | None, route: str | None = None
) -> str | None:
    """``X-Scenario`` header, else ``scenario:NAME`` in the model name, the task's route
    (``X-Agentruns-Route``, which the model executor sends), the system messages or the first
    user message."""
    if header:
        return header.strip()
    for named in (body.get("model"), route):
        if isinstance(named, str) and (match := SCENARIO_MARKER.search(named)):
            return match.group(1)
    seen_user = False
    for message in body.get("messages", []):
        role = message.get("role")
        searchable = role in ("system", "developer") or (role == "user" and not seen_user)
        if searchable and (match := SCENARIO_MARKER.search(_text(message.get("content")))):
            return match.group(1)
        if role == "user":
            seen_user = True
    return None


def conversation_key_of(body: Mapping[str, Any], header: str | None, scenario: str) -> str:
    """``X-Conversation-Key`` header, else the request's ``user`` field, else a hash of the
    scenario and the messages up to the first user message."""
    if header:
        return header.strip()
    user = body.get("user")
    if isinstance(user, str) and user:
        return user
    head: list[Any] = []
    for message in body.get("messages", []):
        head.append([message.get("role"), _text(message.get("content"))])
        if message.get("role") == "user":
            break
    digest = hashlib.sha256(json.dumps([scenario, head]).encode()).hexdigest()
    return f"conv-{digest[:16]}"


def estimate_tokens(text: str) -> int:
    return max(1, (len(text) + 3) // 4)


def anthropic_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request read as a chat completions one, for the scenario, turn
    and conversation rules: ``system`` a system message, a user message of ``tool_result``
    blocks a ``tool`` message (one group per model turn), ``metadata.user_id`` the ``user``."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": system})
    for message in body.get("messages") or ():
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        blocks = content if isinstance(content, list) else []
        results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
        role = "tool" if results and message.get("role") == "user" else message.get("role")
        messages.append({"role": role, "content": _text(content)})
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    return {"model": body.get("model"), "messages": messages, "user": user}


# Anthropic's stop_reason for a scripted finish_reason (others are sent as they are)
STOP_REASONS = {
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "length": "max_tokens",
    "content_filter": "refusal",
}


# --- building the answer ----------------------------------------------------------------


def _pieces(text: str, size: int, at_least: int = 1) -> list[str]:
    if not text:
        return []
    size = min(size, max(1, -(-len(text) // at_least)))
    return [text[i : i + size] for i in range(0, len(text), size)]


class Answer:
    """One scripted completion: its deltas, final message, finish reason and usage."""

    def __init__(
        self, scenario: Scenario, turn: Turn, conversation: str, turn_index: int, prompt: str
    ) -> None:
        self.scenario = scenario
        self.turn = turn
        self.content = turn.content
        self.filler: list[str] = []
        self._prompt_tokens = estimate_tokens(prompt)
        self.tool_calls: list[dict[str, Any]] = []
        conv_hash = hashlib.sha256(conversation.encode()).hexdigest()[:8]
        for i, call in enumerate(turn.tool_calls):
            self.tool_calls.append(
                {
                    "index": i,
                    "id": call.id or f"call_{conv_hash}_{turn_index}_{i}",
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": json.dumps(call.arguments, separators=(",", ":")),
                    },
                }
            )
        self.finish_reason = turn.finish_reason or ("tool_calls" if self.tool_calls else "stop")
        self.usage = self._usage()

    def _usage(self) -> dict[str, int]:
        generated = self.content + "".join(c["function"]["arguments"] for c in self.tool_calls)
        usage = {
            "prompt_tokens": self._prompt_tokens,
            "completion_tokens": estimate_tokens(generated),
        }
        usage.update(self.turn.usage or {})
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return usage

    def add_filler(self, chunks: int) -> None:
        """``chunks`` content deltas of filler words streamed before the scripted ones, as a
        model streams tokens for a while; they are part of the content and of the usage."""
        n, words = FILLER_WORDS_PER_CHUNK, FILLER_TEXT.split()
        self.filler = [
            " ".join(words[(i * n + j) % len(words)] for j in range(n)) + " " for i in range(chunks)
        ]
        self.content = "".join(self.filler) + self.turn.content
        self.usage = self._usage()

    def deltas(self) -> list[dict[str, Any]]:
        """Deltas after the role delta: filler (``latency``), content pieces, then per tool
        call one delta with id and name, then its arguments split across several deltas."""
        size = self.scenario.chunk_chars
        out: list[dict[str, Any]] = [{"content": p} for p in self.filler]
        out += [{"content": p} for p in _pieces(self.turn.content, size)]
        for call in self.tool_calls:
            out.append(
                {
                    "tool_calls": [
                        {
                            "index": call["index"],
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": call["function"]["name"], "arguments": ""},
                        }
                    ]
                }
            )
            for piece in _pieces(call["function"]["arguments"], size, at_least=2):
                out.append(
                    {"tool_calls": [{"index": call["index"], "function": {"arguments": piece}}]}
                )
        return out

    def message(self, complete: bool) -> dict[str, Any]:
        if not complete:
            half = self.content[: len(self.content) // 2]
            return {"role": "assistant", "content": half}
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            msg["tool_calls"] = [
                {k: v for k, v in c.items() if k != "index"} for c in self.tool_calls
            ]
        return msg


# --- the application --------------------------------------------------------------------


class ModelServerApp:
    """State shared by the handler threads: scenarios, fault rules and counters (one lock)."""

    def __init__(self, scenarios: Mapping[str, Scenario]) -> None:
        self._lock = threading.Lock()
        self.scenarios: dict[str, Scenario] = dict(scenarios)
        self._rules: list[tuple[FaultRule, Counter[str]]] = []
        self._attempts: Counter[tuple[str, str, int]] = Counter()
        self._stats: Counter[str] = Counter()
        self._faults: Counter[str] = Counter()
        self._by_scenario: Counter[str] = Counter()
        self._latency: dict[str, list[float]] = {}
        self._served: dict[str, float] = {}

    # counters
    def count(self, name: str) -> None:
        with self._lock:
            self._stats[name] += 1

    def count_fault(self, kind: str) -> None:
        with self._lock:
            self._faults[kind] += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": self._stats["requests"],
                "completions": self._stats["completions"],
                "anthropic_requests": self._stats["anthropic_requests"],
                "faults_served": sum(self._faults.values()),
                "faults": dict(self._faults),
                "by_scenario": dict(self._by_scenario),
                "conversations": len({k[1] for k in self._attempts}),
            }

    def turns(self, conversation: str) -> dict[int, int]:
        """How many requests each turn of a conversation (a run) received: what a test
        asserts when a turn must not be asked again."""
        with self._lock:
            return {t: n for (_, c, t), n in self._attempts.items() if c == conversation}

    def reset(self) -> None:
        with self._lock:
            self._rules.clear()
            self._attempts.clear()
            self._stats.clear()
            self._faults.clear()
            self._by_scenario.clear()
            self._latency.clear()
            self._served.clear()

    def record_latency(self, conversation: str, ms: float) -> None:
        """Account a ``latency`` request's planned time to its conversation (the run)."""
        with self._lock:
            calls_ms = self._latency.setdefault(conversation, [0, 0.0])
            calls_ms[0] += 1
            calls_ms[1] += ms

    def record_served(self, conversation: str, ms: float) -> None:
        """Account how long a ``latency`` request really took to serve, from its body read to
        its last byte written: above the planned time when this server falls behind."""
        with self._lock:
            self._served[conversation] = self._served.get(conversation, 0.0) + ms

    def latency(self) -> dict[str, Any]:
        with self._lock:
            return {
                "conversations": {
                    key: {
                        "calls": int(calls),
                        "ms": round(ms, 3),
                        "served_ms": round(self._served.get(key, 0.0), 3),
                    }
                    for key, (calls, ms) in self._latency.items()
                }
            }

    def add_scenario(self, scenario: Scenario) -> None:
        with self._lock:
            self.scenarios[scenario.name] = scenario

    def add_rule(self, rule: FaultRule) -> None:
        with self._lock:
            self._rules.append((rule, Counter()))

    def rules(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r.model_dump() for r, _ in self._rules]

    def clear_rules(self) -> None:
        with self._lock:
            self._rules.clear()

    def plan(
        self, scenario: Scenario, conversation: str, turn_index: int, header: FaultRequest | None
    ) -> tuple[FaultRequest | None, int]:
        """Which fault (if any) this request gets, and its attempt number for this
        conversation turn. Header first, then ``/faults`` rules, then the turn's faults."""
        with self._lock:
            self._stats["requests"] += 1
            self._by_scenario[scenario.name] += 1
            attempt_key = (scenario.name, conversation, turn_index)
            attempt = self._attempts[attempt_key]
            self._attempts[attempt_key] += 1
            if header is not None:
                return header, attempt
            for rule, used in self._rules:
                if rule.scenario not in (None, scenario.name):
                    continue
                if rule.turn not in (None, turn_index):
                    continue
                if rule.conversation not in (None, conversation):
                    continue
                bucket = conversation if rule.per_conversation else ""
                if rule.times is not None and used[bucket] >= rule.times:
                    continue
                used[bucket] += 1
                return _fault_request(rule), attempt
            served = 0
            for spec in scenario.turn(turn_index).faults:
                if spec.times is None or attempt < served + spec.times:
                    return _fault_request(spec), attempt
                served += spec.times
            return None, attempt


def _fault_request(spec: FaultSpec | FaultRule) -> FaultRequest:
    if spec.kind == "latency":
        return FaultRequest(kind=spec.kind, params=spec.latency_params())
    values: dict[str, float | str | None] = {
        "after_chunks": spec.after_chunks,
        "delay_ms": spec.delay_ms,
        "retry_after": spec.retry_after,
        "shape": spec.shape,
        "size": spec.size,
        "depth": spec.depth,
    }
    params = {k: param_text(v) for k, v in values.items() if v is not None}
    return FaultRequest(kind=spec.kind, params=params)


def bad_chunk(shape: str, completion_id: str, model: str, depth: int = BAD_DEPTH) -> bytes:
    """The ``data:`` payload of a ``bad_chunk`` fault (see ``BadShape``)."""
    base: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
    }
    call = {"id": "call_bad", "type": "function", "function": {"name": "search_docs"}}
    deltas: dict[str, Any] = {
        "delta_string": "oops",
        "content_not_string": {"content": {"text": "oops"}},
        "index_missing": {"tool_calls": [{**call, "function": {"arguments": "{}"}}]},
        "arguments_not_string": {
            "tool_calls": [{"index": 0, **call, "function": {"arguments": {"query": "x"}}}]
        },
        # content parts of a type no protocol has (chat completion deltas carry a string)
        "unknown_block": {"content": [{"type": UNKNOWN_BLOCK_TYPE, "data": "oops"}]},
    }
    match shape:
        case "not_json":
            return b"{not json"
        case "deep":
            return b"[" * depth + b"]" * depth
        case "not_object":
            return b"[1,2,3]"
        case "choices_not_list":
            payload: Any = {**base, "choices": "oops"}
        case "choice_not_object":
            payload = {**base, "choices": ["oops"]}
        case _:
            choice = {"index": 0, "delta": deltas[shape], "finish_reason": None}
            payload = {**base, "choices": [choice]}
    return json.dumps(payload, separators=(",", ":")).encode()


# the kinds that end a stream with an error event (OpenAI mode: an error chunk): its message, type
ERROR_EVENTS: Mapping[str, tuple[str, str]] = {
    "overloaded": ("Overloaded (scripted)", "overloaded_error"),
    "api_error": ("Internal server error (scripted)", "api_error"),
}


def _error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}


def _anthropic_error(message: str, kind: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One Anthropic SSE event: its ``event:`` line names the ``type`` of its ``data``."""
    data = json.dumps(payload, separators=(",", ":")).encode()
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + data + b"\n\n"


def text_block(index: int, pieces: list[str]) -> list[bytes]:
    """A text content block's events: start, one ``text_delta`` per piece, stop."""
    block = {"type": "text", "text": ""}
    deltas = [{"type": "text_delta", "text": piece} for piece in pieces]
    return [
        sse_event({"type": "content_block_start", "index": index, "content_block": block}),
        *(sse_event({"type": "content_block_delta", "index": index, "delta": d}) for d in deltas),
        sse_event({"type": "content_block_stop", "index": index}),
    ]


def anthropic_blocks(answer: Answer) -> list[list[bytes]]:
    """The content blocks of a scripted answer as Anthropic events, one list per block:
    start, deltas (filler and text pieces; tool input JSON in two or more pieces), stop."""
    size = answer.scenario.chunk_chars
    blocks: list[list[bytes]] = []
    pieces = answer.filler + _pieces(answer.turn.content, size)
    if pieces:
        blocks.append(text_block(0, pieces))
    for call in answer.tool_calls:
        index = len(blocks)
        start = {
            "type": "tool_use",
            "id": call["id"],
            "name": call["function"]["name"],
            "input": {},
        }
        events = [
            sse_event({"type": "content_block_start", "index": index, "content_block": start})
        ]
        for piece in _pieces(call["function"]["arguments"], size, at_least=2):
            delta = {"type": "input_json_delta", "partial_json": piece}
            events.append(
                sse_event({"type": "content_block_delta", "index": index, "delta": delta})
            )
        blocks.append([*events, sse_event({"type": "content_block_stop", "index": index})])
    return blocks


def anthropic_message(answer: Answer, model: str, message_id: str, stop: str) -> dict[str, Any]:
    """A whole (non-streamed) Anthropic message of a scripted answer."""
    content: list[dict[str, Any]] = []
    if answer.content:
        content.append({"type": "text", "text": answer.content})
    for call in answer.tool_calls:
        arguments = json.loads(call["function"]["arguments"])
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": arguments,
            }
        )
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": STOP_REASONS.get(stop, stop),
        "stop_sequence": None,
        "usage": {
            "input_tokens": answer.usage["prompt_tokens"],
            "output_tokens": answer.usage["completion_tokens"],
        },
    }


class ModelHandler(JSONHandler):
    @property
    def app(self) -> ModelServerApp:
        app = self.server.app
        assert isinstance(app, ModelServerApp)
        return app

    def do_GET(self) -> None:
        parts = self.path_parts()
        if parts == ["stats"]:
            self.send_json(200, self.app.stats())
        elif parts == ["healthz"]:
            self.send_json(200, {"status": "ok"})
        elif parts == ["v1", "models"]:
            names = sorted(self.app.scenarios)
            data = [
                {"id": f"scenario:{n}", "object": "model", "owned_by": "agentruns"} for n in names
            ]
            self.send_json(200, {"object": "list", "data": data})
        elif parts == ["scenarios"]:
            self.send_json(200, {n: s.model_dump() for n, s in sorted(self.app.scenarios.items())})
        elif parts == ["faults"]:
            self.send_json(200, {"rules": self.app.rules()})
        elif parts == ["latency"]:
            self.send_json(200, self.app.latency())
        else:
            self.send_json(404, _error(f"no route GET {self.path}"))

    def do_DELETE(self) -> None:
        if self.path_parts() == ["faults"]:
            self.app.clear_rules()
            self.send_json(200, {"rules": []})
        else:
            self.send_json(404, _error(f"no route DELETE {self.path}"))

    def do_POST(self) -> None:
        parts = self.path_parts()
        try:
            body = self.read_json()
        except ValueError:
            self.send_json(400, _error("body is not JSON"))
            return
        if parts == ["v1", "chat", "completions"]:
            self.chat_completions(body)
        elif parts == ["v1", "messages"]:
            self.chat_completions(body, anthropic=True)
        elif parts == ["reset"]:
            self.app.reset()
            self.send_json(200, {"reset": True})
        elif parts == ["faults"]:
            try:
                raw = body.get("rules", [body]) if isinstance(body, dict) else body
                rules = [FaultRule.model_validate(r) for r in raw]
            except (ValidationError, AttributeError, TypeError) as exc:
                self.send_json(422, _error(f"invalid fault rule: {exc}"))
                return
            for rule in rules:
                self.app.add_rule(rule)
            self.send_json(200, {"rules": self.app.rules()})
        elif parts == ["scenarios"]:
            try:
                scenario = Scenario.model_validate(body)
            except ValidationError as exc:
                self.send_json(422, _error(f"invalid scenario: {exc}"))
                return
            self.app.add_scenario(scenario)
            self.send_json(200, {"name": scenario.name})
        else:
            self.send_json(404, _error(f"no route POST {self.path}"))

    # --- chat completions --------------------------------------------------------------

    def chat_completions(self, body: Any, anthropic: bool = False) -> None:
        """One completion: OpenAI's ``/v1/chat/completions``, or (``anthropic``) Anthropic's
        ``/v1/messages``, read through :func:`anthropic_view` and answered in its events."""
        began = time.monotonic()
        error = _anthropic_error if anthropic else _error
        if anthropic:
            self.app.count("anthropic_requests")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            self.send_json(400, error("'messages' must be a list", "invalid_request_error"))
            return
        request = anthropic_view(body) if anthropic else body
        messages: list[dict[str, Any]] = [m for m in request["messages"] if isinstance(m, dict)]
        route = self.header("X-Agentruns-Route")
        name = scenario_name_of(request, self.header("X-Scenario"), route) or DEFAULT_SCENARIO.name
        scenario = self.app.scenarios.get(name)
        if scenario is None:
            self.send_json(404, error(f"unknown scenario {name!r}", "not_found_error"))
            return
        conversation = conversation_key_of(request, self.header("X-Conversation-Key"), name)
        turn_index = turn_of(messages)
        header_fault = parse_fault_header(self.header("X-Fault"))
        if header_fault is not None and header_fault.kind not in FAULT_KINDS:
            self.send_json(400, _error(f"unknown fault {header_fault.kind!r}"))
            return
        shape = header_fault.params.get("shape") if header_fault is not None else None
        if shape is not None and shape not in BAD_SHAPES:
            self.send_json(400, _error(f"unknown bad_chunk shape {shape!r}"))
            return
        if header_fault is not None and header_fault.kind == "latency":
            try:
                StreamLatency.model_validate(header_fault.params)
            except ValidationError as exc:
                self.send_json(400, _error(f"invalid latency parameters: {exc}"))
                return
        fault, attempt = self.app.plan(scenario, conversation, turn_index, header_fault)
        if fault is not None:
            self.app.count_fault(fault.kind)
            if fault.kind in ("429", "529"):
                # verbatim: `inf`, `-1`, an HTTP date or garbage reach the client as given
                retry_after = fault.params.get("retry_after", "1")
                kind = "rate_limit_error" if fault.kind == "429" else "overloaded_error"
                self.send_json(
                    int(fault.kind),
                    error(f"{kind} (scripted)", kind),
                    {"Retry-After": retry_after},
                )
                return
            if fault.kind in ("500", "503"):
                kind = "api_error" if anthropic else "server_error"
                self.send_json(int(fault.kind), error("server error (scripted)", kind))
                return
        prompt = " ".join(_text(m.get("content")) for m in messages)
        answer = Answer(scenario, scenario.turn(turn_index), conversation, turn_index, prompt)
        model = str(body.get("model") or f"scenario:{name}")
        digest = hashlib.sha256(f"{conversation}:{turn_index}".encode()).hexdigest()[:12]
        completion_id = f"{'msg' if anthropic else 'chatcmpl'}-{digest}-{attempt}"
        pace: Pace | None = None
        if fault is not None and fault.kind == "latency":
            spec = StreamLatency.model_validate(fault.params)
            total_ms = spec.draw_ms(conversation, turn_index, attempt)
            self.app.record_latency(conversation, total_ms)
            pace = Pace(total_ms / 1000, spec)
        if anthropic and body.get("stream"):
            if pace is not None:
                answer.add_filler(pace.filler(len(answer.deltas())))
            self.anthropic_stream(answer, model, completion_id, fault, pace)
        elif anthropic:
            self.respond(answer, model, completion_id, fault, pace, anthropic=True)
        elif body.get("stream"):
            options = body.get("stream_options")
            separate_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            if pace is not None:
                answer.add_filler(pace.filler(len(answer.deltas())))
            self.stream(answer, model, completion_id, fault, separate_usage, pace)
        else:
            self.respond(answer, model, completion_id, fault, pace)
        if pace is not None:
            self.app.record_served(conversation, (time.monotonic() - began) * 1000)

    def respond(
        self,
        answer: Answer,
        model: str,
        completion_id: str,
        fault: FaultRequest | None,
        pace: Pace | None = None,
        anthropic: bool = False,
    ) -> None:
        kind = fault.kind if fault else None
        delay = answer.scenario.delay_ms / 1000 * len(answer.deltas())
        if kind == "slow" and fault is not None:
            delay += fault.number("delay_ms", 50) / 1000 * (len(answer.deltas()) + 2)
        if pace is not None:  # the whole drawn latency, then the scripted answer (no filler)
            delay = pace.total
        if not self.server.sleep(delay):
            self.drop_connection()
            return
        if kind in ("disconnect", "incomplete", "overloaded", "api_error"):
            self.drop_connection()
            return
        finish = answer.finish_reason
        complete = True
        if kind in ("length", "content_filter"):
            finish, complete = str(kind), False
        if complete:
            self.app.count("completions")
        if anthropic:
            self.send_json(200, anthropic_message(answer, model, completion_id, finish))
            return
        self.send_json(
            200,
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [
                    {"index": 0, "message": answer.message(complete), "finish_reason": finish}
                ],
                "usage": answer.usage,
            },
        )

    def stream(
        self,
        answer: Answer,
        model: str,
        completion_id: str,
        fault: FaultRequest | None,
        separate_usage: bool = False,
        pace: Pace | None = None,
    ) -> None:
        """SSE over chunked transfer encoding (so keep-alive survives). Usage rides on the
        finish chunk, or (``stream_options.include_usage``) on an extra chunk with no choices,
        as OpenAI does. A ``latency`` stream goes out at the ``pace`` drawn for it."""

        def chunk(delta: dict[str, Any] | None, finish: str | None, usage: bool = False) -> bytes:
            payload: dict[str, Any] = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": 0,
                "model": model,
                "choices": []
                if delta is None
                else [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            if usage:
                payload["usage"] = answer.usage
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        def finish(reason: str) -> list[bytes]:
            if separate_usage:
                return [chunk({}, reason), chunk(None, None, usage=True), b"data: [DONE]\n\n"]
            return [chunk({}, reason, usage=True), b"data: [DONE]\n\n"]

        deltas = [{"role": "assistant", "content": ""}, *answer.deltas()]
        events = [chunk(d, None) for d in deltas]
        kind = fault.kind if fault else None
        if fault is not None and kind in ("disconnect", "incomplete"):
            events = events[: max(0, min(fault.integer("after_chunks", 2), len(events) - 1))]
        elif fault is not None and kind in ("bad_chunk", "bad_utf8"):
            at = max(0, min(fault.integer("after_chunks", 2), len(events)))
            if kind == "bad_chunk":
                depth = fault.integer("depth", BAD_DEPTH)
                shape = fault.params.get("shape", "choices_not_list")
                data = bad_chunk(shape, completion_id, model, depth)
            else:  # a content string with bytes that are not UTF-8
                data = chunk({"content": "@@"}, None).removeprefix(b"data: ").rstrip()
                data = data.replace(b"@@", b"\xff\xfe")
            events = [*events[:at], b"data: " + data + b"\n\n", *events[at:]]
            events += finish(answer.finish_reason)
        elif fault is not None and kind == "huge_stream":
            size, piece = fault.integer("size", HUGE_STREAM_BYTES), "x" * 1000
            events = events[:1] + [chunk({"content": piece}, None)] * (size // 1000 + 1)
            events += finish("stop")
        elif fault is not None and kind == "huge_line":
            content = "x" * fault.integer("size", HUGE_LINE_BYTES)
            events = [*events[:1], chunk({"content": content}, None), *finish("stop")]
        elif kind == "length" and answer.tool_calls:
            events = events[:-1]  # the last argument piece never comes: incomplete JSON
            events += finish("length")
        elif kind in ("length", "content_filter"):
            events = events[: max(1, len(events) // 2)]
            events += finish(str(kind))
        elif fault is not None and kind in ERROR_EVENTS:  # OpenAI has no such event: an error
            at = max(0, min(fault.integer("after_chunks", 2), len(events)))  # chunk, no finish
            error = json.dumps(_error(*ERROR_EVENTS[fault.kind])).encode()
            events = [*events[:at], b"data: " + error + b"\n\n"]
        else:
            events += finish(answer.finish_reason)
        self.send_events(answer, events, fault, pace, len(answer.deltas()))

    def anthropic_stream(
        self,
        answer: Answer,
        model: str,
        message_id: str,
        fault: FaultRequest | None,
        pace: Pace | None = None,
    ) -> None:
        """The scripted answer in Anthropic's events (``message_start``, its content blocks,
        ``message_delta`` with the stop_reason and usage, ``message_stop``), faults as in
        :meth:`stream`; ``overloaded`` is an ``error`` event after ``after_chunks`` events."""
        usage = answer.usage
        start: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": 1},
        }

        def finish(reason: str) -> list[bytes]:
            delta = {"stop_reason": STOP_REASONS.get(reason, reason), "stop_sequence": None}
            output = {"output_tokens": answer.usage["completion_tokens"]}
            return [
                sse_event({"type": "message_delta", "delta": delta, "usage": output}),
                sse_event({"type": "message_stop"}),
            ]

        blocks = anthropic_blocks(answer)
        events = [sse_event({"type": "message_start", "message": start})]
        events += [event for block in blocks for event in block]
        kind = fault.kind if fault else None
        if fault is not None and kind in ("disconnect", "incomplete"):
            events = events[: max(0, min(fault.integer("after_chunks", 2), len(events) - 1))]
        elif fault is not None and kind in ("bad_chunk", "bad_utf8", *ERROR_EVENTS):
            at = max(0, min(fault.integer("after_chunks", 2), len(events)))
            if kind in ERROR_EVENTS:
                error = _anthropic_error(*ERROR_EVENTS[fault.kind])
                events = [*events[:at], sse_event(error)]
            else:
                bad_event = b"content_block_delta"
                if kind == "bad_utf8":  # a text delta with bytes that are not UTF-8
                    delta = {"type": "text_delta", "text": "@@"}
                    text = json.dumps({"type": "content_block_delta", "index": 0, "delta": delta})
                    data = text.encode().replace(b"@@", b"\xff\xfe")
                elif fault.params.get("shape") in ("not_json", "deep", "not_object"):
                    depth = fault.integer("depth", BAD_DEPTH)
                    data = bad_chunk(fault.params["shape"], message_id, model, depth)
                elif fault.params.get("shape") == "unknown_block":  # a block of no known type
                    block = {"type": UNKNOWN_BLOCK_TYPE, "data": "oops"}
                    start = {"type": "content_block_start", "index": len(blocks)}
                    data = json.dumps({**start, "content_block": block}).encode()
                    bad_event = b"content_block_start"
                else:  # any other shape: a delta that is not an object
                    data = b'{"type":"content_block_delta","index":0,"delta":"oops"}'
                bad = b"event: " + bad_event + b"\ndata: " + data + b"\n\n"
                events = [*events[:at], bad, *events[at:], *finish(answer.finish_reason)]
        elif fault is not None and kind == "huge_stream":
            size = fault.integer("size", HUGE_STREAM_BYTES)
            events = [events[0], *text_block(0, ["x" * 1000] * (size // 1000 + 1)), *finish("stop")]
        elif fault is not None and kind == "huge_line":
            content = "x" * fault.integer("size", HUGE_LINE_BYTES)
            events = [events[0], *text_block(0, [content]), *finish("stop")]
        elif kind == "length" and answer.tool_calls:
            events = events[:-2]  # the last input piece and its block's stop never come
            events += finish("length")
        elif kind in ("length", "content_filter"):
            events = events[: max(1, len(events) // 2)]
            events += finish(str(kind))
        else:
            events += finish(answer.finish_reason)
        self.send_events(answer, events, fault, pace, max(1, len(events) - 2))

    def send_events(
        self,
        answer: Answer,
        events: list[bytes],
        fault: FaultRequest | None,
        pace: Pace | None,
        deltas: int,
    ) -> None:
        """Send a stream's events (OpenAI chunks or Anthropic events) as the fault says:
        at once, slowed, paced (``latency``: the first ``deltas`` frames spread until L),
        stalled (``keepalive``, ``drip``) or cut (``disconnect``)."""
        kind = fault.kind if fault else None
        delay = answer.scenario.delay_ms / 1000
        if fault is not None and kind == "slow":
            delay += fault.number("delay_ms", 50) / 1000
        head = self.head_bytes(
            200,
            {
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "Transfer-Encoding": "chunked",
            },
        )
        frames = [b"%x\r\n%s\r\n" % (len(event), event) for event in events]
        if kind != "disconnect":
            # "incomplete" ends the body cleanly, unfinished. The end goes out with the last
            # event, as a real server's does: a slowed stream does not wait once more before
            # it (a client that reads the end only briefly after [DONE] keeps its connection)
            end = b"0\r\n\r\n"
            if frames:
                frames[-1] += end
            else:
                frames.append(end)
        if fault is not None and kind in ("keepalive", "drip"):
            self.stall(head, events, fault)
            return
        if pace is not None:
            if self.paced(head, frames, pace.offsets(len(frames), deltas)):
                self.app.count("completions")
            return
        try:
            if delay:
                self.wfile.write(head)
                for frame in frames:
                    if not self.server.sleep(delay):
                        self.drop_connection()
                        return
                    self.wfile.write(frame)
            else:
                self.wfile.write(head + b"".join(frames))
        except OSError:
            self.close_connection = True
            return
        if kind == "disconnect":
            self.drop_connection()  # socket closed mid-body: no finish, no [DONE]
        elif kind is None or kind == "slow":
            self.app.count("completions")

    def paced(self, head: bytes, frames: list[bytes], offsets: list[float]) -> bool:
        """Send each frame when due (the head with the first; frames due together in one
        write), by the server's pacer; this thread finishes a stream the client reads too
        slowly (and a TLS one). False when the client went or the server is closing."""
        start = time.monotonic()
        batches: Frames = []
        for offset, frame in zip(offsets, [head + frames[0], *frames[1:]], strict=True):
            if batches and batches[-1][0] == start + offset:
                batches[-1] = (batches[-1][0], batches[-1][1] + frame)
            else:
                batches.append((start + offset, frame))
        if not isinstance(self.connection, ssl.SSLSocket):
            rest = self.server.pacer.send(self.connection, batches)
            if rest is None:
                self.drop_connection()
                return False
            batches = rest
        try:
            for due, data in batches:
                if not self.server.sleep(due - time.monotonic()):
                    self.drop_connection()
                    return False
                self.wfile.write(data)
        except OSError:
            self.close_connection = True
            return False
        return True

    def stall(self, head: bytes, events: list[bytes], fault: FaultRequest) -> None:
        """``keepalive``: the first ``after_chunks`` events, then a ``: ping`` comment every
        ``delay_ms`` (100), forever. ``drip``: the whole stream, one byte per ``delay_ms``
        (1000), each in its own HTTP chunk. Both end when the client goes or the server
        closes."""
        try:
            if fault.kind == "keepalive":
                delay = fault.number("delay_ms", KEEPALIVE_MS) / 1000
                first = events[: max(0, fault.integer("after_chunks", 2))]
                self.wfile.write(head + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in first))
                self.wfile.flush()
                while self.server.sleep(delay):
                    self.wfile.write(b"8\r\n: ping\n\n\r\n")
                    self.wfile.flush()
            else:
                delay = fault.number("delay_ms", DRIP_MS) / 1000
                self.wfile.write(head)
                self.wfile.flush()
                for byte in b"".join(events):
                    if not self.server.sleep(delay):
                        break
                    self.wfile.write(b"1\r\n%c\r\n" % byte)
                    self.wfile.flush()
                else:
                    self.wfile.write(b"0\r\n\r\n")
                    return
        except OSError:
            pass
        self.drop_connection()


# --- entry points ----------------------------------------------------------------------


def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    scenarios_dir: Path | str | None = None,
    scenarios: Sequence[Scenario] = (),
) -> ServerHandle:
    """Start the model server in a background thread (port 0 picks a free port).

    Scenarios: the built-in ``connectors/dev/servers/scenarios``, then ``scenarios_dir``, then
    ``scenarios``
    (later ones override earlier ones by name). The handle's ``app`` is the ``ModelServerApp``.
    """
    loaded = load_scenarios(BUILTIN_SCENARIOS, scenarios_dir)
    for scenario in scenarios:
        loaded[scenario.name] = scenario
    return start_server(host, port, ModelHandler, ModelServerApp(loaded))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentruns dev model-server",
        description="Scripted OpenAI-compatible model server (SSE streaming, fault injection).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--scenarios", type=Path, default=None, help="extra scenario directory")
    args = parser.parse_args(argv)
    try:
        handle = serve(args.host, args.port, scenarios_dir=args.scenarios)
    except (OSError, ValueError) as exc:  # port in use, unreadable or invalid files
        print(f"error: {exc}", file=sys.stderr)
        return 2
    app = handle.app
    assert isinstance(app, ModelServerApp)
    banner = (
        f"model server listening on {handle.url} (scenarios: {', '.join(sorted(app.scenarios))})"
    )
    return run_until_signal(handle, banner, lambda s: print(s, flush=True))


if __name__ == "__main__":
    from agentruns.connectors.lifecycle import run_command

    raise SystemExit(run_command(main))
