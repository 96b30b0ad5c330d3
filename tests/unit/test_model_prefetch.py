"""`prefetch_conversations`: a batch of model calls reads its conversations in a few statements,
whatever its size, and each call then rebuilds its conversation from the cache alone, the same
conversation as without the read ahead. Hostile chains (cycles, non-object contexts, missing
artifacts) end the read ahead quietly and leave each call's own errors as they were."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import pytest

from agentruns.connectors.executors.base import ExecutorError
from agentruns.connectors.executors.conversation import (
    PREFETCH_DEPTH,
    Conversations,
    build_conversation,
    prefetch_conversations,
)
from agentruns.processors.effects import CallModel, RepairNote
from agentruns.processors.ids import canonical_json


class Store:
    """Artifacts by ref behind a cache, as the model handler's: a statement is a load that
    missed the cache."""

    def __init__(self) -> None:
        self.artifacts: dict[str, Any] = {}
        self.cache: dict[str, Any] = {}
        self.statements = 0

    def put(self, body: Any) -> str:
        ref = "sha256:" + hashlib.sha256(canonical_json(body).encode()).hexdigest()
        self.artifacts[ref] = body
        return ref

    def load(self, refs: Sequence[str]) -> dict[str, Any]:
        found = {r: self.cache[r] for r in refs if r in self.cache}
        missing = [r for r in refs if r not in self.cache]
        if missing:
            self.statements += 1
            for ref in missing:
                if ref in self.artifacts:
                    found[ref] = self.cache[ref] = self.artifacts[ref]
        return found


def _context(store: Store, run_id: str, step: int, previous: str | None, **named: Any) -> str:
    return store.put(
        {
            "run_id": run_id,
            "step": step,
            "goal": "fix the printer",
            "previous_context": previous,
            "previous_candidate": named.get("candidate"),
            "messages": [{"role": "user", "content": "The printer is offline."}]
            if step == 1
            else [],
            "inputs": named.get("inputs", []),
            "tool_registry": named.get("registry"),
        }
    )


def _run(store: Store, run_id: str, steps: int) -> CallModel:
    """A run at its ``steps``-th model call: each step a candidate with one tool call, and its
    result stored as a summary whose raw output is an artifact of its own."""
    registry = store.put([{"name": "search_docs", "parameters": {"type": "object"}}])
    ref = _context(store, run_id, 1, None, registry=registry)
    for step in range(2, steps + 1):
        call = {"id": f"c{step}", "function": {"name": "search_docs", "arguments": '{"q":"x"}'}}
        message = {"role": "assistant", "content": "", "tool_calls": [{**call, "type": "function"}]}
        candidate = store.put({"message": message, "run": run_id, "n": step})
        raw = store.put({"tool": "search_docs", "arguments": {"q": "x"}, "n": step, "run": run_id})
        result = store.put({"summary": f"hit {step}", "raw_ref": raw})
        ref = _context(
            store, run_id, step, ref, candidate=candidate, inputs=[result], registry=registry
        )
    return _call(run_id, ref, steps)


def _call(run_id: str, context_ref: str, step: int) -> CallModel:
    return CallModel(
        idempotency_key=f"{run_id}:model:{step}:1",
        run_id=run_id,
        step=step,
        attempt=1,
        trace_id=f"trace-{run_id}",
        context_ref=context_ref,
        model_route="default",
    )


@pytest.mark.parametrize("runs", [1, 16, 64])
def test_a_batch_reads_its_conversations_in_a_few_statements_whatever_its_size(runs: int) -> None:
    store = Store()
    effects = [_run(store, f"run-{i}", steps=5) for i in range(runs)]
    ahead = prefetch_conversations(effects, store.load)
    # five levels of contexts, then the candidates, results and registry, then the raw outputs
    assert store.statements == 5 + 2
    for effect in effects:
        # every call rebuilt from what was read ahead alone, however many the cache keeps
        messages, context = build_conversation(effect, _only(ahead))
        assert context["step"] == 5
        assert [m["role"] for m in messages].count("tool") == 4
    assert store.statements == 5 + 2


def _only(ahead: dict[str, Any]) -> Any:
    return lambda refs: {ref: ahead[ref] for ref in refs if ref in ahead}


def test_a_conversation_read_ahead_is_the_one_read_without() -> None:
    store = Store()
    effect = _run(store, "run-a", steps=4)
    alone = build_conversation(effect, _copy(store).load)
    ahead = prefetch_conversations([effect], store.load)
    assert build_conversation(effect, _only(ahead)) == alone


def _copy(store: Store) -> Store:
    other = Store()
    other.artifacts = dict(store.artifacts)
    return other


def test_a_cycle_of_contexts_ends_the_read_ahead() -> None:
    store = Store()
    # two contexts naming each other (content hashes make a real cycle impossible; a forged
    # store row could still hold one)
    store.artifacts["sha256:a"] = {"step": 2, "previous_context": "sha256:b"}
    store.artifacts["sha256:b"] = {"step": 1, "previous_context": "sha256:a"}
    effect = _call("r", "sha256:a", step=2)
    prefetch_conversations([effect], store.load)
    assert store.statements == 2  # each context once; they name nothing else


def test_a_chain_longer_than_the_depth_is_read_ahead_only_that_deep() -> None:
    store = Store()
    effect = _run(store, "run-long", steps=PREFETCH_DEPTH + 3)
    prefetch_conversations([effect], store.load)
    assert store.statements == PREFETCH_DEPTH + 2
    messages, _ = build_conversation(effect, store.load)  # reads the rest itself
    assert [m["role"] for m in messages].count("tool") == PREFETCH_DEPTH + 2


@pytest.mark.parametrize(
    "context",
    [None, "a string", 7, ["a", "list"], {"previous_context": 12, "inputs": []}],
    ids=["missing", "string", "number", "list", "bad-previous"],
)
def test_a_hostile_context_ends_the_read_ahead_and_the_call_fails_as_before(context: Any) -> None:
    store = Store()
    if context is not None:
        store.artifacts["sha256:ctx"] = context
    effect = _call("r", "sha256:ctx", step=1)
    prefetch_conversations([effect], store.load)  # raises nothing
    with pytest.raises(ExecutorError, match="not found"):
        build_conversation(effect, store.load)


def _step(store: Store, run_id: str, previous: str, step: int, registry: str) -> str:
    call = {"id": f"c{step}", "function": {"name": "search_docs", "arguments": '{"q":"x"}'}}
    message = {"role": "assistant", "content": "", "tool_calls": [{**call, "type": "function"}]}
    candidate = store.put({"message": message, "run": run_id, "n": step})
    result = store.put({"tool": "search_docs", "arguments": {"q": "x"}, "output": step})
    return _context(
        store, run_id, step, previous, candidate=candidate, inputs=[result], registry=registry
    )


def test_a_known_conversation_makes_each_step_read_only_its_own_artifacts() -> None:
    """Step by step, as a run goes: each call reads its context and what it names, never the
    chain before it, and gets the conversation a call without the cache gets."""
    store, known = Store(), Conversations()
    registry = store.put([{"name": "search_docs", "parameters": {"type": "object"}}])
    ref = _context(store, "run-k", 1, None, registry=registry)
    build_conversation(_call("run-k", ref, 1), store.load, known)
    for step in range(2, 12):
        ref = _step(store, "run-k", ref, step, registry)
        effect = _call("run-k", ref, step)
        before = store.statements
        ahead = prefetch_conversations([effect], store.load, known)
        assert store.statements - before == 2  # its context, then its candidate and result
        messages, context = build_conversation(effect, _only(ahead), known)
        assert store.statements - before == 2
        assert (messages, context) == build_conversation(effect, _copy(store).load)
        assert [m["role"] for m in messages].count("tool") == step - 1


def test_a_repair_note_is_never_kept_in_the_conversation() -> None:
    store, known = Store(), Conversations()
    effect = _run(store, "run-r", steps=3)
    repaired = CallModel(
        **{f: getattr(effect, f) for f in effect.__struct_fields__ if f != "repair"},
        repair=RepairNote(candidate_ref="sha256:x", error_code="BAD_ARGS", detail="no"),
    )
    with_note, _ = build_conversation(repaired, store.load, known)
    without, _ = build_conversation(effect, store.load, known)
    assert len(with_note) == len(without) + 1
    assert without == build_conversation(effect, _copy(store).load)[0]


def test_a_cycle_of_contexts_is_an_error_not_a_loop() -> None:
    store = Store()
    store.artifacts["sha256:a"] = {"step": 2, "previous_context": "sha256:b"}
    store.artifacts["sha256:b"] = {"step": 1, "previous_context": "sha256:a"}
    with pytest.raises(ExecutorError, match="its own ancestor"):
        build_conversation(_call("r", "sha256:a", step=2), store.load)


def test_a_context_after_the_last_adds_its_messages_to_the_conversation() -> None:
    """A fork's context with messages (`agentruns fork --messages`) follows the source's
    context of the same step: the same conversation, then its messages."""
    store = Store()
    effect = _run(store, "run-m", 3)
    before, _ = build_conversation(effect, store.load)
    added = store.put(
        {
            "run_id": "fork-m",
            "step": 3,
            "goal": "fix the printer",
            "previous_context": effect.context_ref,
            "previous_candidate": None,
            "messages": [{"role": "user", "content": "Use the second floor's printer instead."}],
            "inputs": [],
        }
    )
    forked = effect.model_copy(update={"context_ref": added, "run_id": "fork-m"})
    after, context = build_conversation(forked, store.load)
    assert after == [
        *before,
        {"role": "user", "content": "Use the second floor's printer instead."},
    ]
    assert context["run_id"] == "fork-m"
