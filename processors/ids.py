"""Canonical JSON, content hashes and deterministic ids (R4, R7, R11, R25).

Everything here is a pure function of its arguments: no clock, no randomness.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from typing import Any

import msgspec

_SEP = "\x1f"
#: uuid5 namespace of run ids derived from Idempotency-Keys (the API and the client derive the
#: same run from the same key).
RUN_NAMESPACE = uuid.UUID("6f1d3a52-2b8e-5c1e-9a43-61676e747275")
# The reference encoding: Python's json with sorted keys, compact, UTF-8 as is. Keys and refs
# already stored were derived from it, so its bytes are the definition of canonical.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
# msgspec gives the same bytes ~7x faster except for floats Python writes with an exponent
# (1e16 vs 1e+16, 1e-05 vs 1e-5) and non-finite floats (null vs Infinity/NaN): a value holding
# such a float takes the reference path. Floats are rare in our documents, so a msgpack encoding
# (C speed) screens first: every float is a float64 there, marker byte 0xCB; without that byte
# anywhere there is no float at all, and only with it does a Python walk look closer.
_FAST = msgspec.json.Encoder(order="sorted")
_PACK = msgspec.msgpack.Encoder()
_FLOAT64 = b"\xcb"


def _needs_reference(value: Any) -> bool:
    kind = type(value)
    if kind is float:
        return not math.isfinite(value) or "e" in repr(value)
    if kind is dict:
        items: Any = value.values()
    elif kind is list or kind is tuple:
        items = value
    else:
        return False
    for item in items:
        # strings and ints dominate (refs, counters): skip them without a call
        if type(item) is not str and type(item) is not int and _needs_reference(item):
            return True
    return False


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no insignificant whitespace (byte-stable)."""
    try:
        if _FLOAT64 in _PACK.encode(value) and _needs_reference(value):
            return _CANONICAL.encode(value)
        return _FAST.encode(value).decode()
    except (TypeError, OverflowError, msgspec.EncodeError):
        return _CANONICAL.encode(value)


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def content_ref(content: str) -> str:
    """Content address of an artifact: ``sha256:<hex>``."""
    return "sha256:" + sha256_hex(content)


def derive_key(*parts: object) -> str:
    """A deterministic key from ordered parts (unit-separator joined, sha256)."""
    return sha256_hex(_SEP.join(map(str, parts)))


def short_hash(*parts: object) -> str:
    """A 16-hex digest for bounded loop/progress memories (not an identity)."""
    return derive_key(*parts)[:16]


def operation_key(run_id: str, step: int, tool: str, args_canonical: str) -> str:
    """Idempotency key of an Operation: run, step, tool, canonical JSON arguments (R11)."""
    return derive_key("op", run_id, step, tool, args_canonical)


def effect_key(kind: str, run_id: str, step: int, attempt: int, *discriminators: object) -> str:
    """Idempotency key of an effect: run + step + attempt + action discriminator (R25)."""
    return derive_key("effect", kind, run_id, step, attempt, *discriminators)


def timer_id(run_id: str, purpose: str, *discriminators: object) -> str:
    return "tmr-" + derive_key("timer", run_id, purpose, *discriminators)[:32]


def question_id(run_id: str, step: int, attempt: int, kind: str, version: int) -> str:
    return "q-" + derive_key("question", run_id, step, attempt, kind, version)[:32]


def resume_token_id(run_id: str, qid: str, version: int) -> str:
    """Token id bound to (run, question, state version); the API layer signs it (R15)."""
    return "tok-" + derive_key("token", run_id, qid, version)[:32]


def canonicalize_arguments(arguments_json: str) -> str | None:
    """Canonical form of a JSON arguments document, or None if it is not a JSON object.

    Strict JSON, as the validator reads tool-call arguments (no NaN, valid UTF-8)."""
    try:
        value = msgspec.json.decode(arguments_json)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    return canonical_json(value)


def run_id_for_key(idempotency_key: str) -> str:
    """The run a submission with this Idempotency-Key creates (same key -> same run)."""
    return "run-" + uuid.uuid5(RUN_NAMESPACE, idempotency_key).hex


def trace_id_for(run_id: str) -> str:
    return uuid.uuid5(RUN_NAMESPACE, "trace:" + run_id).hex


def submit_event_id(run_id: str) -> str:
    """The RunSubmitted event id: the core drops a second RunSubmitted with it as DUPLICATE."""
    return f"{run_id}:submit"


def request_hash(value: Any) -> str:
    """The hash of a request's canonical JSON: a repeat with another body is told apart."""
    return sha256_hex(canonical_json(value))
