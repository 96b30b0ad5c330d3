"""Forks in the pure core: a fork is fold-exact, and a failed run is resumed before its failure.

Fold-exact: for a generated run, a fork at any seq with no edit, fed the source's later inputs
(addressed to the fork), goes through the source's later states, byte for byte once the fork's
own names are read as the source's (its run id, trace id, and the keys, timer ids, question ids
and artifact refs it derives from them). The renaming is learned from what both sides emit
and checked to be one to one, so it cannot hide a difference.
"""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentruns.connectors.dev.servers.workload import simulate, submitted
from agentruns.processors.effects import CallModel, CallTool, Effect, ScheduleTimer
from agentruns.processors.events import (
    CancelRequested,
    Candidate,
    Event,
    ForkedFrom,
    ModelCallCompleted,
    ModelOutcome,
    RunSubmitted,
    ToolCallFailed,
    ToolCallRequest,
    ToolCallSucceeded,
    parse_event,
)
from agentruns.processors.ids import content_ref, submit_event_id
from agentruns.processors.lineage import (
    Folded,
    ForkError,
    folded,
    fork_record,
    resume_point,
    state_at,
)
from agentruns.processors.state import (
    IN_FLIGHT,
    Budgets,
    ErrorClass,
    ForkEdits,
    Lineage,
    Message,
    OpStatus,
    ReplacedInput,
    RunState,
    RunStatus,
    TimerPurpose,
)
from agentruns.processors.transition import Artifact, Disposition, transition

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
seeds = st.integers(min_value=0, max_value=2**32 - 1)
chaos_levels = st.sampled_from([0.0, 0.1, 0.3])


class Names:
    """A one-to-one renaming of the source's names to the fork's."""

    def __init__(self) -> None:
        self.full: dict[str, str] = {}
        self.back: dict[str, str] = {}
        self.prefixes: dict[str, str] = {}

    def pair(self, source: str | None, fork: str | None) -> None:
        if source is None or fork is None or source == fork:
            assert source == fork or (source is not None and fork is not None)
            return
        assert self.full.get(source, fork) == fork, f"{source} named twice"
        assert self.back.get(fork, source) == source, f"{fork} names two source names"
        self.full[source] = fork
        self.back[fork] = source
        if len(source) == 64:  # a key: core texts quote its first 16 characters
            self.prefixes[source[:16]] = fork[:16]

    def _text(self, text: str) -> str:
        if text in self.full:
            return self.full[text]
        for old, new in self.prefixes.items():
            if old in text:
                text = text.replace(old, new)
        return text

    def _value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._text(value)
        if isinstance(value, list):
            return [self._value(v) for v in value]
        if isinstance(value, dict):
            return {k: self._value(v) for k, v in value.items()}
        return value

    def json(self, text: str) -> Any:
        return self._value(msgspec.json.decode(text))

    def event(self, event: Event) -> Event:
        return parse_event(msgspec.json.encode(self.json(event.model_dump_json())))

    def states(self, source: RunState, fork: RunState) -> None:
        """Learn the names the fork's state gives what the source's state holds."""
        assert len(source.ops) == len(fork.ops)
        for a, b in zip(source.ops, fork.ops, strict=True):
            self.pair(a.key, b.key)
        assert len(source.timers) == len(fork.timers)
        for ta, tb in zip(source.timers, fork.timers, strict=True):
            self.pair(ta.timer_id, tb.timer_id)
        if source.question is not None and fork.question is not None:
            self.pair(source.question.question_id, fork.question.question_id)
            self.pair(source.question.token_id, fork.question.token_id)

    def effects(self, source: tuple[Effect, ...], fork: tuple[Effect, ...]) -> None:
        assert [type(e) for e in source] == [type(e) for e in fork]
        for a, b in zip(source, fork, strict=True):
            self.pair(a.idempotency_key, b.idempotency_key)
            if isinstance(a, CallTool) and isinstance(b, CallTool):
                self.pair(a.operation.key, b.operation.key)
            for name in ("timer_id", "question_id", "token_id"):
                self.pair(getattr(a, name, None), getattr(b, name, None))
        for a, b in zip(source, fork, strict=True):
            assert self.json(a.model_dump_json()) == msgspec.json.decode(b.model_dump_json())

    def artifacts(self, source: tuple[Artifact, ...], fork: tuple[Artifact, ...]) -> None:
        assert len(source) == len(fork)
        for a, b in zip(source, fork, strict=True):
            self.pair(a.ref, b.ref)
        for a, b in zip(source, fork, strict=True):
            assert self.json(a.content) == msgspec.json.decode(b.content)

    def same(self, source: RunState, fork: RunState) -> None:
        """Byte for byte, but for the fork's lineage (the one thing a fork adds)."""
        fork = msgspec.structs.replace(fork, forked_from=source.forked_from)
        assert self.json(source.to_json()) == msgspec.json.decode(fork.to_json())


