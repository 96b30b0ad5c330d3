"""The transcript of a run, built from projection rows and artifacts: steps in order, what the
model saw new at each step, every answer, tool calls with their results or errors, questions
and replies, budgets so far; long contents folded and cut, broken chains listing nothing."""

from __future__ import annotations

import json
from typing import Any

from agentruns.connectors.api.transcript import FOLD_CHARS, MAX_SHOWN, artifacts_named, build

RUN = "run-t"


def _context(
    step: int,
    previous: str | None,
    candidate: str | None,
    inputs: list[str],
    messages: list[dict[str, str]] | None = None,
    goal: str = "find it",
) -> dict[str, Any]:
    return {
        "run_id": RUN,
        "step": step,
        "goal": goal,
        "previous_context": previous,
        "previous_candidate": candidate,
        "messages": messages or [],
        "inputs": inputs,
    }


def _event(
    seq: int, kind: str, step: int, status: str = "RUNNING", **payload: Any
) -> dict[str, Any]:
    return {
        "seq": seq,
        "type": kind,
        "step": step,
        "attempt": payload.pop("attempt", 1),
        "disposition": payload.pop("disposition", "APPLIED"),
        "reason": payload.pop("reason", None),
        "status": status,
        "payload": {"type": kind, **payload},
    }


def _answer(
    seq: int,
    step: int,
    content: str,
    calls: list[tuple[str, str, dict[str, Any]]],
    tokens: tuple[int, int] = (10, 5),
    **extra: Any,
) -> dict[str, Any]:
    candidate = {
        "content": content,
        "tool_calls": [
            {"id": cid, "name": name, "arguments_json": json.dumps(args)}
            for cid, name, args in calls
        ],
    }
    usage = {"input_tokens": tokens[0], "output_tokens": tokens[1], "cost_micros": 0}
    return _event(
        seq,
        "ModelCallCompleted",
        step,
        candidate=candidate,
        usage=usage,
        outcome=extra.pop("outcome", "finished"),
        **extra,
    )


def _run() -> tuple[
    list[dict[str, Any]],
    list[dict[str, Any]],
    list[dict[str, Any]],
    list[tuple[str, Any]],
    dict[str, Any],
]:
    long_text = "x" * (MAX_SHOWN + 100)
    artifacts: dict[str, Any] = {
        "sha256:r1": {"tool": "search", "arguments": {"q": "a"}, "output": {"hits": ["<b>a</b>"]}},
        "sha256:r2": {"tool": "write", "arguments": {"text": "t"}, "output": long_text},
        "sha256:cand1": {
            "content": "searching",
            "tool_calls": [{"id": "c1", "name": "search", "arguments_json": '{"q":"a"}'}],
        },
        "sha256:cand2": {
            "content": "writing",
            "tool_calls": [{"id": "c2", "name": "write", "arguments_json": '{"text":"t"}'}],
        },
    }
    ctx1 = _context(
        1,
        None,
        None,
        [],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "find <script>it</script>"},
        ],
    )
    ctx2 = _context(2, "sha256:ctx1", "sha256:cand1", ["sha256:r1"])
    ctx3 = _context(3, "sha256:ctx2", "sha256:cand2", ["sha256:r2"], goal="find it, then stop")
    artifacts.update({"sha256:ctx1": ctx1, "sha256:ctx2": ctx2, "sha256:ctx3": ctx3})
    events = [
        _event(1, "RunSubmitted", 1, "READY", goal="find it"),
        _answer(2, 1, "", [], outcome="incomplete"),
        _answer(3, 1, "searching", [("c1", "search", {"q": "a"})], attempt=2),
        _event(4, "ToolCallSucceeded", 1, operation_key="op1", result_ref="sha256:r1"),
        _answer(5, 2, "writing", [("c2", "write", {"text": "t"})]),
        _event(
            6,
            "ToolCallFailed",
            2,
            operation_key="op2",
            error_code="boom",
            error_class="TOOL_ERROR",
            message="it broke",
        ),
        _event(7, "UserReplied", 2, question_id="q1", response={"approved": True}),
        _event(8, "ToolCallSucceeded", 2, operation_key="op2", result_ref="sha256:r2"),
        _event(9, "GoalChanged", 3, goal="find it, then stop"),
        _answer(10, 3, "done", [], tokens=(20, 7)),
        _event(
            11, "ModelCallCompleted", 3, "SUCCEEDED", disposition="DUPLICATE", reason="seen already"
        ),
    ]
    operations = [
        {
            "op_key": "op1",
            "step": 1,
            "tool": "search",
            "call_id": "c1",
            "status": "SUCCEEDED",
            "policy_decision": "allow",
            "result_ref": "sha256:r1",
            "error_class": None,
            "error_code": None,
            "seq": 4,
        },
        {
            "op_key": "op2",
            "step": 2,
            "tool": "write",
            "call_id": "c2",
            "status": "SUCCEEDED",
            "policy_decision": "approval",
            "result_ref": "sha256:r2",
            "error_class": None,
            "error_code": None,
            "seq": 8,
        },
    ]
    questions = [
        {
            "question_id": "q1",
            "kind": "approval",
            "status": "answered",
            "opened_seq": 5,
            "closed_seq": 7,
        }
    ]
    contexts = [("sha256:ctx1", 1), ("sha256:ctx2", 2), ("sha256:ctx3", 3)]
    return events, operations, questions, contexts, artifacts


