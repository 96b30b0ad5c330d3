"""What an executor's handlers are made of: the Handler protocol, its Outcome, and the helpers
that build an effect's answer.

An executor (:mod:`agentruns.connectors.executors.loop`) consumes one effects topic and carries
out each effect with a :class:`Handler`, many at once; the handler calls the outside world (a
model route, a tool) and classifies what came back into one core event, the effect's answer,
which the executor records (:mod:`agentruns.connectors.executors.records`) and sends to the
inbox as an ``Input`` record. Input ids are ``<effect key>:result``, so the processor drops a
re-sent answer as an exact duplicate (same id, same bytes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.executors.limits import RouteLimits
from agentruns.connectors.postgres.artifacts import StoredArtifact
from agentruns.processors.effects import Effect
from agentruns.processors.events import Event
from agentruns.processors.limits import MAX_JSON_DEPTH, json_depth
from agentruns.streams import records
from agentruns.streams.clock import now_ms


class ExecutorError(AgentrunsError):
    """An executor cannot run (bad configuration, missing topic, database down)."""


def decode_json(body: bytes, depth: int = MAX_JSON_DEPTH) -> tuple[Any, str | None]:
    """A backend's JSON: (value, None), or (None, what is wrong: ``not_json``, ``not_utf8``,
    ``too_deep``). Never raises: msgspec stops at its own depth limit with RecursionError
    (no Python recursion), and the named limit is checked without recursion."""
    try:
        value = msgspec.json.decode(body)
    except RecursionError:
        return None, "too_deep"
    except UnicodeDecodeError:
        return None, "not_utf8"
    except (msgspec.DecodeError, ValueError):
        return None, "not_json"
    # nested no deeper than its opening brackets (those in strings only add): the walk is
    # needed only past that many (a streamed chunk has a handful)
    if body.count(b"[") + body.count(b"{") > depth and json_depth(value, depth) > depth:
        return None, "too_deep"
    return value, None


def clean_text(text: str, limit: int | None = 1000) -> str:
    """Text for a Postgres ``text`` column: no NUL (which Postgres refuses, and would refuse
    on every retry of the batch), bounded by ``limit`` characters."""
    return text[:limit].replace("\x00", "\\0")


def result_input_id(effect: Effect) -> str:
    """The input id (and event id) of an effect's answer: deterministic from its key."""
    return f"{effect.idempotency_key}:result"


def event_identity(effect: Effect, at: int | None = None) -> dict[str, Any]:
    """The EventBase fields of the answer to ``effect``."""
    return {
        "run_id": effect.run_id,
        "event_id": result_input_id(effect),
        "at": now_ms() if at is None else at,
        "trace_id": effect.trace_id,
    }


def input_record(effect: Effect, event: Event) -> dict[str, Any]:
    """The inbox ``Input`` record (schema v2) carrying ``event`` as the answer to ``effect``."""
    # `event` was built with `event_identity(effect)`: the effect's run, trace and result id.
    return records.input_record(event, input_id=result_input_id(effect))


@dataclass(frozen=True)
class ActionRecord:
    """One row of ``executed_actions`` (migration 0003)."""

    key: str
    effect_type: str
    status: str  # started | completed
    starts: int
    input_json: str | None
    detail: str | None

    @property
    def completed(self) -> bool:
        return self.status == "completed" and self.input_json is not None

    def input(self) -> dict[str, Any]:
        assert self.input_json is not None
        value: dict[str, Any] = json.loads(self.input_json)
        return value


# --------------------------------------------------------------------------- handlers


@dataclass(frozen=True)
class Outcome:
    """What a handler made of one effect: the answer event, the artifacts it references, and
    what its route's limits learn from the call (the tokens it used, the back-off its backend
    asked for)."""

    event: Event
    artifacts: tuple[StoredArtifact, ...] = ()
    detail: str = ""
    tokens: int | None = None
    throttle_s: float | None = None


#: What `Handler.prepare` read ahead for a group of effects: artifacts by ref.
Ahead = Mapping[str, Any]
NOTHING_AHEAD: Ahead = {}


class Handler(Protocol):
    """Carries out effects of some types. ``execute`` is a coroutine, run many at once on the
    executor's event loop, that classifies outside failures into the answer event; if it raises
    anyway, the executor's guard asks ``failure`` for the effect's failure answer (which must
    not raise: no I/O). ``close`` is called in the event loop's thread."""

    effect_types: frozenset[str]

    def route_of(self, effect: Effect) -> str:
        """The route an effect's call goes to: the key of its limits (`limits`)."""
        ...

    def limits(self, route: str) -> RouteLimits:
        """The limits of a route (asked once per route)."""
        ...

    def exclusive_s(self, effect: Effect) -> float:
        """How long one attempt of ``effect`` may go on acting on its backend (its deadline,
        a look-up of a resumed call included): while another member's start of it may still
        be running, a second one is not sent beside it. 0: a second attempt changes nothing
        outside (a look-up, a model call whose first recorded answer wins)."""
        ...

    def prepare(self, effects: Sequence[Effect]) -> Ahead:
        """Before a group of effects starts (in the executor's dispatch thread): read ahead, in
        a few statements, what their ``execute`` calls will read, and return it; each call of
        the group is handed it. Only a read ahead: an error here other than a database outage
        is logged, and each call reads what it needs itself."""
        ...

    async def execute(self, effect: Effect, previous: ActionRecord | None, ahead: Ahead) -> Outcome:
        """Carry out ``effect`` (a task on the executor's event loop, beside hundreds of
        others: it must not block); ``previous`` is its record if it was begun before (a
        ``started`` one: a crash or a hand-over between its call and its answer)."""
        ...

    def failure(self, effect: Effect, code: str, message: str) -> Outcome:
        """The answer to an effect that cannot be carried out: one the core classifies as
        not worth retrying as is. ``code``: ``executor_error`` (the handler raised),
        ``executor_error:restarts`` (a crash loop), ``invalid_output:<what>``."""
        ...

    def close(self) -> None: ...


__all__ = [
    "NOTHING_AHEAD",
    "ActionRecord",
    "Ahead",
    "ExecutorError",
    "Handler",
    "Outcome",
    "clean_text",
    "decode_json",
    "event_identity",
    "input_record",
    "result_input_id",
]
