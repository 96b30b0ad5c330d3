"""The seq protocol (R5) as decisions: which input of a run applies now, which waits for a gap
to fill, which is a duplicate, when a gap timer is armed and what its firing does.

Plain values in (a run's slot, an Input record, event time), decisions out; no Kafka, no clock,
no I/O. `InputPath` (streams/inputs.py) carries the decisions out: it applies inputs through
the core, produces the timer effects, counts and dead-letters.

`Sequencer.admit` is a generator of `Step`s, in the order they must be carried out. The slot's
seq fields (producer marks, buffer, remembered digests, gap_since) change as it goes, and the
code after a yielded step runs only once the caller has carried that step out: when carrying
out a step raises, the generator is abandoned there and nothing after it changes the slot,
just as if the protocol had been written inline.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from agentruns.processors.events import Event, TimerFired

GAP_TIMER = ":gap:"
"""Marks a gap timer's id: `<run_id>:gap:<producer_id>:<expected seq>`."""

MAX_PRODUCER_MARKS = 64
"""Producers whose marks a run keeps: the one heard from longest ago is forgotten past it (a
run hears from a few: the API, the executors, the timer service)."""


class SeqSlot(Protocol):
    """What the protocol reads and changes of a run's slot (`records.RunSlot`)."""

    run_id: str
    buffer: list[dict[str, Any]]
    gap_since: int | None
    producer_marks: dict[str, int]

    def remember(self, key: str, digest: str) -> None: ...

    def recalled(self, key: str) -> str | None: ...


@dataclass(slots=True)
class Ended:
    """What is kept of a run evicted after its end: enough to answer a late input LATE (in
    memory, the `runs` topic and the processor's `RunStore`)."""

    status: str
    last_seq: int
    ended_at: int = 0  # the run's last `at`
    result_ref: str | None = None


def next_seq(last_seq: int, max_log_events: int) -> int | None:
    """The seq of a run's next event; None when its log is at the cap."""
    return None if last_seq >= max_log_events else last_seq + 1


def gap_timer_id(run_id: str, producer_id: str, expected: int) -> str:
    return f"{run_id}{GAP_TIMER}{producer_id}:{expected}"


def parse_gap_timer(run_id: str, timer_id: str) -> tuple[str, int] | None:
    """(producer_id, expected seq) of a gap timer of `run_id`; None if the id is not one."""
    prefix = run_id + GAP_TIMER
    if not timer_id.startswith(prefix):
        return None
    producer_id, _, expected = timer_id[len(prefix) :].rpartition(":")
    if not producer_id or not expected.isascii() or not expected.isdigit():
        return None
    return producer_id, int(expected)


# ------------------------------------------------------------------ steps


@dataclass(frozen=True, slots=True)
class Apply:
    """Apply this input through the core now.

    `numbered`: its producer seq is used up already, so a refusal of it is dead-lettered and
    the steps after it go on; an unnumbered input's refusal ends the admission (it is not
    remembered as applied). `held`: it waited in the buffer (its inbox offset is long
    committed). `event`: the input's event when the protocol had to parse it."""

    record: dict[str, Any]
    numbered: bool
    held: bool = False
    event: Event | None = None


@dataclass(frozen=True, slots=True)
class Duplicate:
    """An input applied before, with the same content: counted, not applied again."""

    key: str


@dataclass(frozen=True, slots=True)
class Conflict:
    """An input applied before with other content: refused whole."""

    key: str


@dataclass(frozen=True, slots=True)
class Hold:
    """The input waits in the run's buffer for the gap before it to fill."""

    record: dict[str, Any]


@dataclass(frozen=True, slots=True)
class BufferFull:
    """The run's buffer holds `limit` inputs already: the input is refused whole."""

    limit: int


@dataclass(frozen=True, slots=True)
class ArmGapTimer:
    """Schedule the timer of a gap that has just opened: producer `producer_id`'s input
    `expected` has not come, later ones wait. `at`/`trace_id`: the input that opened it."""

    timer_id: str
    producer_id: str
    expected: int
    due_at: int
    at: int
    trace_id: str


