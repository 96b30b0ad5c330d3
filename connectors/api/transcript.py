"""A run's transcript: its conversation as a person reads it, step by step.

Per step: the messages the model saw that were new at that step (the goal, a new goal, a
person's reply; the model's own earlier answers and the tool results are shown where they
happened), each answer of the model (every attempt of the step, the last one being the answer
the run went on with), each tool call with its arguments and its result or error, the questions
asked and the replies given, and the budgets spent by the end of the step. Everything shown is
size-capped: a long content is folded, one over `MAX_SHOWN` cut, with its artifact linked.

The conversation is rebuilt the way the model executor rebuilds it
(`agentruns.connectors.executors.conversation.rebuild`), from the frozen contexts in the
artifact store; the rest comes from the projection's `events`, `operations` and `questions`.
Built from rows and artifacts already read: this module does no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentruns.connectors.executors.base import ExecutorError
from agentruns.connectors.executors.conversation import Conversations, rebuild

#: Characters of a content shown unfolded; a longer one is folded (one click opens it).
FOLD_CHARS = 600
#: Characters of one content shown at most; the rest is in its artifact.
MAX_SHOWN = 16 * 1024
#: Roles of the messages listed as new at a step: the assistant's answers and the tool results
#: are listed at the step that made them.
_SEEN_ROLES = frozenset({"system", "developer", "user"})


@dataclass(frozen=True)
class Shown:
    """A content as shown: its text (cut at `MAX_SHOWN`), whether it is folded, its size."""

    text: str
    size: int
    folded: bool
    cut: bool

    @classmethod
    def of(cls, value: Any) -> Shown:
        text = value if isinstance(value, str) else _pretty(value)
        return cls(text[:MAX_SHOWN], len(text), len(text) > FOLD_CHARS, len(text) > MAX_SHOWN)


@dataclass(frozen=True)
class SeenMessage:
    role: str
    content: Shown


@dataclass(frozen=True)
class ToolCallShown:
    call_id: str
    tool: str
    arguments: Shown
    status: str  # the operation's status, or "not dispatched"
    result: Shown | None
    result_ref: str | None
    error: str | None
    decision: str | None  # the policy's decision (allow, approval, deny)


@dataclass(frozen=True)
class Answer:
    seq: int
    attempt: int
    outcome: str
    content: Shown | None
    tokens: int


@dataclass(frozen=True)
class Exchange:
    """A question asked of a person and the reply given, if any."""

    question_id: str
    kind: str
    status: str
    reply: Shown | None


@dataclass
class Step:
    step: int
    first_seq: int
    last_seq: int
    status: str  # the run's status after the step's last event
    seen: list[SeenMessage] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    tool_calls: list[ToolCallShown] = field(default_factory=list)
    exchanges: list[Exchange] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # other events: type and reason
    tokens_so_far: int = 0
    tool_calls_so_far: int = 0
    failed: bool = False

    @property
    def fork_at(self) -> int:
        """The seq to fork at to ask the model this step's question again: the record before
        the step's first answer (the state then waits for it); a step without one, its last."""
        return self.answers[0].seq - 1 if self.answers else self.last_seq


def build(
    events: Sequence[Mapping[str, Any]],
    operations: Sequence[Mapping[str, Any]],
    questions: Sequence[Mapping[str, Any]],
    contexts: Sequence[tuple[str, Any]],
    artifacts: Mapping[str, Any],
) -> list[Step]:
    """The run's steps, oldest first.

    ``events``: the run's events in seq order (seq, type, step, attempt, disposition, reason,
    status, payload); ``operations`` and ``questions``: its rows of those tables;
    ``contexts``: (ref, step) of its frozen contexts, oldest first (a step may have two: a
    fork's messages come in a context of their own); ``artifacts``: ref -> parsed
    JSON of the contexts and of what they name (candidates, tool results), as far as read."""
    steps: dict[int, Step] = {}
    tokens = calls = 0
    candidates: dict[str, Mapping[str, Any]] = {}  # call id -> the tool call of an answer
    question_step: dict[str, int] = {}
    for e in events:
        number, seq, payload = int(e["step"]), int(e["seq"]), e.get("payload") or {}
        step = steps.get(number)
        if step is None:
            step = steps[number] = Step(number, seq, seq, str(e.get("status", "")))
        step.last_seq, step.status = seq, str(e.get("status", ""))
        kind = e["type"]
        if e.get("disposition") not in (None, "APPLIED"):
            step.notes.append(f"{kind} {str(e.get('disposition')).lower()}: {e.get('reason')}")
            continue
        if kind == "ModelCallCompleted":
            used = _tokens(payload)
            tokens += used
            candidate = payload.get("candidate") if isinstance(payload, Mapping) else None
            content = None
            if isinstance(candidate, Mapping):
                for call in candidate.get("tool_calls") or ():
                    if isinstance(call, Mapping) and isinstance(call.get("id"), str):
                        candidates[call["id"]] = call
                if candidate.get("content"):
                    content = Shown.of(candidate["content"])
            step.answers.append(
                Answer(seq, int(e.get("attempt") or 1), str(payload.get("outcome")), content, used)
            )
        elif kind in ("ToolCallSucceeded", "ToolCallFailed", "ToolCallTimedOut"):
            calls += 1
        elif kind == "UserReplied":
            question_step.setdefault(str(payload.get("question_id")), number)
        elif kind not in ("RunSubmitted", "ToolCallAccepted", "ToolStatusReported"):
            reason = e.get("reason")
            step.notes.append(f"{kind}: {reason}" if reason else kind)
        step.tokens_so_far, step.tool_calls_so_far = tokens, calls
        step.failed = step.status == "FAILED"
    failures = _failures(events)
    for op in sorted(operations, key=lambda o: int(o["seq"])):
        step = steps.get(int(op["step"]))
        if step is None:
            continue
        call = candidates.get(str(op["call_id"])) or {}
        ref = op.get("result_ref")
        result = artifacts.get(ref) if isinstance(ref, str) else None
        step.tool_calls.append(
            ToolCallShown(
                str(op["call_id"]),
                str(op["tool"]),
                Shown.of(_arguments(call.get("arguments_json"))),
                str(op["status"]),
                None if result is None else Shown.of(_output(result)),
                ref if isinstance(ref, str) else None,
                failures.get(str(op["op_key"])) or _error(op),
                op.get("policy_decision"),
            )
        )
    by_seq = {int(e["seq"]): int(e["step"]) for e in events}
    replies = {
        str(e["payload"].get("question_id")): e["payload"].get("response")
        for e in events
        if e["type"] == "UserReplied" and isinstance(e.get("payload"), Mapping)
    }
    for q in questions:
        qid = str(q["question_id"])
        opened = q.get("opened_seq")
        at = by_seq.get(int(opened)) if opened is not None else question_step.get(qid)
        if at is None or at not in steps:
            continue
        reply = None if qid not in replies else Shown.of(replies[qid])
        steps[at].exchanges.append(Exchange(qid, str(q["kind"]), str(q["status"]), reply))
    _add_seen(steps, contexts, artifacts)
    return [steps[n] for n in sorted(steps)]