def source_log(seed: int, chaos: float) -> list[Folded]:
    events = simulate(
        random.Random(seed), f"run-{seed}", steps=3, chaos=chaos, faults=0.25, max_events=90
    )
    return folded(enumerate(events, start=1))


def _check_fork(log: list[Folded], k: int) -> None:
    entry = log[k]
    source = entry.state
    assert source is not None
    fork_id = f"fork-{k}-of-{source.run_id}"
    record = fork_record(log, entry.seq, run_id=fork_id, at=0)
    start = transition(None, record)
    if source.cancel_requested and not source.terminal:
        assert start.disposition is Disposition.REJECTED and start.state is None
        return
    assert start.disposition is Disposition.APPLIED and start.state is not None
    fork = start.state
    assert fork.run_id == fork_id and fork.submitted_event_id == submit_event_id(fork_id)
    assert fork.forked_from == Lineage(source_run_id=source.run_id, source_seq=entry.seq)
    # the record alone explains the fork: the same record starts the same fork
    assert transition(None, parse_event(record.model_dump_json())).state == fork
    waiting = {o.key for o in source.ops if o.status in (OpStatus.ACCEPTED, OpStatus.RUNNING)}
    if waiting:
        # the backend holds those under the source's keys: the fork dispatches them again
        sent = {e.operation.key for e in start.effects if isinstance(e, CallTool)}
        for a, b in zip(source.ops, fork.ops, strict=True):
            if a.key in waiting:
                assert b.status is OpStatus.DISPATCHED and b.polls == 0
                assert b.key in sent or source.terminal
        return
    names = Names()
    names.pair(source.run_id, fork_id)
    names.pair(source.trace_id, fork.trace_id)
    names.pair(source.submitted_event_id, fork.submitted_event_id)
    names.states(source, fork)
    names.same(source, fork)
    # what the source waits on is asked for again, under the fork's keys: nothing else
    calls = [e for e in start.effects if isinstance(e, CallTool)]
    dispatched = [o for o in fork.ops if o.status is OpStatus.DISPATCHED]
    if fork.terminal:
        assert not start.effects
    else:
        assert [c.operation.key for c in calls] == [o.key for o in dispatched]
    models = [e for e in start.effects if isinstance(e, CallModel)]
    assert len(models) == (1 if fork.status is RunStatus.MODEL_RUNNING else 0)
    source_keys = {o.key for o in source.ops}
    assert not source_keys & {o.key for o in fork.ops}
    before = source
    for later in log[k + 1 :]:
        moved = transition(fork, names.event(later.event))
        original = transition(before, later.event)
        assert moved.disposition is original.disposition is later.disposition
        if original.state is None or moved.state is None:
            assert original.state is moved.state is None
            break
        names.states(original.state, moved.state)
        names.artifacts(original.artifacts, moved.artifacts)
        names.effects(original.effects, moved.effects)
        names.same(original.state, moved.state)
        fork, before = moved.state, original.state
    assert before == log[-1].state


@SETTINGS
@given(seeds, chaos_levels)
def test_fork_at_every_seq_is_fold_exact(seed: int, chaos: float) -> None:
    log = source_log(seed, chaos)
    for k in range(len(log)):
        _check_fork(log, k)


def test_a_fork_twice_with_one_key_is_one_fork() -> None:
    log = source_log(7, 0.0)
    record = fork_record(log, 3, run_id="fork-once", at=0)
    fork = transition(None, record).state
    again = transition(fork, record)
    assert again.disposition is Disposition.DUPLICATE and again.state is fork


