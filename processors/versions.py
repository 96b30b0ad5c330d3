"""Rules versions: which transition rules fold a run, for the whole of its life.

A run can wait days for a person while the processors around it are upgraded, rolled back and
upgraded again. Its events must mean the same thing at the end as at the start, so every run
records the version of the rules it was submitted under (`RunSubmitted.rules_version`, copied
into `RunState.rules_version` by the submission's handler) and every fold of it — the
processor, the sink's projection, audit, replay, revalidate — applies that version's rules.
A run without a version (submitted before versions existed) is version 1.

`RULES` keeps every rule set this build can apply. Changing what an event does to a run means
a new entry: the new rules as a new function, the old one kept for the runs submitted under
it. Today there is one. A version this build does not have (a run submitted by a newer
processor) is not guessed at: :func:`transition_for` raises `UnknownRulesVersionError`, and the
processor stops the run's partition with that reason until a build that has it takes the
partition over (docs/design.md, "Versions of runs in flight").
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from agentruns.processors.events import Event, ForkedFrom, RunSubmitted
from agentruns.processors.state import RunState
from agentruns.processors.transition import Transition, transition

Rules = Callable[[RunState | None, Event], Transition]

#: Every rule set this build can apply, by version.
RULES: dict[int, Rules] = {1: transition}


class UnknownRulesVersionError(Exception):
    """A run's rules version is not among the ones this build has (a newer build's run)."""

    def __init__(self, version: int) -> None:
        known = ", ".join(str(v) for v in sorted(RULES))
        super().__init__(f"unknown rules version {version} (this build has {known})")
        self.version = version


def current() -> int:
    """The newest rules version this build has: what new runs are submitted under unless the
    processor is told to keep an older one (`agentruns processor --rules-version`)."""
    return max(RULES)


def known(version: int) -> bool:
    return version in RULES


def transition_for(version: int) -> Rules:
    """The transition function of `version`, or UnknownRulesVersionError."""
    rules = RULES.get(version)
    if rules is None:
        raise UnknownRulesVersionError(version)
    return rules


def version_of(state: RunState | None, event: Event) -> int:
    """The rules version `event` is applied under: the run's, or for a run that does not exist
    yet, the one its submission carries (1 when none); a fork keeps its source's."""
    if state is not None:
        return of_state(state)
    if isinstance(event, ForkedFrom):
        return of_state(event.state)
    if isinstance(event, RunSubmitted) and event.rules_version is not msgspec.UNSET:
        return event.rules_version
    return 1


def of_state(state: RunState) -> int:
    """The rules version of a run (1 when its state has none)."""
    version = state.rules_version
    return 1 if version is msgspec.UNSET else version


def stamped(event: RunSubmitted, version: int) -> RunSubmitted:
    """The submission as the processor applies and logs it: under `version`, whatever the
    producer wrote (version 1 is written as no version)."""
    value: int | msgspec.UnsetType = msgspec.UNSET if version == 1 else version
    if event.rules_version == value:
        return event
    return event.model_copy(update={"rules_version": value})


def apply(state: RunState | None, event: Event) -> Transition:
    """`transition(state, event)` under the run's own rules version (UnknownRulesVersionError
    when this build does not have it)."""
    return transition_for(version_of(state, event))(state, event)
