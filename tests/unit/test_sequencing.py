"""The seq protocol's decisions without a broker or a processor: one run's slot, Input records
in, steps out."""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentruns.processors.events import CancelRequested, Event, TimerFired
from agentruns.streams.records import RunSlot, input_digest, input_record
from agentruns.streams.sequencing import (
    MAX_PRODUCER_MARKS,
    Apply,
    ArmGapTimer,
    BufferFull,
    Conflict,
    Duplicate,
    GapExpired,
    Hold,
    Sequencer,
    StaleGapTimer,
    Step,
    gap_timer_id,
    next_seq,
    open_gaps,
    parse_gap_timer,
)

AT = 1_700_000_000_000
RUN = "r"
TIMEOUT = 1000


def numbered(pid: str, pseq: int, *, content: str = "", at: int = AT) -> dict[str, Any]:
    event = CancelRequested(run_id=RUN, event_id=f"{pid}-{pseq}{content}", at=at, trace_id="t")
    return input_record(event, producer_id=pid, producer_seq=pseq)


def never_parsed() -> Event:
    raise AssertionError("a numbered input or a duplicate is not parsed by the protocol")


class Driver:
    """One run's slot fed through a Sequencer, every step carried out."""

    def __init__(self, buffer_limit: int = 64) -> None:
        self.sequencer = Sequencer(buffer_limit, TIMEOUT, input_digest)
        self.slot = RunSlot(RUN)
        self.applied: list[tuple[str, int]] = []
        self.armed: list[ArmGapTimer] = []

    def feed(self, record: dict[str, Any], parse: Callable[[], Event] = never_parsed) -> list[Step]:
        steps = list(self.sequencer.admit(self.slot, record, parse))
        for step in steps:
            if isinstance(step, Apply) and step.numbered:
                self.applied.append((step.record["producer_id"], step.record["producer_seq"]))
            elif isinstance(step, ArmGapTimer):
                self.armed.append(step)
        return steps

    def fire(self, timer_id: str, at: int = AT + TIMEOUT) -> list[Step]:
        fired = TimerFired(
            run_id=RUN, event_id=f"{timer_id}:fired", at=at, trace_id="t", timer_id=timer_id
        )
        return self.feed(input_record(fired), lambda: fired)

    def live_timers(self) -> set[tuple[str, int]]:
        """Armed timers whose gap is still the producer's next: their firing would act."""
        marks = self.slot.producer_marks
        return {
            (t.producer_id, t.expected)
            for t in self.armed
            if marks.get(t.producer_id, 0) + 1 == t.expected
        }


def kinds(steps: list[Step]) -> list[str]:
    return [type(step).__name__ for step in steps]


# ------------------------------------------------------------------ examples


def test_inputs_in_order_apply_at_once_and_advance_the_mark() -> None:
    d = Driver()
    for pseq in (1, 2, 3):
        assert kinds(d.feed(numbered("api", pseq))) == ["Apply"]
    assert d.slot.producer_marks == {"api": 3} and not d.slot.buffer
    assert d.applied == [("api", 1), ("api", 2), ("api", 3)] and not d.armed


def test_an_early_input_is_held_with_a_gap_timer_and_applies_when_the_gap_fills() -> None:
    d = Driver()
    d.feed(numbered("api", 1))
    steps = d.feed(numbered("api", 3, at=AT + 7))
    assert kinds(steps) == ["Hold", "ArmGapTimer"]
    (timer,) = d.armed
    assert (timer.timer_id, timer.expected, timer.due_at) == ("r:gap:api:2", 2, AT + 7 + TIMEOUT)
    assert d.slot.gap_since == AT + 7 and len(d.slot.buffer) == 1
    assert kinds(d.feed(numbered("api", 4))) == ["Hold"]  # the same gap: no second timer
    steps = d.feed(numbered("api", 2))
    assert [s.held for s in steps if isinstance(s, Apply)] == [False, True, True]
    assert d.applied == [("api", 1), ("api", 2), ("api", 3), ("api", 4)]
    assert not d.slot.buffer and d.slot.gap_since is None and len(d.armed) == 1
    assert kinds(d.fire(timer.timer_id)) == ["StaleGapTimer"]  # disarmed by the gap filling


def test_duplicates_are_answered_by_their_content() -> None:
    d = Driver()
    d.feed(numbered("api", 1))
    d.feed(numbered("api", 3))
    assert d.feed(numbered("api", 1)) == [Duplicate("p:api:1")]
    assert d.feed(numbered("api", 1, content="other")) == [Conflict("p:api:1")]
    assert d.feed(numbered("api", 3)) == [Duplicate("p:api:3")]  # the held one
    assert d.feed(numbered("api", 3, content="other")) == [Conflict("p:api:3")]
    assert len(d.slot.buffer) == 1 and d.applied == [("api", 1)]


def test_an_input_older_than_the_remembered_digests_counts_as_a_duplicate() -> None:
    d = Driver()
    for pseq in range(1, 100):
        d.feed(numbered("api", pseq))
    assert d.slot.recalled("p:api:1") is None
    assert d.feed(numbered("api", 1, content="other")) == [Duplicate("p:api:1")]


