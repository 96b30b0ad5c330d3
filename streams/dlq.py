"""Build DeadLetter records (R30): the reason, the original bytes and where they came from.

Pure: the caller supplies the time (``at``) and the original record's fields; the result is a
dict ready for ``codec.encode(DEAD_LETTER_RECORD, ...)``. A dead letter is produced with the key
:func:`key_of` gives (its run id when the run is known, else the original key) and Kafka's
default partitioner (``KEYED_PARTITIONER``), so a run's dead letters land on the run's partition
of the DLQ, the same number as its inbox, events and results records.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agentruns.streams.codec import CodecError, decode_fields, encode

__all__ = [
    "CONFLICTING_DUPLICATE",
    "DEAD_LETTER_RECORD",
    "INVALID_EVENT",
    "MAX_KEY_BYTES",
    "MAX_REASON_CHARS",
    "NOTES_BYTES",
    "PROCESSING_ERROR",
    "RECORD_TOO_LARGE",
    "TRANSACTION_FAILED",
    "Header",
    "bounded_key",
    "dead_letter",
    "dead_letter_for_error",
    "fit",
    "key_of",
    "run_of",
    "text",
]

DEAD_LETTER_RECORD = "DeadLetter"

#: error_class values for rejections that are not codec errors (the codec's own are the
#: ``error_class`` attributes of the classes in :mod:`agentruns.streams.codec`).
INVALID_EVENT = "INVALID_EVENT"  # the envelope decodes but its body fails validation
CONFLICTING_DUPLICATE = "CONFLICTING_DUPLICATE"  # same producer seq, other content (R5)
RECORD_TOO_LARGE = "RECORD_TOO_LARGE"  # a record the input leads to is over the topic's limit
PROCESSING_ERROR = "PROCESSING_ERROR"  # handling the input raised (a bug, kept for its fixer)
TRANSACTION_FAILED = "TRANSACTION_FAILED"  # a transaction of this input alone kept failing

#: A dead letter's reason is cut to this many characters.
MAX_REASON_CHARS = 2000
#: A dead letter's key is the original key, or its digest when the key is longer than this.
MAX_KEY_BYTES = 512
#: What the headers `fit` returns weigh at most (leave this much room beside its value).
NOTES_BYTES = 256
_MAX_HEADERS = 64  # original headers kept in a dead letter that had to be cut

#: A Kafka header as confluent-kafka returns it: (key, value or None).
Header = tuple[str, bytes | None]


def text(value: str) -> str:
    """`value` as it can be written (UTF-8): lone surrogates replaced."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "replace").decode("utf-8")
    return value


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def bounded_key(key: bytes | None) -> bytes | None:
    """The key of a dead letter: the original one, or ``sha256:<hex>`` of an oversize one."""
    if key is None or len(key) <= MAX_KEY_BYTES:
        return key
    return f"sha256:{_digest(key)}".encode()


def _bounded_run(run_id: str) -> str:
    """A run id read from outside, as a dead letter keeps it: a digest when too long."""
    if len(run_id) <= MAX_KEY_BYTES:
        return run_id
    return "sha256:" + _digest(run_id.encode("utf-8", "surrogatepass"))


#: The fields read to find the run of a record, by record name: up to its run_id.
_RUN_FIELDS: dict[str, tuple[str, ...]] = {
    "Input": ("input_id", "run_id"),
    "Effect": ("idempotency_key", "run_id"),
    "Event": ("run_id",),
    "Result": ("run_id",),
    "Snapshot": ("run_id",),
}


def run_of(value: bytes | None, name: str) -> str | None:
    """The run a record of type `name` names, if its envelope decodes that far (a dead
    letter's ``run_id``); None when it does not, or for a record that names no run."""
    fields = _RUN_FIELDS.get(name)
    if value is None or fields is None:
        return None
    try:
        run_id = decode_fields(value, name, fields)["run_id"]
    except CodecError:
        return None
    return _bounded_run(text(str(run_id)))


def key_of(record: Mapping[str, Any]) -> bytes | None:
    """The key a dead letter is produced with: its run id when the run is known (``run_id``
    set), so it is keyed and partitioned like the run's records on every other topic; else the
    original key (`bounded_key`), None when there was none. A run id is bounded by characters,
    as the core bounds ids (`_bounded_run`), not by bytes: one of up to 512 multi-byte
    characters stays whole, on its run's partition."""
    run_id = record.get("run_id")
    if run_id is not None:
        return _bounded_run(str(run_id)).encode("utf-8", "surrogatepass")
    key: bytes | None = record["original_key"]
    return bounded_key(key)


