"""Records of a newer version and runs of another rules version.

A body written by a newer agentruns (more fields, at any depth) decodes to the fields this
version knows; a snapshot keeps the newer top-level fields when it is written again; every
run is folded under the rules version it was submitted under, and a version this build does
not have stops the run's partition instead of being guessed at.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentruns.connectors.health import consumer_check
from agentruns.processors import effects as effects_module
from agentruns.processors import events as events_module
from agentruns.processors import state as state_module
from agentruns.processors import versions
from agentruns.processors.effects import Effect
from agentruns.processors.events import CancelRequested, Event, RunSubmitted, parse_event
from agentruns.processors.state import RunState, decode_state
from agentruns.processors.transition import transition
from agentruns.streams.codec import decode, encode
from agentruns.streams.inputs import Batch, Inbound, InputPath, PathSettings, RecordLimits
from agentruns.streams.membership import Membership
from agentruns.streams.metrics import ProcessorStats
from agentruns.streams.records import RunSlot, input_record, parse_effect_body, parse_event_body
from agentruns.streams.topics import TopicNames

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
AT = 1_700_000_000_000


def _golden_events() -> list[Event]:
    out: list[Event] = []
    for path in sorted(GOLDEN.glob("*.jsonl")):
        out.extend(parse_event(line) for line in path.read_text("utf-8").splitlines() if line)
    return out


def _folded() -> tuple[list[Effect], list[RunState]]:
    effects: list[Effect] = []
    states: list[RunState] = []
    state: RunState | None = None
    for event in EVENTS:
        if isinstance(event, RunSubmitted):
            state = None
        result = transition(state, event)
        state = result.state
        effects.extend(result.effects)
        if state is not None:
            states.append(state)
    return effects, states


EVENTS = _golden_events()
EFFECTS, STATES = _folded()

# Where a struct sits inside a body (a newer version may add fields there too). Fields typed
# `dict[str, Any]` (a tool's parameters, a reply's response) are values, not structs: a key
# added to them changes the value, so they are not listed.
STRUCT_PATHS = (
    (),
    ("policy",),
    ("budgets",),
    ("loop",),
    ("candidate",),
    ("candidate", "tool_calls", "*"),
    ("usage",),
    ("summary",),
    ("tools", "*"),
    ("messages", "*"),
    ("operation",),
    ("repair",),
    ("config",),
    ("config", "policy"),
    ("config", "tools", "*"),
    ("time",),
    ("ops", "*"),
    ("question",),
    ("timers", "*"),
    ("last_decision",),
)

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _known_names() -> frozenset[str]:
    """Every field name a struct of the core has: one left out of a body because it holds its
    default (`rules_version`, ...) is not new."""
    names: set[str] = set()
    for module in (events_module, effects_module, state_module):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, msgspec.Struct):
                names.update(value.__struct_fields__)
    return frozenset(names)


KNOWN_NAMES = _known_names()
NEW_NAMES = st.text(min_size=1, max_size=16).filter(lambda name: name not in KNOWN_NAMES)
NEW_FIELDS = st.dictionaries(NEW_NAMES, JSON_VALUES, min_size=1, max_size=4)


def _nodes(body: Any, path: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    if not path:
        if isinstance(body, dict):
            yield body
        return
    head, rest = path[0], path[1:]
    if head == "*":
        if isinstance(body, list):
            for item in body:
                yield from _nodes(item, rest)
    elif isinstance(body, dict) and head in body:
        yield from _nodes(body[head], rest)


def _with_new_fields(
    body: str, new: dict[str, Any], everywhere: bool
) -> tuple[str, dict[str, Any]]:
    """`body` with the fields of `new` a struct does not have added (at the top, and in every
    nested struct when `everywhere`); also the ones added at the top."""
    doc = json.loads(body)
    top: dict[str, Any] = {}
    for path in STRUCT_PATHS if everywhere else ((),):
        for node in _nodes(doc, path):
            for name, value in new.items():
                if name not in node:
                    node[name] = value
                    if not path:
                        top[name] = value
    return json.dumps(doc), top


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(EVENTS), NEW_FIELDS, st.booleans())
def test_an_event_with_new_fields_decodes_to_the_same_known_fields(
    event: Event, new: dict[str, Any], everywhere: bool
) -> None:
    body, _ = _with_new_fields(event.model_dump_json(), new, everywhere)
    assert parse_event_body(body) == event


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(EFFECTS), NEW_FIELDS, st.booleans())
def test_an_effect_with_new_fields_decodes_to_the_same_known_fields(
    effect: Effect, new: dict[str, Any], everywhere: bool
) -> None:
    """What the executors and the timer service decode: a newer processor's effect runs."""
    body, _ = _with_new_fields(effect.model_dump_json(), new, everywhere)
    assert parse_effect_body(body) == effect


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(STATES), NEW_FIELDS, st.booleans())
def test_a_state_with_new_fields_decodes_and_keeps_the_new_top_level_ones(
    state: RunState, new: dict[str, Any], everywhere: bool
) -> None:
    body, top = _with_new_fields(state.to_json(), new, everywhere)
    decoded, extra = decode_state(body)
    assert decoded == state and extra == top
    # written again (the next snapshot), the newer fields are still there
    slot = RunSlot(state.run_id, state=decoded, extra=extra)
    again = RunSlot.from_record(slot.to_record())
    assert again.state == state and again.extra == top


