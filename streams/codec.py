"""The wire codec: Avro single-object encoding of the agentruns envelopes.

A record on the wire is::

    0xC3 0x01 | 8-byte CRC-64-AVRO fingerprint of the writer schema (little-endian) | Avro body

(the Avro specification's single-object encoding). The body is written with the CURRENT
version of the record's schema. A reader looks the writer schema up by fingerprint among every
schema version shipped in :mod:`schemas` and reads with the CURRENT version of that record
name, so old records come back in today's shape (Avro schema resolution: fields added since
take their defaults).

Records written with the current version are read by a reader compiled from the schema
(:mod:`agentruns.streams.avro_reader`): fastavro's ``schemaless_reader`` calls ``fo.read()`` on a
BytesIO
for every primitive, byte by byte for varints, so ``decode`` took ~8 us for a ~500-byte
``Event`` and ~37 us for a ~6 KB ``Snapshot`` on our test host; compiled, ~4.9 and ~20 us.
Records of an older writer version need schema resolution and still go through fastavro. A
test checks that both return the same values.

Every failure to decode raises a subclass of :class:`CodecError` whose ``error_class`` is the
machine-readable reason a dead-letter record carries (see :mod:`agentruns.streams.dlq`). Decoding
never
raises anything else for any input bytes.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from fastavro import schemaless_reader

from agentruns.schemas import Registry, SchemaVersion, registry
from agentruns.streams.avro_reader import Read, compile_reader
from agentruns.streams.avro_writer import Write, compile_writer

__all__ = [
    "HEADER_LEN",
    "MAGIC",
    "Codec",
    "CodecError",
    "CorruptRecordError",
    "Decoded",
    "InvalidRecordError",
    "NotSingleObjectError",
    "UnknownFingerprintError",
    "UnknownRecordNameError",
    "WrongRecordTypeError",
    "decode",
    "decode_fields",
    "default_codec",
    "encode",
    "fingerprint_of",
]

MAGIC = b"\xc3\x01"
HEADER_LEN = len(MAGIC) + 8


class CodecError(Exception):
    """Root of the codec's errors. ``error_class`` names the failure for the DLQ.

    None of them is retryable: the same bytes fail the same way every time.
    """

    error_class: ClassVar[str] = "CODEC_ERROR"
    retryable: ClassVar[bool] = False


class NotSingleObjectError(CodecError):
    """Too short for the header, or the first two bytes are not 0xC3 0x01."""

    error_class = "NOT_SINGLE_OBJECT"


class UnknownFingerprintError(CodecError):
    """The writer schema's fingerprint is not among the shipped schemas."""

    error_class = "UNKNOWN_FINGERPRINT"

    def __init__(self, message: str, fingerprint: bytes) -> None:
        super().__init__(message)
        self.fingerprint = fingerprint


class CorruptRecordError(CodecError):
    """The header is fine but the Avro body does not decode with the writer schema."""

    error_class = "CORRUPT_RECORD"


class WrongRecordTypeError(CodecError):
    """The record decodes, but is not the record type the caller expected."""

    error_class = "WRONG_RECORD_TYPE"

    def __init__(self, message: str, expected: str, actual: str) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class UnknownRecordNameError(CodecError):
    """``encode`` was asked for a record name (or version) no schema has (a caller bug)."""

    error_class = "UNKNOWN_RECORD_NAME"