def fit(record: dict[str, Any], max_bytes: int) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Encode a dead-letter `record` in at most `max_bytes`, with headers that say what was cut:
    an oversize original key, header values or value are cut, and the reason (and, for the
    value, the headers) keep the sha256 and the length of each whole, so a dead letter fits its
    topic however large the input was."""
    value: bytes | None = record["original_value"]
    key: bytes | None = record["original_key"]
    headers: list[dict[str, Any]] = record["original_headers"]
    kept = dict(record, reason=text(record["reason"])[:MAX_REASON_CHARS])
    encoded = encode(DEAD_LETTER_RECORD, kept)
    if len(encoded) <= max_bytes:
        return encoded, []
    cut: list[str] = []
    if key is not None and len(key) > MAX_KEY_BYTES:
        cut.append(f"key of {len(key)} bytes, sha256 {_digest(key)}")
        key = key[:MAX_KEY_BYTES]
    small: list[dict[str, Any]] = []
    for h in headers[:_MAX_HEADERS]:
        hv = h["value"]
        if hv is not None and len(hv) > MAX_KEY_BYTES:
            if len(cut) < _MAX_HEADERS // 4:
                cut.append(f"header {h['key'][:64]!r} of {len(hv)} bytes, sha256 {_digest(hv)}")
            hv = hv[:MAX_KEY_BYTES]
        small.append({"key": h["key"][:MAX_KEY_BYTES], "value": hv})
    if len(headers) > _MAX_HEADERS:
        cut.append(f"{len(headers) - _MAX_HEADERS} more headers dropped")
    notes: list[tuple[str, bytes]] = []
    if value is not None:
        notes = [
            ("original_sha256", _digest(value).encode()),
            ("original_length", str(len(value)).encode()),
        ]
        cut.append(f"value of {len(value)} bytes, sha256 {_digest(value)}")
    kept["reason"] = kept["reason"] + "; original cut to fit: " + ", ".join(cut)
    kept.update(original_key=key, original_headers=small, original_value=value)
    encoded = encode(DEAD_LETTER_RECORD, kept)
    while len(encoded) > max_bytes and kept["original_value"]:
        excess = len(encoded) - max_bytes
        whole = kept["original_value"]
        kept["original_value"] = whole[: max(0, len(whole) - excess - 16)]
        encoded = encode(DEAD_LETTER_RECORD, kept)
    return encoded, notes


def _bytes(value: bytes | bytearray | memoryview | str | None) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return bytes(value)


def dead_letter(
    reason: str,
    error_class: str,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    headers: Iterable[tuple[str, bytes | bytearray | memoryview | str | None]] | None,
    at: int,
    *,
    original_timestamp: int | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """A DeadLetter record dict for one rejected Kafka record.

    ``headers`` is what ``confluent_kafka.Message.headers()`` returns (a list of
    ``(key, value)`` or None); str values are stored UTF-8 encoded. Order and duplicates are
    kept.
    """
    original_headers: Sequence[dict[str, Any]] = [
        {"key": text(str(k)), "value": _bytes(v)} for k, v in (headers or ())
    ]
    return {
        "reason": text(reason),
        "error_class": error_class,
        "source_topic": text(topic),
        "source_partition": partition,
        "source_offset": offset,
        "original_key": _bytes(key),
        "original_value": _bytes(value),
        "original_headers": list(original_headers),
        "original_timestamp": original_timestamp,
        "run_id": None if run_id is None else _bounded_run(text(run_id)),
        "at": at,
    }


def dead_letter_for_error(
    error: CodecError,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    headers: Iterable[tuple[str, bytes | bytearray | memoryview | str | None]] | None,
    at: int,
    *,
    original_timestamp: int | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    """:func:`dead_letter` with reason and error_class taken from a codec error."""
    return dead_letter(
        str(error),
        error.error_class,
        topic,
        partition,
        offset,
        key,
        value,
        headers,
        at,
        original_timestamp=original_timestamp,
        run_id=run_id,
    )