def test_the_limits_of_known_fields_still_hold_beside_new_ones() -> None:
    event = CancelRequested(run_id="r", event_id="e", at=AT, trace_id="t")
    doc = {**json.loads(event.model_dump_json()), "newer": 1}
    with pytest.raises(msgspec.ValidationError, match=r"\$\.at"):
        parse_event_body(json.dumps({**doc, "at": "soon"}))
    with pytest.raises(msgspec.ValidationError, match=r"\$\.reason"):
        parse_event_body(json.dumps({**doc, "reason": "x" * 300_000}))
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(msgspec.DecodeError):
        parse_event_body(json.dumps(doc)[:-1] + ', "deep": ' + deep + "}")


def test_a_state_without_new_fields_is_written_as_it_always_was() -> None:
    state = STATES[-1]
    assert RunSlot(state.run_id, state=state).to_record()["state"] == state.to_json()
    assert '"rules_version"' not in state.to_json()  # version 1: no field, the old bytes


# --------------------------------------------------------------------------- rules versions


@pytest.fixture
def newer_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that has a rules version 2 (the same rules, under a new number)."""
    monkeypatch.setitem(versions.RULES, 2, transition)


def submission(run_id: str, **fields: Any) -> RunSubmitted:
    return RunSubmitted(
        run_id=run_id, event_id=f"{run_id}:submit", at=AT, trace_id="t", goal="g", **fields
    )


def test_a_run_is_version_1_without_a_version_and_keeps_its_own() -> None:
    state = transition(None, submission("r")).state
    assert state is not None and versions.of_state(state) == 1
    assert versions.version_of(None, submission("r")) == 1
    assert (
        versions.version_of(None, CancelRequested(run_id="r", event_id="e", at=AT, trace_id="t"))
        == 1
    )
    with pytest.raises(versions.UnknownRulesVersionError, match="unknown rules version 7"):
        versions.apply(None, submission("r", rules_version=7))


def test_a_submission_is_stamped_with_the_processors_version_whatever_the_producer_wrote(
    newer_rules: None,
) -> None:
    assert versions.current() == 2
    stamped = versions.stamped(submission("r", rules_version=9), 2)
    assert stamped.rules_version == 2
    state = versions.apply(None, stamped).state
    assert state is not None and versions.of_state(state) == 2
    assert versions.stamped(submission("r", rules_version=9), 1).rules_version is msgspec.UNSET


TOPICS = TopicNames.for_prefix("t")


def new_path(rules_version: int | None = None) -> InputPath:
    return InputPath(
        TOPICS,
        PathSettings(rules_version=rules_version),
        ProcessorStats(),
        limits=RecordLimits(default=1 << 20),
        clock=lambda: AT / 1000,
    )


def of_event(event: Event, offset: int, partition: int = 0) -> Inbound:
    value = encode("Input", input_record(event))
    return Inbound("t.inbox", partition, offset, event.run_id.encode(), value, [], AT)


def logged(batch: Batch) -> list[dict[str, Any]]:
    return [decode(r[2], "Event").record for r in batch.records if r[0] == TOPICS.events]


def test_a_run_of_a_rules_version_this_build_lacks_stops_its_partition_and_stays_unconsumed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(versions.RULES, 2, transition)
    newer, batch = new_path(), Batch()
    newer.handle(of_event(submission("r1"), 0), batch)
    (event,) = logged(batch)
    assert json.loads(event["body"])["rules_version"] == 2
    slot = newer.slots[0]["r1"]
    monkeypatch.delitem(versions.RULES, 2)

    older, batch = new_path(), Batch()
    older.slots[0] = {"r1": slot}
    older.handle(of_event(submission("r2"), 5, partition=1), batch)
    cancel = CancelRequested(run_id="r1", event_id="c", at=AT + 1, trace_id="t")
    older.handle(of_event(cancel, 6), batch)
    older.handle(of_event(submission("r3"), 7), batch)  # behind it on the stopped partition
    older.handle(of_event(submission("r4"), 8, partition=1), batch)
    assert older.stopped == {0: "run r1: unknown rules version 2 (this build has 1)"}
    # the stopped input and the ones behind it are not consumed; the other partition goes on
    assert batch.positions == {1: 9, 0: 6}
    assert [e["run_id"] for e in logged(batch)] == ["r2", "r4"]
    assert "r3" not in older.slots[0] and older.slots[0]["r1"].state == slot.state


def test_a_processor_can_keep_submitting_under_an_older_version(newer_rules: None) -> None:
    path, batch = new_path(rules_version=1), Batch()
    path.handle(of_event(submission("r1", rules_version=2), 0), batch)
    (event,) = logged(batch)
    assert "rules_version" not in json.loads(event["body"])
    with pytest.raises(ValueError, match="unknown rules version 3"):
        new_path(rules_version=3)


def test_readiness_names_a_stopped_partition_and_its_reason() -> None:
    membership = Membership()
    membership.assigned([0, 1])
    assert consumer_check(membership, "g").ok
    membership.stopped({1: "run r1: unknown rules version 2 (this build has 1)"})
    check = consumer_check(membership, "g")
    assert not check.ok
    assert check.detail == (
        "1 of 2 partitions stopped: partition 1: run r1: unknown rules version 2 (this build has 1)"
    )


def test_the_processor_applies_a_body_with_hostile_new_fields_and_refuses_bad_known_ones() -> None:
    """The tolerance is no way around a limit: a new field may hold any JSON the record and
    nesting limits let through, and a known field beside it is checked as ever."""
    path, batch = new_path(), Batch()
    doc = json.loads(submission("r1").model_dump_json())
    doc |= {"newer": "x" * 200_000, "deeper": json.loads("[" * 60 + "]" * 60)}
    doc["policy"] = {"future_policy": {"a": [1, None, True]}}
    record = {**input_record(submission("r1")), "body": json.dumps(doc)}
    path.handle(Inbound("t.inbox", 0, 0, b"r1", encode("Input", record), [], AT), batch)
    bad = {**doc, "run_id": "r2", "event_id": "r2:s", "at": "yesterday"}
    record = {**input_record(submission("r2")), "body": json.dumps(bad)}
    path.handle(Inbound("t.inbox", 0, 1, b"r2", encode("Input", record), [], AT), batch)
    too_deep = {**doc, "run_id": "r3", "event_id": "r3:s", "deeper": "X"}
    body = json.dumps(too_deep).replace('"X"', "[" * 5000 + "]" * 5000)
    record = {**input_record(submission("r3")), "body": body}
    path.handle(Inbound("t.inbox", 0, 2, b"r3", encode("Input", record), [], AT), batch)
    assert [e["run_id"] for e in logged(batch)] == ["r1"]
    assert "newer" not in logged(batch)[0]["body"]  # logged as applied: the known fields
    dead = [decode(r[2], "DeadLetter").record for r in batch.records if r[0] == TOPICS.dlq]
    assert [(d["run_id"], d["error_class"]) for d in dead] == [
        ("r2", "INVALID_EVENT"),
        ("r3", "INVALID_EVENT"),
    ]
    assert "$.at" in dead[0]["reason"] and "too deeply" in dead[1]["reason"]
