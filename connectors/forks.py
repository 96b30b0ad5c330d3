"""`agentruns fork` and `agentruns resume`: a new run from another run's state at one seq.

The source's log is read from `<prefix>.events` and folded (the core decides the state and,
for a resume, the seq: `agentruns.processors.lineage`); the fork's `ForkedFrom` record is
produced to the inbox through the door of a task (`RunsProducer.fork`): input 1 of its
producer for a run whose id derives from the idempotency key, so forking twice with one key
gives one fork. The source is only read, never written.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from agentruns.connectors.errors import AgentrunsError, InvalidArgumentError
from agentruns.connectors.lifecycle import progress
from agentruns.connectors.projection.reading import read_log
from agentruns.connectors.settings import current
from agentruns.processors.events import ForkedFrom, parse_event
from agentruns.processors.ids import canonical_json, request_hash, run_id_for_key
from agentruns.processors.limits import MAX_ID_CHARS, MAX_ITEMS, MAX_TEXT_CHARS
from agentruns.processors.lineage import (
    Folded,
    ForkError,
    folded,
    fork_record,
    resume_point,
    state_at,
)
from agentruns.processors.state import Budgets, ForkEdits, Message, Messages, ReplacedInput
from agentruns.streams.clock import now_ms
from agentruns.streams.records import parse_event_body
from agentruns.streams.topics import default_prefix


class NoSuchRunError(AgentrunsError):
    """The run to fork has no records in the log."""


class ForkRefusedError(AgentrunsError):
    """The fork cannot be made (a seq outside the log, a run that did not fail...)."""


@dataclass(frozen=True, slots=True)
class Fork:
    """A fork as produced: its record and the key it was made under."""

    record: ForkedFrom
    idempotency_key: str

    def as_json(self) -> dict[str, Any]:
        r = self.record
        return {
            "run_id": r.run_id,
            "trace_id": r.trace_id,
            "input_id": r.event_id,
            "source_run_id": r.source_run_id,
            "source_seq": r.source_seq,
            "status": str(r.state.status),
            "step": r.state.step,
            "edits": r.edits.model_dump(),
            "idempotency_key": self.idempotency_key,
        }


def source_log(bootstrap: str, prefix: str, run_id: str) -> list[Folded]:
    """The run's log, folded; NoSuchRunError when it has none."""
    if not run_id or len(run_id) > MAX_ID_CHARS:
        raise NoSuchRunError(f"no run {run_id[:80]!r}")
    records = read_log(bootstrap, prefix, [run_id], say=progress("fork")).get(run_id, [])
    if not records:
        raise NoSuchRunError(f"no run {run_id}: the log has no records of it")
    return folded((r["seq"], parse_event_body(r["body"])) for r in records)


def default_key(source_run_id: str, seq: int, edits: ForkEdits) -> str:
    """The key of a fork made without one: the same fork of the same point is one run."""
    key = f"fork:{source_run_id}:{seq}:{edits.model_route or ''}"
    if edits.replaced_inputs or edits.messages or edits.budgets is not None:
        dumped = edits.model_dump()
        more = {k: dumped[k] for k in ("replaced_inputs", "messages", "budgets")}
        key += ":" + request_hash(msgspec.to_builtins(more))[:16]
    return key


#: The budgets a fork or a resume may raise: `--budget NAME=VALUE`, the API's `budgets`.
RAISABLE = ("max_steps", "max_tokens", "max_cost_micros", "max_tool_calls", "deadline_at")


def raised_budgets(log: Sequence[Folded], seq: int, changes: dict[str, int]) -> Budgets | None:
    """The source's budgets at `seq` with `changes` (a name of RAISABLE -> its new value); None
    for no change. ForkRefusedError for a name not raisable or a value out of range (the core
    refuses a lowered one)."""
    if not changes:
        return None
    unknown = sorted(set(changes) - set(RAISABLE))
    if unknown:
        raise ForkRefusedError(f"budgets: {unknown[0]!r} is not one of {', '.join(RAISABLE)}")
    try:
        current_budgets = state_at(log, seq).config.budgets
        return msgspec.convert(
            {**msgspec.to_builtins(current_budgets), **changes}, Budgets, from_attributes=False
        )
    except ForkError as exc:
        raise ForkRefusedError(f"cannot fork: {exc}") from None
    except msgspec.ValidationError as exc:
        raise ForkRefusedError(f"budgets: {exc}") from None


