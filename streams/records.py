"""Envelope records built from core objects: the one place that maps the pure core to the wire.

Every producer of `Event`, `Effect`, `Snapshot` and `Result` records (the processor, tests,
benchmarks) builds them here, and every reader (sink, replay, audit) parses bodies back with the
core's own adapters, so the two sides cannot drift.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import msgspec

from agentruns.processors.effects import EFFECT_DECODER, Effect, PublishResult
from agentruns.processors.events import EVENT_DECODER, Event
from agentruns.processors.state import RunState, decode_state
from agentruns.processors.transition import Transition
from agentruns.streams.codec import decode
from agentruns.streams.sequencing import Ended

EFFECT_TOPIC_KIND: dict[str, str] = {
    "CallModel": "model",
    "CallTool": "tool",
    "Reconcile": "tool",
    "PollTool": "tool",
    "CancelTool": "tool",
    # A child run's end, to the tool executor that answers its parent's call.
    "NotifyParent": "tool",
    "ScheduleTimer": "timer",
    "CancelTimer": "timer",
    # A question for a person: the timer service owns its expiry; the API reads it from state.
    "AskUser": "timer",
}
"""Which `effects.<kind>` topic carries each effect type (PublishResult goes to results)."""

RECENT_INPUTS = 32
"""How many applied inputs per run keep their digest for duplicate/conflict detection."""


def input_digest(kind: str, body: str) -> str:
    return hashlib.sha256(f"{kind}\n{body}".encode()).hexdigest()[:16]


def event_body(event: Event) -> str:
    return event.model_dump_json()


def parse_event_body(body: str) -> Event:
    return EVENT_DECODER.decode(body)


def parse_effect_body(body: str) -> Effect:
    return EFFECT_DECODER.decode(body)


def parse_state(state_json: str | None) -> RunState | None:
    return None if state_json is None else decode_state(state_json)[0]


def state_json(state: RunState, extra: dict[str, Any]) -> str:
    """A snapshot's state: the state's JSON and, after its own fields, the fields a newer
    version wrote that this one does not know (`RunSlot.extra`)."""
    text = state.model_dump_json()
    if not extra:
        return text
    return text[:-1] + "," + _JSON.encode(extra).decode()[1:]


_JSON = msgspec.json.Encoder()


class _ResultRef(msgspec.Struct):
    result_ref: str | None = None


def result_ref_of(state_json: str | None) -> str | None:
    """The result ref of a run state's JSON, the rest of it skipped: what eviction keeps of a
    run restored parked (not decoded)."""
    if state_json is None:
        return None
    return msgspec.json.decode(state_json, type=_ResultRef).result_ref


def identity(event: Event, state: RunState | None) -> tuple[int, int]:
    """(step, attempt) of an event: its own when it names them, else the run's after it (R4)."""
    step = getattr(event, "step", None)
    attempt = getattr(event, "attempt", None)
    if state is not None:
        step = state.step if step is None else step
        attempt = state.attempt if attempt is None else attempt
    return int(step or 0), int(attempt or 0)


def input_record(
    event: Event,
    *,
    input_id: str | None = None,
    producer_id: str | None = None,
    producer_seq: int | None = None,
    reply_to: str | None = None,
) -> dict[str, Any]:
    """The inbox `Input` record carrying `event` (its id, time and trace are the event's)."""
    return {
        "input_id": input_id or event.event_id,
        "run_id": event.run_id,
        "kind": event.type,
        "trace_id": event.trace_id,
        "producer_id": producer_id,
        "producer_seq": producer_seq,
        "at": event.at,
        "body": event.model_dump_json(),
        "reply_to": reply_to,
    }


def event_record(
    run_id: str, seq: int, event: Event, result: Transition, *, input_id: str | None
) -> dict[str, Any]:
    step, attempt = identity(event, result.state)
    return {
        "run_id": run_id,
        "seq": seq,
        "event_id": event.event_id,
        "type": event.type,
        "step": step,
        "attempt": attempt,
        "trace_id": event.trace_id,
        "at": event.at,
        "disposition": str(result.disposition),
        "reason": result.reason,
        "body": event_body(event),
        "input_id": input_id,
    }


def effect_record(effect: Effect, *, seq: int, at: int) -> dict[str, Any]:
    return {
        "idempotency_key": effect.idempotency_key,
        "run_id": effect.run_id,
        "seq": seq,
        "step": effect.step,
        "attempt": effect.attempt,
        "type": effect.type,
        "trace_id": effect.trace_id,
        "at": at,
        "body": effect.model_dump_json(),
    }


