"""Canonical JSON, content hashes and deterministic ids (R4, R7, R11, R25).

Everything here is a pure function of its arguments: no clock, no randomness.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

_SEP = "\x1f"
# json.dumps with non-default options builds a new JSONEncoder on every call; one shared,
# stateless encoder with the same options gives the same bytes for less work.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no insignificant whitespace (byte-stable)."""
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
    """Canonical form of a JSON arguments document, or None if it is not a JSON object."""
    try:
        value = json.loads(arguments_json)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return canonical_json(value)