class InvalidRecordError(CodecError):
    """``encode`` was given a record that does not match the writer schema (a caller bug)."""

    error_class = "INVALID_RECORD"


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded record.

    ``name`` is the short record name (``"Event"``); ``version`` is the WRITER schema version
    found on the wire; ``record`` is already resolved to the current reader schema.
    """

    name: str
    version: int
    record: dict[str, Any]


_INT_RANGES = {"int": (-(2**31), 2**31 - 1), "long": (-(2**63), 2**63 - 1)}
_Check = Callable[[Any, str], str | None]


def _compile(schema: Any) -> _Check | None:
    """A checker for the int/long values inside ``schema``, or None if it has none.

    fastavro's writer rejects wrong types but silently truncates floats and writes Python ints
    beyond the Avro int range; this closes that gap at a fraction of the cost of a full
    ``fastavro.validation.validate`` (which would halve the encode rate).
    """
    if isinstance(schema, str):
        bounds = _INT_RANGES.get(schema)
        if bounds is None:
            return None
        lo, hi = bounds

        def check_int(value: Any, path: str) -> str | None:
            if type(value) is not int or not lo <= value <= hi:
                return f"{path}: {value!r} is not an Avro {schema}"
            return None

        return check_int
    if isinstance(schema, list):
        branches = [(b, _compile(b)) for b in schema]
        if all(c is None for _, c in branches):
            return None
        int_checks = [c for b, c in branches if b in _INT_RANGES and c is not None]

        def check_union(value: Any, path: str) -> str | None:
            # Only numbers can be out of range; other branches are checked by fastavro.
            if isinstance(value, int | float) and not isinstance(value, bool) and int_checks:
                problems = [c(value, path) for c in int_checks]
                return None if None in problems else problems[0]
            return None

        return check_union
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if kind == "record":
        # Plain int/long fields (optionally nullable) are checked inline, without a call each.
        simple: list[tuple[str, int, int]] = []
        nested: list[tuple[str, _Check]] = []
        for f in schema["fields"]:
            ftype = f["type"]
            alts = ftype if isinstance(ftype, list) else [ftype]
            ints = [b for b in alts if isinstance(b, str) and b in _INT_RANGES]
            if len(ints) == 1 and all(b == "null" or b in ints for b in alts):
                simple.append((f["name"], *_INT_RANGES[ints[0]]))
            else:
                check = _compile(ftype)
                if check is not None:
                    nested.append((f["name"], check))
        if not simple and not nested:
            return None

        def check_record(value: Any, path: str) -> str | None:
            if not isinstance(value, dict):
                return None  # fastavro reports the type error
            for field_name, lo, hi in simple:
                v = value.get(field_name)
                if v is not None and (type(v) is not int or v < lo or v > hi):
                    return f"{path}.{field_name}: {v!r} is out of range or not an int"
            for field_name, check in nested:
                if field_name in value:
                    problem = check(value[field_name], f"{path}.{field_name}")
                    if problem is not None:
                        return problem
            return None

        return check_record
    if kind in ("array", "map"):
        inner = _compile(schema["items" if kind == "array" else "values"])
        if inner is None:
            return None

        def check_container(value: Any, path: str) -> str | None:
            items = value.items() if isinstance(value, dict) else enumerate(value or ())
            for k, v in items:
                problem = inner(v, f"{path}[{k!r}]")
                if problem is not None:
                    return problem
            return None

        return check_container
    return _compile(kind) if isinstance(kind, str | list) else None


@dataclass(frozen=True, slots=True)
class _Reader:
    name: str
    version: int
    writer: dict[str, Any]
    reader: dict[str, Any] | None  # None: the writer is the current version, no resolution
    # compiled (streams/avro_reader.py) when there is no resolution; fastavro otherwise
    read: Read | None


def _undecodable(rd: _Reader, exc: Exception) -> CorruptRecordError:
    return CorruptRecordError(
        f"{rd.name} v{rd.version} body does not decode: {type(exc).__name__}: {exc}"
    )


@dataclass(frozen=True, slots=True)
class _Writer:
    header: bytes  # MAGIC + fingerprint
    check: _Check | None
    fields: frozenset[str]
    write: Write  # compiled (streams/avro_writer.py): fastavro's bytes, without its per-call setup


class Codec:
    """Encoder/decoder bound to one schema registry; caches everything it derives."""

    __slots__ = ("_partial", "_readers", "_registry", "_validate", "_writers")

    def __init__(self, reg: Registry | None = None, *, validate_on_encode: bool = True) -> None:
        self._registry = reg if reg is not None else registry()
        self._validate = validate_on_encode
        self._writers: dict[tuple[str, int | None], _Writer] = {}
        self._readers: dict[bytes, _Reader] = {}
        self._partial: dict[tuple[str, tuple[str, ...]], Read] = {}
        for fp, sv in self._registry.by_fingerprint.items():
            current = self._registry.current(sv.name)
            if current.fingerprint == fp:
                try:
                    read: Read | None = compile_reader(sv.raw)
                except ValueError:  # a type the compiled reader lacks (float, enum, ...)
                    read = None
                self._readers[fp] = _Reader(sv.name, sv.version, sv.parsed, None, read)
            else:
                self._readers[fp] = _Reader(sv.name, sv.version, sv.parsed, current.parsed, None)

    @property
    def registry(self) -> Registry:
        return self._registry

    def _writer(self, name: str, version: int | None) -> _Writer:
        cached = self._writers.get((name, version))
        if cached is not None:
            return cached
        try:
            sv: SchemaVersion = (
                self._registry.current(name)
                if version is None
                else self._registry.get(name, version)
            )
        except KeyError:
            v = "" if version is None else f" v{version}"
            raise UnknownRecordNameError(f"no schema for record {name}{v}") from None
        fields = frozenset(f["name"] for f in sv.raw["fields"])
        entry = _Writer(MAGIC + sv.fingerprint, _compile(sv.raw), fields, compile_writer(sv.raw))
        self._writers[(name, version)] = entry
        return entry

    def encode(self, name: str, record: dict[str, Any], *, version: int | None = None) -> bytes:
        """Single-object encode ``record`` as record ``name``.

        The writer schema is the current version, or ``version`` when given (during a rolling
        upgrade, keep writing the previous version until every reader has the new schema).
        Nullable fields and fields with defaults may be left out of ``record``.
        """
        wr = self._writer(name, version)
        if self._validate:
            if not wr.fields.issuperset(record):
                extra = sorted(str(k) for k in record if k not in wr.fields)
                raise InvalidRecordError(f"{name}: fields not in the schema: {extra}")
            if wr.check is not None:
                problem = wr.check(record, name)
                if problem is not None:
                    raise InvalidRecordError(problem)
        out = bytearray(wr.header)
        try:
            wr.write(record, out)
        except (TypeError, ValueError, AttributeError) as exc:  # a value that does not fit
            raise InvalidRecordError(f"{name}: {exc}") from exc
        return bytes(out)

    def _reader_of(self, data: bytes, expected_name: str | None) -> _Reader:
        if len(data) < HEADER_LEN or data[:2] != MAGIC:
            raise NotSingleObjectError(
                f"not an Avro single-object record ({len(data)} bytes, starts {data[:2]!r})"
            )
        fp = data[2:HEADER_LEN]
        rd = self._readers.get(fp)
        if rd is None:
            raise UnknownFingerprintError(f"unknown writer schema fingerprint {fp.hex()}", fp)
        if expected_name is not None and expected_name != rd.name:
            raise WrongRecordTypeError(
                f"expected a {expected_name} record, got {rd.name} v{rd.version}",
                expected_name,
                rd.name,
            )
        return rd

    def decode(self, data: bytes, expected_name: str | None = None) -> Decoded:
        """Decode single-object encoded ``data``; raise a :class:`CodecError` on any failure."""
        if type(data) is not bytes:  # the compiled readers slice values out of it: bytes only
            data = bytes(data)
        rd = self._reader_of(data, expected_name)
        return Decoded(rd.name, rd.version, self._read(rd, data))

    def _read(self, rd: _Reader, data: bytes) -> dict[str, Any]:
        try:
            if rd.read is not None:
                record, end = rd.read(data, HEADER_LEN)
            else:
                buf = io.BytesIO(data)
                buf.seek(HEADER_LEN)
                record = schemaless_reader(buf, rd.writer, rd.reader)
                end = buf.tell()
        except Exception as exc:  # EOFError, UnicodeDecodeError, ValueError, IndexError, ...
            raise _undecodable(rd, exc) from exc
        if end != len(data):
            raise CorruptRecordError(
                f"{rd.name} v{rd.version} body has {len(data) - end} trailing bytes"
            )
        if not isinstance(record, dict):  # pragma: no cover - every shipped schema is a record
            raise CorruptRecordError(f"{rd.name} v{rd.version} did not decode to a record")
        return record

    def decode_fields(
        self, data: bytes, expected_name: str, fields: tuple[str, ...]
    ) -> dict[str, Any]:
        """Only ``fields`` of an ``expected_name`` record (in today's shape), for a reader
        that needs a few leading fields of a large record. Of a current-version record only
        the bytes up to the last of them are read, so damage after it goes unnoticed; errors
        are :class:`CodecError` as in :meth:`decode`."""
        if type(data) is not bytes:
            data = bytes(data)
        rd = self._reader_of(data, expected_name)
        if rd.read is None:  # an old version (resolved by fastavro), read whole, then picked
            record = self._read(rd, data)
            return {name: record[name] for name in fields}
        # rd.read is set only for the current version, so the name alone keys the reader
        read = self._partial.get((rd.name, fields))
        if read is None:
            schema = self._registry.current(rd.name).raw
            read = self._partial[(rd.name, fields)] = compile_reader(schema, fields)
        try:
            picked: dict[str, Any] = read(data, HEADER_LEN)[0]
        except Exception as exc:
            raise _undecodable(rd, exc) from exc
        return picked


def fingerprint_of(data: bytes) -> bytes | None:
    """The writer fingerprint in a single-object header, or None if there is no valid header."""
    if len(data) < HEADER_LEN or data[:2] != MAGIC:
        return None
    return bytes(data[2:HEADER_LEN])


_default: Codec | None = None


def default_codec() -> Codec:
    """The process-wide codec over the shipped schemas (created on first use)."""
    global _default
    if _default is None:
        _default = Codec()
    return _default


def encode(name: str, record: dict[str, Any], *, version: int | None = None) -> bytes:
    """Encode with the shipped schemas; see :meth:`Codec.encode`."""
    return default_codec().encode(name, record, version=version)


def decode(data: bytes, expected_name: str | None = None) -> Decoded:
    """Decode with the shipped schemas; see :meth:`Codec.decode`."""
    return default_codec().decode(data, expected_name)


def decode_fields(data: bytes, expected_name: str, fields: tuple[str, ...]) -> dict[str, Any]:
    """Some fields of a record, with the shipped schemas; see :meth:`Codec.decode_fields`."""
    return default_codec().decode_fields(data, expected_name, fields)
