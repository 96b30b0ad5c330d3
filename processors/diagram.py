"""Mermaid state diagram generated from the transition table (text in, text out).

``python -m agentruns.connectors.diagram_doc --write docs/design.md`` replaces the block between
the markers; ``python -m agentruns.connectors.diagram_doc`` prints it.
"""

from __future__ import annotations

from agentruns.processors.state import TERMINAL, TRANSIENT, RunStatus
from agentruns.processors.transition import PASS_THROUGH, RESTING, TABLE

BEGIN = "<!-- BEGIN state-diagram (generated, do not edit) -->"
END = "<!-- END state-diagram -->"


def edges() -> dict[tuple[RunStatus, RunStatus], list[str]]:
    """(from, to) → labels, from the table rows and the in-transition pass-throughs."""
    found: dict[tuple[RunStatus, RunStatus], list[str]] = {}
    for (status, event), row in TABLE.items():
        for target in sorted(row.targets):
            if target != status:
                found.setdefault((status, target), []).append(event)
    for status in RESTING:
        found.setdefault((status, RunStatus.FAILED), []).append("event cap")
    for status, targets in PASS_THROUGH.items():
        for target in sorted(targets):
            found.setdefault((status, target), []).append("internal")
    return found


def mermaid() -> str:
    lines = ["```mermaid", "stateDiagram-v2"]
    lines.append("    [*] --> READY: RunSubmitted")
    order = list(RunStatus)
    for (source, target), labels in sorted(
        edges().items(), key=lambda kv: (order.index(kv[0][0]), order.index(kv[0][1]))
    ):
        unique = sorted(set(labels))
        lines.append(f"    {source.value} --> {target.value}: {', '.join(unique)}")
    for status in sorted(TERMINAL, key=order.index):
        lines.append(f"    {status.value} --> [*]")
    for status in sorted(TRANSIENT, key=order.index):
        lines.append(f"    note right of {status.value}: passed through within one transition")
    lines.append("```")
    return "\n".join(lines)


def render_into(document: str) -> str:
    """The document with the generated block between the markers replaced."""
    start = document.index(BEGIN) + len(BEGIN)
    stop = document.index(END)
    return document[:start] + "\n" + mermaid() + "\n" + document[stop:]
