"""docs/metrics.md's tables as data, and Prometheus' naming rules, for the tests that hold the
services' scrapes to them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

_ROW = re.compile(r"^\| `(agentruns_\w+)` \| (counter|gauge|histogram) \|([^|]*)\|", re.MULTILINE)
_SNAKE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
#: Units Prometheus names carry at the end of a name, in their base form.
_NOT_BASE_UNITS = ("_milliseconds", "_ms", "_microseconds", "_kilobytes", "_megabytes", "_minutes")


@dataclass(frozen=True)
class Documented:
    name: str  # as scraped: counters with their _total suffix
    type: str
    labels: frozenset[str]


def documented(text: str | None = None) -> dict[str, Documented]:
    """Every metric row of docs/metrics.md: `name` | type | labels (each a backticked or bare
    word, with its values in parentheses) | ..."""
    found = {}
    for name, kind, cell in _ROW.findall(DOC.read_text() if text is None else text):
        bare = re.sub(r"\([^)]*\)", "", cell)
        labels = frozenset(w.strip(" `") for w in bare.split(",") if w.strip(" `"))
        found[name] = Documented(name, kind, labels)
    return found


def naming_problems(name: str, kind: str, labels: dict[str, str]) -> list[str]:
    """What breaks Prometheus' naming rules in one scraped family (its name as scraped, counters
    with _total) and one sample's labels: snake case, counters ending in _total and nothing
    else doing so, base units (seconds, bytes), lower-case label values."""
    problems = []
    if not _SNAKE.fullmatch(name):
        problems.append(f"{name}: not snake_case")
    if (kind == "counter") != name.endswith("_total"):
        problems.append(f"{name}: a {kind} {'without' if kind == 'counter' else 'with'} _total")
    stem = name.removesuffix("_total")
    if any(stem.endswith(unit) for unit in _NOT_BASE_UNITS):
        problems.append(f"{name}: not in base units (seconds, bytes)")
    for label, value in labels.items():
        if label == "le":  # a histogram's bucket bound ("+Inf"): Prometheus' own
            continue
        if not _SNAKE.fullmatch(label):
            problems.append(f"{name}: label {label!r} not snake_case")
        if value != value.lower():
            problems.append(f"{name}: label {label}={value!r} not lower case")
    return problems
