"""The processor's per-input path without a broker: every input ends applied, rejected,
refused or dead-lettered, and nothing the batch holds is over the record limit."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from agentruns.connectors.executors.base import event_identity, result_input_id
from agentruns.processors.effects import Effect
from agentruns.processors.events import (
    CancelRequested,
    Event,
    GoalChanged,
    ModelCallCompleted,
    ModelOutcome,
    RunSubmitted,
    TimerFired,
)
from agentruns.processors.state import RunStatus
from agentruns.streams import dlq
from agentruns.streams.codec import decode, encode
from agentruns.streams.inputs import (
    MAX_PRODUCER_MARKS,
    Batch,
    Ended,
    Inbound,
    InputPath,
    PathSettings,
    RecordLimits,
    record_size,
)
from agentruns.streams.metrics import ProcessorStats
from agentruns.streams.records import Parked, input_record, parse_effect_body
from agentruns.streams.topics import TopicNames

LIMIT = 32 << 10
AT = 1_700_000_000_000
TOPICS = TopicNames.for_prefix("t")


def new_path(limit: int = LIMIT, cls: type[InputPath] = InputPath) -> InputPath:
    return cls(
        TOPICS,
        PathSettings(buffer_limit=8, gap_timeout_ms=1000, max_log_events=50),
        ProcessorStats(),
        limits=RecordLimits(default=limit),
        model_partitions=lambda: 3,
        clock=lambda: AT / 1000,
    )


def submit(run_id: str, *, goal: str = "find three documents", trace: str = "t") -> RunSubmitted:
    return RunSubmitted(
        run_id=run_id, event_id=f"{run_id}:submit", at=AT, trace_id=trace, goal=goal
    )


def inbound(
    value: bytes | None,
    *,
    key: bytes | None = None,
    offset: int = 0,
    headers: list[tuple[str, str | bytes | None]] | None = None,
) -> Inbound:
    return Inbound("t.inbox", 0, offset, key, value, headers or [], AT)


def of_event(event: Event, offset: int = 0, **options: Any) -> Inbound:
    return inbound(
        encode("Input", input_record(event, **options)), key=event.run_id.encode(), offset=offset
    )


def records_to(batch: Batch, topic: str, since: int = 0) -> list[dict[str, Any]]:
    name = {TOPICS.events: "Event", TOPICS.dlq: "DeadLetter", TOPICS.runs: "EndedRun"}.get(
        topic, "Effect"
    )
    return [decode(r[2], name).record for r in batch.records[since:] if r[0] == topic]


def test_an_input_whose_event_is_over_the_record_limit_fails_its_run_as_record_too_large() -> None:
    path, batch = new_path(), Batch()
    path.handle(of_event(submit("r1")), batch)
    big = GoalChanged(run_id="r1", event_id="g", at=AT + 1, trace_id="t", step=1, goal="x" * LIMIT)
    path.handle(of_event(big, offset=1), batch)
    events = records_to(batch, TOPICS.events)
    assert [e["type"] for e in events] == ["RunSubmitted", "InputRefused"]
    state = path.slots[0]["r1"].state
    assert state is not None and state.status is RunStatus.FAILED
    assert state.outcome is not None
    assert state.outcome.startswith("invalid_input:record_too_large: t.events record of")
    assert all(record_size(r) <= LIMIT for r in batch.records)
    assert batch.positions == {0: 2} and path.stats.too_large == 1


def test_a_submission_over_the_limit_is_dead_lettered_whole_and_the_next_run_goes_on() -> None:
    path, batch = new_path(), Batch()
    huge = submit("r2", goal="z" * (200 << 10))  # within the core's bounds, over the record limit
    path.handle(of_event(huge), batch)
    path.handle(of_event(submit("r3"), offset=1), batch)
    (dead,) = records_to(batch, TOPICS.dlq)
    original = encode("Input", input_record(huge))
    assert dead["error_class"] == dlq.RECORD_TOO_LARGE and dead["run_id"] == "r2"
    assert dead["reason"].startswith("invalid_input:record_too_large:")
    assert hashlib.sha256(original).hexdigest() in dead["reason"]
    assert original.startswith(dead["original_value"]) and len(dead["original_value"]) < LIMIT
    assert "r2" not in path.slots[0] and path.slots[0]["r3"].last_seq == 1
    assert all(record_size(r) <= LIMIT for r in batch.records)


class _FailsOnGoalChanges(InputPath):
    """A path with a bug: it raises after a GoalChanged emitted its records."""

    def _apply(self, partition: int, slot: Any, event: Event, input_id: str | None) -> None:
        super()._apply(partition, slot, event, input_id)
        if isinstance(event, GoalChanged):
            raise RuntimeError("boom")


def test_an_error_halfway_through_an_input_rolls_it_back_and_refuses_it() -> None:
    path, batch = new_path(cls=_FailsOnGoalChanges), Batch()
    path.handle(of_event(submit("r4")), batch)
    before = path.slots[0]["r4"]
    goal = GoalChanged(run_id="r4", event_id="g", at=AT + 5, trace_id="t", step=1, goal="other")
    path.handle(of_event(goal, offset=1), batch)
    assert [e["type"] for e in records_to(batch, TOPICS.events)] == [
        "RunSubmitted",
        "InputRefused",
    ]
    after = path.slots[0]["r4"]
    assert before.last_seq == 1 and before.state is not None
    assert before.state.status is not RunStatus.FAILED  # the slot before is left as it was
    assert after.last_seq == 2 and after.state is not None
    assert after.state.outcome == "invalid_input:unprocessable: RuntimeError: boom"
    assert batch.dirty["r4"][1] is after
    assert path.stats.applied == 2  # the submission and the refusal, not the rolled back input
    (dead,) = records_to(batch, TOPICS.dlq)
    assert dead["error_class"] == dlq.PROCESSING_ERROR and dead["source_offset"] == 1
    path.handle(of_event(CancelRequested(run_id="r4", event_id="c", at=AT, trace_id="t"), 2), batch)
    assert records_to(batch, TOPICS.events)[-1]["disposition"] == "LATE"


def test_inputs_held_for_a_gap_cannot_grow_the_snapshot_past_the_limit() -> None:
    path, batch = new_path(), Batch()
    path.handle(of_event(submit("r5"), producer_id="api", producer_seq=1), batch)
    for seq in range(3, 9):  # 2 never comes: each is held in the run's snapshot
        goal = GoalChanged(
            run_id="r5", event_id=f"g{seq}", at=AT + seq, trace_id="t", step=1, goal="y" * 9000
        )
        path.handle(of_event(goal, seq, producer_id="api", producer_seq=seq), batch)
    slot = path.slots[0]["r5"]
    assert len(encode("Snapshot", slot.to_record())) <= LIMIT
    assert slot.state is not None and slot.state.status is RunStatus.FAILED
    assert slot.state.outcome is not None
    assert slot.state.outcome.startswith("invalid_input:record_too_large: t.state record of")


def test_a_dead_letter_of_any_size_fits_its_limit_and_names_the_whole() -> None:
    value = bytes(range(256)) * 4000
    record = dlq.dead_letter(
        reason="r" * 5000,
        error_class="X",
        topic="t.inbox",
        partition=0,
        offset=7,
        key=b"k" * 100_000,
        value=value,
        headers=[("h", b"v" * 100_000), ("crlf", "a\r\nb"), ("\udcff", b"\xff")],
        at=AT,
        run_id="\ud800run",
    )
    encoded, notes = dlq.fit(record, 8000)
    assert len(encoded) <= 8000
    back = decode(encoded, "DeadLetter").record
    assert hashlib.sha256(value).hexdigest() in back["reason"]
    assert dict(notes)["original_length"] == str(len(value)).encode()
    assert value.startswith(back["original_value"])


# ------------------------------------------------------------------ property


_RUNS = ("p0", "p1", "p2")


def _events(run_id: str) -> list[Event]:
    return [
        submit(run_id),
        GoalChanged(run_id=run_id, event_id="g", at=AT + 1, trace_id="t", step=1, goal="g2"),
        CancelRequested(run_id=run_id, event_id="c", at=AT + 2, trace_id="t"),
        TimerFired(run_id=run_id, event_id="f", at=AT + 3, trace_id="t", timer_id="nope"),
        TimerFired(
            run_id=run_id, event_id="f2", at=AT + 3, trace_id="t", timer_id=f"{run_id}:gap:api:2"
        ),
    ]


_valid = st.builds(
    lambda run, i, numbered, seq: input_record(
        _events(run)[i],
        producer_id="api" if numbered else None,
        producer_seq=seq if numbered else None,
    ),
    st.sampled_from(_RUNS),
    st.integers(0, 4),
    st.booleans(),
    st.integers(1, 5),
)


_sizes = st.one_of(st.integers(0, 100), st.sampled_from([LIMIT // 3, LIMIT, 3 * LIMIT]))


def _hostile_body(record: dict[str, Any], body: str) -> dict[str, Any]:
    return dict(record, body=body)


_bodies = st.one_of(
    st.text(max_size=50),
    st.just('{"type": "RunSubmitted"}'),
    st.just(json.dumps({"type": "RunSubmitted", "run_id": "p0", "goal": 5})),
    st.builds(
        lambda n: json.dumps(
            {"type": "GoalChanged", "run_id": "p0", "event_id": "x", "at": AT, "trace_id": "t"}
            | {"step": 1, "goal": "w" * n}
        ),
        _sizes,
    ),
    st.builds(lambda d: "[" * d + "]" * d, st.integers(1, 5000)),
)

_records = st.one_of(
    _valid,
    st.builds(_hostile_body, _valid, _bodies),
    st.builds(lambda r, n: dict(r, trace_id="t" * n), _valid, _sizes),
    st.builds(lambda r, n: dict(r, input_id="i" * n), _valid, _sizes),
    st.builds(lambda r, at: dict(r, at=at), _valid, st.integers(-(2**63), 2**63 - 1)),
    st.builds(lambda r, k: dict(r, kind=k), _valid, st.text(max_size=20)),
)


def _mutate(data: bytes, how: int, where: int) -> bytes:
    if not data:
        return data
    i = where % len(data)
    if how == 0:
        return data[:i]  # truncated
    if how == 1:
        return data[:i] + bytes([data[i] ^ (1 << (where % 8))]) + data[i + 1 :]  # bit flip
    return data


_headers = st.lists(
    st.tuples(
        st.one_of(st.text(max_size=10), st.just("a\r\nb"), st.just("\udcff")),
        st.one_of(st.none(), st.binary(max_size=20), st.just(b"x\r\ny"), st.just("v\r\n")),
    ),
    max_size=3,
)

_keys = st.one_of(
    st.none(),
    st.just(b"right"),  # replaced by the record's own run_id
    st.just(b"right"),
    st.just(b"right"),
    st.binary(max_size=20),
    st.just(b"\xff\xfe"),
)


@st.composite
def _inputs(draw: st.DrawFn) -> tuple[bytes | None, bytes | None, list[Any]]:
    kind = draw(st.integers(0, 4))
    headers = draw(_headers)
    if kind == 0:
        return draw(st.binary(max_size=200)), draw(_keys), headers
    if kind == 1:
        return None, draw(_keys), headers
    record = draw(_records)
    try:
        value = encode("Input", record)
    except Exception:
        value = encode("Input", draw(_valid))
    if kind == 2:
        value = _mutate(value, draw(st.integers(0, 2)), draw(st.integers(0, 10**6)))
    key = draw(_keys)
    if key == b"right":
        key = str(record["run_id"]).encode("utf-8", "surrogatepass")
    return value, key, headers


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(_inputs(), min_size=1, max_size=12))
def test_every_input_ends_applied_rejected_refused_or_dead_lettered(
    inputs: list[tuple[bytes | None, bytes | None, list[Any]]],
) -> None:
    path, batch = new_path(), Batch()
    path.ended[0] = {"p2": Ended("SUCCEEDED", 5)}  # evicted after its end
    live = [(encode("Input", input_record(submit(run))), run.encode(), []) for run in _RUNS[:2]]
    for offset, (value, key, headers) in enumerate([*live, *inputs]):
        before = len(batch.records)
        stats = (path.stats.duplicates, path.stats.buffered, path.stats.stale_timers)
        path.handle(inbound(value, key=key, offset=offset, headers=headers), batch)
        new = batch.records[before:]
        events = records_to(batch, TOPICS.events, before)
        dead = records_to(batch, TOPICS.dlq, before)
        held = (path.stats.duplicates, path.stats.buffered, path.stats.stale_timers) != stats
        assert events or dead or held, f"input {offset} left no trace"
        for outcome in [*(e["disposition"] for e in events), *(d["error_class"] for d in dead)]:
            event(outcome)  # what the generated inputs reach: --hypothesis-show-statistics
        assert all(e["disposition"] in {"APPLIED", "REJECTED", "DUPLICATE", "LATE"} for e in events)
        assert all(record_size(r) <= LIMIT for r in new)
        assert batch.positions[0] == offset + 1
    for _, slot in batch.dirty.values():
        if slot.state is not None or slot.buffer:
            assert len(encode("Snapshot", slot.to_record())) <= LIMIT


# ------------------------------------------------------------------ ended and evicted runs


def test_a_parked_run_answers_an_input_as_the_slot_it_was_parked_from() -> None:
    """An ended run held as its encoded snapshot gives the same records for a late input as
    the decoded slot it came from, and is held decoded again after it."""
    held, parked = new_path(), new_path()
    for path in (held, parked):
        batch = Batch()
        path.handle(of_event(submit("r1")), batch)
        path.handle(
            of_event(CancelRequested(run_id="r1", event_id="c", at=AT, trace_id="t")), batch
        )
    slot = parked.slots[0]["r1"]
    assert slot.state is not None and slot.state.terminal
    value = encode("Snapshot", slot.to_record())
    parked.park(0, "r1", Parked(value, str(slot.state.status), slot.last_seq, slot.updated_at))
    assert "r1" not in parked.slots[0]
    outputs = []
    for path in (held, parked):
        batch = Batch()
        late = CancelRequested(run_id="r1", event_id="late", at=AT + 5, trace_id="t")
        path.handle(of_event(late, offset=2), batch)
        outputs.append(records_to(batch, TOPICS.events))
    assert outputs[0] == outputs[1] and outputs[0][0]["disposition"] == "LATE"
    assert parked.slots[0]["r1"].to_record() == held.slots[0]["r1"].to_record()
    assert "r1" not in parked.parked[0]


def test_an_input_of_a_run_evicted_after_its_end_is_answered_late_from_its_last_seq() -> None:
    path, batch = new_path(), Batch()
    path.ended[0] = {"gone": Ended("SUCCEEDED", 7)}
    cancel = CancelRequested(run_id="gone", event_id="c", at=AT, trace_id="t")
    path.handle(of_event(cancel), batch)
    (event,) = records_to(batch, TOPICS.events)
    assert (event["seq"], event["disposition"], event["reason"]) == (8, "LATE", "run is SUCCEEDED")
    assert path.ended[0]["gone"].last_seq == 8 and "gone" not in path.slots.get(0, {})
    assert not batch.dirty  # no snapshot: its state is not held any more
    assert [r["last_seq"] for r in records_to(batch, TOPICS.runs)] == [8]


def test_a_late_answer_over_the_limit_leaves_the_evicted_runs_seq_as_it_was() -> None:
    path, batch = new_path(), Batch()
    path.ended[0] = {"gone": Ended("FAILED", 3)}
    goal = GoalChanged(run_id="gone", event_id="g", at=AT, trace_id="t", step=1, goal="x" * LIMIT)
    path.handle(of_event(goal), batch)
    (dead,) = records_to(batch, TOPICS.dlq)
    assert dead["error_class"] == dlq.RECORD_TOO_LARGE
    assert not records_to(batch, TOPICS.events) and path.ended[0]["gone"].last_seq == 3
    assert not records_to(batch, TOPICS.runs)


def test_a_submission_of_a_run_in_the_store_of_ended_runs_is_late_whatever_its_at() -> None:
    """A run evicted and forgotten by memory (a restart) is found in the run store: its
    submission again, with a fresh `at`, is answered LATE at its next seq, never run again."""
    stored = {"gone": Ended("SUCCEEDED", 7, AT, "sha256:abc")}
    path = InputPath(
        TOPICS,
        PathSettings(buffer_limit=8, gap_timeout_ms=1000, max_log_events=50),
        ProcessorStats(),
        limits=RecordLimits(default=LIMIT),
        model_partitions=lambda: 3,
        clock=lambda: AT / 1000,
        recall=lambda partition, run_id: stored.get(run_id),
    )
    batch = Batch()
    again = RunSubmitted(run_id="gone", event_id="g:submit", at=AT + 10**9, trace_id="t", goal="g")
    path.handle(of_event(again), batch)
    path.handle(of_event(submit("fresh"), offset=1), batch)
    (late,) = [e for e in records_to(batch, TOPICS.events) if e["run_id"] == "gone"]
    assert (late["seq"], late["disposition"]) == (8, "LATE")
    (kept,) = records_to(batch, TOPICS.runs)
    assert kept == {
        "run_id": "gone",
        "status": "SUCCEEDED",
        "last_seq": 8,
        "ended_at": AT,
        "result_ref": "sha256:abc",
    }
    assert "gone" not in path.slots[0] and "fresh" in path.slots[0]
    assert {e["run_id"] for e in records_to(batch, TOPICS.effects["model"])} == {"fresh"}


def test_a_run_keeps_the_marks_of_the_producers_it_heard_from_last() -> None:
    path, batch = new_path(), Batch()
    path.handle(of_event(submit("many"), producer_id="api", producer_seq=1), batch)
    for i in range(MAX_PRODUCER_MARKS + 5):
        cancel = CancelRequested(run_id="many", event_id=f"c{i}", at=AT + i, trace_id="t")
        path.handle(of_event(cancel, i + 1, producer_id=f"p{i}", producer_seq=1), batch)
    marks = path.slots[0]["many"].producer_marks
    assert len(marks) == MAX_PRODUCER_MARKS
    assert "api" not in marks and f"p{MAX_PRODUCER_MARKS + 4}" in marks


# ------------------------------------------------------------------ repeated answers


def _model_effects(batch: Batch, since: int = 0) -> list[Effect]:
    return [
        parse_effect_body(decode(r[2], "Effect").record["body"])
        for r in batch.records[since:]
        if r[0] == TOPICS.effects["model"]
    ]


def _answer(effect: Effect, input_id: str | None = None) -> Inbound:
    """The executor's answer to ``effect``: what it sends, and re-sends from its record."""
    event = ModelCallCompleted(
        **event_identity(effect, at=AT + 1),
        step=effect.step,
        attempt=effect.attempt,
        outcome=ModelOutcome.INCOMPLETE,  # the core calls the model again: a second attempt
    )
    record = input_record(event, input_id=input_id or result_input_id(effect))
    return inbound(encode("Input", record), key=effect.run_id.encode())