def result_record(effect: PublishResult, *, seq: int, at: int) -> dict[str, Any]:
    return {
        "run_id": effect.run_id,
        "status": str(effect.status),
        "seq": seq,
        "version": effect.resolution,
        "result_ref": effect.result_ref,
        "summary": effect.summary,
        "trace_id": effect.trace_id,
        "at": at,
        "body": effect.model_dump_json(),
    }


def ended_run_record(run_id: str, ended: Ended) -> dict[str, Any]:
    """The `runs` topic's value (`EndedRun`) for a run evicted after its end."""
    return {
        "run_id": run_id,
        "status": ended.status,
        "last_seq": ended.last_seq,
        "ended_at": ended.ended_at,
        "result_ref": ended.result_ref,
    }


def ended_run_of(record: dict[str, Any]) -> Ended:
    """What an `EndedRun` record keeps of its run."""
    return Ended(record["status"], record["last_seq"], record["ended_at"], record["result_ref"])


@dataclass(frozen=True, slots=True)
class Parked:
    """A run held after its end as the snapshot its last transaction wrote, decoded into a
    `RunSlot` again only if an input for it arrives. Ended runs are held for the terminal
    retention, and a decoded one takes several times its snapshot's bytes (docs/benchmarks.md,
    "Processor memory")."""

    value: bytes  # the encoded Snapshot
    status: str
    last_seq: int
    updated_at: int
    result_ref: str | None = None

    def slot(self) -> RunSlot:
        slot = RunSlot.from_record(decode(self.value, expected_name="Snapshot").record)
        slot.size_estimate = len(self.value) + len(slot.run_id)
        return slot


@dataclass
class RunSlot:
    """What the processor holds per run between transactions; serialized as a Snapshot."""

    run_id: str
    state: RunState | None = None
    last_seq: int = 0
    version: int = 0
    buffer: list[dict[str, Any]] = field(default_factory=list)
    gap_since: int | None = None
    producer_marks: dict[str, int] = field(default_factory=dict)
    recent: list[tuple[str, str]] = field(default_factory=list)
    updated_at: int = 0
    # The run's trace context (streams/tracing.py): edge data, so it lives here, not in the
    # core's state.
    traceparent: str | None = None
    # Not serialized: an upper estimate of the encoded snapshot (exact after each seal), so
    # the processor measures a snapshot only when it may be near the record limit.
    size_estimate: int = 0
    # The state's top-level fields this version does not know (a newer version wrote them):
    # written back with every later snapshot, so rolling back and forth loses none of them.
    extra: dict[str, Any] = field(default_factory=dict)

    def copy(self) -> RunSlot:
        """A copy one input can change without touching this slot (the state is immutable)."""
        return RunSlot(
            self.run_id,
            self.state,
            self.last_seq,
            self.version,
            list(self.buffer),
            self.gap_since,
            dict(self.producer_marks),
            list(self.recent),
            self.updated_at,
            self.traceparent,
            self.size_estimate,
            self.extra,
        )

    def remember(self, key: str, digest: str) -> None:
        self.recent.append((key, digest))
        if len(self.recent) > RECENT_INPUTS:
            del self.recent[: len(self.recent) - RECENT_INPUTS]

    def recalled(self, key: str) -> str | None:
        for k, digest in reversed(self.recent):
            if k == key:
                return digest
        return None

    def to_record(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "last_seq": self.last_seq,
            "version": self.version,
            "status": None if self.state is None else str(self.state.status),
            "state": None if self.state is None else state_json(self.state, self.extra),
            "buffer": list(self.buffer),
            "gap_since": self.gap_since,
            "producer_marks": dict(self.producer_marks),
            "seen_input_ids": [],
            "updated_at": self.updated_at,
            "recent_inputs": [{"key": k, "digest": d} for k, d in self.recent],
            "traceparent": self.traceparent,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> RunSlot:
        """Raises msgspec.DecodeError when the state does not decode (its known fields)."""
        text = record["state"]
        state, extra = (None, {}) if text is None else decode_state(text)
        return cls(
            run_id=record["run_id"],
            state=state,
            extra=extra,
            last_seq=record["last_seq"],
            version=record["version"],
            buffer=list(record["buffer"]),
            gap_since=record["gap_since"],
            producer_marks=dict(record["producer_marks"]),
            recent=[(r["key"], r["digest"]) for r in record.get("recent_inputs", [])],
            updated_at=record["updated_at"],
            traceparent=record.get("traceparent"),
        )
