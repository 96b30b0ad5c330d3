"""Artifacts carried in a CallModel effect record's header, so that the model executor builds
the call's conversation without reading them back from the artifact store.

The processor writes every artifact to the store before its transaction commits (R2); the
store stays the one durable copy. The header (`HEADER`) is a copy of some of them: a JSON array
of ``[ref, content]`` pairs, at most `MAX_BYTES` in all (artifacts that do not fit are left out
and read from the store as before). Its reader trusts nothing in it: an entry whose content is
not of its content address (``sha256:`` of the content, `agentruns.processors.ids.content_ref`),
a repeated ref, or a header that is not such an array or over `MAX_BYTES`, is ignored and counted
in `INLINED_ARTIFACTS`; whatever is missing is read from the store.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import msgspec
from agentruns.processors.ids import content_ref
from agentruns.processors.transition import Artifact
from agentruns.streams.metrics import INLINED_ARTIFACTS

HEADER = "agentruns-artifacts"
MAX_BYTES = 64 * 1024

_ENCODE = msgspec.json.Encoder()
_DECODE = msgspec.json.Decoder(list[tuple[str, str]])

# A/B switch for the benchmark only: "0" leaves the header out and the executor's own
# candidates out of its cache.
ENABLED = os.environ.get("AGENTRUNS_INLINE_ARTIFACTS", "1") != "0"


def for_call(
    context_ref: str, artifacts: Sequence[Artifact], limit: int = MAX_BYTES
) -> bytes | None:
    """The header of a CallModel on ``context_ref`` from the artifacts its transition made: the
    context first, then those the context names (its inputs, such as a large output's summary).
    None when there is nothing to carry or the context is not among them."""
    if not ENABLED:
        return None
    context = next((a for a in artifacts if a.ref == context_ref), None)
    if context is None:
        return None
    named = [a for a in artifacts if a.ref != context_ref and a.ref in context.content]
    return encode(((a.ref, a.content) for a in (context, *named)), limit)


def encode(pairs: Iterable[tuple[str, str]], limit: int = MAX_BYTES) -> bytes | None:
    """``[[ref, content], ...]`` of the pairs that fit in ``limit`` bytes, in order."""
    pieces: list[bytes] = []
    size = 2  # the brackets
    for pair in pairs:
        piece = _ENCODE.encode(pair)
        extra = len(piece) + (1 if pieces else 0)
        if size + extra > limit:
            continue  # a smaller one after it may still fit
        pieces.append(piece)
        size += extra
    if not pieces:
        return None
    return b"[" + b",".join(pieces) + b"]"


def decode(value: bytes | str | None, limit: int = MAX_BYTES) -> dict[str, str]:
    """The verified entries of a header (ref -> content); everything else is counted and
    ignored."""
    if value is None:
        return {}
    data = value.encode() if isinstance(value, str) else value
    if len(data) > limit:
        INLINED_ARTIFACTS.labels("too_large").inc()
        return {}
    try:
        pairs = _DECODE.decode(data)
    except (msgspec.DecodeError, RecursionError):
        INLINED_ARTIFACTS.labels("malformed").inc()
        return {}
    found: dict[str, str] = {}
    for ref, content in pairs:
        if ref in found:
            INLINED_ARTIFACTS.labels("duplicate").inc()
        elif content_ref(content) != ref:
            INLINED_ARTIFACTS.labels("mismatched").inc()
        else:
            found[ref] = content
    if found:
        INLINED_ARTIFACTS.labels("used").inc(len(found))
    return found


def header_value(headers: Iterable[tuple[str, str | bytes | None]] | None) -> bytes | str | None:
    """The value of the first `HEADER` among a record's headers (a second one is ignored)."""
    for name, value in headers or ():
        if name == HEADER:
            return value
    return None


__all__ = ["ENABLED", "HEADER", "MAX_BYTES", "decode", "encode", "for_call", "header_value"]
