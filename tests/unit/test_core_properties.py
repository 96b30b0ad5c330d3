"""Hypothesis properties of the core over simulated event sequences (chaos included)."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentruns.connectors.dev.servers.workload import simulate, submitted
from agentruns.processors import fold
from agentruns.processors.effects import EFFECT_DECODER, CallModel, CallTool
from agentruns.processors.events import (
    Candidate,
    Event,
    ModelCallCompleted,
    ModelOutcome,
    ModelUsage,
    ReconcileCompleted,
    ReconcileOutcome,
    ToolCallFailed,
    ToolCallRequest,
    ToolCallSucceeded,
    UserReplied,
)
from agentruns.processors.ids import content_ref
from agentruns.processors.state import (
    TERMINAL,
    TRANSIENT,
    Budgets,
    ErrorClass,
    LoopLimits,
    OpStatus,
    Policy,
    RunState,
    RunStatus,
)
from agentruns.processors.transition import PASS_THROUGH, TABLE, Disposition, Transition, transition
from agentruns.processors.validation import revalidate

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

seeds = st.integers(min_value=0, max_value=2**32 - 1)
chaos_levels = st.sampled_from([0.0, 0.1, 0.3])


def run_log(seed: int, chaos: float, corrections: bool = True, steps: int = 5) -> list[Event]:
    rng = random.Random(seed)
    return simulate(
        rng,
        f"run-{seed}",
        steps=steps,
        chaos=chaos,
        faults=0.25,
        corrections=corrections,
        max_events=250,
    )


def steps_of(events: list[Event]) -> Iterator[tuple[RunState | None, Event, Transition]]:
    state: RunState | None = None
    for event in events:
        result = transition(state, event)
        yield state, event, result
        state = result.state


def effects_json(t: Transition) -> list[str]:
    return [e.model_dump_json() for e in t.effects]


# 1. replay determinism, byte-identical serialization, round trip
@SETTINGS
@given(seeds, chaos_levels)
def test_replay_is_deterministic(seed: int, chaos: float) -> None:
    events = run_log(seed, chaos)
    first = [(r.state, effects_json(r), r.disposition) for _, _, r in steps_of(events)]
    second = [(r.state, effects_json(r), r.disposition) for _, _, r in steps_of(events)]
    assert first == second
    for (a, _, _), (b, _, _) in zip(first, second, strict=True):
        if a is not None and b is not None:
            assert a.to_json() == b.to_json()
            assert RunState.from_json(a.to_json()) == a  # every snapshot round-trips
    for _, _, r in steps_of(events):
        for effect in r.effects:
            assert EFFECT_DECODER.decode(effect.model_dump_json()) == effect
    final = fold(events)
    assert final is not None
    assert RunState.from_json(final.to_json()) == final
    assert RunState.from_json(final.to_json()).to_json() == final.to_json()
    # the event log itself round-trips through JSON and replays to the same bytes
    from agentruns.processors.events import parse_event

    again = fold(parse_event(e.model_dump_json()) for e in events)
    assert again is not None and again.to_json() == final.to_json()


# 2. delivering any event twice changes nothing
@SETTINGS
@given(seeds, chaos_levels, st.data())
def test_duplicates_change_nothing(seed: int, chaos: float, data: st.DataObject) -> None:
    events = run_log(seed, chaos)
    history = list(steps_of(events))
    applied = [
        (i, e) for i, (_, e, r) in enumerate(history) if r.disposition is Disposition.APPLIED
    ]
    for i, (_, event, result) in enumerate(history):
        state = result.state
        # the same event again, right away
        again = transition(state, event)
        assert again.disposition is not Disposition.APPLIED, (event, again.reason)
        assert again.state is state and not again.effects and not again.artifacts
        # an event applied earlier, delivered again now
        earlier = [e for j, e in applied if j <= i]
        if earlier:
            old = data.draw(st.sampled_from(earlier))
            late = transition(state, old)
            assert late.disposition is not Disposition.APPLIED, (old, late.reason)
            assert late.state is state and not late.effects


# 3. at most one terminal state; after it only LATE (no corrections in this world)
@SETTINGS
@given(seeds, chaos_levels)
def test_one_terminal_state_then_nothing_changes(seed: int, chaos: float) -> None:
    events = run_log(seed, chaos, corrections=False)
    terminal: RunState | None = None
    entered = 0
    for before, _, result in steps_of(events):
        if terminal is not None:
            assert result.disposition is not Disposition.APPLIED
            assert result.state is terminal and not result.effects
        elif result.state is not None and result.state.terminal:
            terminal = result.state
            entered += 1
            assert before is None or not before.terminal
    assert entered <= 1


# the table is honest: every applied transition follows a declared row and pass-throughs
@SETTINGS
@given(seeds, chaos_levels)
def test_transitions_follow_the_table(seed: int, chaos: float) -> None:
    for before, event, result in steps_of(run_log(seed, chaos)):
        if before is None or result.disposition is not Disposition.APPLIED:
            continue
        after = result.state
        assert after is not None and after.version == before.version + 1
        assert after.status not in TRANSIENT
        row = TABLE[(before.status, event.type)]
        path = after.path or (after.status,)
        assert path[-1] is after.status
        assert path[0] in row.reachable or path[0] is before.status, (before.status, event, path)
        for here, there in itertools.pairwise(path):
            assert there in PASS_THROUGH[here], (here, there, event.type)


def _transient_failure_of(event: Event, key: str, dispatch: int) -> bool:
    return (
        isinstance(event, ToolCallFailed)
        and event.error_class is ErrorClass.TRANSIENT
        and event.operation_key == key
        and event.dispatch == dispatch
    )


# 4. no CallTool without a validated, finished candidate (or a resend/approval of one)
@SETTINGS
@given(seeds, chaos_levels)
def test_no_tool_call_without_validated_candidate(seed: int, chaos: float) -> None:
    for before, event, result in steps_of(run_log(seed, chaos)):
        for effect in result.effects:
            if not isinstance(effect, CallTool):
                continue
            assert before is not None
            previous = before.op(effect.operation.key)
            if previous is not None:
                # a resend or an approved proposal of an operation validated earlier
                assert previous.status in {
                    OpStatus.PROPOSED,
                    OpStatus.UNKNOWN,
                    OpStatus.FAILED,
                } or (_transient_failure_of(event, previous.key, previous.dispatch))
                continue
            assert isinstance(event, ModelCallCompleted)
            assert event.outcome is ModelOutcome.FINISHED and event.candidate is not None
            decision = revalidate(event.candidate, before, before.config.validator_version)
            assert decision.ok and decision.action == "dispatch"


# 5. no effect after a budget is exhausted, and no model call beyond a budget
@SETTINGS
@given(seeds, st.integers(min_value=500, max_value=6_000), st.integers(min_value=1, max_value=4))
def test_no_effect_after_budget_exhausted(seed: int, max_tokens: int, max_steps: int) -> None:
    submit = submitted(f"run-{seed}", budgets=Budgets(max_tokens=max_tokens, max_steps=max_steps))
    events = simulate(
        random.Random(seed),
        f"run-{seed}",
        steps=8,
        chaos=0.1,
        submit=submit,
        corrections=False,
        max_events=250,
    )
    exhausted = False
    for _, _, result in steps_of(events):
        if exhausted:
            assert not result.effects and result.disposition is not Disposition.APPLIED
        s = result.state
        assert s is not None
        for effect in result.effects:
            if isinstance(effect, CallModel):
                assert s.usage.total_tokens < max_tokens and s.step <= max_steps
        exhausted = exhausted or s.status is RunStatus.BUDGET_EXHAUSTED


# 6. UNKNOWN is dispatched again only after reconcile says not-executed, with the same key
@SETTINGS
@given(seeds, chaos_levels)
def test_unknown_operation_resent_only_after_not_executed(seed: int, chaos: float) -> None:
    for before, event, result in steps_of(run_log(seed, chaos)):
        for effect in result.effects:
            if not isinstance(effect, CallTool) or before is None:
                continue
            previous = before.op(effect.operation.key)
            if previous is None:
                continue
            # never two dispatches in flight: an in-flight one must have just failed
            if previous.status in {OpStatus.DISPATCHED, OpStatus.ACCEPTED, OpStatus.RUNNING}:
                assert _transient_failure_of(event, previous.key, previous.dispatch)
            assert effect.operation.dispatch == previous.dispatch + (
                0 if previous.status is OpStatus.PROPOSED else 1
            )
            if previous.status is OpStatus.UNKNOWN:
                assert isinstance(event, ReconcileCompleted)
                assert event.outcome is ReconcileOutcome.NOT_EXECUTED
                assert event.operation_key == effect.operation.key == previous.key


# 7. a resume token is accepted at most once
@SETTINGS
@given(seeds, st.sampled_from([0.1, 0.3]))
def test_resume_token_accepted_at_most_once(seed: int, chaos: float) -> None:
    events = run_log(seed, chaos, steps=6)
    # deliver every reply twice more, at the end and right after itself
    replies = [e for e in events if isinstance(e, UserReplied)]
    noisy: list[Event] = []
    for e in events:
        noisy.append(e)
        if isinstance(e, UserReplied):
            noisy.append(e.model_copy(update={"event_id": e.event_id + ":again"}))
    noisy.extend(r.model_copy(update={"event_id": r.event_id + ":late"}) for r in replies)
    accepted: dict[str, int] = {}
    for _, event, result in steps_of(noisy):
        if isinstance(event, UserReplied) and result.disposition is Disposition.APPLIED:
            accepted[event.token_id] = accepted.get(event.token_id, 0) + 1
    assert all(n == 1 for n in accepted.values())


# 8. the loop detector fires within its bound
def _loop_run(pattern: str, bound: int, seed: int) -> tuple[RunState, int]:
    rng = random.Random(seed)
    limits = LoopLimits(
        max_repeat_action=bound,
        max_repeat_error=bound,
        max_steps_without_progress=bound,
        max_events=10_000,
    )
    policy = Policy(on_no_progress="fail", max_repairs=0)
    submit = submitted("loop", policy=policy, budgets=Budgets(max_steps=1_000)).model_copy(
        update={"loop": limits}
    )
    state = transition(None, submit).state
    assert state is not None
    n = 0
    steps = 0
    while not state.terminal and steps < 10 * bound + 10:
        n += 1
        step, attempt = state.step, state.attempt
        if state.status is RunStatus.MODEL_RUNNING:
            steps += 1
            query = {
                "repeat": "same",
                "oscillate": "ab"[step % 2],
                "error": f"q{step}",
                "no_progress": f"q{step}",
            }[pattern]
            call = ToolCallRequest(
                id="c", name="search", arguments_json=json.dumps({"query": query})
            )
            event: Event = ModelCallCompleted(
                run_id="loop",
                event_id=f"e{n}",
                at=n,
                trace_id="t",
                step=step,
                attempt=attempt,
                outcome=ModelOutcome.FINISHED,
                candidate=Candidate(tool_calls=(call,)),
                usage=ModelUsage(),
            )
        else:
            op = state.ops[-1]
            if pattern == "error":
                event = ToolCallFailed(
                    run_id="loop",
                    event_id=f"e{n}",
                    at=n,
                    trace_id="t",
                    step=op.step,
                    operation_key=op.key,
                    dispatch=op.dispatch,
                    error_class=ErrorClass.STATE_CONFLICT,
                    error_code="STALE",
                )
            else:
                result = "same" if pattern == "no_progress" else f"r{rng.random()}"
                event = ToolCallSucceeded(
                    run_id="loop",
                    event_id=f"e{n}",
                    at=n,
                    trace_id="t",
                    step=op.step,
                    operation_key=op.key,
                    dispatch=op.dispatch,
                    result_ref=content_ref(result),
                )
        state = transition(state, event).state
        assert state is not None
    return state, steps


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(["repeat", "oscillate", "error", "no_progress"]),
    st.integers(min_value=2, max_value=6),
    seeds,
)
def test_loop_detector_fires_within_bound(pattern: str, bound: int, seed: int) -> None:
    state, steps = _loop_run(pattern, bound, seed)
    assert state.status is RunStatus.FAILED, state.outcome
    expected = {
        "repeat": "loop:repeated_action",
        "oscillate": "loop:plan_oscillation",
        "error": "loop:repeated_error",
        "no_progress": "loop:no_progress",
    }[pattern]
    assert (state.outcome or "").startswith(expected)
    limit = {"repeat": bound, "oscillate": 4, "error": bound, "no_progress": bound + 2}[pattern]
    assert steps <= limit


# terminal runs always published exactly one result per resolution
@SETTINGS
@given(seeds, chaos_levels)
def test_each_terminal_entry_publishes_one_result(seed: int, chaos: float) -> None:
    for before, _, result in steps_of(run_log(seed, chaos)):
        s = result.state
        published = [e for e in result.effects if e.type == "PublishResult"]
        entering = s is not None and s.terminal and (before is None or before != s)
        if result.disposition is Disposition.APPLIED and s is not None and s.status in TERMINAL:
            assert len(published) == 1 and published[0].result_ref == s.result_ref
            assert s.result_ref in {a.ref for a in result.artifacts}
        else:
            assert not published or entering