def test_steps_show_what_the_model_saw_answered_and_called_in_order() -> None:
    steps = build(*_run())
    assert [s.step for s in steps] == [1, 2, 3]
    first, second, third = steps
    assert [(m.role, m.content.text) for m in first.seen] == [
        ("system", "be brief"),
        ("user", "find <script>it</script>"),  # escaped by the template, never here
    ]
    assert second.seen == []  # its new messages are the answer and result of step 1
    assert [m.content.text for m in third.seen] == ["New goal: find it, then stop"]
    assert [(a.attempt, a.outcome) for a in first.answers] == [(1, "incomplete"), (2, "finished")]
    assert first.answers[-1].content is not None and first.answers[-1].content.text == "searching"
    (search,) = first.tool_calls
    assert (search.tool, search.status, search.error) == ("search", "SUCCEEDED", None)
    assert json.loads(search.arguments.text) == {"q": "a"}
    assert search.result is not None and json.loads(search.result.text) == {"hits": ["<b>a</b>"]}
    (write,) = second.tool_calls
    assert write.error == "boom: it broke" and write.decision == "approval"
    assert [(x.question_id, x.kind) for x in second.exchanges] == [("q1", "approval")]
    assert second.exchanges[0].reply is not None and "true" in second.exchanges[0].reply.text
    assert first.tokens_so_far == 30 and third.tokens_so_far == 72
    assert (first.tool_calls_so_far, second.tool_calls_so_far) == (1, 3)
    assert third.status == "SUCCEEDED" and (third.first_seq, third.last_seq) == (9, 11)
    assert "GoalChanged" in third.notes and any("duplicate" in n for n in third.notes)


def test_a_long_content_is_folded_and_one_over_the_limit_cut() -> None:
    steps = build(*_run())
    result = steps[1].tool_calls[0].result
    assert result is not None and result.folded and result.cut
    assert len(result.text) == MAX_SHOWN and result.size == MAX_SHOWN + 100
    short = steps[0].tool_calls[0].arguments
    assert not short.folded and not short.cut and len(short.text) < FOLD_CHARS


def test_missing_artifacts_and_a_broken_chain_list_no_messages_and_no_results() -> None:
    events, operations, questions, contexts, artifacts = _run()
    del artifacts["sha256:ctx1"], artifacts["sha256:r1"]
    steps = build(events, operations, questions, contexts, artifacts)
    assert all(s.seen == [] for s in steps)
    assert steps[0].tool_calls[0].result is None
    assert steps[0].tool_calls[0].result_ref == "sha256:r1"  # still linked


def test_rows_of_unexpected_shape_do_not_break_the_transcript() -> None:
    events = [
        _event(1, "RunSubmitted", 1),
        {
            **_event(2, "ModelCallCompleted", 1),
            "payload": {"candidate": "not an object", "usage": {"input_tokens": "x"}},
        },
        _event(3, "ToolCallFailed", 1),
    ]
    operations = [
        {"op_key": "op9", "step": 7, "tool": "t", "call_id": "c9", "status": "X", "seq": 3}
    ]
    questions = [{"question_id": "q9", "kind": "input", "status": "open", "opened_seq": 99}]
    steps = build(events, operations, questions, [("sha256:nothing", 1)], {})
    assert len(steps) == 1 and steps[0].answers[0].content is None
    assert steps[0].tokens_so_far == 0 and steps[0].tool_calls == [] and steps[0].exchanges == []


def test_the_artifacts_to_read_are_the_candidates_inputs_and_results_named() -> None:
    _, operations, _, _, artifacts = _run()
    docs = [artifacts["sha256:ctx2"], artifacts["sha256:ctx3"], "not a document"]
    assert artifacts_named(docs, operations) == [
        "sha256:cand1",
        "sha256:cand2",
        "sha256:r1",
        "sha256:r2",
    ]


def test_a_second_context_of_a_step_adds_its_messages_to_that_step() -> None:
    """A fork that adds messages where it asks the model writes a context of its own for the
    same step: its messages join what the model saw at that step, after the others."""
    events, operations, questions, contexts, artifacts = _run()
    added = [{"role": "user", "content": "try the other queue"}]
    artifacts["sha256:ctx3b"] = _context(3, "sha256:ctx3", None, [], added, "find it, then stop")
    steps = build(events, operations, questions, [*contexts, ("sha256:ctx3b", 3)], artifacts)
    assert [m.content.text for m in steps[2].seen] == [
        "New goal: find it, then stop",
        "try the other queue",
    ]
