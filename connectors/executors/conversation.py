"""The conversation a model call sees, rebuilt from its frozen context chain (R7).

A frozen context names the context of the step before (``previous_context``), that step's
candidate (``previous_candidate``) and the step's inputs (tool results, notes). The
conversation is the first context's messages, then per later step the assistant message of the
previous candidate, one ``tool`` message per tool call (matched to the results among the
inputs), a new goal if the goal changed, and the messages a later context adds (a fork's,
`agentruns fork --messages`). The model executor sends it; the console's
transcript shows it step by step.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentruns.connectors.executors.base import ExecutorError
from agentruns.processors.effects import CallModel
from agentruns.processors.ids import canonical_json


def assistant_message(candidate: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant message of a stored candidate (this module's format or the core's)."""
    if isinstance(candidate.get("message"), Mapping):
        return dict(candidate["message"])
    message: dict[str, Any] = {"role": "assistant", "content": candidate.get("content", "")}
    calls = candidate.get("tool_calls") or ()
    if calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c.get("arguments_json", "{}")},
            }
            for c in calls
        ]
    return message


def _canonical_args(text: Any) -> str | None:
    if text is None:
        return None
    try:
        return canonical_json(json.loads(text) if isinstance(text, str) else text)
    except ValueError:
        return None


@dataclass
class _Result:
    tool: str | None
    args: str | None
    content: str
    used: bool = False


def tool_messages(
    calls: Sequence[Mapping[str, Any]],
    inputs: Sequence[str],
    artifacts: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """One ``tool`` message per call of an assistant message, from the next step's inputs.

    ``artifacts`` maps refs to parsed JSON (tool results, summaries and their raw outputs).
    Results are matched to calls by tool name and canonical arguments, then by tool name;
    notes (``failed:<tool>:...``) answer calls without a result."""
    results: list[_Result] = []
    for item in inputs:
        if item.startswith("sha256:"):
            data = artifacts.get(item)
            if not isinstance(data, Mapping):
                results.append(_Result(None, None, f"(artifact {item} not found)"))
                continue
            if "raw_ref" in data and "summary" in data:
                raw = artifacts.get(data["raw_ref"])
                raw = raw if isinstance(raw, Mapping) else {}
                content = canonical_json(
                    {"summary": data["summary"], "raw_ref": data["raw_ref"], "large_output": True}
                )
                results.append(
                    _Result(raw.get("tool"), _canonical_args(raw.get("arguments")), content)
                )
                continue
            output = data.get("output", data)
            content = output if isinstance(output, str) else canonical_json(output)
            results.append(
                _Result(data.get("tool"), _canonical_args(data.get("arguments")), content)
            )
        else:
            parts = item.split(":")
            tool = parts[1] if len(parts) > 1 else None
            results.append(_Result(tool, None, canonical_json({"note": item})))
    messages = []
    for call in calls:
        function = call.get("function") or {}
        name, args = function.get("name"), _canonical_args(function.get("arguments"))
        match = next((r for r in results if not r.used and r.tool == name and r.args == args), None)
        match = match or next((r for r in results if not r.used and r.tool == name), None)
        match = match or next((r for r in results if not r.used and r.tool is None), None)
        if match is not None:
            match.used = True
        content = match.content if match is not None else '{"note":"no result recorded"}'
        messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": content})
    return messages


Loader = Callable[[Sequence[str]], dict[str, Any]]

#: How many levels of context chains `prefetch_conversations` reads for a batch; a call whose
#: chain is longer reads the rest itself.
PREFETCH_DEPTH = 64


def _named(contexts: Sequence[Mapping[str, Any]]) -> list[str]:
    """The artifacts frozen contexts name: the previous candidates and the stored inputs."""
    needed = [c["previous_candidate"] for c in contexts if c.get("previous_candidate")]
    needed += [i for c in contexts for i in c.get("inputs") or () if i.startswith("sha256:")]
    return needed


def _raw_refs(found: Mapping[str, Any]) -> list[str]:
    """The raw answers that loaded artifacts (tool results stored apart) point to."""
    return [v["raw_ref"] for v in found.values() if isinstance(v, Mapping) and "raw_ref" in v]


@dataclass(frozen=True)
class Conversation:
    """The conversation up to and with one frozen context: its messages (the dicts shared with
    the conversations after it, never changed), the goal then, and the context itself."""

    messages: tuple[dict[str, Any], ...]
    goal: Any
    context: dict[str, Any]


class Conversations:
    """Conversations by the ref of their last frozen context (bounded LRU, thread-safe).

    A step's conversation is the previous step's plus what the step added (the candidate's
    assistant message, the tool results, a new goal), and artifacts never change: with the
    previous step's conversation known, a call reads only its own step's artifacts instead of
    its whole chain (rebuilding every chain made a run's calls quadratic in its steps)."""

    def __init__(self, size: int = 8192) -> None:
        self._size = size
        self._items: OrderedDict[str, Conversation] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, ref: str) -> Conversation | None:
        with self._lock:
            found = self._items.get(ref)
            if found is not None:
                self._items.move_to_end(ref)
            return found

    def put(self, ref: str, conversation: Conversation) -> None:
        with self._lock:
            self._items[ref] = conversation
            self._items.move_to_end(ref)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def __contains__(self, ref: object) -> bool:
        with self._lock:
            return ref in self._items