def plan(
    log: Sequence[Folded],
    seq: int,
    *,
    key: str | None = None,
    edits: ForkEdits | None = None,
    actor: str | None = None,
    at: int | None = None,
) -> Fork:
    """The fork of the run whose log is `log`, at `seq` (ForkRefusedError when it cannot be)."""
    edits = edits or ForkEdits()
    source = log[0].event.run_id if log else ""
    key = key or default_key(source, seq, edits)
    if len(key) > MAX_ID_CHARS:
        raise ForkRefusedError(f"the idempotency key is over {MAX_ID_CHARS} characters")
    try:
        record = fork_record(
            log,
            seq,
            run_id=run_id_for_key(key),
            at=now_ms() if at is None else at,
            edits=edits,
            actor=actor,
        )
    except ForkError as exc:
        raise ForkRefusedError(f"cannot fork {source}: {exc}") from None
    return Fork(record, key)


def resume_seq(log: Sequence[Folded], *, cancelled: bool = False) -> int:
    """Where the failed run `log` is resumed (ForkRefusedError when it is not resumable)."""
    try:
        return resume_point(log, cancelled=cancelled)
    except ForkError as exc:
        source = log[0].event.run_id if log else "the run"
        raise ForkRefusedError(f"cannot resume {source}: {exc}") from None


def resumed(
    log: Sequence[Folded],
    *,
    key: str | None = None,
    actor: str | None = None,
    at: int | None = None,
    from_seq: int | None = None,
    cancelled: bool = False,
    budgets: dict[str, int] | None = None,
) -> Fork:
    """The resume of the run `log` ended without finishing (a fork at the seq before the
    failure, or at `from_seq`, before it), with `budgets` raised; the key by default is one
    per source, seq and raised budgets. ForkRefusedError when it cannot be."""
    source = log[0].event.run_id if log else ""
    failed_at = resume_seq(log, cancelled=cancelled)
    seq = failed_at if from_seq is None else from_seq
    if seq > failed_at:
        raise ForkRefusedError(
            f"cannot resume {source} from {seq}: after the failure (resume from {failed_at} or "
            "before)"
        )
    raised = raised_budgets(log, seq, budgets or {})
    edits = ForkEdits(budgets=raised)
    if key is None:
        key = f"resume:{source}:{seq}"
        if raised is not None:
            key += ":" + request_hash(msgspec.to_builtins(raised))[:16]
    return plan(log, seq, key=key, edits=edits, actor=actor, at=at)


def produce(bootstrap: str, prefix: str, fork: Fork, producer_id: str) -> None:
    from agentruns.connectors.api.client import RunsProducer

    with RunsProducer(bootstrap, producer_id=producer_id, prefix=prefix) as producer:
        producer.fork(fork.record)


def replaced_input(seq: int, event: Any) -> ReplacedInput:
    """A replacement of the source's record `seq` by `event` (a parsed JSON object: the event
    as `agentruns replay --json` or the API's events show its body); ForkRefusedError for one
    that is not an event."""
    try:
        text = canonical_json(event)
        parse_event(text)
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        raise ForkRefusedError(f"the replacement of record {seq} is not an event: {exc}") from None
    if len(text) > MAX_TEXT_CHARS:
        raise ForkRefusedError(f"the replacement of record {seq} is over {MAX_TEXT_CHARS} chars")
    return ReplacedInput(seq=seq, event=text)


def _replacement(spec: str) -> ReplacedInput:
    seq_text, sep, path = spec.partition("=")
    if not sep or not seq_text.isdigit() or len(seq_text) > 10 or not path:
        raise InvalidArgumentError(f"--replace-input {spec[:80]!r}: give SEQ=FILE")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEXT_CHARS + 1)
    except OSError as exc:
        raise InvalidArgumentError(f"--replace-input: cannot read {path}: {exc}") from None
    if len(data) > MAX_TEXT_CHARS:
        raise InvalidArgumentError(f"--replace-input: {path} is over {MAX_TEXT_CHARS} bytes")
    try:
        event = json.loads(data)
    except ValueError as exc:
        raise InvalidArgumentError(f"--replace-input: {path} is not JSON ({exc})") from None
    return replaced_input(int(seq_text), event)


def _edits(args: argparse.Namespace) -> ForkEdits:
    route = getattr(args, "route", None)
    if route is not None and (not route or len(route) > MAX_ID_CHARS):
        raise InvalidArgumentError(f"--route must be 1 to {MAX_ID_CHARS} characters")
    specs = getattr(args, "replace_input", None) or []
    if len(specs) > MAX_ITEMS:
        raise InvalidArgumentError(f"at most {MAX_ITEMS} --replace-input")
    messages: tuple[Message, ...] = ()
    path = getattr(args, "messages", None)
    if path is not None:
        messages = _messages(path)
    return ForkEdits(
        model_route=route,
        messages=messages,
        replaced_inputs=tuple(_replacement(s) for s in specs),
    )


