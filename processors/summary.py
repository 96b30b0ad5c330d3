"""Deterministic summary of a large tool output (R14): head, tail, error lines, counts.

Executors call :func:`summarize` when they persist a raw output; the raw output stays as
its own artifact and the summary refers to it.
"""

from __future__ import annotations

import re

from agentruns.processors.events import OutputSummary

HEAD_CHARS = 1_000
TAIL_CHARS = 1_000
MAX_ERROR_LINES = 10
MAX_LINE_CHARS = 200
_ERROR_RE = re.compile(r"\b(error|exception|fatal|failed|traceback)\b", re.IGNORECASE)


def summarize(output: str) -> OutputSummary:
    lines = output.splitlines()
    errors = [line for line in lines if _ERROR_RE.search(line)]
    if len(output) <= HEAD_CHARS + TAIL_CHARS:
        head, tail = output, ""
    else:
        head, tail = output[:HEAD_CHARS], output[-TAIL_CHARS:]
    return OutputSummary(
        head=head,
        tail=tail,
        error_lines=tuple(line[:MAX_LINE_CHARS] for line in errors[:MAX_ERROR_LINES]),
        line_count=len(lines),
        byte_count=len(output.encode("utf-8")),
        error_count=len(errors),
    )