def prefetch_conversations(
    effects: Sequence[CallModel], load: Loader, known: Conversations | None = None
) -> dict[str, Any]:
    """What `build_conversation` reads for each call of a batch, one statement at a time,
    loaded for the whole batch in a few: the context chains a level at a time (down to a
    context whose conversation is ``known``), then the candidates, inputs and tool registries
    they name, then the raw answers of those."""
    ahead: dict[str, Any] = {}
    seen: set[str] = set()
    refs = {e.context_ref for e in effects if known is None or e.context_ref not in known}
    for _ in range(PREFETCH_DEPTH):
        refs -= seen
        if not refs:
            break
        seen |= refs
        level = load(sorted(refs))
        ahead.update(level)
        contexts = [c for c in level.values() if isinstance(c, Mapping)]
        refs = {
            c["previous_context"]
            for c in contexts
            if isinstance(c.get("previous_context"), str)
            and (known is None or c["previous_context"] not in known)
        }
    contexts = [c for c in ahead.values() if isinstance(c, Mapping)]
    if known is not None:
        for effect in effects:
            conversation = known.get(effect.context_ref)
            if conversation is not None:
                contexts.append(conversation.context)
    registries = [c["tool_registry"] for c in contexts if isinstance(c.get("tool_registry"), str)]
    found = load(_named([c for c in contexts if c.get("previous_context")]) + registries)
    ahead.update(found)
    raws = _raw_refs(found)
    if raws:
        ahead.update(load(raws))
    return ahead


def build_conversation(
    effect: CallModel, load: Loader, known: Conversations | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, current context) of a model call: its context's conversation (`rebuild`),
    and its repair note, if any, as a last user message."""
    messages, current = rebuild(effect.context_ref, load, known)
    if effect.repair is not None:
        messages.append(
            {
                "role": "user",
                "content": (
                    f"Your previous answer was rejected ({effect.repair.error_code}): "
                    f"{effect.repair.detail}. Answer again; call tools only with arguments "
                    "that match their schemas."
                ),
            }
        )
    return messages, current


def rebuild(
    context_ref: str, load: Loader, known: Conversations | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, current context) rebuilt from the frozen context chain (R7), from the last
    context whose conversation is ``known`` on (and every step's added to it)."""
    chain: list[tuple[str, dict[str, Any]]] = []
    base: Conversation | None = None
    ref: str | None = context_ref
    while ref is not None:
        if known is not None and (base := known.get(ref)) is not None:
            break
        if any(ref == seen for seen, _ in chain):
            raise ExecutorError(f"context artifact {ref} is its own ancestor")
        context = load([ref]).get(ref)
        if not isinstance(context, dict):
            raise ExecutorError(f"context artifact {ref} not found", retryable=True)
        chain.append((ref, context))
        ref = context.get("previous_context")
    chain.reverse()
    if base is None:
        first_ref, first = chain.pop(0)
        messages: list[dict[str, Any]] = [
            {"role": m["role"], "content": m["content"]} for m in first.get("messages") or ()
        ]
        if not any(m["role"] == "user" for m in messages):
            messages.append({"role": "user", "content": first.get("goal", "")})
        base = Conversation(tuple(messages), first.get("goal"), first)
        if known is not None:
            known.put(first_ref, base)
    messages, goal, current = list(base.messages), base.goal, base.context
    found = load(_named([c for _, c in chain])) if chain else {}
    raws = _raw_refs(found)
    if raws:
        found.update(load(raws))
    for ref, current in chain:
        candidate = found.get(current.get("previous_candidate") or "")
        calls: list[Mapping[str, Any]] = []
        if isinstance(candidate, Mapping):
            assistant = assistant_message(candidate)
            calls = list(assistant.get("tool_calls") or ())
            messages.append(assistant)
        inputs = list(current.get("inputs") or ())
        messages.extend(tool_messages(calls, inputs, found))
        if not calls and inputs:
            messages.append({"role": "user", "content": canonical_json({"results": inputs})})
        if current.get("goal") and current.get("goal") != goal:
            goal = current["goal"]
            messages.append({"role": "user", "content": f"New goal: {goal}"})
        # messages a later context adds (a fork's, `agentruns fork --messages`)
        for m in current.get("messages") or ():
            if isinstance(m, Mapping):
                messages.append({"role": m.get("role"), "content": m.get("content")})
        if known is not None:
            known.put(ref, Conversation(tuple(messages), goal, current))
    return messages, current


__all__ = [
    "PREFETCH_DEPTH",
    "Conversation",
    "Conversations",
    "Loader",
    "assistant_message",
    "build_conversation",
    "prefetch_conversations",
    "rebuild",
    "tool_messages",
]