def _messages(path: str) -> tuple[Message, ...]:
    """The messages of `--messages FILE`: a JSON list of {role, content}."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEXT_CHARS + 1)
    except OSError as exc:
        raise InvalidArgumentError(f"--messages: cannot read {path}: {exc}") from None
    if len(data) > MAX_TEXT_CHARS:
        raise InvalidArgumentError(f"--messages: {path} is over {MAX_TEXT_CHARS} bytes")
    try:
        return msgspec.json.decode(data, type=Messages)
    except msgspec.DecodeError as exc:
        raise InvalidArgumentError(
            f"--messages: {path} is not a JSON list of {{role, content}} ({exc})"
        ) from None


def _budget_changes(specs: Sequence[str] | None) -> dict[str, int]:
    """`--budget NAME=VALUE` (repeatable); `deadline_in_s=S` sets `deadline_at` S seconds
    from now."""
    changes: dict[str, int] = {}
    for spec in specs or ():
        name, sep, value = spec.partition("=")
        if not sep or not value.isdigit() or len(value) > 18:
            raise InvalidArgumentError(f"--budget {spec[:80]!r}: give NAME=INTEGER")
        if name == "deadline_in_s":
            name, number = "deadline_at", now_ms() + int(value) * 1000
        else:
            number = int(value)
        if name not in RAISABLE:
            raise InvalidArgumentError(
                f"--budget {name[:40]!r}: one of {', '.join(RAISABLE)}, deadline_in_s"
            )
        changes[name] = number
    return changes


def _parser(name: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"agentruns {name}", description=description)
    parser.add_argument("run_id", help="the run to fork (it is only read)")
    parser.add_argument(
        "--budget",
        action="append",
        metavar="NAME=VALUE",
        help="raise a budget of the fork (max_steps, max_tokens, max_cost_micros, "
        "max_tool_calls, deadline_at in ms, or deadline_in_s from now); never lower (repeat)",
    )
    parser.add_argument("--key", help="idempotency key of the fork (same key -> same fork)")
    parser.add_argument("--producer-id", default=current().producer_id)
    parser.add_argument("--prefix", default=default_prefix())
    return parser


def _bootstrap() -> str:
    from agentruns.connectors.endpoints import configured_kafka

    return configured_kafka()


def main_fork(argv: Sequence[str] | None = None) -> int:
    parser = _parser(
        "fork",
        "Start a new run from a run's state at one seq: its log begins with a ForkedFrom "
        "record naming the source and the seq; the source is never changed.",
    )
    parser.add_argument("--at", type=int, required=True, metavar="SEQ", help="the fork point")
    parser.add_argument("--route", help="another model route for the fork's model calls")
    parser.add_argument(
        "--messages",
        metavar="FILE",
        help="a JSON list of {role, content} added where the fork asks the model (a fork point "
        "where the source was waiting for it)",
    )
    parser.add_argument(
        "--replace-input",
        action="append",
        metavar="SEQ=FILE",
        help="fold the source with the event in FILE (JSON) in place of its record SEQ, at or "
        "before the fork point (repeat)",
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    edits = _edits(args)
    changes = _budget_changes(args.budget)
    bootstrap = _bootstrap()
    log = source_log(bootstrap, args.prefix, args.run_id)
    budgets = raised_budgets(log, args.at, changes)
    if budgets is not None:
        edits = msgspec.structs.replace(edits, budgets=budgets)
    fork = plan(log, args.at, key=args.key, edits=edits, actor=f"cli:{args.producer_id}")
    produce(bootstrap, args.prefix, fork, args.producer_id)
    print(json.dumps(fork.as_json(), sort_keys=True), flush=True)
    return 0


def main_resume(argv: Sequence[str] | None = None) -> int:
    parser = _parser(
        "resume",
        "Resume a failed run after a fix: a fork at the last step before its failure, so the "
        "failed call runs again and nothing before it does.",
    )
    parser.add_argument(
        "--from",
        dest="from_seq",
        type=int,
        metavar="SEQ",
        help="resume from the state after this record instead of the one before the failure",
    )
    parser.add_argument(
        "--cancelled",
        action="store_true",
        help="also resume a cancelled run (from before its cancel was asked)",
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    changes = _budget_changes(args.budget)
    bootstrap = _bootstrap()
    log = source_log(bootstrap, args.prefix, args.run_id)
    fork = resumed(
        log,
        key=args.key,
        actor=f"cli:{args.producer_id}",
        from_seq=args.from_seq,
        cancelled=args.cancelled,
        budgets=changes,
    )
    produce(bootstrap, args.prefix, fork, args.producer_id)
    print(json.dumps(fork.as_json(), sort_keys=True), flush=True)
    return 0
