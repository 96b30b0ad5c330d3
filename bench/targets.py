"""A bench's targets as checks on its own figures: each run (and the median of several trials,
`agentruns bench repeat`) says per target whether it was met.

A check names its figure by a dotted path into the bench's JSON, so it can be evaluated again on
any object of the same shape: the median of trials has the same shape as one trial.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Target:
    figure: str  # dotted path into the bench's JSON figures
    bound: float
    at_most: bool = False  # the figure must be <= bound (a latency); else >= bound (a rate)

    def as_check(self, figures: Mapping[str, Any]) -> dict[str, Any]:
        value = figure(figures, self.figure)
        met = None
        if value is not None:
            met = value <= self.bound if self.at_most else value >= self.bound
        return {
            "figure": self.figure,
            "bound": self.bound,
            "at_most": self.at_most,
            "value": value,
            "met": met,
        }


def figure(figures: Mapping[str, Any], path: str) -> float | None:
    """The number at ``path`` (``a.b.c``), or None when it is absent or not a number."""
    node: Any = figures
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    if isinstance(node, bool) or not isinstance(node, int | float):
        return None
    return float(node)


def evaluate(figures: Mapping[str, Any], targets: Iterable[Target]) -> dict[str, Any]:
    """``targets`` (figure path -> bound), ``checks`` (one per target, ``met`` None when the
    figure was not measured) and ``meets_targets`` (every target measured and met)."""
    targets = tuple(targets)
    checks = [t.as_check(figures) for t in targets]
    return {
        "targets": {t.figure: t.bound for t in targets},
        "checks": checks,
        "meets_targets": all(c["met"] is True for c in checks),
    }


def targets_of(checks: Iterable[Mapping[str, Any]]) -> list[Target]:
    """The targets behind checks a bench printed (to evaluate them again on other figures)."""
    return [Target(str(c["figure"]), float(c["bound"]), bool(c["at_most"])) for c in checks]