def test_a_full_buffer_refuses_the_input_and_leaves_the_slot_as_it_was() -> None:
    d = Driver(buffer_limit=2)
    d.feed(numbered("api", 3))
    d.feed(numbered("api", 4))
    before = d.slot.copy()
    assert d.feed(numbered("api", 5)) == [BufferFull(2)]
    assert d.slot.buffer == before.buffer and d.slot.producer_marks == before.producer_marks


def test_an_unnumbered_input_is_remembered_once_applied_and_its_redelivery_not_parsed() -> None:
    d = Driver()
    event = CancelRequested(run_id=RUN, event_id="c", at=AT, trace_id="t")
    record = input_record(event)
    (step,) = d.feed(record, lambda: event)
    assert step == Apply(record, numbered=False, event=event)
    assert d.feed(record) == [Duplicate("i:c")]
    assert d.feed(dict(record, body=record["body"] + " ")) == [Conflict("i:c")]


def test_an_unnumbered_input_whose_application_fails_is_not_remembered() -> None:
    d = Driver()
    event = CancelRequested(run_id=RUN, event_id="c", at=AT, trace_id="t")
    steps = d.sequencer.admit(d.slot, input_record(event), lambda: event)
    assert isinstance(next(steps), Apply)
    steps.close()  # what carrying out the step raising does to the generator
    assert d.slot.recalled("i:c") is None


def test_a_parse_error_propagates_and_changes_nothing() -> None:
    d = Driver()

    def broken() -> Event:
        raise ValueError("not an event")

    event = CancelRequested(run_id=RUN, event_id="c", at=AT, trace_id="t")
    with pytest.raises(ValueError, match="not an event"):
        d.feed(input_record(event), broken)
    assert not d.slot.recent


def test_a_gap_timer_firing_while_the_gap_is_open_skips_it_and_applies_what_waits() -> None:
    d = Driver()
    d.feed(numbered("api", 1))
    d.feed(numbered("api", 4))
    d.feed(numbered("api", 5))
    (timer,) = d.armed
    steps = d.fire(timer.timer_id)
    assert kinds(steps) == ["GapExpired", "Apply", "Apply"]
    expired = steps[0]
    assert isinstance(expired, GapExpired) and expired.expected == 2
    assert expired.diagnosis == (
        f"inputs 2..3 of producer api did not arrive within {TIMEOUT} ms; "
        "2 later inputs applied after the gap"
    )
    assert d.applied == [("api", 1), ("api", 4), ("api", 5)] and not d.slot.buffer
    assert d.feed(numbered("api", 2)) == [Duplicate("p:api:2")]  # what was skipped
    assert kinds(d.fire(timer.timer_id)) == ["StaleGapTimer"]


def test_each_producers_gap_and_each_next_gap_gets_its_own_timer() -> None:
    d = Driver()
    d.feed(numbered("api", 2))
    d.feed(numbered("exec", 3))
    assert [(t.producer_id, t.expected) for t in d.armed] == [("api", 1), ("exec", 1)]
    d.feed(numbered("api", 5))
    d.feed(numbered("api", 1, at=AT + 50))  # 1 and 2 apply; 5 waits for 3 now
    assert d.applied == [("api", 1), ("api", 2)]
    assert (d.armed[-1].producer_id, d.armed[-1].expected, d.armed[-1].due_at) == (
        "api",
        3,
        AT + 50 + TIMEOUT,
    )
    d.fire(gap_timer_id(RUN, "exec", 1))  # exec's gap times out: api's stays open
    assert d.applied[-1] == ("exec", 3) and open_gaps(d.slot) == {"api": 3}
    assert d.live_timers() == {("api", 3)}


def test_a_gap_timer_of_another_shape_is_stale() -> None:
    d = Driver()
    d.feed(numbered("api", 3))
    for timer_id in ("r:gap:api:x", "r:gap::2", "other:gap:api:1", "r:gap:api:\u0661"):
        assert kinds(d.fire(timer_id)) == ["StaleGapTimer"]
    assert len(d.slot.buffer) == 1


def test_gap_timer_ids_round_trip_for_any_producer() -> None:
    assert parse_gap_timer("a:gap:b", gap_timer_id("a:gap:b", "p:1", 7)) == ("p:1", 7)
    assert parse_gap_timer("a", "a:gap:p") is None


def test_a_refused_input_uses_up_its_seq_or_its_id() -> None:
    d = Driver()
    d.sequencer.refused(d.slot, numbered("api", 1), "api-1")
    d.sequencer.refused(d.slot, numbered("api", 5), "api-5")  # not the next: nothing used up
    assert d.slot.producer_marks == {"api": 1}
    event = CancelRequested(run_id=RUN, event_id="c", at=AT, trace_id="t")
    d.sequencer.refused(d.slot, input_record(event), "c")
    assert d.feed(input_record(event)) == [Duplicate("i:c")]
    assert d.feed(numbered("api", 1)) == [Duplicate("p:api:1")]


