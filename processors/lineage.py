"""Forks and resumes, pure: the state a run had at one seq, the fork's first record, and where
a failed run is resumed (docs/design.md, "Lineage: forks and resumes").

A fork is a new run whose log begins with a `ForkedFrom` record carrying its source's state at
the fork point; the core starts it from that record alone (`transition._on_forked`). The
shell reads the source's log, and these functions decide from it what to write.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec

from agentruns.processors import versions
from agentruns.processors.events import (
    CarriedArtifact,
    Event,
    ForkedFrom,
    ModelCallCompleted,
    ModelOutcome,
    ToolCallFailed,
    ToolCallTimedOut,
    parse_event,
)
from agentruns.processors.ids import submit_event_id, trace_id_for
from agentruns.processors.state import ForkEdits, RunState, RunStatus
from agentruns.processors.transition import Artifact, Disposition, budgets_refusal

#: Statuses a run may be resumed from: it ended without doing what it was asked.
RESUMABLE: frozenset[RunStatus] = frozenset(
    {RunStatus.FAILED, RunStatus.EXPIRED, RunStatus.BUDGET_EXHAUSTED}
)


class ForkError(ValueError):
    """A fork or a resume that cannot be made, with the reason (no such run, no such seq...)."""


@dataclass(frozen=True, slots=True)
class Folded:
    """One record of a run's log, as its fold saw it."""

    seq: int
    event: Event
    disposition: Disposition
    state: RunState | None  # the run's state after this record
    artifacts: tuple[Artifact, ...] = ()  # what its transition stored


def folded(records: Iterable[tuple[int, Event]]) -> list[Folded]:
    """A run's log (seq, event), folded under the run's own rules version."""
    out: list[Folded] = []
    state: RunState | None = None
    for seq, event in records:
        result = versions.apply(state, event)
        state = result.state
        out.append(Folded(seq, event, result.disposition, state, result.artifacts))
    return out


def state_at(log: Sequence[Folded], seq: int) -> RunState:
    """The run's state after its record `seq` (ForkError when the log has no such record)."""
    if not log:
        raise ForkError("the run has no records")
    last = log[-1].seq
    if seq < 1 or seq > last:
        raise ForkError(f"seq {seq} is outside the run's log (1..{last})")
    for entry in log:
        if entry.seq == seq:
            if entry.state is None:
                raise ForkError(f"the run has no state at seq {seq}")
            return entry.state
    raise ForkError(f"the run's log has no record {seq}")


def with_replaced(log: Sequence[Folded], edits: ForkEdits, seq: int) -> list[Folded]:
    """The run's log folded again with the records `edits` replaces (a fork at `seq` from
    another answer than the source had); the log itself when it replaces none. ForkError for a
    replacement after the fork point, of no record, twice the same seq, or for another run."""
    if not edits.replaced_inputs:
        return list(log)
    replaced: dict[int, Event] = {}
    run_id = log[0].event.run_id if log else ""
    for r in edits.replaced_inputs:
        if r.seq in replaced:
            raise ForkError(f"record {r.seq} is replaced twice")
        if r.seq < 1 or r.seq > seq:
            raise ForkError(f"record {r.seq} is not at or before the fork point {seq}")
        try:
            event = parse_event(r.event)
        except msgspec.DecodeError as exc:
            raise ForkError(f"the replacement of record {r.seq} is not an event: {exc}") from None
        if event.run_id != run_id:
            raise ForkError(f"the replacement of record {r.seq} is for another run")
        replaced[r.seq] = event
    if min(replaced) == 1:
        raise ForkError("the first record cannot be replaced: submit another task instead")
    return folded((e.seq, replaced.get(e.seq, e.event)) for e in log)