def test_a_fork_with_another_route_calls_that_route() -> None:
    log = source_log(11, 0.0)
    at_model = next(
        e for e in log if e.state is not None and e.state.status is RunStatus.MODEL_RUNNING
    )
    record = fork_record(
        log, at_model.seq, run_id="fork-route", at=0, edits=ForkEdits(model_route="other")
    )
    start = transition(None, record)
    assert start.state is not None and start.state.config.model_route == "other"
    source = at_model.state
    assert source is not None
    assert start.state.config.config_ref != source.config.config_ref
    assert [a.ref for a in start.artifacts] == [start.state.config.config_ref]
    (call,) = [e for e in start.effects if isinstance(e, CallModel)]
    assert call.model_route == "other" and call.run_id == "fork-route"


def test_forks_refuse_what_they_cannot_be() -> None:
    log = source_log(5, 0.0)
    with pytest.raises(ForkError, match="outside"):
        state_at(log, len(log) + 1)
    with pytest.raises(ForkError, match="outside"):
        state_at(log, 0)
    with pytest.raises(ForkError, match="own"):
        fork_record(log, 2, run_id=log[0].event.run_id, at=0)
    with pytest.raises(ForkError, match="no records"):
        state_at([], 1)
    # a forged record naming the fork's own run as its state is refused by the core too
    record = fork_record(log, 2, run_id="fork-x", at=0)
    forged = record.model_copy(update={"run_id": record.state.run_id})
    assert transition(None, forged).disposition is Disposition.REJECTED
    # and one whose state is not the run it names as its source
    forged = record.model_copy(update={"source_run_id": "run-other"})
    assert transition(None, forged).disposition is Disposition.REJECTED


def test_a_fork_of_a_fork_of_a_fork_names_its_direct_source() -> None:
    log = source_log(3, 0.0)
    chain: list[Folded] = log
    for generation in range(3):
        run_id = f"fork-{generation}"
        record = fork_record(chain, chain[-1].seq if generation else 2, run_id=run_id, at=0)
        assert record.source_run_id == chain[0].event.run_id
        fork = transition(None, record).state
        assert fork is not None and fork.run_id == run_id
        assert isinstance(fork.forked_from, Lineage)
        assert fork.forked_from.source_run_id == record.source_run_id  # the direct source
        chain = folded([(1, record)])


# -- resume


def _run(run_id: str, failures: list[ToolCallFailed | None]) -> list[tuple[int, Event]]:
    """A run whose one tool call fails as told, then succeeds."""
    events: list[Event] = [submitted(run_id, at=1_000)]
    state = transition(None, events[0]).state
    n = 0

    def ids() -> dict[str, Any]:
        nonlocal n
        n += 1
        return {"run_id": run_id, "event_id": f"e{n}", "at": 1_000 + n, "trace_id": "t"}

    call = ToolCallRequest(id="c0", name="search", arguments_json='{"query":"x"}')
    candidate = Candidate(tool_calls=(call,))
    model = ModelCallCompleted(
        **ids(),
        step=1,
        attempt=1,
        outcome=ModelOutcome.FINISHED,
        candidate=candidate,
        candidate_ref=content_ref(candidate.model_dump_json()),
    )
    result = transition(state, model)
    events.append(model)
    for failure in failures:
        (effect,) = [e for e in result.effects if isinstance(e, CallTool)]
        op = effect.operation
        event: Event
        if failure is None:
            event = ToolCallSucceeded(
                **ids(), step=1, operation_key=op.key, dispatch=op.dispatch, result_ref="sha256:r"
            )
        else:
            event = failure.model_copy(
                update={**ids(), "step": 1, "operation_key": op.key, "dispatch": op.dispatch}
            )
        assert result.state is not None
        result = transition(result.state, event)
        events.append(event)
        if result.state is None or result.state.terminal:
            break
    return list(enumerate(events, start=1))


FAIL = ToolCallFailed(
    run_id="x",
    event_id="x",
    at=0,
    trace_id="t",
    step=1,
    operation_key="k",
    error_class=ErrorClass.TRANSIENT,
    error_code="E_BUG",
)


