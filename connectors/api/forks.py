"""Forks and resumes through the API (`POST /runs/{id}/fork`, `POST /runs/{id}/resume`).

The source's log is read from the projection (the `events` table holds every record of it, in
seq order), folded by the core, and the fork planned as `agentruns fork` plans it
(`agentruns.connectors.forks.plan`); `ApiService.fork` produces it once per idempotency key.
A source the sink has not projected to the fork point yet is refused like a seq past its end:
the API forks only what it can read.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from agentruns.connectors.api.errors import ApiError
from agentruns.connectors.forks import (
    Fork,
    ForkRefusedError,
    plan,
    raised_budgets,
    replaced_input,
    resumed,
)
from agentruns.processors.events import parse_event
from agentruns.processors.limits import (
    MAX_AMOUNT,
    MAX_COUNT,
    MAX_ID_CHARS,
    MAX_ITEMS,
    MAX_JSON_DEPTH,
    MAX_TIME_MS,
    json_depth,
)
from agentruns.processors.lineage import Folded, folded
from agentruns.processors.state import ForkEdits, Messages

#: The most records of a source the API folds to fork it (a run's log is capped lower).
MAX_SOURCE_RECORDS = 100_000

Route = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]


class Replacement(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    seq: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
    event: dict[str, Any]  # an event's JSON; its size is the body's, its depth checked below


class RaisedBudgets(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Budgets a fork or a resume raises (each at least the source's: the core refuses less)."""

    max_steps: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_AMOUNT)] | None = None
    max_cost_micros: Annotated[int, msgspec.Meta(ge=0, le=MAX_AMOUNT)] | None = None
    max_tool_calls: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] | None = None
    deadline_at: Annotated[int, msgspec.Meta(ge=0, le=MAX_TIME_MS)] | None = None

    def changes(self) -> dict[str, int]:
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


class ForkBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    at: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
    model_route: Route | None = None
    messages: Messages = ()
    replace_inputs: Annotated[tuple[Replacement, ...], msgspec.Meta(max_length=MAX_ITEMS)] = ()
    budgets: RaisedBudgets = RaisedBudgets()


class ResumeBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    #: Resume from the state after this record (at or before the failure) instead.
    from_seq: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)] | None = None
    #: Resume a cancelled run too (from before its cancel was asked).
    cancelled: bool = False
    budgets: RaisedBudgets = RaisedBudgets()


def parse(action: str, body: dict[str, Any]) -> ForkBody | ResumeBody:
    """The body as the action's struct; anything else is a 422 `invalid_body`."""
    try:
        if action == "fork":
            return msgspec.convert(body, ForkBody)
        return msgspec.convert(body, ResumeBody)
    except msgspec.ValidationError as exc:
        text = str(exc)
        loc = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else ""
        raise ApiError(
            422, "invalid_body", f"{action}: {text}", errors=[{"loc": loc, "msg": text}]
        ) from None


def source_log(records: list[tuple[int, Any]]) -> list[Folded]:
    """The projected records of the source, folded."""
    return folded((seq, parse_event(msgspec.json.encode(payload))) for seq, payload in records)


def planned(
    action: str,
    log: list[Folded],
    body: ForkBody | ResumeBody,
    *,
    key: str | None,
    actor: str,
    at: int,
) -> Fork:
    """The fork the request asks for; a 409 `fork_refused` with the reason when it cannot be."""
    try:
        if isinstance(body, ForkBody):
            if any(json_depth(r.event) > MAX_JSON_DEPTH for r in body.replace_inputs):
                raise ApiError(422, "invalid_body", f"a replacement nests over {MAX_JSON_DEPTH}")
            replaced = tuple(replaced_input(r.seq, r.event) for r in body.replace_inputs)
            edits = ForkEdits(
                model_route=body.model_route,
                messages=body.messages,
                replaced_inputs=replaced,
                budgets=raised_budgets(log, body.at, body.budgets.changes()),
            )
            return plan(log, body.at, key=key, edits=edits, actor=actor, at=at)
        return resumed(
            log,
            key=key,
            actor=actor,
            at=at,
            from_seq=body.from_seq,
            cancelled=body.cancelled,
            budgets=body.budgets.changes(),
        )
    except ForkRefusedError as exc:
        raise ApiError(409, "fork_refused", str(exc).removeprefix("cannot ")) from None