def test_a_repeated_answer_to_an_effect_changes_nothing_however_it_comes_back() -> None:
    """An executor may send an answer again (a crash after the send and before its offsets
    were committed, or its producer's retry after a new start): byte-identical, same input id.
    The run applies it once; a repeat is dropped by its input id, and the answer to an older
    attempt of the effect by its step and attempt, with no new effect either way."""
    path, batch = new_path(), Batch()
    path.handle(of_event(submit("r")), batch)
    (first,) = _model_effects(batch)
    answer = _answer(first)
    mark = len(batch.records)
    path.handle(answer, batch)
    (second,) = _model_effects(batch, mark)
    assert (second.step, second.attempt) == (first.step, first.attempt + 1)
    slot = path.slots[0]["r"]
    state, seq = slot.state, slot.last_seq
    repeats = [
        answer,  # the same record again
        _answer(first, input_id="another id"),  # the same answer event under another input id
        _answer(replace(first, idempotency_key="k2")),  # another answer to the older attempt
    ]
    for repeat in repeats:
        mark = len(batch.records)
        path.handle(repeat, batch)
        assert _model_effects(batch, mark) == []
        assert slot.state == state
    events = [e for e in records_to(batch, TOPICS.events) if e["seq"] > seq]
    assert [e["disposition"] for e in events] == ["DUPLICATE", "LATE"]
    assert path.stats.duplicates == 2


