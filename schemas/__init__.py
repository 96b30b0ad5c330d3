"""The Avro schemas of agentruns and the registry that maps fingerprints to them.

Every schema ever written ships in this package as ``<namespace>.<Name>.v<N>.avsc`` and is
never edited or deleted afterwards. :func:`registry` loads them all once, computes each
schema's CRC-64-AVRO (Rabin) fingerprint over its Parsing Canonical Form, and answers:

- which schema a fingerprint names (for readers of single-object encoded records), and
- which version of a record name is the current one (the highest N; used as the writer
  schema and as the reader schema of schema resolution).

The module only reads package data; it has no other side effects.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from types import MappingProxyType
from typing import Any, cast

from fastavro.schema import fingerprint as _fingerprint
from fastavro.schema import parse_schema as _parse_schema
from fastavro.schema import to_parsing_canonical_form as _canonical

__all__ = [
    "NAMESPACE",
    "Registry",
    "SchemaError",
    "SchemaVersion",
    "fingerprint_of",
    "load_registry",
    "registry",
]

NAMESPACE = "agentruns"
FINGERPRINT_ALGORITHM = "CRC-64-AVRO"
_FILE_RE = re.compile(r"^(?P<full>[A-Za-z_][A-Za-z0-9_.]*)\.v(?P<version>[1-9][0-9]*)\.avsc$")


class SchemaError(Exception):
    """The shipped schema files are inconsistent (a packaging or authoring bug)."""


@dataclass(frozen=True, slots=True)
class SchemaVersion:
    """One shipped schema file.

    ``fingerprint`` is the 8-byte CRC-64-AVRO fingerprint exactly as it appears on the wire in
    the single-object encoding (little-endian).
    """

    name: str
    full_name: str
    version: int
    fingerprint: bytes
    canonical_form: str
    parsed: dict[str, Any] = field(repr=False, compare=False)
    raw: dict[str, Any] = field(repr=False, compare=False)
    file_name: str = ""


@dataclass(frozen=True, slots=True)
class Registry:
    """All shipped schema versions, indexed by fingerprint and by (name, version)."""

    by_fingerprint: Mapping[bytes, SchemaVersion]
    by_name: Mapping[str, tuple[SchemaVersion, ...]]

    def names(self) -> tuple[str, ...]:
        """Short record names (``"Input"``, ``"Event"``, ...), sorted."""
        return tuple(sorted(self.by_name))

    def versions(self, name: str) -> tuple[SchemaVersion, ...]:
        """Every version of ``name``, oldest first. Raises KeyError for an unknown name."""
        return self.by_name[_short(name)]

    def current(self, name: str) -> SchemaVersion:
        """The highest version of ``name``. Raises KeyError for an unknown name."""
        return self.by_name[_short(name)][-1]

    def get(self, name: str, version: int) -> SchemaVersion:
        """The given version of ``name``. Raises KeyError if it does not exist."""
        for sv in self.by_name[_short(name)]:
            if sv.version == version:
                return sv
        raise KeyError(f"{name} v{version}")

    def lookup(self, fp: bytes) -> SchemaVersion | None:
        """The schema with wire fingerprint ``fp``, or None."""
        return self.by_fingerprint.get(fp)


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def fingerprint_of(schema: Any) -> tuple[bytes, str]:
    """(wire fingerprint, Parsing Canonical Form) of a raw (JSON) Avro schema."""
    canonical = _canonical(schema)
    # fastavro returns the fingerprint bytes in little-endian order, hex-encoded, which is the
    # byte order the single-object encoding puts on the wire.
    return bytes.fromhex(_fingerprint(canonical, FINGERPRINT_ALGORITHM)), canonical


def _load_one(file_name: str, text: str) -> SchemaVersion:
    match = _FILE_RE.match(file_name)
    if match is None:
        raise SchemaError(f"{file_name}: expected <namespace>.<Name>.v<N>.avsc")
    raw = json.loads(text)
    if not isinstance(raw, dict) or raw.get("type") != "record":
        raise SchemaError(f"{file_name}: top level must be a record schema")
    full_name = f"{raw.get('namespace', '')}.{raw['name']}".lstrip(".")
    if full_name != match["full"]:
        raise SchemaError(f"{file_name}: declares {full_name}, file name says {match['full']}")
    try:
        parsed = cast(dict[str, Any], _parse_schema(raw))
    except Exception as exc:  # fastavro raises several types for bad schemas
        raise SchemaError(f"{file_name}: {exc}") from exc
    fp, canonical = fingerprint_of(raw)
    return SchemaVersion(
        name=_short(full_name),
        full_name=full_name,
        version=int(match["version"]),
        fingerprint=fp,
        canonical_form=canonical,
        parsed=parsed,
        raw=raw,
        file_name=file_name,
    )


def load_registry(files: Mapping[str, str]) -> Registry:
    """Build a registry from ``{file name: schema JSON text}`` (the package files or a test's)."""
    by_fp: dict[bytes, SchemaVersion] = {}
    by_name: dict[str, list[SchemaVersion]] = {}
    for file_name in sorted(files):
        sv = _load_one(file_name, files[file_name])
        clash = by_fp.get(sv.fingerprint)
        if clash is not None:
            raise SchemaError(
                f"{file_name} and {clash.file_name} have the same canonical form; a new"
                " version must change the schema (defaults, docs and aliases do not count)"
            )
        by_fp[sv.fingerprint] = sv
        by_name.setdefault(sv.name, []).append(sv)
    for name, svs in by_name.items():
        svs.sort(key=lambda s: s.version)
        numbers = [s.version for s in svs]
        if numbers != list(range(1, len(svs) + 1)):
            raise SchemaError(f"{name}: versions {numbers} must be 1..N without gaps")
        if len({s.full_name for s in svs}) != 1:
            raise SchemaError(f"{name}: versions declare different namespaces")
    return Registry(
        by_fingerprint=MappingProxyType(by_fp),
        by_name=MappingProxyType({n: tuple(s) for n, s in by_name.items()}),
    )


def _package_files() -> dict[str, str]:
    root = resources.files(__name__)
    return {
        entry.name: entry.read_text(encoding="utf-8")
        for entry in root.iterdir()
        if entry.name.endswith(".avsc") and entry.is_file()
    }


@cache
def registry() -> Registry:
    """The registry of the schemas shipped in this package (loaded once per process)."""
    return load_registry(_package_files())