def test_a_run_keeps_the_marks_of_the_producers_it_heard_from_last() -> None:
    d = Driver()
    for i in range(MAX_PRODUCER_MARKS + 3):
        d.feed(numbered(f"p{i}", 1))
    d.feed(numbered("p0", 1))  # forgotten: its input 1 counts as new
    assert len(d.slot.producer_marks) == MAX_PRODUCER_MARKS
    assert list(d.slot.producer_marks)[-1] == "p0" and "p1" not in d.slot.producer_marks


def test_the_log_cap() -> None:
    assert next_seq(0, 3) == 1 and next_seq(2, 3) == 3
    assert next_seq(3, 3) is None and next_seq(9, 3) is None


def test_the_module_imports_only_the_core_and_the_standard_library() -> None:
    source = Path(__file__).resolve().parents[2] / "streams" / "sequencing.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    outside = {
        m
        for m in found
        if m.split(".")[0] not in sys.stdlib_module_names
        and not m.startswith("agentruns.processors.")
    }
    assert "agentruns.processors.events" in found and not outside


# ------------------------------------------------------------------ properties

_PRODUCERS = ("api", "exec", "timer")


@st.composite
def _deliveries(draw: st.DrawFn) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """Each producer's inputs 1..n, shuffled together, some delivered more than once."""
    counts = {p: draw(st.integers(0, 8)) for p in draw(st.sets(st.sampled_from(_PRODUCERS)))}
    inputs = [(p, s) for p, n in counts.items() for s in range(1, n + 1)]
    repeats = draw(st.lists(st.sampled_from(inputs), max_size=6)) if inputs else []
    return counts, draw(st.permutations(inputs + repeats))


def _check_timers(d: Driver) -> None:
    """A gap timer is armed exactly while its gap is open, and never armed twice."""
    assert d.live_timers() == set(open_gaps(d.slot).items())
    armed = [(t.producer_id, t.expected) for t in d.armed]
    assert len(armed) == len(set(armed))


@settings(max_examples=300, deadline=None)
@given(_deliveries())
def test_any_order_with_duplicates_applies_each_producers_inputs_once_in_order(
    delivery: tuple[dict[str, int], list[tuple[str, int]]],
) -> None:
    counts, order = delivery
    d = Driver(buffer_limit=sum(counts.values()))
    for pid, pseq in order:
        steps = d.feed(numbered(pid, pseq))
        assert not any(isinstance(s, Conflict | BufferFull) for s in steps)
        _check_timers(d)
    for pid, n in counts.items():
        assert [s for p, s in d.applied if p == pid] == list(range(1, n + 1))
    assert len(d.applied) == sum(counts.values())
    assert not d.slot.buffer and d.slot.gap_since is None


@settings(max_examples=300, deadline=None)
@given(_deliveries(), st.integers(1, 4))
def test_the_buffer_never_exceeds_its_bound_and_refused_inputs_can_come_again(
    delivery: tuple[dict[str, int], list[tuple[str, int]]], limit: int
) -> None:
    counts, order = delivery
    d = Driver(buffer_limit=limit)
    refused: list[tuple[str, int]] = []
    for pid, pseq in order:
        steps = d.feed(numbered(pid, pseq))
        if BufferFull(limit) in steps:
            refused.append((pid, pseq))
        assert len(d.slot.buffer) <= limit
        _check_timers(d)
    for pid, pseq in sorted(refused, key=lambda r: r[1]):  # the producer sends them again
        d.feed(numbered(pid, pseq))
        assert len(d.slot.buffer) <= limit
    for pid, n in counts.items():
        assert [s for p, s in d.applied if p == pid] == list(range(1, n + 1))


@settings(max_examples=300, deadline=None)
@given(_deliveries(), st.lists(st.integers(0, 30), max_size=6))
def test_gap_timers_fired_at_any_point_skip_gaps_but_never_apply_twice_or_backwards(
    delivery: tuple[dict[str, int], list[tuple[str, int]]], firings: list[int]
) -> None:
    counts, order = delivery
    d = Driver(buffer_limit=sum(counts.values()))
    for i, (pid, pseq) in enumerate(order):
        d.feed(numbered(pid, pseq))
        _check_timers(d)
        for pick in firings:
            if d.armed and pick % (len(order) + 1) == i:
                timer = d.armed[pick % len(d.armed)]
                live = (timer.producer_id, timer.expected) in d.live_timers()
                steps = d.fire(timer.timer_id)
                assert isinstance(steps[0], GapExpired if live else StaleGapTimer)
                _check_timers(d)
    for pid, n in counts.items():
        applied = [s for p, s in d.applied if p == pid]
        assert applied == sorted(set(applied)) and set(applied) <= set(range(1, n + 1))
        assert d.slot.producer_marks.get(pid, 0) == n  # every gap closed: filled or skipped
    assert not d.slot.buffer and not d.live_timers()
    assert all(kinds(d.fire(t.timer_id)) == ["StaleGapTimer"] for t in d.armed)


def test_hold_steps_carry_the_input_held() -> None:
    d = Driver()
    record = numbered("api", 2)
    assert d.feed(record)[0] == Hold(record) and d.slot.buffer == [record]