def fork_record(
    source: Sequence[Folded],
    seq: int,
    *,
    run_id: str,
    at: int,
    edits: ForkEdits | None = None,
    actor: str | None = None,
) -> ForkedFrom:
    """The first record of the fork `run_id` of the run whose log is `source`, at `seq`."""
    edits = edits or ForkEdits()
    log = with_replaced(source, edits, seq)
    state = state_at(log, seq)
    if run_id == state.run_id:
        raise ForkError("a fork needs a run id of its own (another idempotency key)")
    if edits.messages and state.status is not RunStatus.MODEL_RUNNING:
        raise ForkError(
            f"messages are added where the model is asked; at seq {seq} the run is "
            f"{state.status.value}"
        )
    if edits.budgets is not None:
        refused = budgets_refusal(state.config.budgets, edits.budgets, max(at, state.time.last_at))
        if refused is not None:
            raise ForkError(refused)
    # folded again from a replaced record on, the source's state names artifacts (contexts,
    # results) nobody stored: the record carries them, the processor stores them with it
    carried: dict[str, CarriedArtifact] = {}
    if edits.replaced_inputs:
        first = min(r.seq for r in edits.replaced_inputs)
        for entry in log:
            if first <= entry.seq <= seq:
                for a in entry.artifacts:
                    carried.setdefault(
                        a.ref,
                        CarriedArtifact(ref=a.ref, media_type=a.media_type, content=a.content),
                    )
    return ForkedFrom(
        run_id=run_id,
        event_id=submit_event_id(run_id),
        at=max(at, state.time.last_at),
        trace_id=trace_id_for(run_id),
        source_run_id=state.run_id,
        source_seq=seq,
        state=state,
        edits=edits,
        artifacts=tuple(carried.values()),
        actor=actor,
    )


def _terminal(state: RunState | None) -> bool:
    return state is not None and state.terminal


def _failure_of(event: Event) -> str | None:
    """What failed, if `event` reports a failed effect: an operation's key or a model step."""
    match event:
        case ToolCallFailed() | ToolCallTimedOut():
            return "op:" + event.operation_key
        case ModelCallCompleted() if event.outcome is not ModelOutcome.FINISHED:
            return f"model:{event.step}"
    return None


def resume_point(log: Sequence[Folded], *, cancelled: bool = False) -> int:
    """Where a failed run is resumed: the seq just before the first failure of the effect whose
    failure ended it (its retries included, so the fork gives it its whole allowance again), or
    the seq before the record that ended it when no effect failed (a budget stop, a refused
    input). With `cancelled`, a cancelled run too: the seq before its cancel was asked.
    ForkError when the run is not resumable."""
    if not log or log[-1].state is None:
        raise ForkError("the run has no state")
    final = log[-1].state
    if cancelled and final.status is RunStatus.CANCELLED:
        return _before_cancel(log)
    if final.status not in RESUMABLE:
        what = "still running" if not final.terminal else final.status.value
        hint = " (resume it as cancelled explicitly)" if final.status is RunStatus.CANCELLED else ""
        raise ForkError(f"only a failed run is resumed (the run is {what}){hint}; fork it instead")
    # the record that ended the run (after its last correction, if it was reopened)
    end = len(log) - 1
    while end > 0 and _terminal(log[end - 1].state):
        end -= 1
    failed: list[tuple[int, str]] = []
    for i, entry in enumerate(log[: end + 1]):
        failure = _failure_of(entry.event)
        if (
            failure is not None
            and entry.disposition is Disposition.APPLIED
            and entry.state is not None
            and entry.state.resolution == final.resolution
        ):
            failed.append((i, failure))
    if not failed:
        if end == 0:
            raise ForkError("the run ended at its first record: submit it again instead")
        return log[end - 1].seq
    last = failed[-1][1]
    first = next(i for i, w in failed if w == last)
    if first == 0:
        raise ForkError("the run failed at its first record")
    return log[first - 1].seq


def _before_cancel(log: Sequence[Folded]) -> int:
    """The seq before the record at which the run's cancel was asked (the first of the
    records at its end whose state asks for the cancel or has ended)."""

    def cancelling(entry: Folded) -> bool:
        return entry.state is not None and (entry.state.cancel_requested or entry.state.terminal)

    first = len(log) - 1
    while first > 0 and cancelling(log[first - 1]):
        first -= 1
    if first == 0:
        raise ForkError("the run was cancelled at its first record")
    return log[first - 1].seq
