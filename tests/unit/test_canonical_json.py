"""docs/canonical-json-vectors.json: the canonical JSON docs/contract.md defines is what the core
writes, byte for byte, on both of its encoding paths."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agentruns.processors.ids import canonical_json, canonicalize_arguments, content_ref

ROOT = Path(__file__).resolve().parents[2]
VECTORS: list[dict[str, Any]] = json.loads(
    (ROOT / "docs" / "canonical-json-vectors.json").read_text(encoding="utf-8")
)["vectors"]
VALID = [v for v in VECTORS if not v.get("error")]
REFUSED = [v for v in VECTORS if v.get("error")]
# The reference encoding the fast path must agree with (processors/ids.py).
REFERENCE = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _input(vector: dict[str, Any]) -> bytes:
    if "input_hex" in vector:
        return bytes.fromhex(vector["input_hex"])
    return str(vector["input"]).encode("utf-8")


@pytest.mark.parametrize("vector", VALID, ids=[v["name"] for v in VALID])
def test_each_vector_is_what_the_core_writes(vector: dict[str, Any]) -> None:
    value = msgspec.json.decode(_input(vector))
    written = canonical_json(value)
    assert written == vector["canonical"]
    assert written.encode("utf-8").hex() == vector["canonical_hex"]
    assert hashlib.sha256(bytes.fromhex(vector["canonical_hex"])).hexdigest() == vector["sha256"]
    assert content_ref(written) == "sha256:" + vector["sha256"]
    assert REFERENCE.encode(value) == written  # the fast path and the reference agree
    assert canonical_json(msgspec.json.decode(written)) == written  # a fixed point
    if isinstance(value, dict):  # a tool call's arguments are canonicalized the same way
        assert canonicalize_arguments(vector["input"]) == written


@pytest.mark.parametrize("vector", REFUSED, ids=[v["name"] for v in REFUSED])
def test_each_refused_vector_is_refused(vector: dict[str, Any]) -> None:
    with pytest.raises((msgspec.DecodeError, UnicodeDecodeError)):  # bytes not UTF-8: the latter
        msgspec.json.decode(_input(vector))
    if "input" in vector:
        assert canonicalize_arguments('{"x":' + str(vector["input"]) + "}") is None


def test_the_vectors_cover_the_hostile_cases() -> None:
    """Every rule docs/contract.md states has a vector that would catch a client breaking it."""
    canonical = "\n".join(v["canonical"] for v in VALID)
    for needle in (
        "{}",  # empty containers
        "[]",
        '"\\u001b"'[1:-1],  # a control character, lowercase hex
        "\\n",  # a short escape
        "\u2028",  # written as is
        "\U0001f600",  # outside the BMP, after U+FFFF in key order
        "1.0",  # a float with an integral value keeps its fraction
        "1e+16",  # exponent notation from 1e16
        "1e-05",  # and below 1e-4, with two exponent digits
        "-0.0",
        "18446744073709551616",  # an integer past 64 bits
    ):
        assert needle in canonical, needle
    keys = next(v for v in VALID if "code point" in v["name"])["canonical"]
    assert keys.index("\uffff") < keys.index("\U0001f600")  # UTF-16 order would swap them
    assert len(REFUSED) >= 5