def test_resume_forks_before_the_first_failure_of_the_failed_call() -> None:
    log = folded(_run("run-r", [FAIL, FAIL, FAIL]))
    final = log[-1].state
    assert final is not None and final.status is RunStatus.FAILED
    seq = resume_point(log)
    assert seq == 2  # after the model's answer, before the first of the three failures
    at = state_at(log, seq)
    assert at.status is RunStatus.TOOL_RUNNING
    assert [o.status for o in at.ops] == [OpStatus.DISPATCHED] and at.ops[0].dispatch == 1
    start = transition(None, fork_record(log, seq, run_id="run-r2", at=0))
    (call,) = [e for e in start.effects if isinstance(e, CallTool)]
    assert call.operation.key != at.ops[0].key
    # nothing before the failure is asked again: no model call, the one tool call (and the
    # deadline timer, re-armed under the fork's id)
    assert sorted(type(e).__name__ for e in start.effects) == ["CallTool", "ScheduleTimer"]


def test_resume_refuses_what_did_not_fail() -> None:
    running = folded(_run("run-ok", []))
    with pytest.raises(ForkError, match="still running"):
        resume_point(running)
    assert all(o.status in IN_FLIGHT for o in state_at(running, 2).ops)
    with pytest.raises(ForkError, match="no state"):
        resume_point([])


def test_resume_after_a_stop_without_a_failed_call_forks_before_the_stop() -> None:
    log = source_log(5, 0.0)
    final = log[-1].state
    assert final is not None
    if final.status is RunStatus.SUCCEEDED:
        with pytest.raises(ForkError, match="SUCCEEDED"):
            resume_point(log)
    record = ForkedFrom.model_validate_json(fork_record(log, 1, run_id="f", at=0).model_dump_json())
    assert record.source_seq == 1


# -- replaced inputs


def _replacing(seq: int, event: Event) -> ForkEdits:
    return ForkEdits(replaced_inputs=(ReplacedInput(seq=seq, event=event.model_dump_json()),))


def test_a_fork_folds_the_source_with_the_inputs_it_replaces() -> None:
    records = _run("run-x", [FAIL, FAIL, FAIL])
    log = folded(records)
    first_failure = records[2][1]
    assert isinstance(first_failure, ToolCallFailed)
    success = ToolCallSucceeded(
        run_id="run-x",
        event_id="e-fixed",
        at=first_failure.at,
        trace_id="t",
        step=1,
        operation_key=first_failure.operation_key,
        result_ref="sha256:" + "f" * 64,
    )
    record = fork_record(log, 3, run_id="fork-x", at=0, edits=_replacing(3, success))
    assert record.state.status is RunStatus.MODEL_RUNNING and record.state.step == 2
    assert record.state.completed_ops == 1  # the call counts as done, its result kept
    assert record.state.result_refs == ("sha256:" + "f" * 64,)
    start = transition(None, record)
    assert start.state is not None and start.state.forked_from == Lineage(
        source_run_id="run-x", source_seq=3, edits=record.edits
    )
    # the new step's context was made by the fold, not by the source's processor: the record
    # carries it, and the core hands it to the processor to store (a forged one is refused)
    assert record.state.context_ref in {a.ref for a in record.artifacts}
    assert record.state.context_ref in {a.ref for a in start.artifacts}
    forged = record.artifacts[0].model_copy(update={"content": "{}"})
    bad = record.model_copy(update={"artifacts": (forged,)})
    assert transition(None, bad).disposition is Disposition.REJECTED
    # the tool is not called again: its answer is the replacement; the model is asked step 2
    assert [type(e) for e in start.effects if not isinstance(e, ScheduleTimer)] == [CallModel]
    # the same record in place of itself: the state of a fork without the edit
    same = fork_record(log, 3, run_id="fork-y", at=0, edits=_replacing(3, first_failure))
    assert same.state == state_at(log, 3)