def _tenant_path(trust: bool) -> InputPath:
    return InputPath(
        TOPICS,
        PathSettings(default_tenant="upstream", tenant_header="trusted" if trust else "default"),
        ProcessorStats(),
        clock=lambda: AT / 1000,
    )


def test_a_task_produced_straight_to_kafka_gets_the_default_tenant_or_its_trusted_header() -> None:
    def applied(path: InputPath, event: RunSubmitted, header: bytes | None) -> Batch:
        batch = Batch()
        record = encode("Input", input_record(event))
        headers: list[tuple[str, str | bytes | None]] = []
        if header is not None:
            headers.append(("agentruns-tenant", header))
        path.handle(inbound(record, key=event.run_id.encode(), headers=headers), batch)
        return batch

    untrusted = _tenant_path(trust=False)
    applied(untrusted, submit("t1"), b"billing")  # the header is not trusted: ignored
    assert untrusted.slots[0]["t1"].state.tenant == "upstream"  # type: ignore[union-attr]
    trusted = _tenant_path(trust=True)
    batch = applied(trusted, submit("t2"), b"billing")
    assert trusted.slots[0]["t2"].state.tenant == "billing"  # type: ignore[union-attr]
    (first, *_) = records_to(batch, TOPICS.events)
    assert json.loads(first["body"])["tenant"] == "billing"  # in the run's log
    # a tenant the submission names itself (the API's) is kept, whatever the header says
    applied(trusted, replace(submit("t3"), tenant="ops"), b"billing")
    assert trusted.slots[0]["t3"].state.tenant == "ops"  # type: ignore[union-attr]
    # a trusted header that is no tenant name refuses the input
    batch = applied(trusted, submit("t4"), b"Not A Tenant\xff")
    (dead,) = records_to(batch, TOPICS.dlq)
    assert "tenant" in dead["reason"] and "t4" not in trusted.slots.get(0, {})
    # the default tenant is not written: a run's log is the bytes it was before tenants
    plain = InputPath(TOPICS, PathSettings(), ProcessorStats(), clock=lambda: AT / 1000)
    batch = applied(plain, submit("t5"), None)
    (first, *_) = records_to(batch, TOPICS.events)
    assert "tenant" not in json.loads(first["body"])