@dataclass(frozen=True, slots=True)
class GapExpired:
    """A gap timer fired while its gap was open: the core records `GapTimedOut` (the run
    fails); then the gap is skipped and the held inputs after it apply."""

    fired: TimerFired
    producer_id: str
    expected: int
    diagnosis: str


@dataclass(frozen=True, slots=True)
class StaleGapTimer:
    """A gap timer fired after its gap filled (or names no gap of the run): nothing to do."""

    timer_id: str


Step = Apply | Duplicate | Conflict | Hold | BufferFull | ArmGapTimer | GapExpired | StaleGapTimer


# ------------------------------------------------------------------ the protocol


def open_gaps(slot: SeqSlot) -> dict[str, int]:
    """producer_id -> the seq its held inputs wait for, for each producer with held inputs."""
    marks = slot.producer_marks
    return {held["producer_id"]: marks.get(held["producer_id"], 0) + 1 for held in slot.buffer}


@dataclass(frozen=True)
class Sequencer:
    """The seq protocol of one processor: its buffer bound and gap timeout."""

    buffer_limit: int
    gap_timeout_ms: int
    digest: Callable[[str, str], str]  # (kind, body) -> the content digest duplicates compare

    def admit(
        self, slot: SeqSlot, record: dict[str, Any], parse: Callable[[], Event]
    ) -> Generator[Step, None, None]:
        """The steps of one Input `record` of the run held in `slot`. `parse` gives the input's
        event (its errors propagate); it is called only when the protocol needs the event, so
        a duplicate is never parsed."""
        pid, pseq = record["producer_id"], record["producer_seq"]
        if pid is None or pseq is None:
            yield from self._unnumbered(slot, record, parse)
            return
        digest = self.digest(record["kind"], record["body"])
        mark = slot.producer_marks.get(pid, 0)
        if pseq <= mark:
            # Older than the window of remembered digests: cannot be compared, so it is
            # treated as the duplicate it almost surely is.
            key = f"p:{pid}:{pseq}"
            yield _duplicate(slot.recalled(key) or digest, digest, key)
            return
        gaps = open_gaps(slot) if slot.buffer else {}
        if pseq > mark + 1:
            yield self._hold(slot, record, digest)
        else:
            self.spend(slot, record)
            yield Apply(record, numbered=True)
            yield from self._drain(slot)
        yield from self._arm(slot, gaps, record["at"], record["trace_id"])

    def spend(self, slot: SeqSlot, record: dict[str, Any]) -> None:
        """Use up the seq of a producer's next input, before it is applied: a refused input
        never blocks the ones behind it."""
        pid, pseq = record["producer_id"], record["producer_seq"]
        marks = slot.producer_marks
        marks.pop(pid, None)  # re-inserted last: the marks are in the order last heard
        marks[pid] = pseq
        if len(marks) > MAX_PRODUCER_MARKS:
            del marks[next(iter(marks))]
        slot.remember(f"p:{pid}:{pseq}", self.digest(record["kind"], record["body"]))

    def refused(self, slot: SeqSlot, record: dict[str, Any], input_id: str) -> None:
        """An input the processor refuses (and fails its run with) is used up as if applied:
        its seq if it was the producer's next, else its id, so it comes back a duplicate."""
        pid, pseq = record["producer_id"], record["producer_seq"]
        if pid is not None and pseq is not None:
            if pseq == slot.producer_marks.get(pid, 0) + 1:
                self.spend(slot, record)
        else:
            slot.remember(f"i:{input_id}", self.digest(record["kind"], record["body"]))

    def _unnumbered(
        self, slot: SeqSlot, record: dict[str, Any], parse: Callable[[], Event]
    ) -> Iterator[Step]:
        """Executor results and timer firings: deduped by input id within the window of
        remembered digests (their senders re-send byte-identical inputs)."""
        digest = self.digest(record["kind"], record["body"])
        key = f"i:{record['input_id']}"
        known = slot.recalled(key)
        if known is not None:
            yield _duplicate(known, digest, key)
            return
        event = parse()
        if isinstance(event, TimerFired) and GAP_TIMER in event.timer_id:
            yield from self._gap_timer_fired(slot, event, record["trace_id"])
            return
        yield Apply(record, numbered=False, event=event)
        slot.remember(key, digest)

    def _hold(self, slot: SeqSlot, record: dict[str, Any], digest: str) -> Step:
        pid, pseq = record["producer_id"], record["producer_seq"]
        for held in slot.buffer:
            if held["producer_id"] == pid and held["producer_seq"] == pseq:
                known = self.digest(held["kind"], held["body"])
                return _duplicate(known, digest, f"p:{pid}:{pseq}")
        if len(slot.buffer) >= self.buffer_limit:
            return BufferFull(self.buffer_limit)
        slot.buffer.append(dict(record))
        if slot.gap_since is None:
            slot.gap_since = record["at"]
        return Hold(record)

    def _drain(self, slot: SeqSlot) -> Iterator[Step]:
        """Apply held inputs whose turn has come, in producer order."""
        progressed = True
        while progressed and slot.buffer:
            progressed = False
            for held in list(slot.buffer):
                if held["producer_seq"] == slot.producer_marks.get(held["producer_id"], 0) + 1:
                    slot.buffer.remove(held)
                    self.spend(slot, held)
                    yield Apply(held, numbered=True, held=True)
                    progressed = True
        slot.gap_since = min((h["at"] for h in slot.buffer), default=None)

    def _arm(self, slot: SeqSlot, before: dict[str, int], at: int, trace: str) -> Iterator[Step]:
        """A timer for each gap open now that was not open before this input (a producer's
        first held input, or a gap further on once the one before it closed)."""
        if not slot.buffer:
            return
        for pid, expected in open_gaps(slot).items():
            if before.get(pid) != expected:
                yield ArmGapTimer(
                    timer_id=gap_timer_id(slot.run_id, pid, expected),
                    producer_id=pid,
                    expected=expected,
                    due_at=at + self.gap_timeout_ms,
                    at=at,
                    trace_id=trace,
                )

    def _gap_timer_fired(self, slot: SeqSlot, fired: TimerFired, trace: str) -> Iterator[Step]:
        """The gap did not fill in time: diagnose it, skip it, apply what waits behind it."""
        parsed = parse_gap_timer(slot.run_id, fired.timer_id)
        if parsed is None:
            yield StaleGapTimer(fired.timer_id)
            return
        pid, expected = parsed
        waiting = sorted(h["producer_seq"] for h in slot.buffer if h["producer_id"] == pid)
        if slot.producer_marks.get(pid, 0) >= expected or not waiting:
            yield StaleGapTimer(fired.timer_id)  # the gap filled before the timer fired
            return
        first = waiting[0]
        before = open_gaps(slot)
        yield GapExpired(
            fired,
            pid,
            expected,
            f"inputs {expected}..{first - 1} of producer {pid} did not arrive within "
            f"{self.gap_timeout_ms} ms; {len(waiting)} later inputs applied after the gap",
        )
        slot.producer_marks[pid] = first - 1
        yield from self._drain(slot)
        yield from self._arm(slot, before, fired.at, trace)


def _duplicate(known: str, digest: str, key: str) -> Duplicate | Conflict:
    return Duplicate(key) if known == digest else Conflict(key)


__all__ = [
    "GAP_TIMER",
    "MAX_PRODUCER_MARKS",
    "Apply",
    "ArmGapTimer",
    "BufferFull",
    "Conflict",
    "Duplicate",
    "Ended",
    "GapExpired",
    "Hold",
    "SeqSlot",
    "Sequencer",
    "StaleGapTimer",
    "Step",
    "gap_timer_id",
    "next_seq",
    "open_gaps",
    "parse_gap_timer",
]