def artifacts_named(contexts: Iterable[Any], operations: Iterable[Mapping[str, Any]]) -> list[str]:
    """The artifacts a transcript reads besides the contexts: the candidates and inputs the
    contexts name, and the operations' results."""
    refs: list[str] = []
    for doc in contexts:
        if not isinstance(doc, Mapping):
            continue
        if isinstance(doc.get("previous_candidate"), str):
            refs.append(doc["previous_candidate"])
        refs += [
            i for i in doc.get("inputs") or () if isinstance(i, str) and i.startswith("sha256:")
        ]
    refs += [o["result_ref"] for o in operations if isinstance(o.get("result_ref"), str)]
    return sorted(set(refs))


def _add_seen(
    steps: dict[int, Step], contexts: Sequence[tuple[str, Any]], artifacts: Mapping[str, Any]
) -> None:
    """Each step's new messages, from the conversation rebuilt at its context and at the one
    before (a step whose chain is not all read lists none)."""

    def load(refs: Sequence[str]) -> dict[str, Any]:
        return {r: artifacts[r] for r in refs if r in artifacts}

    known = Conversations(size=len(contexts) + 1)
    before = 0
    for ref, number in contexts:
        try:
            messages, _ = rebuild(ref, load, known)
        except (ExecutorError, KeyError, TypeError, ValueError):
            before = 0
            continue
        step = steps.get(number) if isinstance(number, int) else None
        if step is not None:
            step.seen += [
                SeenMessage(str(m.get("role")), Shown.of(m.get("content")))
                for m in messages[before:]
                if m.get("role") in _SEEN_ROLES
            ]
        before = len(messages)


def _failures(events: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """operation key -> what its last failure said."""
    out: dict[str, str] = {}
    for e in events:
        payload = e.get("payload")
        if e["type"] in ("ToolCallFailed", "ToolCallTimedOut") and isinstance(payload, Mapping):
            code = payload.get("error_code") or payload.get("error_class") or e["type"]
            message = payload.get("message")
            out[str(payload.get("operation_key"))] = f"{code}: {message}" if message else str(code)
    return out


def _error(op: Mapping[str, Any]) -> str | None:
    code, kind = op.get("error_code"), op.get("error_class")
    return None if not (code or kind) else f"{kind or ''} {code or ''}".strip()


def _tokens(payload: Mapping[str, Any]) -> int:
    usage = payload.get("usage")
    if not isinstance(usage, Mapping):
        return 0
    try:
        return int(usage.get("input_tokens") or 0) + int(usage.get("output_tokens") or 0)
    except (TypeError, ValueError):
        return 0


def _arguments(text: Any) -> Any:
    if not isinstance(text, str):
        return text if text is not None else "(not recorded)"
    try:
        return json.loads(text)
    except ValueError:
        return text


def _output(result: Any) -> Any:
    """A stored tool result's output (a summarized one's summary)."""
    if isinstance(result, Mapping):
        if "summary" in result and "raw_ref" in result:
            return {"summary": result["summary"], "full result": result["raw_ref"]}
        return result.get("output", result)
    return result


def _pretty(value: Any) -> str:
    try:
        return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(value)


__all__ = ["FOLD_CHARS", "MAX_SHOWN", "Step", "artifacts_named", "build"]