def test_replaced_inputs_that_cannot_be_are_refused() -> None:
    records = _run("run-z", [FAIL, FAIL, FAIL])
    log = folded(records)
    failure = records[2][1]
    other = failure.model_copy(update={"run_id": "run-other"})
    for edits, reason in (
        (_replacing(4, failure), "not at or before the fork point"),
        (_replacing(1, failure), "first record"),
        (_replacing(3, other), "another run"),
        (
            ForkEdits(replaced_inputs=(ReplacedInput(seq=3, event='{"type": "Nothing"}'),)),
            "not an event",
        ),
        (
            ForkEdits(
                replaced_inputs=(
                    ReplacedInput(seq=2, event=failure.model_dump_json()),
                    ReplacedInput(seq=2, event=failure.model_dump_json()),
                )
            ),
            "twice",
        ),
    ):
        with pytest.raises(ForkError, match=reason):
            fork_record(log, 3, run_id="fork-z", at=0, edits=edits)


def test_a_fork_with_messages_asks_the_model_again_with_them() -> None:
    log = source_log(11, 0.0)
    at_model = next(
        e for e in log if e.state is not None and e.state.status is RunStatus.MODEL_RUNNING
    )
    source = at_model.state
    assert source is not None
    note = Message(role="user", content="Look in the archive too.")
    edits = ForkEdits(messages=(note,))
    start = transition(None, fork_record(log, at_model.seq, run_id="fork-msg", at=0, edits=edits))
    assert start.state is not None and start.state.context_ref != source.context_ref
    (call,) = [e for e in start.effects if isinstance(e, CallModel)]
    assert call.context_ref == start.state.context_ref and (call.step, call.attempt) == (
        source.step,
        source.attempt,
    )
    (context,) = [json.loads(a.content) for a in start.artifacts if a.ref == call.context_ref]
    assert context["previous_context"] == source.context_ref
    assert context["messages"] == [note.model_dump()] and context["inputs"] == []
    # anywhere else the model is not being asked: refused
    elsewhere = next(
        e for e in log if e.state is not None and e.state.status is not RunStatus.MODEL_RUNNING
    )
    with pytest.raises(ForkError, match="where the model is asked"):
        fork_record(log, elsewhere.seq, run_id="fork-msg2", at=0, edits=edits)
    plain = fork_record(log, elsewhere.seq, run_id="fork-msg2", at=0)
    refused = transition(None, plain.model_copy(update={"edits": edits}))  # forged: the core
    assert refused.disposition is Disposition.REJECTED and "messages" in (refused.reason or "")


# -- raised budgets


def _budget_stopped(run_id: str) -> list[Folded]:
    """A run submitted with one step, stopped by its budget when its first tool result asks
    for a second model call."""
    records = _run(run_id, [None])
    first = records[0][1]
    assert isinstance(first, RunSubmitted)
    one_step = first.model_copy(update={"budgets": Budgets(deadline_at=90_000, max_steps=1)})
    return folded([(1, one_step), *records[1:]])


def test_a_resume_with_a_raised_budget_goes_on_where_the_budget_stopped_the_run() -> None:
    log = _budget_stopped("run-b")
    final = log[-1].state
    assert final is not None and final.status is RunStatus.BUDGET_EXHAUSTED
    seq = resume_point(log)
    before = state_at(log, seq)
    # without more budget the fork stops where the source stopped
    same = transition(None, fork_record(log, seq, run_id="run-b1", at=2_000))
    assert same.state is not None
    assert transition(same.state, _rekeyed_last(log, same.state)).state.status is (
        RunStatus.BUDGET_EXHAUSTED
    )
    raised = Budgets(deadline_at=90_000, max_steps=5)
    start = transition(
        None, fork_record(log, seq, run_id="run-b2", at=2_000, edits=ForkEdits(budgets=raised))
    )
    assert start.disposition is Disposition.APPLIED and start.state is not None
    assert start.state.config.budgets == raised
    assert start.state.config.config_ref != before.config.config_ref  # the frozen config re-made
    assert [a.ref for a in start.artifacts] == [start.state.config.config_ref]
    after = transition(start.state, _rekeyed_last(log, start.state))
    assert after.state is not None and after.state.status is RunStatus.MODEL_RUNNING
    assert any(isinstance(e, CallModel) for e in after.effects)


