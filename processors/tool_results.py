"""A tool's successful answer as the core's event, the same whichever door it came through (the
tool executor's call, a look-up or poll, an async tool's callback to the API)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentruns.processors.events import ToolCallSucceeded
from agentruns.processors.ids import canonical_json
from agentruns.processors.limits import LARGE_OUTPUT_BYTES, MAX_ID_CHARS
from agentruns.processors.summary import summarize


def succeeded(
    ids: Mapping[str, Any],
    output: Any,
    result_ref: str,
    summary_bytes: int = LARGE_OUTPUT_BYTES,
) -> ToolCallSucceeded:
    """``ToolCallSucceeded`` of ``output`` (kept whole as the artifact ``result_ref``): its size
    as canonical text, a deterministic summary when it is over ``summary_bytes``, and the
    resource version it reports (``output["version"]``, when it is an id the core can carry).
    ``ids`` are the event's identity fields (run, event id, step, operation key, dispatch)."""
    text = output if isinstance(output, str) else canonical_json(output)
    size = len(text.encode())
    version = None
    if isinstance(output, dict) and isinstance(output.get("version"), int | str):
        version = str(output["version"])
        if len(version) > MAX_ID_CHARS:  # not an id the core can carry: no version
            version = None
    return ToolCallSucceeded(
        **ids,
        result_ref=result_ref,
        result_bytes=size,
        summary=summarize(text) if size > summary_bytes else None,
        resource_version=version,
    )