def _rekeyed_last(log: list[Folded], fork: RunState) -> Event:
    """The source's last input (its tool result), addressed to the fork's operation."""
    last = log[-1].event
    assert isinstance(last, ToolCallSucceeded)
    (op,) = fork.ops
    return last.model_copy(
        update={"run_id": fork.run_id, "event_id": "again", "operation_key": op.key}
    )


def test_a_fork_never_lowers_a_budget_and_a_new_deadline_lies_ahead() -> None:
    log = _budget_stopped("run-c")
    seq = resume_point(log)
    lowered = ForkEdits(budgets=Budgets(deadline_at=90_000, max_steps=0))
    with pytest.raises(ForkError, match="never lowers them: max_steps 0 < 1"):
        fork_record(log, seq, run_id="run-c1", at=2_000, edits=lowered)
    # the core refuses it too (a record made by another writer)
    record = fork_record(log, seq, run_id="run-c1", at=2_000)
    forged = record.model_copy(update={"edits": lowered})
    refused = transition(None, forged)
    assert refused.disposition is Disposition.REJECTED and "never lowers" in refused.reason
    past = ForkEdits(budgets=Budgets(deadline_at=95_000, max_steps=1))
    with pytest.raises(ForkError, match="not after the fork's time"):
        fork_record(log, seq, run_id="run-c2", at=100_000, edits=past)
    unlimited = ForkEdits(budgets=Budgets(deadline_at=None, max_steps=1))
    assert transition(None, fork_record(log, seq, run_id="run-c3", at=2_000, edits=unlimited))


def test_a_raised_deadline_replaces_the_source_deadline_timer() -> None:
    log = _budget_stopped("run-d")
    seq = resume_point(log)
    later = Budgets(deadline_at=500_000, max_steps=1)
    start = transition(
        None, fork_record(log, seq, run_id="run-d1", at=2_000, edits=ForkEdits(budgets=later))
    )
    assert start.state is not None
    deadlines = [t for t in start.state.timers if t.purpose is TimerPurpose.DEADLINE]
    assert [t.due_at for t in deadlines] == [500_000]
    scheduled = [e for e in start.effects if isinstance(e, ScheduleTimer)]
    assert [(e.timer_id, e.due_at) for e in scheduled] == [(deadlines[0].timer_id, 500_000)]


def test_a_cancelled_run_is_resumed_only_when_asked_from_before_its_cancel() -> None:
    records = _run("run-k", [])[:1]  # submitted: the model is asked
    cancel = CancelRequested(run_id="run-k", event_id="cancel", at=5_000, trace_id="t")
    log = folded([*records, (2, cancel)])
    assert log[-1].state is not None and log[-1].state.status is RunStatus.CANCELLED
    with pytest.raises(ForkError, match="resume it as cancelled explicitly"):
        resume_point(log)
    assert resume_point(log, cancelled=True) == 1  # the record before the cancel
    start = transition(None, fork_record(log, 1, run_id="run-k2", at=6_000))
    assert start.disposition is Disposition.APPLIED
    assert start.state is not None and not start.state.cancel_requested
    assert any(isinstance(e, CallModel) for e in start.effects)
    with pytest.raises(ForkError, match="no state"):
        resume_point(folded([(1, cancel)]), cancelled=True)


def test_a_fork_that_asks_the_model_with_raised_budgets_asks_with_what_now_remains() -> None:
    log = _budget_stopped("run-m")
    later = Budgets(deadline_at=700_000, max_steps=9)
    start = transition(
        None, fork_record(log, 1, run_id="run-m1", at=2_000, edits=ForkEdits(budgets=later))
    )
    assert start.state is not None and start.state.status is RunStatus.MODEL_RUNNING
    (call,) = [e for e in start.effects if isinstance(e, CallModel)]
    source_context = state_at(log, 1).context_ref
    assert call.context_ref != source_context
    (stored,) = [a for a in start.artifacts if a.ref == call.context_ref]
    context = json.loads(stored.content)
    assert context["previous_context"] == source_context and context["messages"] == []
    assert context["remaining"]["deadline_at"] == 700_000 and context["remaining"]["steps"] == 8
